//! What a run looks like: a Chrome trace of what happened when, and a plot of the memory tide.
//!
//! * [`ChromeTrace`] collects events in the Chrome trace-event format, the JSON that
//!   [Perfetto](https://ui.perfetto.dev) and `chrome://tracing` load. Spans ([`ChromeTrace::complete`]),
//!   instants ([`ChromeTrace::instant`]) and counters ([`ChromeTrace::counter`]) go on numbered
//!   [`Track`]s, which [`ChromeTrace::name_track`] labels.
//!
//! ```
//! use tidemem::profile::{ChromeTrace, Track};
//! let mut trace = ChromeTrace::new();
//! let copies = Track(2);
//! trace.name_track(copies, "h2d copies");
//! trace.complete("upload chunk 0", "copy", copies, 10.0, 250.0, serde_json::json!({"bytes": 4096}));
//! trace.instant("evict", "chunk", copies, 300.0, serde_json::Value::Null);
//! trace.counter("device memory", 300.0, &[("chunks", 4096.0), ("non-model", 512.0)]);
//! assert_eq!(trace.len(), 4);
//!
//! let parsed: serde_json::Value = serde_json::from_str(&trace.to_json()).unwrap();
//! let events = parsed["traceEvents"].as_array().unwrap();
//! assert_eq!(events[0]["ph"], "M"); // track names come first
//! assert_eq!(events[1]["dur"], 250.0);
//! ```
//!
//! * [`tide_svg`] draws the device memory of an iteration, one [`TidePoint`] per moment, as a
//!   stacked area plot in SVG: non-model data at the bottom, chunk payload on top of it, the
//!   non-model data plus the chunk budget as a step line, and the device capacity as a dashed
//!   line.
//!
//! ```
//! use tidemem::profile::{tide_svg, TidePoint};
//! let points = [
//!     TidePoint { non_model: 1 << 30, chunks: 2 << 30, budget: Some(3 << 30) },
//!     TidePoint { non_model: 3 << 30, chunks: 1 << 30, budget: Some(1 << 30) },
//!     TidePoint { non_model: 2 << 30, chunks: 2 << 30, budget: None },
//! ];
//! let svg = tide_svg("step 1 <bert>", &points, 8 << 30);
//! assert!(svg.starts_with("<svg"));
//! assert!(svg.contains("step 1 &lt;bert&gt;"));
//! assert!(svg.contains("8.0 GiB"));
//! ```

use std::cmp::Ordering;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

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

    /// Writes [`ChromeTrace::to_json`] to `path`, replacing the file if it exists.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        std::fs::write(path, self.to_json()).map_err(|source| Error::Io {
            during: "writing a Chrome trace",
            source,
        })
    }
}

/// Device memory at one moment of an iteration, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TidePoint {
    /// Bytes of non-model data (activations, temporaries, workspaces).
    pub non_model: u64,
    /// Bytes of chunk payload resident on the device.
    pub chunks: u64,
    /// The chunk budget at this moment, when known.
    pub budget: Option<u64>,
}

/// Width of the SVG [`tide_svg`] draws, in pixels.
const SVG_W: f64 = 900.0;
/// Height of the SVG [`tide_svg`] draws, in pixels.
const SVG_H: f64 = 420.0;
/// Left edge of the plot area.
const PLOT_L: f64 = 90.0;
/// Right edge of the plot area.
const PLOT_R: f64 = 880.0;
/// Top edge of the plot area.
const PLOT_T: f64 = 44.0;
/// Bottom edge of the plot area (the x axis).
const PLOT_B: f64 = 330.0;

const COLOR_NON_MODEL: &str = "#e8833a";
const COLOR_CHUNKS: &str = "#3b7dd8";
const COLOR_BUDGET: &str = "#1e8a3e";
const COLOR_CAPACITY: &str = "#c0392b";

/// Escapes the five XML special characters.
fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

/// The binary units the y axis uses, with their sizes in bytes.
const UNITS: [(&str, f64); 5] = [
    ("B", 1.0),
    ("KiB", 1024.0),
    ("MiB", 1048576.0),
    ("GiB", 1073741824.0),
    ("TiB", 1099511627776.0),
];

/// The largest unit that `bytes` is at least one of (bytes for anything under 1 KiB).
fn unit_for(bytes: f64) -> (&'static str, f64) {
    UNITS
        .iter()
        .rev()
        .find(|&&(_, size)| bytes >= size)
        .copied()
        .unwrap_or(UNITS[0])
}

/// `bytes` in `unit`, with one decimal (none for bytes).
fn format_in(bytes: f64, (name, size): (&str, f64)) -> String {
    if size == 1.0 {
        format!("{bytes:.0} {name}")
    } else {
        format!("{:.1} {name}", bytes / size)
    }
}

/// `bytes` in the largest unit it is at least one of, e.g. `1.5 GiB`.
fn human_bytes(bytes: f64) -> String {
    format_in(bytes, unit_for(bytes))
}

/// The smallest of 1, 2, 5 times a power of ten that is at least `x` (and at least `min`).
fn nice_step(x: f64, min: f64) -> f64 {
    if x.is_nan() || x <= min {
        return min;
    }
    let mag = 10f64.powf(x.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= x {
            return (m * mag).max(min);
        }
    }
    10.0 * mag
}

/// Step outline of `values` over moments: moment `i` spans `[i, i + 1]` on the x axis. Returns
/// `(moment position, value)` vertices from the left edge of moment 0 to the right edge of the
/// last moment, without vertices in the middle of runs of equal values.
fn step_outline(values: &[f64]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(values.len() * 2);
    let Some(&first) = values.first() else {
        return out;
    };
    out.push((0.0, first));
    let mut current = first;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v != current {
            out.push((i as f64, current));
            out.push((i as f64, v));
            current = v;
        }
    }
    out.push((values.len() as f64, current));
    out
}

/// Maps moment positions and byte values to pixels inside the plot area.
struct Scale {
    moments: f64,
    y_top: f64,
}

impl Scale {
    fn x(&self, m: f64) -> f64 {
        (PLOT_L + m / self.moments * (PLOT_R - PLOT_L)).clamp(PLOT_L, PLOT_R)
    }

    fn y(&self, bytes: f64) -> f64 {
        (PLOT_B - bytes / self.y_top * (PLOT_B - PLOT_T)).clamp(PLOT_T, PLOT_B)
    }

    /// Appends `M`/`L` commands through the vertices to `d`, starting with a move.
    fn trace(&self, d: &mut String, vertices: impl IntoIterator<Item = (f64, f64)>) {
        for (i, (m, v)) in vertices.into_iter().enumerate() {
            let cmd = if i == 0 { 'M' } else { 'L' };
            if !d.is_empty() {
                d.push(' ');
            }
            let _ = write!(d, "{cmd}{:.1},{:.1}", self.x(m), self.y(v));
        }
    }
}

/// Opening of the SVG document, with background and title.
fn svg_head(out: &mut String, title: &str) {
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#,
        w = SVG_W,
        h = SVG_H
    );
    let _ = writeln!(
        out,
        r##"<rect x="0" y="0" width="{SVG_W}" height="{SVG_H}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text class="title" x="{:.1}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
        SVG_W / 2.0,
        xml_escape(title)
    );
}

/// An SVG plot of device memory over the moments of an iteration.
///
/// Moment `i` of `points` covers the interval `[i, i + 1]` of the x axis, whose ticks are labelled
/// with moment indices. The y axis runs from 0 to at least the larger of `capacity` and the
/// highest value plotted, rounded up to a tick, with labels in KiB/MiB/GiB. The plot has
///
/// * a filled area for `non_model` bytes at the bottom,
/// * a filled area for `chunks` bytes stacked on top of it,
/// * a step line at `non_model + budget` over the moments whose budget is known (the line breaks
///   where it is not),
/// * a dashed horizontal line at `capacity` (left out when `capacity` is 0),
///
/// plus axes, a legend and `title` (escaped for XML). An empty `points` gives a valid SVG with
/// the title and the text "no data". The picture is 900 × 420 pixels and every coordinate lies
/// inside it.
pub fn tide_svg(title: &str, points: &[TidePoint], capacity: u64) -> String {
    let mut out = String::new();
    svg_head(&mut out, title);

    if points.is_empty() {
        let _ = writeln!(
            out,
            r##"<text class="no-data" x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14" fill="#666666">no data</text>"##,
            SVG_W / 2.0,
            SVG_H / 2.0
        );
        out.push_str("</svg>\n");
        return out;
    }

    let non_model: Vec<f64> = points.iter().map(|p| p.non_model as f64).collect();
    let stacked: Vec<f64> = points
        .iter()
        .map(|p| p.non_model.saturating_add(p.chunks) as f64)
        .collect();
    let budget_line: Vec<Option<f64>> = points
        .iter()
        .map(|p| p.budget.map(|b| p.non_model.saturating_add(b) as f64))
        .collect();

    let highest = stacked
        .iter()
        .copied()
        .chain(budget_line.iter().flatten().copied())
        .fold(capacity as f64, f64::max)
        .max(1.0);
    let unit = unit_for(highest);
    // Five or so ticks, at a 1-2-5 step of the axis unit (at least 0.1 of it, whole bytes).
    let min_step = if unit.1 == 1.0 { 1.0 } else { 0.1 };
    let step = nice_step(highest / unit.1 / 5.0, min_step) * unit.1;
    let y_top = (highest / step - 1e-9).ceil().max(1.0) * step;
    let n = points.len();
    let scale = Scale {
        moments: n as f64,
        y_top,
    };

    // Horizontal grid lines and y tick labels.
    let ticks = (y_top / step).round() as u64;
    for k in 0..=ticks {
        let v = k as f64 * step;
        let y = scale.y(v);
        let _ = writeln!(
            out,
            r##"<line class="grid" x1="{PLOT_L:.1}" y1="{y:.1}" x2="{PLOT_R:.1}" y2="{y:.1}" stroke="#e4e4e4" stroke-width="1"/>"##
        );
        let _ = writeln!(
            out,
            r#"<text class="y-tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            PLOT_L - 6.0,
            y + 4.0,
            format_in(v, unit)
        );
    }

    // Non-model area, from the axis up to the non-model bytes.
    let mut d = String::new();
    let outline = step_outline(&non_model);
    scale.trace(
        &mut d,
        std::iter::once((0.0, 0.0))
            .chain(outline)
            .chain(std::iter::once((n as f64, 0.0))),
    );
    d.push_str(" Z");
    let _ = writeln!(
        out,
        r#"<path class="non-model" d="{d}" fill="{COLOR_NON_MODEL}" fill-opacity="0.75" stroke="{COLOR_NON_MODEL}" stroke-width="1"/>"#
    );

    // Chunk area, between the non-model bytes and the stacked total.
    let mut d = String::new();
    let mut lower = step_outline(&non_model);
    lower.reverse();
    scale.trace(&mut d, step_outline(&stacked).into_iter().chain(lower));
    d.push_str(" Z");
    let _ = writeln!(
        out,
        r#"<path class="chunks" d="{d}" fill="{COLOR_CHUNKS}" fill-opacity="0.75" stroke="{COLOR_CHUNKS}" stroke-width="1"/>"#
    );

    // Budget line, one sub-path per run of moments with a known budget.
    let has_budget = budget_line.iter().any(Option::is_some);
    if has_budget {
        let mut d = String::new();
        let mut i = 0;
        while i < n {
            if budget_line[i].is_none() {
                i += 1;
                continue;
            }
            let start = i;
            let mut run = Vec::new();
            while let Some(Some(v)) = budget_line.get(i) {
                run.push(*v);
                i += 1;
            }
            let outline = step_outline(&run);
            scale.trace(
                &mut d,
                outline.into_iter().map(|(m, v)| (m + start as f64, v)),
            );
        }
        let _ = writeln!(
            out,
            r#"<path class="budget" d="{d}" fill="none" stroke="{COLOR_BUDGET}" stroke-width="2"/>"#
        );
    }

    // Capacity line.
    if capacity > 0 {
        let mut d = String::new();
        let c = capacity as f64;
        scale.trace(&mut d, [(0.0, c), (n as f64, c)]);
        let _ = writeln!(
            out,
            r#"<path class="capacity" d="{d}" fill="none" stroke="{COLOR_CAPACITY}" stroke-width="1.5" stroke-dasharray="6,4"/>"#
        );
    }

    // Axes.
    let _ = writeln!(
        out,
        r##"<path class="axes" d="M{PLOT_L:.1},{PLOT_T:.1} L{PLOT_L:.1},{PLOT_B:.1} L{PLOT_R:.1},{PLOT_B:.1}" fill="none" stroke="#333333" stroke-width="1"/>"##
    );

    // X ticks at the centre of every `x_step`-th moment, about ten of them.
    let x_step = nice_step(n as f64 / 10.0, 1.0) as usize;
    for i in (0..n).step_by(x_step.max(1)) {
        let x = scale.x(i as f64 + 0.5);
        let _ = writeln!(
            out,
            r##"<line class="x-tick" x1="{x:.1}" y1="{PLOT_B:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333333" stroke-width="1"/>"##,
            PLOT_B + 5.0
        );
        let _ = writeln!(
            out,
            r#"<text class="x-tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{i}</text>"#,
            PLOT_B + 19.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text class="x-label" x="{:.1}" y="{:.1}" text-anchor="middle">moment</text>"#,
        (PLOT_L + PLOT_R) / 2.0,
        PLOT_B + 38.0
    );
    let _ = writeln!(
        out,
        r#"<text class="y-label" x="16" y="{mid:.1}" text-anchor="middle" transform="rotate(-90 16 {mid:.1})">device memory</text>"#,
        mid = (PLOT_T + PLOT_B) / 2.0
    );

    // Legend, in one row under the x axis label.
    let legend_y = SVG_H - 22.0;
    let mut entries: Vec<(String, &str, bool, bool)> = vec![
        ("non-model data".to_owned(), COLOR_NON_MODEL, true, false),
        ("chunks".to_owned(), COLOR_CHUNKS, true, false),
    ];
    if has_budget {
        entries.push((
            "non-model + chunk budget".to_owned(),
            COLOR_BUDGET,
            false,
            false,
        ));
    }
    if capacity > 0 {
        entries.push((
            format!("capacity ({})", human_bytes(capacity as f64)),
            COLOR_CAPACITY,
            false,
            true,
        ));
    }
    let _ = writeln!(out, r#"<g class="legend">"#);
    let mut x = PLOT_L;
    for (label, color, filled, dashed) in entries {
        if filled {
            let _ = writeln!(
                out,
                r#"<rect x="{x:.1}" y="{:.1}" width="14" height="10" fill="{color}" fill-opacity="0.75"/>"#,
                legend_y - 9.0
            );
        } else {
            let dash = if dashed {
                r#" stroke-dasharray="6,4""#
            } else {
                ""
            };
            let _ = writeln!(
                out,
                r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
                x + 20.0,
                y = legend_y - 4.0
            );
        }
        let text_x = x + if filled { 20.0 } else { 26.0 };
        let _ = writeln!(
            out,
            r#"<text x="{text_x:.1}" y="{legend_y:.1}">{}</text>"#,
            xml_escape(&label)
        );
        // About 7 pixels per character at this font size, plus a gap.
        x = text_x + label.chars().count() as f64 * 7.0 + 24.0;
    }
    let _ = writeln!(out, "</g>");
    out.push_str("</svg>\n");
    out
}

/// Writes [`tide_svg`] to `path`, replacing the file if it exists.
pub fn write_tide_svg(
    path: impl AsRef<Path>,
    title: &str,
    points: &[TidePoint],
    capacity: u64,
) -> Result<()> {
    std::fs::write(path, tide_svg(title, points, capacity)).map_err(|source| Error::Io {
        during: "writing a tide plot",
        source,
    })
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
        let err = t.write(dir.path().join("missing").join("trace.json"));
        assert!(matches!(err, Err(Error::Io { .. })), "{err:?}");
    }

    /// The `d` attribute of the path with the given class.
    fn path_data<'a>(svg: &'a str, class: &str) -> Option<&'a str> {
        let tag = format!(r#"<path class="{class}" d=""#);
        let start = svg.find(&tag)? + tag.len();
        let len = svg[start..].find('"')?;
        Some(&svg[start..start + len])
    }

    /// The `(x, y)` pairs of path data made of `M`, `L` and `Z` commands.
    fn coords(d: &str) -> Vec<(f64, f64)> {
        let nums: Vec<f64> = d
            .split([' ', ',', 'M', 'L', 'Z'])
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("bad number {s:?} in {d:?}"))
            })
            .collect();
        assert_eq!(nums.len() % 2, 0, "odd number count in {d:?}");
        nums.chunks(2).map(|c| (c[0], c[1])).collect()
    }

    /// The numbers of the `viewBox` attribute.
    fn view_box(svg: &str) -> (f64, f64, f64, f64) {
        let start = svg.find(r#"viewBox=""#).unwrap() + 9;
        let len = svg[start..].find('"').unwrap();
        let v: Vec<f64> = svg[start..start + len]
            .split(' ')
            .map(|s| s.parse().unwrap())
            .collect();
        (v[0], v[1], v[2], v[3])
    }

    /// A small well-formedness check: tags nest, and every `&` starts an entity.
    fn assert_well_formed(svg: &str) {
        let mut stack: Vec<String> = Vec::new();
        let mut rest = svg;
        while let Some(open) = rest.find('<') {
            let text = &rest[..open];
            assert!(!text.contains('>'), "stray '>' in {text:?}");
            let close = rest[open..].find('>').expect("unclosed tag") + open;
            let tag = &rest[open + 1..close];
            assert!(!tag.contains('<'), "'<' inside tag {tag:?}");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(
                    stack.pop().as_deref(),
                    Some(name.trim()),
                    "mismatched </{name}>"
                );
            } else if !tag.ends_with('/') {
                let name = tag.split_whitespace().next().unwrap();
                stack.push(name.to_owned());
            }
            rest = &rest[close + 1..];
        }
        assert!(stack.is_empty(), "unclosed elements {stack:?}");
        for (i, _) in svg.match_indices('&') {
            let ent = &svg[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                    .iter()
                    .any(|e| ent.starts_with(e)),
                "bare '&' at {i}"
            );
        }
    }

    fn sample() -> Vec<TidePoint> {
        (0..37u64)
            .map(|i| TidePoint {
                non_model: (i % 7 + 1) << 28,
                chunks: (i % 5) << 29,
                budget: if i % 11 == 3 {
                    None
                } else {
                    Some((i % 4 + 1) << 29)
                },
            })
            .collect()
    }

    #[test]
    fn svg_has_every_series_inside_the_view_box() {
        let svg = tide_svg("tide", &sample(), 6 << 30);
        assert!(svg.starts_with("<svg"));
        assert_well_formed(&svg);
        let (x0, y0, w, h) = view_box(&svg);
        assert_eq!((x0, y0, w, h), (0.0, 0.0, SVG_W, SVG_H));
        for class in ["non-model", "chunks", "budget", "capacity"] {
            let d = path_data(&svg, class).unwrap_or_else(|| panic!("no {class} path"));
            let pts = coords(d);
            assert!(pts.len() >= 2, "{class}: {d}");
            for (x, y) in pts {
                assert!(
                    (0.0..=w).contains(&x) && (0.0..=h).contains(&y),
                    "{class}: ({x}, {y})"
                );
            }
        }
        assert!(svg.contains("non-model + chunk budget"));
        assert!(svg.contains("capacity (6.0 GiB)"));
        assert!(svg.contains(">moment<"));
        // The budget is unknown at moments 3, 14, 25 and 36: the line has a sub-path per run.
        assert_eq!(path_data(&svg, "budget").unwrap().matches('M').count(), 4);
    }

    #[test]
    fn stacked_area_sits_on_the_non_model_area() {
        let points = [
            TidePoint {
                non_model: 100 << 20,
                chunks: 300 << 20,
                budget: None,
            },
            TidePoint {
                non_model: 200 << 20,
                chunks: 100 << 20,
                budget: None,
            },
        ];
        let svg = tide_svg("t", &points, 512 << 20);
        let nm = coords(path_data(&svg, "non-model").unwrap());
        let ch = coords(path_data(&svg, "chunks").unwrap());
        // The top of the non-model area at moment 0 is the bottom of the chunk area there.
        let nm_top0 = nm
            .iter()
            .filter(|p| p.0 < 100.0)
            .map(|p| p.1)
            .fold(f64::MAX, f64::min);
        let ch_bottom0 = ch
            .iter()
            .filter(|p| p.0 < 100.0)
            .map(|p| p.1)
            .fold(f64::MIN, f64::max);
        assert!(
            (nm_top0 - ch_bottom0).abs() < 0.11,
            "{nm_top0} vs {ch_bottom0}"
        );
        // Chunk area top at moment 0 (400 MiB) is higher (smaller y) than at moment 1 (300 MiB).
        let ch_top0 = ch
            .iter()
            .filter(|p| p.0 < 100.0)
            .map(|p| p.1)
            .fold(f64::MAX, f64::min);
        let ch_top1 = ch
            .iter()
            .filter(|p| p.0 > 800.0)
            .map(|p| p.1)
            .fold(f64::MAX, f64::min);
        assert!(ch_top0 < ch_top1, "{ch_top0} vs {ch_top1}");
        // No budget anywhere: no budget path and no budget legend entry.
        assert!(path_data(&svg, "budget").is_none());
        assert!(!svg.contains("chunk budget"));
        assert!(svg.contains("MiB"));
    }

    #[test]
    fn title_is_escaped() {
        let svg = tide_svg(r#"a<b & "c" 'd'>"#, &sample(), 1 << 30);
        assert!(svg.contains("a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;"));
        assert!(!svg.contains("a<b"));
        assert_well_formed(&svg);
    }

    #[test]
    fn empty_points_give_valid_svg_with_no_data() {
        let svg = tide_svg("empty <run>", &[], 1 << 30);
        assert_well_formed(&svg);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("empty &lt;run&gt;"));
        assert!(svg.contains(">no data<"));
        assert!(path_data(&svg, "chunks").is_none());
    }

    #[test]
    fn values_above_capacity_scale_the_axis() {
        let capacity = 1u64 << 30;
        let points = [
            TidePoint {
                non_model: 512 << 20,
                chunks: 256 << 20,
                budget: Some(256 << 20),
            },
            TidePoint {
                non_model: 1 << 30,
                chunks: 2 << 30,
                budget: Some(1 << 30),
            },
        ];
        let svg = tide_svg("over", &points, capacity);
        assert_well_formed(&svg);
        let ch = coords(path_data(&svg, "chunks").unwrap());
        let top = ch.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        assert!(top >= PLOT_T - 1e-9, "chunk area leaves the plot: {top}");
        let cap = coords(path_data(&svg, "capacity").unwrap());
        let cap_y = cap[0].1;
        // 3 GiB stacked against a 1 GiB capacity: the capacity line is a third of the way up.
        let frac = (PLOT_B - cap_y) / (PLOT_B - top);
        assert!(
            (frac - 1.0 / 3.0).abs() < 0.01,
            "capacity at {frac} of the peak"
        );
        // The axis reaches at least the peak.
        assert!(svg.contains(">3.0 GiB<"), "{svg}");
    }

    #[test]
    fn single_point_and_tiny_values_stay_inside() {
        for (p, cap) in [
            (
                TidePoint {
                    non_model: 0,
                    chunks: 0,
                    budget: None,
                },
                0,
            ),
            (
                TidePoint {
                    non_model: 3,
                    chunks: 1,
                    budget: Some(u64::MAX),
                },
                2,
            ),
        ] {
            let svg = tide_svg("one", &[p], cap);
            assert_well_formed(&svg);
            for class in ["non-model", "chunks"] {
                for (x, y) in coords(path_data(&svg, class).unwrap()) {
                    assert!((0.0..=SVG_W).contains(&x) && (0.0..=SVG_H).contains(&y));
                }
            }
            assert_eq!(path_data(&svg, "capacity").is_some(), cap > 0);
        }
    }

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(512.0), "512 B");
        assert_eq!(human_bytes(1536.0), "1.5 KiB");
        assert_eq!(human_bytes(3.0 * 1048576.0), "3.0 MiB");
        assert_eq!(human_bytes(8.0 * 1073741824.0), "8.0 GiB");
    }

    #[test]
    fn write_tide_svg_writes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tide.svg");
        write_tide_svg(&path, "t", &sample(), 1 << 30).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            tide_svg("t", &sample(), 1 << 30)
        );
        let err = write_tide_svg(dir.path().join("no").join("t.svg"), "t", &[], 0);
        assert!(matches!(err, Err(Error::Io { .. })));
    }
}
