//! The soak's picture, as SVG text: RSS, device resources and p99 latency over time in three
//! panels sharing the time axis, each fault a shaded band across all of them.

use std::fmt::Write;

use crate::faults::Event;
use crate::report::{Sample, mib};

const W: f64 = 1000.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const PANEL: f64 = 170.0;
const GAP: f64 = 40.0;
const TOP: f64 = 60.0;

struct Series<'a> {
    name: &'a str,
    color: &'a str,
    pts: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG document.
pub fn render(title: &str, samples: &[Sample], events: &[Event]) -> String {
    let t_max = samples
        .iter()
        .map(|s| s.t)
        .chain(events.iter().map(|e| e.end))
        .fold(1.0, f64::max);
    let x = |t: f64| LEFT + (W - LEFT - RIGHT) * t / t_max;
    let h = TOP + 3.0 * (PANEL + GAP) + 20.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        o,
        r##"<text x="{LEFT}" y="42" fill="#555">shaded: faults (label at the top of each band); x: minutes since the start</text>"##
    );
    let panels: [(&str, Vec<Series<'_>>); 3] = [
        (
            "RSS of side A (MiB)",
            vec![Series {
                name: "RSS",
                color: "#1f77b4",
                pts: samples.iter().map(|s| (s.t, mib(s.snap.rss))).collect(),
            }],
        ),
        (
            "device resources on A (rdma resource show)",
            ["qp", "cq", "mr", "cm_id"]
                .iter()
                .zip(["#d62728", "#2ca02c", "#9467bd", "#ff7f0e"])
                .map(|(k, c)| Series {
                    name: k,
                    color: c,
                    pts: samples.iter().map(|s| (s.t, s.res(k) as f64)).collect(),
                })
                .collect(),
        ),
        (
            "p99 round trip of messages <= 4 KiB per interval (ms)",
            vec![Series {
                name: "p99",
                color: "#8c564b",
                pts: samples
                    .iter()
                    .filter_map(|s| s.p99_ms.map(|p| (s.t, p)))
                    .collect(),
            }],
        ),
    ];
    for (i, (label, series)) in panels.iter().enumerate() {
        let y0 = TOP + i as f64 * (PANEL + GAP);
        let y_max = series
            .iter()
            .flat_map(|s| s.pts.iter().map(|p| p.1))
            .fold(0.0, f64::max)
            .max(1e-9)
            * 1.1;
        let y = |v: f64| y0 + PANEL - PANEL * v / y_max;
        for e in events {
            let (a, b) = (x(e.start), x(e.end).max(x(e.start) + 2.0));
            let _ = writeln!(
                o,
                r##"<rect x="{a:.1}" y="{y0}" width="{:.1}" height="{PANEL}" fill="#f4a582" fill-opacity="0.35"/>"##,
                b - a
            );
            if i == 0 {
                let _ = writeln!(
                    o,
                    r#"<text x="{a:.1}" y="{:.1}" font-size="9" transform="rotate(-30 {a:.1} {:.1})">{}</text>"#,
                    y0 - 3.0,
                    y0 - 3.0,
                    esc(&e.name)
                );
            }
        }
        let _ = writeln!(
            o,
            r##"<rect x="{LEFT}" y="{y0}" width="{}" height="{PANEL}" fill="none" stroke="#333"/>"##,
            W - LEFT - RIGHT
        );
        let _ = writeln!(
            o,
            r#"<text x="{LEFT}" y="{:.1}" font-weight="bold">{}</text>"#,
            y0 + PANEL + 28.0,
            esc(label)
        );
        for k in 0..=4 {
            let v = y_max * k as f64 / 4.0;
            let _ = writeln!(
                o,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333">{}</text><line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#ddd"/>"##,
                LEFT - 4.0,
                y(v) + 4.0,
                if y_max >= 10.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                },
                W - RIGHT,
                y(v),
                y(v)
            );
        }
        for m in 0..=6 {
            let t = t_max * m as f64 / 6.0;
            let _ = writeln!(
                o,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333">{:.1}</text>"##,
                x(t),
                y0 + PANEL + 14.0,
                t / 60.0
            );
        }
        for (j, s) in series.iter().enumerate() {
            if s.pts.is_empty() {
                continue;
            }
            let pts: Vec<String> = s
                .pts
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
                .collect();
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="1.5"/>"#,
                pts.join(" "),
                s.color
            );
            let _ = writeln!(
                o,
                r#"<text x="{:.1}" y="{:.1}" fill="{}">{}</text>"#,
                W - RIGHT - 200.0 + 50.0 * j as f64,
                y0 + PANEL + 28.0,
                s.color,
                esc(s.name)
            );
        }
    }
    o.push_str("</svg>\n");
    o
}
