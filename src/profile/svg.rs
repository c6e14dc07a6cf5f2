//! The tide plot: device memory over the moments of an iteration, as an SVG stacked area plot.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::canvas::{
    nice_step, step_outline, svg_head, xml_escape, Scale, PLOT_B, PLOT_L, PLOT_R, PLOT_T, SVG_H,
    SVG_W,
};
use crate::error::Result;
use crate::units::ByteUnit;

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

const COLOR_NON_MODEL: &str = "#e8833a";
const COLOR_CHUNKS: &str = "#3b7dd8";
const COLOR_BUDGET: &str = "#1e8a3e";
const COLOR_CAPACITY: &str = "#c0392b";

/// `bytes` in the largest unit it is at least one of, with one decimal, e.g. `1.5 GiB`.
fn human_bytes(bytes: f64) -> String {
    ByteUnit::for_bytes(bytes).format(bytes, 1)
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

    let series = Series::new(points);
    let axis = YAxis::new(series.highest(capacity));
    let n = points.len();
    let scale = Scale {
        moments: n as f64,
        y_top: axis.top,
    };

    y_grid(&mut out, &scale, &axis);
    areas(&mut out, &scale, &series);
    let has_budget = budget_path(&mut out, &scale, &series.budget_line);
    if capacity > 0 {
        let mut d = String::new();
        let c = capacity as f64;
        scale.trace(&mut d, [(0.0, c), (n as f64, c)]);
        let _ = writeln!(
            out,
            r#"<path class="capacity" d="{d}" fill="none" stroke="{COLOR_CAPACITY}" stroke-width="1.5" stroke-dasharray="6,4"/>"#
        );
    }
    axes(&mut out, &scale, n);
    legend(&mut out, has_budget, capacity);
    out.push_str("</svg>\n");
    out
}

/// The values a tide plot draws, one per moment.
struct Series {
    /// Non-model bytes.
    non_model: Vec<f64>,
    /// Non-model plus chunk bytes.
    stacked: Vec<f64>,
    /// Non-model bytes plus the chunk budget, where the budget is known.
    budget_line: Vec<Option<f64>>,
}

impl Series {
    fn new(points: &[TidePoint]) -> Self {
        Series {
            non_model: points.iter().map(|p| p.non_model as f64).collect(),
            stacked: points
                .iter()
                .map(|p| p.non_model.saturating_add(p.chunks) as f64)
                .collect(),
            budget_line: points
                .iter()
                .map(|p| p.budget.map(|b| p.non_model.saturating_add(b) as f64))
                .collect(),
        }
    }

    /// The highest value drawn, `capacity` included (at least 1).
    fn highest(&self, capacity: u64) -> f64 {
        self.stacked
            .iter()
            .copied()
            .chain(self.budget_line.iter().flatten().copied())
            .fold(capacity as f64, f64::max)
            .max(1.0)
    }
}

/// The y axis: its unit, tick step and top, all in bytes.
struct YAxis {
    unit: ByteUnit,
    step: f64,
    top: f64,
}

impl YAxis {
    /// Five or so ticks up to at least `highest`, at a 1-2-5 step of the axis unit (at least 0.1
    /// of it, whole bytes).
    fn new(highest: f64) -> Self {
        let unit = ByteUnit::for_bytes(highest);
        let size = unit.size as f64;
        let min_step = if unit.size == 1 { 1.0 } else { 0.1 };
        let step = nice_step(highest / size / 5.0, min_step) * size;
        let top = (highest / step - 1e-9).ceil().max(1.0) * step;
        YAxis { unit, step, top }
    }
}

/// Horizontal grid lines and y tick labels.
fn y_grid(out: &mut String, scale: &Scale, axis: &YAxis) {
    let ticks = (axis.top / axis.step).round() as u64;
    for k in 0..=ticks {
        let v = k as f64 * axis.step;
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
            axis.unit.format(v, 1)
        );
    }
}

/// The non-model area, from the axis up to the non-model bytes, and the chunk area stacked on
/// it.
fn areas(out: &mut String, scale: &Scale, series: &Series) {
    let n = series.non_model.len() as f64;
    let mut d = String::new();
    let outline = step_outline(&series.non_model);
    scale.trace(
        &mut d,
        std::iter::once((0.0, 0.0))
            .chain(outline)
            .chain(std::iter::once((n, 0.0))),
    );
    d.push_str(" Z");
    let _ = writeln!(
        out,
        r#"<path class="non-model" d="{d}" fill="{COLOR_NON_MODEL}" fill-opacity="0.75" stroke="{COLOR_NON_MODEL}" stroke-width="1"/>"#
    );

    let mut d = String::new();
    let mut lower = step_outline(&series.non_model);
    lower.reverse();
    scale.trace(
        &mut d,
        step_outline(&series.stacked).into_iter().chain(lower),
    );
    d.push_str(" Z");
    let _ = writeln!(
        out,
        r#"<path class="chunks" d="{d}" fill="{COLOR_CHUNKS}" fill-opacity="0.75" stroke="{COLOR_CHUNKS}" stroke-width="1"/>"#
    );
}

/// The budget line, one sub-path per run of moments with a known budget; whether there was one.
fn budget_path(out: &mut String, scale: &Scale, budget_line: &[Option<f64>]) -> bool {
    if budget_line.iter().all(Option::is_none) {
        return false;
    }
    let mut d = String::new();
    let mut i = 0;
    while i < budget_line.len() {
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
    true
}

/// The axes, x ticks at the centre of about ten moments, and the axis labels.
fn axes(out: &mut String, scale: &Scale, n: usize) {
    let _ = writeln!(
        out,
        r##"<path class="axes" d="M{PLOT_L:.1},{PLOT_T:.1} L{PLOT_L:.1},{PLOT_B:.1} L{PLOT_R:.1},{PLOT_B:.1}" fill="none" stroke="#333333" stroke-width="1"/>"##
    );
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
}

/// The legend, in one row under the x axis label.
fn legend(out: &mut String, has_budget: bool, capacity: u64) {
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
}

/// Writes [`tide_svg`] to `path`, replacing the file if it exists, atomically (see
/// [`ChromeTrace::write`](super::ChromeTrace::write)).
pub fn write_tide_svg(
    path: impl AsRef<Path>,
    title: &str,
    points: &[TidePoint],
    capacity: u64,
) -> Result<()> {
    let svg = tide_svg(title, points, capacity);
    crate::checkpoint::write_file(path.as_ref(), svg.as_bytes(), "writing a tide plot")
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let missing = dir.path().join("no").join("t.svg");
        let err = write_tide_svg(&missing, "t", &[], 0);
        assert!(matches!(&err, Err(crate::Error::FileIo { path, .. }) if path == &missing));
    }
}
