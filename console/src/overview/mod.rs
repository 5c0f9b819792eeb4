//! `/console`: the pipeline left to right — commands, events, outbox, relays, stream, projections —
//! with charts of the last minutes. Rendered on the server with the latest snapshot (so it reads
//! complete before any script runs), then refreshed by the script from `/console/api/overview`: every
//! value the script updates carries its JSON path in `data-k` and its format in `data-f`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Serialize;
use serde_json::Value;

use super::Shared;
use super::html::{self, Section, esc};
use super::pipeline::{HISTORY_LEN, Series, Snapshot};
use super::relays::RelayMetricsView;

/// The overview API's answer.
#[derive(Debug, Serialize)]
pub struct Overview {
    /// The pipeline now.
    pub snapshot: Snapshot,
    /// The charts' data.
    pub series: Series,
    /// Whether state-changing actions exist on this service.
    pub operator: bool,
}

impl Overview {
    /// The latest sample and the charts, as both the page and the API show them.
    async fn now(console: &Shared) -> Self {
        let (snapshot, series) = console.snapshot().await;
        Self {
            snapshot,
            series,
            operator: console.operator(),
        }
    }
}

/// `GET /console/api/overview`.
pub async fn api(State(console): State<Shared>) -> Json<Overview> {
    Json(Overview::now(&console).await)
}

/// `GET /console`.
pub async fn page(State(console): State<Shared>) -> Response {
    let overview = Overview::now(&console).await;
    let body = render(&overview);
    html::respond(
        StatusCode::OK,
        html::page("Pipeline", Section::Overview, overview.operator, &body),
    )
}

/// How a value is shown; the script has the same formats.
#[derive(Debug, Clone, Copy)]
enum Format {
    Count,
    Rate,
    Age,
    Bytes,
    Text,
    Time,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Rate => "rate",
            Self::Age => "age",
            Self::Bytes => "bytes",
            Self::Text => "text",
            Self::Time => "time",
        }
    }

    fn show(self, value: &Value) -> String {
        match (self, value) {
            (_, Value::Null) => "—".to_owned(),
            (Self::Count, v) => v.as_i64().map_or_else(|| v.to_string(), html::count),
            (Self::Rate, v) => format!("{:.1}/s", v.as_f64().unwrap_or(0.0)),
            (Self::Age, v) => html::age(v.as_f64().unwrap_or(0.0)),
            (Self::Bytes, v) => bytes(v.as_f64().unwrap_or(0.0)),
            // RFC 3339 in UTC: the time of day is what a live page needs.
            (Self::Time, Value::String(s)) => s
                .get(11..19)
                .map_or_else(|| s.clone(), |t| format!("{t} UTC")),
            (Self::Text, Value::String(s)) => s.clone(),
            (Self::Text | Self::Time, v) => v.to_string(),
        }
    }
}

fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{value:.0} {}", UNITS[0])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The JSON value at a dotted path (`snapshot.projections.0.applied`); `length` of an array is its
/// length, as in the script.
fn at(root: &Value, path: &str) -> Value {
    let mut here = root;
    for key in path.split('.') {
        if let (Value::Array(items), "length") = (here, key) {
            return Value::from(items.len());
        }
        here = match key.parse::<usize>() {
            Ok(i) => here.get(i),
            Err(_) => here.get(key),
        }
        .unwrap_or(&Value::Null);
    }
    here.clone()
}

/// Renders with access to the overview as JSON (the same paths the script reads).
struct Renderer {
    root: Value,
}

impl Renderer {
    /// A value the script keeps up to date.
    fn field(&self, path: &str, format: Format) -> String {
        format!(
            "<span class=\"v\" data-k=\"{p}\" data-f=\"{f}\">{v}</span>",
            p = esc(path),
            f = format.name(),
            v = esc(&format.show(&at(&self.root, path))),
        )
    }

    fn truthy(&self, path: &str) -> bool {
        match &at(&self.root, path) {
            Value::Null | Value::Bool(false) => false,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::String(s) => !s.is_empty(),
            _ => true,
        }
    }

    /// A row of a card: a label and a value.
    fn row(&self, label: &str, path: &str, format: Format) -> String {
        format!(
            "<div class=\"row\"><dt>{}</dt><dd>{}</dd></div>",
            esc(label),
            self.field(path, format)
        )
    }

    /// An element shown while `path` is truthy (`when`) or falsy (`unless`).
    fn shown(&self, path: &str, when: bool, inner: &str) -> String {
        let hidden = self.truthy(path) != when;
        format!(
            "<div data-{attr}=\"{p}\"{h}>{inner}</div>",
            attr = if when { "when" } else { "unless" },
            p = esc(path),
            h = if hidden { " hidden" } else { "" },
        )
    }
}

fn render(overview: &Overview) -> String {
    let r = Renderer {
        root: serde_json::to_value(overview).unwrap_or(Value::Null),
    };
    let s = &overview.snapshot;
    let mut out = String::new();
    let _ = write!(
        out,
        "<h1>Pipeline</h1><p class=\"lead\">Live from PostgreSQL and NATS, refreshed every 2 s \
         (as JSON at <a href=\"/console/api/overview\">/console/api/overview</a>). Read at \
         {at}.</p>",
        at = r.field("snapshot.taken_at", Format::Time)
    );
    out.push_str("<div class=\"pipeline\" role=\"list\">");

    // Commands.
    let _ = write!(
        out,
        "<section class=\"card stage\" role=\"listitem\" aria-labelledby=\"st-commands\">\
         <h2 id=\"st-commands\">Commands</h2><dl>{}</dl>\
         <p class=\"muted small\">Accepted commands, measured as events appended (each accepted \
         command appends one). Refused commands write nothing, so the database cannot count them; \
         see <code>waybill_http_requests_total</code> on --metrics-listen.</p></section>",
        r.row("accepted", "snapshot.rates.events_per_s", Format::Rate)
    );

    // Events.
    let _ = write!(
        out,
        "<section class=\"card stage\" role=\"listitem\" aria-labelledby=\"st-events\">\
         <h2 id=\"st-events\">Events</h2><dl>{}{}</dl>{}</section>",
        format_args!(
            "<div class=\"row big\"><dt>stored</dt><dd data-testid=\"events-stored\">{}</dd></div>",
            r.field("snapshot.events.stored", Format::Count)
        ),
        r.row(
            "last recorded",
            "snapshot.events.last_recorded_at",
            Format::Time
        ),
        r.shown(
            "snapshot.events.error",
            true,
            &format!(
                "<p class=\"error\">{}</p>",
                r.field("snapshot.events.error", Format::Text)
            )
        ),
    );

    // Outbox.
    let dead_link = "<a href=\"/console/outbox/dead\">dead rows, with replay</a>";
    let _ = write!(
        out,
        "<section class=\"card stage\" role=\"listitem\" aria-labelledby=\"st-outbox\">\
         <h2 id=\"st-outbox\">Outbox</h2><dl>{}{}{}{}{}</dl><p>{dead_link}</p>{}</section>",
        r.row("pending", "snapshot.outbox.pending", Format::Count),
        r.row("failed", "snapshot.outbox.failed", Format::Count),
        r.row("dead", "snapshot.outbox.dead", Format::Count),
        r.row(
            "oldest pending",
            "snapshot.outbox.oldest_pending_age_seconds",
            Format::Age
        ),
        r.row(
            "orders held back",
            "snapshot.outbox.aggregates_held_back",
            Format::Count
        ),
        r.shown(
            "snapshot.outbox_error",
            true,
            &format!(
                "<p class=\"error\">{}</p>",
                r.field("snapshot.outbox_error", Format::Text)
            )
        ),
    );

    // Relays.
    let _ = write!(
        out,
        "<section class=\"card stage\" role=\"listitem\" aria-labelledby=\"st-relay\">\
         <h2 id=\"st-relay\">Relays</h2><dl>{}{}{}{}{}</dl>{}\
         <p class=\"muted small\">Publish rate is measured at the stream (new messages per second; \
         copies the broker refused are not counted).</p></section>",
        r.row(
            "publish rate",
            "snapshot.rates.published_per_s",
            Format::Rate
        ),
        r.row("connected", "snapshot.relay.connected", Format::Count),
        r.row("last sent", "snapshot.relay.last_sent_at", Format::Time),
        r.row(
            "unsettled publishes",
            "snapshot.outbox.unsettled_publishes",
            Format::Count
        ),
        format_args!(
            "<div class=\"row\"><dt>fence conflicts</dt><dd>{}</dd></div>",
            r.field("snapshot.outbox.fence_conflicts.length", Format::Count)
        ),
        relay_counters(&r, &s.relay.metrics),
    );

    // Stream.
    let _ = write!(
        out,
        "<section class=\"card stage\" role=\"listitem\" aria-labelledby=\"st-stream\">\
         <h2 id=\"st-stream\">Stream <span class=\"muted\">{}</span></h2>{}{}</section>",
        esc(&s.stream.name),
        r.shown(
            "snapshot.stream.available",
            true,
            &format!(
                "<dl>{}{}{}{}</dl>",
                r.row(
                    "last sequence",
                    "snapshot.stream.last_sequence",
                    Format::Count
                ),
                r.row("messages", "snapshot.stream.messages", Format::Count),
                r.row("bytes", "snapshot.stream.bytes", Format::Bytes),
                r.row(
                    "first sequence",
                    "snapshot.stream.first_sequence",
                    Format::Count
                ),
            )
        ),
        r.shown(
            "snapshot.stream.available",
            false,
            &format!(
                "<p class=\"error\"><strong>unavailable</strong>: {}</p>",
                r.field("snapshot.stream.reason", Format::Text)
            )
        ),
    );

    // Projections.
    out.push_str(
        "<section class=\"card stage projections\" role=\"listitem\" aria-labelledby=\"st-proj\">\
         <h2 id=\"st-proj\">Projections</h2>",
    );
    for (i, p) in s.projections.iter().enumerate() {
        let base = format!("snapshot.projections.{i}");
        let name = p.state.name;
        let _ = write!(
            out,
            "<section class=\"projection\" aria-labelledby=\"pj-{name}\" data-testid=\"projection-{name}\">\
             <h3 id=\"pj-{name}\">{name}</h3>{found}{missing}{error}</section>",
            found = r.shown(
                &format!("{base}.found"),
                true,
                &format!(
                    "<dl>{}{}{}{}{}{}</dl><p class=\"small\"><a href=\"/console/projections/{name}/parked\">parked</a> \
                     · <a href=\"/console/projections/{name}/held\">held</a></p>",
                    r.row("applied", &format!("{base}.applied"), Format::Count),
                    r.row("rate", &format!("snapshot.rates.applied_per_s.{name}"), Format::Rate),
                    r.row("behind stream", &format!("{base}.behind_stream"), Format::Count),
                    r.row("behind store", &format!("{base}.behind_store"), Format::Count),
                    r.row("held", &format!("{base}.held"), Format::Count),
                    r.row("parked", &format!("{base}.parked"), Format::Count),
                )
            ),
            missing = r.shown(
                &format!("{base}.found"),
                false,
                "<p class=\"muted\">not found in this database (its schema is absent: not started \
                 yet, or it keeps its state in another database)</p>"
            ),
            error = r.shown(
                &format!("{base}.error"),
                true,
                &format!("<p class=\"error\">{}</p>", r.field(&format!("{base}.error"), Format::Text))
            ),
        );
    }
    out.push_str(
        "<p class=\"muted small\">Behind stream: messages its consumer has not settled (from NATS). \
         Behind store: events stored minus events applied (from its checkpoints).</p></section></div>",
    );

    // Charts.
    let minutes = HISTORY_LEN * 2 / 60;
    let _ = write!(
        out,
        "<div class=\"charts\"><figure class=\"card\"><figcaption>Throughput, per second \
         (last {minutes} min while watched)</figcaption>{}</figure>\
         <figure class=\"card\"><figcaption>Backlog: outbox unsent, projections behind</figcaption>{}</figure></div>",
        chart("throughput", &overview.series.throughput),
        chart("backlog", &overview.series.backlog),
    );
    out
}

/// Duplicate PubAcks and fenced publishes: only the relays count them, so they are shown from the
/// relays' scraped /metrics, per relay and in total, or (without `--relay-metrics`) explained. The
/// relays are fixed at start, so the rows are rendered here and only their values refreshed.
fn relay_counters(r: &Renderer, metrics: &RelayMetricsView) -> String {
    const WHY: &str = "Duplicate PubAcks and fenced publishes are counted only inside each relay \
        process (<code>waybill_relay_duplicate_acks_total</code>, \
        <code>waybill_relay_fenced_total</code> on its --metrics-listen): neither the database nor \
        the stream records them.";
    if metrics.relays.is_empty() {
        return format!(
            "<p class=\"muted small\" data-testid=\"relay-metrics-off\">{WHY} Start \
             <code>waybill serve</code> with <code>--relay-metrics \
             http://&lt;relay&gt;/metrics</code> (once per relay, or \
             <code>WAYBILL_RELAY_METRICS</code>, comma-separated) to show them here.</p>"
        );
    }
    let base = "snapshot.relay.metrics";
    let mut out = format!(
        "<dl data-testid=\"relay-metrics\">{}{}<div class=\"row\"><dt>answering</dt>\
         <dd>{} of {}</dd></div></dl><ul class=\"relays small\">",
        r.row(
            "duplicate PubAcks",
            &format!("{base}.duplicate_acks"),
            Format::Count
        ),
        r.row("fenced publishes", &format!("{base}.fenced"), Format::Count),
        r.field(&format!("{base}.reachable"), Format::Count),
        r.field(&format!("{base}.configured"), Format::Count),
    );
    for (i, relay) in metrics.relays.iter().enumerate() {
        let at = format!("{base}.relays.{i}");
        let _ = write!(
            out,
            "<li data-testid=\"relay-metrics-{i}\"><code>{url}</code>{ok}{down}</li>",
            url = esc(&relay.url),
            ok = r.shown(
                &format!("{at}.reachable"),
                true,
                &format!(
                    "duplicates {} · fenced {}{}",
                    r.field(&format!("{at}.duplicate_acks"), Format::Count),
                    r.field(&format!("{at}.fenced"), Format::Count),
                    r.shown(
                        &format!("{at}.exported"),
                        false,
                        "<span class=\"muted\">not exported yet: nothing claimed since it \
                         started, or not a relay</span>"
                    ),
                )
            ),
            down = r.shown(
                &format!("{at}.reachable"),
                false,
                &format!(
                    "<span class=\"error\"><strong>unreachable</strong>: {}</span>",
                    r.field(&format!("{at}.error"), Format::Text)
                )
            ),
        );
    }
    let _ = write!(
        out,
        "</ul><p class=\"muted small\">{WHY} Scraped from each relay's /metrics with every sample \
         (1 s timeout); the totals are over the relays that answered, and a relay counts from its \
         own start.</p>"
    );
    out
}

/// The series' colours: fixed per name, so a line keeps its colour between refreshes.
const SERIES: [&str; 6] = [
    "events",
    "stream",
    "outbox",
    "inventory",
    "points",
    "search",
];

/// A chart as inline SVG (the script redraws it the same way).
fn chart(name: &str, series: &BTreeMap<String, Vec<(i64, f64)>>) -> String {
    let (w, h) = (320.0, 110.0);
    let points = series.values().flatten();
    let (t0, t1) = points.clone().fold((i64::MAX, i64::MIN), |(a, b), (t, _)| {
        (a.min(*t), b.max(*t))
    });
    let top = points.map(|(_, v)| *v).fold(1.0_f64, f64::max);
    let mut svg = format!(
        "<svg class=\"chart\" data-chart=\"{name}\" viewBox=\"0 0 {w} {h}\" role=\"img\" \
         aria-label=\"{name} chart\" preserveAspectRatio=\"none\"><text class=\"axis\" x=\"2\" y=\"10\">{top}</text>",
        top = esc(&format!("{top:.0}")),
    );
    if t0 < t1 {
        for (label, values) in series {
            let line: Vec<String> = values
                .iter()
                .map(|(t, v)| {
                    let x = (t - t0) as f64 / (t1 - t0) as f64 * w;
                    let y = h - v / top * (h - 14.0) - 2.0;
                    format!("{x:.1},{y:.1}")
                })
                .collect();
            let _ = write!(
                svg,
                "<polyline class=\"s-{c}\" points=\"{p}\"/>",
                c = series_class(label),
                p = line.join(" ")
            );
        }
    } else {
        svg.push_str("<text class=\"axis\" x=\"100\" y=\"60\">collecting samples…</text>");
    }
    svg.push_str("</svg><ul class=\"legend\">");
    for label in series.keys() {
        let _ = write!(
            svg,
            "<li><span class=\"key s-{}\"></span>{}</li>",
            series_class(label),
            esc(label)
        );
    }
    svg.push_str("</ul>");
    svg
}

fn series_class(label: &str) -> &'static str {
    SERIES
        .iter()
        .copied()
        .find(|s| *s == label)
        .unwrap_or("other")
}
