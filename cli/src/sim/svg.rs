//! A hand-written SVG plot of memory over time: one panel per scenario,
//! one colour per policy, memory held as a solid line and tokens stored as a
//! dashed one, under a line at the budget. No dependencies: plain strings.

use std::fmt::Write as _;

use super::report::{PolicyReport, ScenarioReport};

const WIDTH: f64 = 960.0;
const PANEL_H: f64 = 300.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Points per line at most: each one averages a run of steps.
const MAX_POINTS: usize = 600;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Escapes text for an XML text node or attribute.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A round step for about five ticks up to `max`.
fn tick_step(max: f64) -> f64 {
    let raw = (max / 5.0).max(1.0);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag)
}

fn fmt_num(v: f64) -> String {
    if v >= 10_000.0 && v % 1000.0 == 0.0 {
        format!("{}k", v / 1000.0)
    } else {
        format!("{v}")
    }
}

/// The whole document. `title` heads the figure.
pub fn render(title: &str, scenarios: &[ScenarioReport]) -> String {
    let panel_total = TOP + PANEL_H + BOTTOM;
    let height = 60.0 + panel_total * scenarios.len().max(1) as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="16">KV memory held (solid) and tokens stored (dashed) per policy</text>"#,
        WIDTH / 2.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="42" text-anchor="middle" font-size="11">{}</text>"#,
        WIDTH / 2.0,
        esc(title)
    );
    for (i, sc) in scenarios.iter().enumerate() {
        panel(&mut s, sc, 60.0 + i as f64 * panel_total);
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, sc: &ScenarioReport, y0: f64) {
    let x_max = sc
        .policies
        .iter()
        .map(|p| p.steps)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let y_max = sc
        .policies
        .iter()
        .map(|p| p.capacity_tokens)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (px0, py0) = (LEFT, y0 + TOP);
    let (pw, ph) = (WIDTH - LEFT - RIGHT, PANEL_H);
    let x = |v: f64| px0 + v / x_max * pw;
    let y = |v: f64| py0 + ph - v / y_max * ph;
    let _ = writeln!(s, "<g>");
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="14">KV memory over time, sampling {}</text>"#,
        px0 + pw / 2.0,
        y0 + 22.0,
        esc(&sc.sampling)
    );
    // Grid and ticks.
    let (xs, ys) = (tick_step(x_max), tick_step(y_max));
    let mut t = 0.0;
    while t <= x_max + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#e0e0e0"/><text x="{0:.1}" y="{3:.1}" text-anchor="middle">{4}</text>"##,
            x(t),
            py0,
            py0 + ph,
            py0 + ph + 16.0,
            fmt_num(t)
        );
        t += xs;
    }
    let mut t = 0.0;
    while t <= y_max + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1:.1}" x2="{2:.1}" y2="{1:.1}" stroke="#e0e0e0"/><text x="{3:.1}" y="{4:.1}" text-anchor="end">{5}</text>"##,
            px0,
            y(t),
            px0 + pw,
            px0 - 6.0,
            y(t) + 4.0,
            fmt_num(t)
        );
        t += ys;
    }
    // Axes and their labels.
    let _ = writeln!(
        s,
        r#"<path d="M{px0:.1},{py0:.1} V{:.1} H{:.1}" fill="none" stroke="black"/>"#,
        py0 + ph,
        px0 + pw
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">scheduler step</text>"#,
        px0 + pw / 2.0,
        py0 + ph + 36.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{0:.1}" y="{1:.1}" text-anchor="middle" transform="rotate(-90 {0:.1} {1:.1})">KV slots (tokens)</text>"#,
        px0 - 58.0,
        py0 + ph / 2.0
    );
    // Budget.
    let _ = writeln!(
        s,
        r#"<line x1="{px0:.1}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="black" stroke-dasharray="2,3"/>"#,
        y(y_max),
        px0 + pw
    );
    // Lines, then the legend.
    for (i, p) in sc.policies.iter().enumerate() {
        let legend = (px0 + pw + 16.0, py0 + 10.0 + i as f64 * 34.0);
        policy_lines(s, COLOURS[i % COLOURS.len()], p, &x, &y, legend);
    }
    let ly = py0 + 10.0 + sc.policies.len() as f64 * 34.0;
    let lx = px0 + pw + 16.0;
    let _ = writeln!(
        s,
        r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="black" stroke-dasharray="2,3"/><text x="{:.1}" y="{:.1}">budget</text>"#,
        lx + 24.0,
        lx + 30.0,
        ly + 4.0
    );
    let _ = writeln!(s, "</g>");
}

/// One policy's two lines (held solid, stored dashed; averaged into at
/// most MAX_POINTS points) and its legend at `legend`.
fn policy_lines(
    s: &mut String,
    colour: &str,
    p: &PolicyReport,
    x: &dyn Fn(f64) -> f64,
    y: &dyn Fn(f64) -> f64,
    legend: (f64, f64),
) {
    let n = p.series.len();
    let bucket = n.div_ceil(MAX_POINTS).max(1);
    let (mut held, mut stored) = (String::new(), String::new());
    for chunk in p.series.chunks(bucket) {
        let k = chunk.len() as f64;
        let step = chunk.iter().map(|c| c.step as f64).sum::<f64>() / k;
        let h = chunk.iter().map(|c| c.held as f64).sum::<f64>() / k;
        let st = chunk.iter().map(|c| c.stored as f64).sum::<f64>() / k;
        let _ = write!(held, "{:.1},{:.1} ", x(step), y(h));
        let _ = write!(stored, "{:.1},{:.1} ", x(step), y(st));
    }
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.5"/>"#,
        held.trim_end()
    );
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.5" stroke-dasharray="6,3"/>"#,
        stored.trim_end()
    );
    let (lx, ly) = legend;
    let _ = writeln!(
        s,
        r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="1.5"/><text x="{:.1}" y="{:.1}">{} held</text>"#,
        lx + 24.0,
        lx + 30.0,
        ly + 4.0,
        esc(&p.label)
    );
    let _ = writeln!(
        s,
        r#"<line x1="{lx:.1}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="6,3"/><text x="{2:.1}" y="{3:.1}">{4} stored</text>"#,
        ly + 15.0,
        lx + 24.0,
        lx + 30.0,
        ly + 19.0,
        esc(&p.label)
    );
}
