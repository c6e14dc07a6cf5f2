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

mod canvas;
mod chrome;
mod peak;
mod svg;

pub use chrome::{ChromeTrace, Track};
pub use peak::{fma_isa, fma_peak};
pub use svg::{tide_svg, write_tide_svg, TidePoint};
