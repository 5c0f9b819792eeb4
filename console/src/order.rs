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
use maud::{Markup, html};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::catalog::{self, Step};
use crate::html::{self, Section};
use crate::readside::{self, OrderMarks};
use crate::stream::StreamCopy;
use crate::{Console, Shared};

/// An order's events are shown up to this many (an order has a handful; more is a broken writer).
const MAX_EVENTS: i64 = 500;
/// [`MAX_EVENTS`] as a length.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "500 fits"
)]
const MAX_SHOWN: usize = MAX_EVENTS as usize;

/// One event of the timeline.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TimelineEvent {
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
pub(crate) struct OutboxView {
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
pub(crate) struct Timeline {
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
    let rows = store::outbox::admin::timeline(&console.pool, order, MAX_EVENTS + 1).await?;
    // One more than shown is read only to tell that there are more.
    let mut rows = rows;
    let more_events = rows.len() > MAX_SHOWN;
    rows.truncate(MAX_SHOWN);
    let upcasters = Upcasters::all();
    let mut marks: Vec<OrderMarks> = Vec::with_capacity(readside::names().len());
    for &name in readside::names() {
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
    for row in rows {
        let event_id = row.event_id;
        let event_type = row.event_type;
        let stored_version = row.event_version;
        let aggregate_version = row.aggregate_version;
        let (upcast_payload, upcast_error) =
            match upcasters.upcast(&event_type, stored_version, row.payload) {
                Ok(value) => (Some(value), None),
                Err(error) => (None, Some(error.to_string())),
            };
        let outbox = row.row.map(|o| OutboxView {
            status: o.status.to_string(),
            attempts: o.attempts,
            stream_seq: o.stream_seq,
            sent_at: o.sent_at,
            last_error: o.error,
        });
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
            position: row.position,
            event_id,
            current_version: upcasters.current_version(&event_type),
            upcast_chain: catalog::chain(&upcasters, &event_type, stored_version),
            event_type,
            stored_version,
            aggregate_version,
            occurred_at: row.occurred_at,
            recorded_at: row.recorded_at,
            stored_payload: row.stored_payload,
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
    let (folded, fold_error) = if events.is_empty() {
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
pub(crate) struct Find {
    id: Option<String>,
}

pub(crate) async fn find(State(console): State<Shared>, Query(find): Query<Find>) -> Response {
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
pub(crate) async fn api(State(console): State<Shared>, Path(id): Path<String>) -> Response {
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
pub(crate) async fn page(State(console): State<Shared>, Path(id): Path<String>) -> Response {
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
                "The database did not answer; the console's log has the error.",
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
            render(&timeline),
        ),
    )
}

const TIME: &str = "%Y-%m-%d %H:%M:%S%.3f UTC";

fn render(t: &Timeline) -> Markup {
    let api = format!("/console/api/orders/{}", t.order_id);
    html! {
        h1 { "Order " code { (t.order_id) } }
        p.lead {
            (t.events.len()) " event(s) as stored in " code { "events" } " and as upcast to today's \
             shape; each with its outbox row, its stream sequence and what each projection's \
             checkpoint says. As JSON at " a href=(api) { (api) } "."
        }
        @if t.more_events {
            p.note data-testid="more-events" {
                "Only the first " (MAX_EVENTS) " events are shown: this order has more (an order \
                 normally has a handful; so many points at a broken writer). The folded order beside \
                 them is of all its events."
            }
        }
        @if let Some(reason) = &t.stream_reason {
            p.note { "The stream was not read for this order: " (html::text(reason)) "." }
        }
        div.order-layout {
            ol.timeline {
                @for e in &t.events { (render_event(e)) }
            }
            aside.card.folded aria-labelledby="folded-h" {
                h2 #folded-h { "Folded order" }
                @match (&t.folded, &t.fold_error) {
                    (Some(folded), _) => {
                        p.muted { "Every event upcast and applied in order, as the command side sees it." }
                        pre.json data-testid="folded" { (html::json_block(folded)) }
                    }
                    (None, Some(error)) => {
                        p.error { "The order cannot be folded: " (html::text(error)) }
                    }
                    (None, None) => { p { "Nothing to fold." } }
                }
                @if !t.foreign_messages.is_empty() {
                    p.error {
                        (t.foreign_messages.len()) " message(s) on this order's subject are none of \
                         its events: sequences "
                        (t.foreign_messages.iter().map(|c| c.sequence.to_string()).collect::<Vec<_>>().join(", "))
                        "."
                    }
                }
            }
        }
    }
}

/// The badge class of a projection's verdict.
fn verdict_class(state: &str) -> &'static str {
    match state {
        "applied" => "ok",
        "parked" | "discarded" | "skipped" => "bad",
        "held" | "pending" => "warn",
        _ => "",
    }
}

fn render_event(e: &TimelineEvent) -> Markup {
    let anchor = catalog::anchor(&e.event_type, e.stored_version);
    let legacy = e.current_version.filter(|c| *c != e.stored_version);
    html! {
        li.card.event id={ "v" (e.aggregate_version) } {
            h2 {
                span.muted { "v" (e.aggregate_version) } " "
                a href={ "/console/catalog#" (anchor) } data-testid="event-type" { (html::text(&e.event_type)) } " "
                span.muted { "stored as version" } " "
                span data-testid="stored-version" { (e.stored_version) }
                @if let Some(current) = legacy {
                    " " span.badge.warn { "legacy: current is v" (current) }
                }
            }
            p.meta {
                "event " code { (e.event_id) } " · occurred " (e.occurred_at.format(TIME))
                " · recorded " (e.recorded_at.format(TIME)) " · position " (e.position)
            }
            div.two {
                section aria-label="as stored" {
                    h3 { "As stored (v" (e.stored_version) ")" }
                    pre.json data-testid="stored-payload" { (html::capped(&e.stored_payload)) }
                }
                section aria-label="as upcast" {
                    h3 { "As upcast (v" (e.current_version.map_or("?".to_owned(), |c| c.to_string())) ")" }
                    @match (&e.upcast_payload, &e.upcast_error) {
                        (Some(payload), _) => {
                            p.chain {
                                (html::text(&e.upcast_chain.as_deref().map_or("no chain known".to_owned(), catalog::describe)))
                            }
                            pre.json { (html::json_block(payload)) }
                        }
                        (None, Some(error)) => { p.error { "Cannot be upcast: " (html::text(error)) } }
                        (None, None) => {}
                    }
                }
            }
            p.delivery {
                @match &e.outbox {
                    Some(o) => {
                        @let class = match o.status.as_str() { "sent" => "ok", "dead" => "bad", _ => "warn" };
                        span class={ "badge " (class) } { "outbox " (html::text(&o.status)) }
                        " " (o.attempts) " attempt(s)"
                        @if let Some(sent) = o.sent_at { ", sent " (sent.format(TIME)) }
                        @if let Some(error) = &o.last_error { " " span.error { (html::capped(error)) } }
                    }
                    None => {
                        span.badge { "no outbox row" } " (purged after sending, or written without one)"
                    }
                }
                " · "
                @match e.stream_sequence {
                    Some(s) => {
                        "stream sequence " strong data-testid="seq" { (s) } " "
                        span.muted { "(" (e.stream_sequence_source) ")" }
                    }
                    None => { "stream sequence " strong { "unknown" } }
                }
                @if let Some(note) = &e.stream_note { " " span.muted { "— " (html::text(note)) } }
            }
            ul.badges aria-label="projections" {
                @for (name, state, detail) in &e.projections {
                    li { span class={ "badge " (verdict_class(state)) } title=(html::text(detail)) { (name) ": " (state) } }
                }
            }
        }
    }
}
