//! `/console/orders/{id}`: one order's timeline. Each event as stored (type, version, the payload as
//! PostgreSQL holds it), as upcast to the current shape (with the chain of upcasters), its outbox
//! row, its stream sequence, and whether each projection has applied it (from that projection's
//! checkpoint for the order); the order as folded from its events beside it.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use domain::{OrderId, Upcasters};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::Row;
use uuid::Uuid;

use super::catalog::{self, Step};
use super::html::{self, Section, esc, esc_capped};
use super::readside::{self, OrderMarks, PROJECTIONS};
use super::stream::StreamCopy;
use super::{Console, Shared};

/// An order's events are shown up to this many (an order has a handful; more is a broken writer).
const MAX_EVENTS: i64 = 500;

/// One event of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineEvent {
    /// Insertion number in `events`.
    pub position: i64,
    pub event_id: Uuid,
    pub event_type: String,
    /// The payload version it was stored with.
    pub stored_version: i32,
    /// Its place in the order's history.
    pub aggregate_version: i64,
    /// When it was decided.
    pub occurred_at: DateTime<Utc>,
    /// When the database recorded it.
    pub recorded_at: DateTime<Utc>,
    /// The payload as stored (`payload::text`: JSONB normalizes key order and spacing).
    pub stored_payload: String,
    /// The payload in the current shape.
    pub upcast_payload: Option<Value>,
    /// The current version of its type.
    pub current_version: Option<i32>,
    /// The upcasters applied, in order (empty: stored in the current shape).
    pub upcast_chain: Option<Vec<Step>>,
    /// Why it cannot be upcast.
    pub upcast_error: Option<String>,
    /// The outbox row (`None`: purged after it was sent, or never written).
    pub outbox: Option<OutboxView>,
    /// The stream sequence, and where it was learned.
    pub stream_sequence: Option<u64>,
    /// `stream` (read from the order's subject), `outbox` (the relay's record of the PubAck) or
    /// `unknown`.
    pub stream_sequence_source: &'static str,
    /// Copies, mismatches, or why the sequence is unknown.
    pub stream_note: Option<String>,
    /// Per projection: `applied`, `skipped` (an operator's release passed it over), `held`,
    /// `parked`, `discarded`, `pending`, `not found` or `unknown`, and a sentence.
    pub projections: Vec<(&'static str, &'static str, String)>,
}

/// The event's outbox row.
#[derive(Debug, Clone, Serialize)]
pub struct OutboxView {
    /// `pending`, `sent`, `failed` or `dead`.
    pub status: String,
    /// Publish attempts.
    pub attempts: i32,
    /// The relay's record of the stream sequence.
    pub stream_seq: Option<i64>,
    /// When it was sent.
    pub sent_at: Option<DateTime<Utc>>,
    /// The last publish error, or why it died.
    pub last_error: Option<String>,
}

/// An order's events with, for each, its outbox row, its stream copy and each projection's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Timeline {
    pub order_id: Uuid,
    /// Its events, oldest first.
    pub events: Vec<TimelineEvent>,
    /// The order folded from its events.
    pub folded: Option<Value>,
    /// Why it could not be folded.
    pub fold_error: Option<String>,
    /// Whether the stream was read for this order, and if not why.
    pub stream_read: bool,
    /// Why the stream was not read.
    pub stream_reason: Option<String>,
    /// Messages on the order's subject that are none of its events (not looked for when the
    /// timeline is cut: the later events' copies would be counted as strangers).
    pub foreign_messages: Vec<StreamCopy>,
    /// The order has more than the events shown (the first [`MAX_EVENTS`]).
    pub more_events: bool,
}

async fn timeline(console: &Console, order: Uuid) -> Result<Timeline, sqlx::Error> {
    // The outbox is joined on (aggregate_id, aggregate_version), its unique index: `event_id` has
    // none there, and joining on it would scan the whole outbox for every order looked at.
    let rows = sqlx::query(
        "SELECT e.position, e.event_id, e.event_type, e.event_version, e.aggregate_version,
                e.occurred_at, e.recorded_at, e.payload::text AS stored_payload, e.payload,
                o.status, o.attempts, o.stream_seq, o.sent_at, coalesce(o.dead_reason, o.last_error) AS error,
                o.id IS NOT NULL AS has_outbox
         FROM events e LEFT JOIN outbox o
              ON o.aggregate_id = e.aggregate_id AND o.aggregate_version = e.aggregate_version
         WHERE e.aggregate_id = $1 ORDER BY e.aggregate_version LIMIT $2",
    )
    .bind(order)
    .bind(MAX_EVENTS + 1)
    .fetch_all(&console.pool)
    .await?;
    // One more than shown is read only to tell that there are more.
    let mut rows = rows;
    let more_events = rows.len() as i64 > MAX_EVENTS;
    rows.truncate(MAX_EVENTS as usize);
    let upcasters = Upcasters::orders();
    let mut marks: Vec<OrderMarks> = Vec::with_capacity(PROJECTIONS.len());
    for name in PROJECTIONS {
        marks.push(readside::order_marks(&console.pool, name, order).await);
    }
    let (copies, stream_reason) = if rows.is_empty() {
        (Vec::new(), Some("the order has no events".to_owned()))
    } else {
        match console.stream.order_messages(order).await {
            Ok(copies) => (copies, None),
            Err(reason) => (Vec::new(), Some(reason)),
        }
    };
    let stream_read = stream_reason.is_none();
    let mut events = Vec::with_capacity(rows.len());
    let mut matched = vec![false; copies.len()];
    for row in &rows {
        let event_id: Uuid = row.try_get("event_id")?;
        let event_type: String = row.try_get("event_type")?;
        let stored_version: i32 = row.try_get("event_version")?;
        let aggregate_version: i64 = row.try_get("aggregate_version")?;
        let payload: Value = row.try_get("payload")?;
        let (upcast_payload, upcast_error) =
            match upcasters.upcast(&event_type, stored_version, payload) {
                Ok(value) => (Some(value), None),
                Err(error) => (None, Some(error.to_string())),
            };
        let outbox = if row.try_get::<bool, _>("has_outbox")? {
            Some(OutboxView {
                status: row.try_get("status")?,
                attempts: row.try_get("attempts")?,
                stream_seq: row.try_get("stream_seq")?,
                sent_at: row.try_get("sent_at")?,
                last_error: row.try_get("error")?,
            })
        } else {
            None
        };
        let own: Vec<usize> = copies
            .iter()
            .enumerate()
            .filter(|(_, c)| c.msg_id.as_deref() == Some(event_id.to_string().as_str()))
            .map(|(i, _)| i)
            .collect();
        for i in &own {
            matched[*i] = true;
        }
        let recorded = outbox.as_ref().and_then(|o| o.stream_seq);
        let (stream_sequence, source, note) = sequence_of(
            &own,
            &copies,
            recorded,
            stream_read,
            stream_reason.as_deref(),
        );
        events.push(TimelineEvent {
            position: row.try_get("position")?,
            event_id,
            current_version: upcasters.current_version(&event_type),
            upcast_chain: catalog::chain(&upcasters, &event_type, stored_version),
            event_type,
            stored_version,
            aggregate_version,
            occurred_at: row.try_get("occurred_at")?,
            recorded_at: row.try_get("recorded_at")?,
            stored_payload: row.try_get("stored_payload")?,
            upcast_payload,
            upcast_error,
            outbox,
            stream_sequence,
            stream_sequence_source: source,
            stream_note: note,
            projections: marks
                .iter()
                .map(|m| {
                    let (state, detail) = m.verdict(aggregate_version);
                    (m.name, state, detail)
                })
                .collect(),
        });
    }
    let (folded, fold_error) = if rows.is_empty() {
        (None, None)
    } else {
        match store::load_order(&console.pool, OrderId::from_uuid(order), &upcasters).await {
            Ok(folded) => (serde_json::to_value(&folded).ok(), None),
            Err(error) => (None, Some(ops::error_chain(&error))),
        }
    };
    let foreign_messages = if more_events {
        Vec::new()
    } else {
        copies
            .into_iter()
            .zip(matched)
            .filter(|(_, m)| !m)
            .map(|(c, _)| c)
            .collect()
    };
    Ok(Timeline {
        order_id: order,
        events,
        folded,
        fold_error,
        stream_read,
        stream_reason,
        foreign_messages,
        more_events,
    })
}

/// Where an event sits in the stream: the stream's own answer when it was read, else the relay's
/// record in the outbox, else unknown and why.
fn sequence_of(
    own: &[usize],
    copies: &[StreamCopy],
    recorded: Option<i64>,
    stream_read: bool,
    reason: Option<&str>,
) -> (Option<u64>, &'static str, Option<String>) {
    let recorded = recorded.and_then(|s| u64::try_from(s).ok());
    if stream_read {
        return match own {
            [] => (
                None,
                "unknown",
                Some("not on the order's subject in the stream (not published yet?)".to_owned()),
            ),
            [one] => {
                let sequence = copies[*one].sequence;
                let note = recorded
                    .filter(|r| *r != sequence)
                    .map(|r| format!("the outbox recorded sequence {r}"));
                (Some(sequence), "stream", note)
            }
            many => (
                Some(copies[many[0]].sequence),
                "stream",
                Some(format!(
                    "{} copies on the stream, at sequences {}",
                    many.len(),
                    many.iter()
                        .map(|i| copies[*i].sequence.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
            ),
        };
    }
    match recorded {
        Some(sequence) => (
            Some(sequence),
            "outbox",
            Some(format!(
                "from the relay's record; the stream was not read ({})",
                reason.unwrap_or("unavailable")
            )),
        ),
        None => (
            None,
            "unknown",
            Some(format!(
                "no record in the outbox, and the stream was not read ({})",
                reason.unwrap_or("unavailable")
            )),
        ),
    }
}

fn parse(id: &str) -> Option<Uuid> {
    Uuid::parse_str(id.trim()).ok()
}

/// `GET /console/orders?id=…`: the search box.
#[derive(Debug, Deserialize)]
pub struct Find {
    id: Option<String>,
}

pub async fn find(State(console): State<Shared>, Query(find): Query<Find>) -> Response {
    match find.id.as_deref().and_then(parse) {
        Some(id) => (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/console/orders/{id}"))],
        )
            .into_response(),
        None => html::error_page(
            StatusCode::BAD_REQUEST,
            "Not an order id",
            "An order id is a UUID, like 0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b.",
            console.operator(),
        ),
    }
}

/// `GET /console/api/orders/{id}`.
pub async fn api(State(console): State<Shared>, Path(id): Path<String>) -> Response {
    let Some(order) = parse(&id) else {
        return (StatusCode::BAD_REQUEST, "an order id is a UUID").into_response();
    };
    match timeline(&console, order).await {
        Ok(timeline) if timeline.events.is_empty() => {
            (StatusCode::NOT_FOUND, Json(timeline)).into_response()
        }
        Ok(timeline) => Json(timeline).into_response(),
        Err(error) => {
            tracing::error!(%order, %error, "console cannot read an order");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the order could not be read",
            )
                .into_response()
        }
    }
}

/// `GET /console/orders/{id}`.
pub async fn page(State(console): State<Shared>, Path(id): Path<String>) -> Response {
    console.viewed();
    let operator = console.operator();
    let Some(order) = parse(&id) else {
        return html::error_page(
            StatusCode::BAD_REQUEST,
            "Not an order id",
            &format!("{id:?} is not a UUID."),
            operator,
        );
    };
    let timeline = match timeline(&console, order).await {
        Ok(timeline) => timeline,
        Err(error) => {
            tracing::error!(%order, %error, "console cannot read an order");
            return html::error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "The order could not be read",
                "The database did not answer; the service log has the error.",
                operator,
            );
        }
    };
    if timeline.events.is_empty() {
        return html::error_page(
            StatusCode::NOT_FOUND,
            "No such order",
            &format!("No events are stored for order {order}."),
            operator,
        );
    }
    html::respond(
        StatusCode::OK,
        html::page(
            &format!("Order {order}"),
            Section::Order,
            operator,
            &render(&timeline),
        ),
    )
}

fn render(t: &Timeline) -> String {
    let mut out = format!(
        "<h1>Order <code>{id}</code></h1><p class=\"lead\">{n} event(s) as stored in <code>events</code> \
         and as upcast to today's shape; each with its outbox row, its stream sequence and what each \
         projection's checkpoint says. As JSON at <a href=\"/console/api/orders/{id}\">/console/api/orders/{id}</a>.</p>",
        id = t.order_id,
        n = t.events.len(),
    );
    if t.more_events {
        out.push_str(&format!(
            "<p class=\"note\" data-testid=\"more-events\">Only the first {MAX_EVENTS} events are shown: \
             this order has more (an order normally has a handful; so many points at a broken \
             writer). The folded order beside them is of all its events.</p>"
        ));
    }
    if let Some(reason) = &t.stream_reason {
        out.push_str(&format!(
            "<p class=\"note\">The stream was not read for this order: {}.</p>",
            esc(reason)
        ));
    }
    out.push_str("<div class=\"order-layout\"><ol class=\"timeline\">");
    for e in &t.events {
        out.push_str(&render_event(e));
    }
    out.push_str("</ol><aside class=\"card folded\" aria-labelledby=\"folded-h\"><h2 id=\"folded-h\">Folded order</h2>");
    match (&t.folded, &t.fold_error) {
        (Some(folded), _) => out.push_str(&format!(
            "<p class=\"muted\">Every event upcast and applied in order, as the command side sees it.</p>\
             <pre class=\"json\" data-testid=\"folded\">{}</pre>",
            html::json_block(folded)
        )),
        (None, Some(error)) => out.push_str(&format!(
            "<p class=\"error\">The order cannot be folded: {}</p>",
            esc(error)
        )),
        (None, None) => out.push_str("<p>Nothing to fold.</p>"),
    }
    if !t.foreign_messages.is_empty() {
        out.push_str(&format!(
            "<p class=\"error\">{} message(s) on this order's subject are none of its events: sequences {}.</p>",
            t.foreign_messages.len(),
            esc(&t
                .foreign_messages
                .iter()
                .map(|c| c.sequence.to_string())
                .collect::<Vec<_>>()
                .join(", "))
        ));
    }
    out.push_str("</aside></div>");
    out
}

fn render_event(e: &TimelineEvent) -> String {
    let anchor = catalog::anchor(&e.event_type, e.stored_version);
    let upcast = match (&e.upcast_payload, &e.upcast_error) {
        (Some(payload), _) => format!(
            "<p class=\"chain\">{}</p><pre class=\"json\">{}</pre>",
            esc(&e
                .upcast_chain
                .as_deref()
                .map_or("no chain known".to_owned(), catalog::describe)),
            html::json_block(payload)
        ),
        (None, Some(error)) => format!("<p class=\"error\">Cannot be upcast: {}</p>", esc(error)),
        (None, None) => String::new(),
    };
    let outbox = match &e.outbox {
        Some(o) => format!(
            "<span class=\"badge {cls}\">outbox {status}</span> {attempts} attempt(s){sent}{err}",
            cls = if o.status == "sent" { "ok" } else if o.status == "dead" { "bad" } else { "warn" },
            status = esc(&o.status),
            attempts = o.attempts,
            sent = o.sent_at.map_or(String::new(), |t| format!(", sent {}", t.format("%Y-%m-%d %H:%M:%S%.3f UTC"))),
            err = o.last_error.as_deref().map_or(String::new(), |r| format!(
                " <span class=\"error\">{}</span>",
                esc_capped(r)
            )),
        ),
        None => "<span class=\"badge\">no outbox row</span> (purged after sending, or written without one)".to_owned(),
    };
    let sequence = match e.stream_sequence {
        Some(s) => format!(
            "stream sequence <strong data-testid=\"seq\">{s}</strong> <span class=\"muted\">({})</span>",
            esc(e.stream_sequence_source)
        ),
        None => "stream sequence <strong>unknown</strong>".to_owned(),
    };
    let note = e.stream_note.as_deref().map_or(String::new(), |n| {
        format!(" <span class=\"muted\">— {}</span>", esc(n))
    });
    let projections: String = e
        .projections
        .iter()
        .map(|(name, state, detail)| {
            format!(
                "<li><span class=\"badge {cls}\" title=\"{d}\">{name}: {state}</span></li>",
                cls = match *state {
                    "applied" => "ok",
                    "parked" | "discarded" | "skipped" => "bad",
                    "held" | "pending" => "warn",
                    _ => "",
                },
                d = esc(detail),
                name = esc(name),
                state = esc(state),
            )
        })
        .collect();
    format!(
        "<li class=\"card event\" id=\"v{v}\"><h2><span class=\"muted\">v{v}</span> \
         <a href=\"/console/catalog#{anchor}\" data-testid=\"event-type\">{ty}</a> \
         <span class=\"muted\">stored as version</span> <span data-testid=\"stored-version\">{sv}</span>\
         {cur}</h2>\
         <p class=\"meta\">event <code>{id}</code> · occurred {occ} · recorded {rec} · position {pos}</p>\
         <div class=\"two\"><section aria-label=\"as stored\"><h3>As stored (v{sv})</h3>\
         <pre class=\"json\" data-testid=\"stored-payload\">{stored}</pre></section>\
         <section aria-label=\"as upcast\"><h3>As upcast (v{curv})</h3>{upcast}</section></div>\
         <p class=\"delivery\">{outbox} · {sequence}{note}</p>\
         <ul class=\"badges\" aria-label=\"projections\">{projections}</ul></li>",
        v = e.aggregate_version,
        ty = esc(&e.event_type),
        sv = e.stored_version,
        cur = if e.current_version.is_some_and(|c| c != e.stored_version) {
            format!(
                " <span class=\"badge warn\">legacy: current is v{}</span>",
                e.current_version.unwrap_or_default()
            )
        } else {
            String::new()
        },
        id = e.event_id,
        occ = e.occurred_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
        rec = e.recorded_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
        pos = e.position,
        stored = esc_capped(&e.stored_payload),
        curv = e.current_version.map_or("?".to_owned(), |c| c.to_string()),
    )
}
