//! What every SVG plot of this module draws on: the picture and plot-area geometry, the scale
//! from data to pixels, tick steps and XML escaping.

use std::fmt::Write as _;

/// Width of the picture, in pixels.
pub(super) const SVG_W: f64 = 900.0;
/// Height of the picture, in pixels.
pub(super) const SVG_H: f64 = 420.0;
/// Left edge of the plot area.
pub(super) const PLOT_L: f64 = 90.0;
/// Right edge of the plot area.
pub(super) const PLOT_R: f64 = 880.0;
/// Top edge of the plot area.
pub(super) const PLOT_T: f64 = 44.0;
/// Bottom edge of the plot area (the x axis).
pub(super) const PLOT_B: f64 = 330.0;

/// Escapes the five XML special characters.
pub(super) fn xml_escape(s: &str) -> String {
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

/// The smallest of 1, 2, 5 times a power of ten that is at least `x` (and at least `min`).
pub(super) fn nice_step(x: f64, min: f64) -> f64 {
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
pub(super) fn step_outline(values: &[f64]) -> Vec<(f64, f64)> {
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
pub(super) struct Scale {
    /// Moments on the x axis.
    pub(super) moments: f64,
    /// The value at the top of the y axis.
    pub(super) y_top: f64,
}

impl Scale {
    pub(super) fn x(&self, m: f64) -> f64 {
        (PLOT_L + m / self.moments * (PLOT_R - PLOT_L)).clamp(PLOT_L, PLOT_R)
    }

    pub(super) fn y(&self, bytes: f64) -> f64 {
        (PLOT_B - bytes / self.y_top * (PLOT_B - PLOT_T)).clamp(PLOT_T, PLOT_B)
    }

    /// Appends `M`/`L` commands through the vertices to `d`, starting with a move.
    pub(super) fn trace(&self, d: &mut String, vertices: impl IntoIterator<Item = (f64, f64)>) {
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
pub(super) fn svg_head(out: &mut String, title: &str) {
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
