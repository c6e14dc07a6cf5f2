//! Chrome trace-event-format traces, the JSON that [Perfetto](https://ui.perfetto.dev) and
//! `chrome://tracing` load.

use std::cmp::Ordering;
use std::path::Path;

use serde::Serialize;

use crate::error::Result;

/// The process id every event of a [`ChromeTrace`] carries.
const PID: u32 = 1;

/// A horizontal lane of a [`ChromeTrace`], written as the event's `"tid"`.
///
/// Events on the same track are drawn on the same row; [`ChromeTrace::name_track`] gives a track
/// the label the viewer shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Track(pub u32);

/// One trace event as written to the JSON file.
#[derive(Debug, Clone, Serialize)]
struct Event {
    name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    cat: String,
    ph: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    args: serde_json::Value,
}

impl Event {
    fn is_metadata(&self) -> bool {
        self.ph == "M"
    }
}

/// The top-level object of a trace file.
#[derive(Serialize)]
struct TraceFile<'a> {
    #[serde(rename = "traceEvents")]
    trace_events: Vec<&'a Event>,
    #[serde(rename = "displayTimeUnit")]
    display_time_unit: &'static str,
}

/// Replaces a non-finite number with 0 so that the file stays valid JSON.
fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// Turns user arguments into the object the format expects: `null` stays absent, an object is
/// kept, anything else is wrapped as `{"value": ...}`.
fn args_object(args: serde_json::Value) -> serde_json::Value {
    match args {
        serde_json::Value::Null | serde_json::Value::Object(_) => args,
        other => {
            let mut map = serde_json::Map::new();
            map.insert("value".to_owned(), other);
            serde_json::Value::Object(map)
        }
    }
}

/// A collector of Chrome trace-event-format events.
///
/// Timestamps and durations are in microseconds, as the format defines them. Every event has
/// `"pid": 1`; the [`Track`] is the `"tid"`. On output the thread-name metadata comes first and
/// the other events follow sorted by timestamp (stable: events with equal timestamps keep the
/// order in which they were added).
///
/// Non-finite timestamps, durations and counter values are recorded as 0, and negative durations
/// as 0, so the output always loads. Arguments that are `null` are left out; arguments that are
/// not a JSON object are wrapped as `{"value": ...}`.
#[derive(Debug, Clone, Default)]
pub struct ChromeTrace {
    events: Vec<Event>,
}

impl ChromeTrace {
    /// An empty trace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a span (`"ph": "X"`) that starts at `start_us` and lasts `dur_us` microseconds.
    pub fn complete(
        &mut self,
        name: &str,
        cat: &str,
        track: Track,
        start_us: f64,
        dur_us: f64,
        args: serde_json::Value,
    ) {
        self.events.push(Event {
            name: name.to_owned(),
            cat: cat.to_owned(),
            ph: "X",
            ts: Some(finite(start_us)),
            dur: Some(finite(dur_us).max(0.0)),
            pid: PID,
            tid: Some(track.0),
            s: None,
            args: args_object(args),
        });
    }

    /// Adds an instant (`"ph": "i"`, thread scope `"s": "t"`) at `ts_us` microseconds.
    pub fn instant(
        &mut self,
        name: &str,
        cat: &str,
        track: Track,
        ts_us: f64,
        args: serde_json::Value,
    ) {
        self.events.push(Event {
            name: name.to_owned(),
            cat: cat.to_owned(),
            ph: "i",
            ts: Some(finite(ts_us)),
            dur: None,
            pid: PID,
            tid: Some(track.0),
            s: Some("t"),
            args: args_object(args),
        });
    }

    /// Adds a counter sample (`"ph": "C"`) at `ts_us` microseconds: each `(series, value)` pair
    /// becomes one series of the counter `name`. Counters belong to the process, so the event has
    /// no `"tid"`.
    pub fn counter(&mut self, name: &str, ts_us: f64, values: &[(&str, f64)]) {
        let mut map = serde_json::Map::new();
        for &(series, value) in values {
            map.insert(series.to_owned(), serde_json::Value::from(finite(value)));
        }
        self.events.push(Event {
            name: name.to_owned(),
            cat: String::new(),
            ph: "C",
            ts: Some(finite(ts_us)),
            dur: None,
            pid: PID,
            tid: None,
            s: None,
            args: serde_json::Value::Object(map),
        });
    }

    /// Labels `track` with `name` (a `thread_name` metadata event, `"ph": "M"`). Naming a track
    /// again replaces its earlier name.
    pub fn name_track(&mut self, track: Track, name: &str) {
        self.events
            .retain(|e| !(e.is_metadata() && e.name == "thread_name" && e.tid == Some(track.0)));
        self.events.push(Event {
            name: "thread_name".to_owned(),
            cat: String::new(),
            ph: "M",
            ts: None,
            dur: None,
            pid: PID,
            tid: Some(track.0),
            s: None,
            args: serde_json::json!({ "name": name }),
        });
    }

    /// Number of events, metadata included.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event has been added.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The trace as a JSON document: `{"traceEvents": [...], "displayTimeUnit": "ms"}`, metadata
    /// first, then the other events sorted by timestamp.
    pub fn to_json(&self) -> String {
        let mut sorted: Vec<&Event> = self.events.iter().collect();
        sorted.sort_by(|a, b| match (a.is_metadata(), b.is_metadata()) {
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (true, true) => Ordering::Equal,
            (false, false) => a.ts.unwrap_or(0.0).total_cmp(&b.ts.unwrap_or(0.0)),
        });
        let file = TraceFile {
            trace_events: sorted,
            display_time_unit: "ms",
        };
        // Every field is a string, a finite number or a JSON value with string keys, none of
        // which serde_json can fail to write.
        serde_json::to_string(&file).expect("trace events always serialize to JSON")
    }

    /// Writes [`ChromeTrace::to_json`] to `path`, replacing the file if it exists: atomically
    /// (a file beside it renamed over it once complete and synced), so a full disk leaves no
    /// truncated trace, and an error names the path.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        crate::checkpoint::write_file(
            path.as_ref(),
            self.to_json().as_bytes(),
            "writing a Chrome trace",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn parse(trace: &ChromeTrace) -> Vec<Value> {
        let v: Value = serde_json::from_str(&trace.to_json()).expect("trace is valid JSON");
        assert_eq!(v["displayTimeUnit"], "ms");
        v["traceEvents"].as_array().expect("traceEvents").clone()
    }

    #[test]
    fn complete_and_instant_fields() {
        let mut t = ChromeTrace::new();
        assert!(t.is_empty());
        t.complete("fwd", "compute", Track(3), 12.5, 40.0, json!({"layer": 7}));
        t.instant("oom", "alloc", Track(4), 20.0, Value::Null);
        assert_eq!(t.len(), 2);
        assert!(!t.is_empty());
        let ev = parse(&t);
        assert_eq!(ev.len(), 2);
        let x = &ev[0];
        assert_eq!(x["ph"], "X");
        assert_eq!(x["name"], "fwd");
        assert_eq!(x["cat"], "compute");
        assert_eq!(x["ts"], 12.5);
        assert_eq!(x["dur"], 40.0);
        assert_eq!(x["pid"], 1);
        assert_eq!(x["tid"], 3);
        assert_eq!(x["args"]["layer"], 7);
        let i = &ev[1];
        assert_eq!(i["ph"], "i");
        assert_eq!(i["s"], "t");
        assert_eq!(i["ts"], 20.0);
        assert_eq!(i["tid"], 4);
        assert_eq!(i["pid"], 1);
        assert!(i.get("dur").is_none());
        assert!(i.get("args").is_none());
    }

    #[test]
    fn events_sorted_stably_with_metadata_first() {
        let mut t = ChromeTrace::new();
        t.complete("c", "", Track(1), 30.0, 1.0, Value::Null);
        t.complete("a", "", Track(1), 10.0, 1.0, Value::Null);
        t.instant("b1", "", Track(2), 20.0, Value::Null);
        t.name_track(Track(1), "compute");
        t.instant("b2", "", Track(2), 20.0, Value::Null);
        t.counter("mem", 5.0, &[("x", 1.0)]);
        let ev = parse(&t);
        let names: Vec<&str> = ev.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["thread_name", "mem", "a", "b1", "b2", "c"]);
        let ts: Vec<f64> = ev[1..].iter().map(|e| e["ts"].as_f64().unwrap()).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
    }

    #[test]
    fn counter_args_are_the_values() {
        let mut t = ChromeTrace::new();
        t.counter(
            "device memory",
            100.0,
            &[("chunks", 4096.0), ("non-model", 512.5)],
        );
        let ev = parse(&t);
        assert_eq!(ev[0]["ph"], "C");
        assert_eq!(ev[0]["name"], "device memory");
        assert_eq!(ev[0]["ts"], 100.0);
        assert_eq!(ev[0]["pid"], 1);
        assert_eq!(ev[0]["args"], json!({"chunks": 4096.0, "non-model": 512.5}));
    }

    #[test]
    fn metadata_names_tracks_and_renaming_replaces() {
        let mut t = ChromeTrace::new();
        t.name_track(Track(2), "copies");
        t.name_track(Track(5), "compute");
        t.name_track(Track(2), "h2d copies");
        assert_eq!(t.len(), 2);
        let ev = parse(&t);
        for e in &ev {
            assert_eq!(e["ph"], "M");
            assert_eq!(e["name"], "thread_name");
            assert_eq!(e["pid"], 1);
        }
        let t2 = ev.iter().find(|e| e["tid"] == 2).expect("track 2 named");
        assert_eq!(t2["args"]["name"], "h2d copies");
        let t5 = ev.iter().find(|e| e["tid"] == 5).expect("track 5 named");
        assert_eq!(t5["args"]["name"], "compute");
    }

    #[test]
    fn bad_numbers_and_scalar_args_still_give_valid_json() {
        let mut t = ChromeTrace::new();
        t.complete("nan", "", Track(0), f64::NAN, -5.0, json!(42));
        t.counter("inf", f64::INFINITY, &[("v", f64::NEG_INFINITY)]);
        let ev = parse(&t);
        assert_eq!(ev.len(), 2);
        for e in &ev {
            assert_eq!(e["ts"], 0.0);
        }
        let x = ev.iter().find(|e| e["ph"] == "X").unwrap();
        assert_eq!(x["dur"], 0.0);
        assert_eq!(x["args"], json!({"value": 42}));
        let c = ev.iter().find(|e| e["ph"] == "C").unwrap();
        assert_eq!(c["args"]["v"], 0.0);
    }

    #[test]
    fn write_creates_a_loadable_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        let mut t = ChromeTrace::new();
        t.complete("fwd", "compute", Track(1), 0.0, 1.0, Value::Null);
        t.write(&path).unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["traceEvents"][0]["ph"], "X");
        let missing = dir.path().join("missing").join("trace.json");
        let err = t.write(&missing);
        assert!(
            matches!(&err, Err(crate::Error::FileIo { path, .. }) if path == &missing),
            "{err:?}"
        );
        // written whole or not at all: nothing but the trace is left beside it
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
