//! The overview's charts, drawn in one place: here, on the server, as standalone SVG images
//! (`GET /console/charts/{name}.svg`). The page shows them as `<img>`, and its script only asks for
//! a fresh copy on each refresh, so there is one drawing of a chart, no markup built in the browser,
//! and a page without scripts still has its charts.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{Markup, html};

use crate::Shared;
use crate::pipeline::Series;

/// The drawing area, in SVG user units; the legend is drawn below it.
const WIDTH: f64 = 320.0;
const HEIGHT: f64 = 110.0;
/// Height of one legend row.
const LEGEND_ROW: f64 = 14.0;

/// The built-in series' colours (the page's palette); a line keeps its colour between refreshes.
const NAMED: [(&str, &str); 6] = [
    ("events", "#1a56db"),
    ("stream", "#7c3aed"),
    ("outbox", "#b45309"),
    ("inventory", "#0f766e"),
    ("points", "#be185d"),
    ("search", "#4d7c0f"),
];

/// Colours for every other series (a read model of the registry), chosen by its name so that it is
/// the same on every refresh and every console.
const OTHERS: [&str; 6] = [
    "#c2410c", "#0369a1", "#6d28d9", "#15803d", "#a16207", "#475569",
];

/// The charts the overview has, by name.
const CHARTS: [&str; 2] = ["throughput", "backlog"];

fn colour(label: &str) -> &'static str {
    if let Some((_, colour)) = NAMED.iter().find(|(name, _)| *name == label) {
        return colour;
    }
    // FNV-1a: stable across processes and versions, unlike the standard library's hasher.
    let hash = label.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    OTHERS[usize::try_from(hash % OTHERS.len() as u64).unwrap_or(0)]
}

/// The chart named `name` (its key in the API's `series`) on the page: the image, which the script
/// reloads on each refresh.
pub(super) fn chart(name: &str) -> Markup {
    html! {
        img.chart data-chart=(name) src={ "/console/charts/" (name) ".svg" }
            alt={ (name) " chart: the same series as /console/api/overview" };
    }
}

/// `GET /console/charts/{name}.svg`.
pub(crate) async fn image(State(console): State<Shared>, Path(file): Path<String>) -> Response {
    let Some(name) = file.strip_suffix(".svg").filter(|n| CHARTS.contains(n)) else {
        return (StatusCode::NOT_FOUND, "no such chart").into_response();
    };
    let (_, series) = console.snapshot().await;
    let body = svg(name, pick(&series, name)).into_string();
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("image/svg+xml"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

fn pick<'a>(series: &'a Series, name: &str) -> &'a BTreeMap<String, Vec<(i64, f64)>> {
    if name == "backlog" {
        &series.backlog
    } else {
        &series.throughput
    }
}

/// The whole image: an axis label with the top value, a line per series scaled to the window's time
/// span, and the legend below. Colours are attributes, not a stylesheet: an image has none of the
/// page's.
fn svg(name: &str, series: &BTreeMap<String, Vec<(i64, f64)>>) -> Markup {
    let points = series.values().flatten();
    let (t0, t1) = points.clone().fold((i64::MAX, i64::MIN), |(a, b), (t, _)| {
        (a.min(*t), b.max(*t))
    });
    let top = points.map(|(_, v)| *v).fold(1.0_f64, f64::max);
    #[allow(
        clippy::cast_precision_loss,
        reason = "milliseconds of a few minutes' window, far below 2^52"
    )]
    let line = |values: &[(i64, f64)]| {
        values
            .iter()
            .map(|(t, v)| {
                let x = (t - t0) as f64 / (t1 - t0) as f64 * WIDTH;
                let y = HEIGHT - v / top * (HEIGHT - 14.0) - 2.0;
                format!("{x:.1},{y:.1}")
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    #[allow(
        clippy::cast_precision_loss,
        reason = "a handful of series: the count is exact in an f64"
    )]
    let height = HEIGHT + LEGEND_ROW * (series.len() as f64) + 4.0;
    let legend_y = |i: usize| {
        #[allow(
            clippy::cast_precision_loss,
            reason = "a handful of series: the index is exact in an f64"
        )]
        let row = i as f64;
        HEIGHT + 4.0 + LEGEND_ROW * row
    };
    html! {
        svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (WIDTH) " " (height) }
            width=(WIDTH) height=(height) font-family="system-ui, sans-serif" role="img" {
            title { (name) " chart" }
            rect width=(WIDTH) height=(HEIGHT) fill="#fbfcfd" stroke="#eceef2" {}
            text x="2" y="10" font-size="9" fill="#5b6474" { (format!("{top:.0}")) }
            @if t0 < t1 {
                @for (label, values) in series {
                    polyline fill="none" stroke=(colour(label)) stroke-width="1.6"
                        points=(line(values)) {}
                }
            } @else {
                text x="100" y="60" font-size="9" fill="#5b6474" { "collecting samples…" }
            }
            @for (i, label) in series.keys().enumerate() {
                rect x="2" y=(legend_y(i) + 5.0) width="14" height="3" fill=(colour(label)) {}
                text x="22" y=(legend_y(i) + 10.0) font-size="11" fill="#1d2330" { (label) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_series() -> BTreeMap<String, Vec<(i64, f64)>> {
        BTreeMap::from([
            ("events".to_owned(), vec![(1_000, 5.0), (3_000, 10.0)]),
            ("revenue".to_owned(), vec![(1_000, 1.0), (3_000, 2.0)]),
        ])
    }

    #[test]
    fn draws_a_line_and_a_legend_entry_per_series() {
        let image = svg("throughput", &two_series()).into_string();
        assert_eq!(image.matches("<polyline").count(), 2, "{image}");
        assert!(image.contains(">events</text>") && image.contains(">revenue</text>"));
        // The top value scales the y axis; the window's ends are the x axis's.
        assert!(image.contains(">10</text>"), "{image}");
        assert!(image.contains("points=\"0.0,"), "{image}");
        assert!(image.contains("320.0,"), "{image}");
    }

    #[test]
    fn a_series_not_built_in_gets_a_stable_colour_of_its_own() {
        assert_eq!(colour("events"), "#1a56db");
        assert_eq!(colour("revenue"), colour("revenue"));
        assert!(OTHERS.contains(&colour("revenue")));
        assert_ne!(colour("revenue"), "#888");
    }

    #[test]
    fn one_sample_says_it_is_still_collecting_and_names_are_escaped() {
        let series = BTreeMap::from([("<b>&".to_owned(), vec![(1_000, 1.0)])]);
        let image = svg("backlog", &series).into_string();
        assert!(image.contains("collecting samples"));
        assert!(!image.contains("<polyline"));
        assert!(image.contains("&lt;b&gt;&amp;"), "{image}");
    }
}
