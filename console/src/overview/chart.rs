//! The overview's charts as inline SVG, drawn from the history's series on the server; the script
//! redraws them the same way with each refresh.

use std::collections::BTreeMap;

use maud::{Markup, html};

/// The series' colours: fixed per name, so a line keeps its colour between refreshes.
const SERIES: [&str; 6] = [
    "events",
    "stream",
    "outbox",
    "inventory",
    "points",
    "search",
];

fn series_class(label: &str) -> &'static str {
    SERIES
        .iter()
        .copied()
        .find(|s| *s == label)
        .unwrap_or("other")
}

/// A chart named `name` (its key in the API's `series`) and its legend.
pub(super) fn chart(name: &str, series: &BTreeMap<String, Vec<(i64, f64)>>) -> Markup {
    let (w, h) = (320.0, 110.0);
    let points = series.values().flatten();
    let (t0, t1) = points.clone().fold((i64::MAX, i64::MIN), |(a, b), (t, _)| {
        (a.min(*t), b.max(*t))
    });
    let top = points.map(|(_, v)| *v).fold(1.0_f64, f64::max);
    let line = |values: &[(i64, f64)]| {
        values
            .iter()
            .map(|(t, v)| {
                let x = (t - t0) as f64 / (t1 - t0) as f64 * w;
                let y = h - v / top * (h - 14.0) - 2.0;
                format!("{x:.1},{y:.1}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    // SVG elements are closed explicitly: in HTML's foreign content an unclosed <polyline> would
    // take the next one as its child.
    html! {
        svg.chart data-chart=(name) viewBox={ "0 0 " (w) " " (h) } role="img"
            aria-label={ (name) " chart" } preserveAspectRatio="none" {
            text.axis x="2" y="10" { (format!("{top:.0}")) }
            @if t0 < t1 {
                @for (label, values) in series {
                    polyline class={ "s-" (series_class(label)) } points=(line(values)) {}
                }
            } @else {
                text.axis x="100" y="60" { "collecting samples…" }
            }
        }
        ul.legend {
            @for label in series.keys() {
                li { span class={ "key s-" (series_class(label)) } {} (label) }
            }
        }
    }
}
