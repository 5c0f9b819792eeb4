//! The console's lists: the outbox's dead rows (with replay, when actions are on), and each
//! projection's parked messages and held events (with redrive, discard and release buttons when
//! actions are on and the projection's operator API is known; else the command that does it).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};

use crate::Shared;
use crate::html::{self, Section};
use crate::readside;

/// Rows listed at most per page.
const LIMIT: i64 = 200;

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `GET /console/outbox/dead`.
pub(crate) async fn dead(State(console): State<Shared>) -> Response {
    console.viewed();
    let operator = console.operator();
    let rows = match relay::admin::dead_rows(&console.pool, LIMIT).await {
        Ok(rows) => rows,
        Err(error) => {
            tracing::error!(%error, "console cannot list dead rows");
            return html::error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Dead rows could not be read",
                "The database did not answer; the console's log has the error.",
                operator,
            );
        }
    };
    let body = html! {
        h1 { "Dead outbox rows" }
        p.lead {
            "Events the relay gave up publishing after its last attempt, oldest first; each holds \
             back its order's later events. Replaying puts a row back to pending with its attempts \
             reset (the same as " code { "waybill outbox dead replay" } ")."
        }
        @if operator {
            (operator_panel(false, html! {
                button type="button" data-replay="all" { "Replay every dead row" }
            }))
        } @else {
            p.note {
                (actions_off()) " Run " code { "waybill outbox dead replay <id>" } " instead."
            }
        }
        @if rows.is_empty() {
            p data-testid="dead-empty" { "No dead rows." }
        } @else {
            table.grid {
                thead { tr {
                    th scope="col" { "Outbox id" } th scope="col" { "Order · version" }
                    th scope="col" { "Event" } th scope="col" { "Attempts" } th scope="col" { "Dead since" }
                    th scope="col" { "Reason" } th scope="col" { "Waiting behind" } th scope="col" { "Action" }
                } }
                tbody {
                    @for row in &rows {
                        tr {
                            td { (row.id) }
                            td { (order_link(row.aggregate_id)) " · v" (row.aggregate_version) }
                            td { (html::text(&row.event_type)) br; code.small { (row.event_id) } }
                            td { (row.attempts) }
                            td { @if let Some(at) = row.dead_at { (time(at)) } }
                            td.error { (html::capped(row.dead_reason.as_deref().unwrap_or(""))) }
                            td { (row.waiting_behind) }
                            td {
                                @if operator {
                                    button type="button" data-replay=(row.id) { "Replay" }
                                } @else {
                                    code { "waybill outbox dead replay " (row.id) }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    html::respond(
        StatusCode::OK,
        html::page("Dead rows", Section::Lists, operator, body),
    )
}

/// Why a page has no buttons when the console has no token.
fn actions_off() -> Markup {
    html! {
        "Actions are off: this console was started without an operator token ("
        code { "--operator-token" } " or " code { "WAYBILL_OPERATOR_TOKEN" } ")."
    }
}

fn order_link(order: uuid::Uuid) -> Markup {
    html! { a href={ "/console/orders/" (order) } { (order) } }
}

/// The operator's inputs (token; with `decisions`, who acts and why, for the projection's operator log)
/// and the page's bulk `buttons`, with the line where results are shown.
fn operator_panel(decisions: bool, buttons: Markup) -> Markup {
    html! {
        div.card.operator data-operator-panel {
            label for="token" { "Operator token" } " "
            input #token type="password" autocomplete="off" data-token;
            " " span.muted.small { "kept in this tab only; sent as Authorization: Bearer" }
            @if decisions {
                p {
                    label for="by" { "Acting as" } " "
                    input #by autocomplete="username" data-by;
                    " " label for="reason" { "Reason" } " "
                    input #reason size="40" data-reason;
                    " " span.muted.small {
                        "both recorded in the projection's operator log; a discard or a release needs a reason"
                    }
                }
            }
            p { (buttons) " " output data-result role="status" {} }
        }
    }
}

/// Why a projection's list has no buttons: actions are off, or its operator API is not known.
fn no_actions(console: &Shared, name: &str) -> Markup {
    html! {
        @if console.operator() {
            p.note {
                "This console does not know the " (name) " projection's operator API: start it with "
                code { "--projection-api " (name) "=http://<its --listen address>" }
                " (and the projection with the same operator token) to act from here."
            }
        } @else {
            p.note { (actions_off()) }
        }
    }
}

fn unknown(console: &Shared, name: &str) -> Response {
    html::error_page(
        StatusCode::NOT_FOUND,
        "No such projection",
        &format!(
            "{name:?} is not a projection; there are {}.",
            readside::names().join(", ")
        ),
        console.operator(),
    )
}

fn absent(name: &str) -> Markup {
    html! {
        p.note {
            "The " (name) " projection was not found in this database: its schema is absent (not \
             started yet, or it keeps its state in another database)."
        }
    }
}

/// The list page of projection `name`.
fn list_page(console: &Shared, title: String, body: Markup) -> Response {
    html::respond(
        StatusCode::OK,
        html::page(&title, Section::Lists, console.operator(), body),
    )
}

/// `GET /console/projections/{name}/parked`.
pub(crate) async fn parked(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let Some(name) = readside::known(&name) else {
        return unknown(&console, &name);
    };
    let acts = console.acts_in(name);
    let rows = readside::parked(&console.pool, name, LIMIT).await;
    if let Err(error) = &rows {
        tracing::warn!(projection = name, %error, "console cannot list parked messages");
    }
    let body = html! {
        h1 { "Parked in " (name) }
        p.lead {
            "Poison the " (name) " projection set aside with its reason, newest first; each holds back \
             its order's later versions. Redrive re-applies every parked message (after an upgrade \
             taught the code its shape); discard gives up on one on purpose. On the command line, with \
             the projection's " code { "DATABASE_URL" } " and NATS settings: "
            code { "waybill-" (name) " redrive" } ", "
            code { "waybill-" (name) " parked discard ID --reason '…' --by you" } "."
        }
        @if acts {
            (operator_panel(true, html! {
                button type="button" data-needs-reason
                    data-action={ "/console/api/projections/" (name) "/redrive" }
                    data-confirm={ "Redrive the parked messages of " (name) "?" } { "Redrive parked messages" }
            }))
        } @else {
            (no_actions(&console, name))
        }
        @match &rows {
            Ok(None) => { (absent(name)) }
            Ok(Some(rows)) if rows.is_empty() => { p data-testid="parked-empty" { "Nothing is parked." } }
            Ok(Some(rows)) => {
                table.grid {
                    thead { tr {
                        th scope="col" { "Id" } th scope="col" { "Order · version" }
                        th scope="col" { "Stream seq · subject" } th scope="col" { "Reason" }
                        th scope="col" { "Body (start)" } th scope="col" { "Discard" }
                    } }
                    tbody {
                        @for row in rows {
                            tr {
                                td { (row.id) br; span.small.muted { (time(row.parked_at)) } }
                                td {
                                    @match row.aggregate_id {
                                        Some(id) => {
                                            (order_link(id)) " · v"
                                            (row.aggregate_version.map_or("?".to_owned(), |v| v.to_string()))
                                        }
                                        None => { "unreadable" }
                                    }
                                }
                                td {
                                    (row.stream_sequence.map_or("—".to_owned(), |s| s.to_string())) br;
                                    code.small { (html::text(&row.subject)) }
                                }
                                td.error { (html::capped(&row.reason)) }
                                td {
                                    details {
                                        summary { (row.body_size) " bytes" }
                                        pre.json { (html::capped(&String::from_utf8_lossy(&row.body))) }
                                    }
                                }
                                td {
                                    @if acts {
                                        button type="button" data-needs-reason
                                            data-action={ "/console/api/projections/" (name) "/parked/" (row.id) "/discard" }
                                            { "Discard" }
                                    } @else {
                                        code.small { "waybill-" (name) " parked discard " (row.id) " --reason '…' --by you" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            Err(error) => { p.error { "The parked table could not be read: " (html::text(&error.to_string())) } }
        }
    };
    list_page(&console, format!("Parked in {name}"), body)
}

/// `GET /console/projections/{name}/held`.
pub(crate) async fn held(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let Some(name) = readside::known(&name) else {
        return unknown(&console, &name);
    };
    let acts = console.acts_in(name);
    let rows = readside::held(&console.pool, name, LIMIT).await;
    if let Err(error) = &rows {
        tracing::warn!(projection = name, %error, "console cannot list held events");
    }
    let body = html! {
        h1 { "Held in " (name) }
        p.lead {
            "Events that reached the " (name) " projection before their predecessor, by order and \
             version. They are applied as soon as the predecessor is. Releasing an order skips its \
             missing versions on purpose and applies what is held behind them; on the command line: "
            code { "waybill-" (name) " held release ORDER_ID --reason '…' --by you" } "."
        }
        @if acts { (operator_panel(true, html! {})) } @else { (no_actions(&console, name)) }
        @match &rows {
            Ok(None) => { (absent(name)) }
            Ok(Some(rows)) if rows.is_empty() => { p data-testid="held-empty" { "Nothing is held." } }
            Ok(Some(rows)) => {
                table.grid {
                    thead { tr {
                        th scope="col" { "Order · version" } th scope="col" { "Held since" }
                        th scope="col" { "Waits for" } th scope="col" { "Release" }
                    } }
                    tbody {
                        @for row in rows {
                            tr {
                                td { (order_link(row.aggregate_id)) " · v" (row.version) }
                                td { (time(row.held_at)) }
                                td {
                                    "v" (row.waiting_for)
                                    @if let Some(id) = row.behind_parked {
                                        " — parked as "
                                        a href={ "/console/projections/" (name) "/parked" } { "#" (id) }
                                    }
                                }
                                td {
                                    @if acts {
                                        button type="button" data-needs-reason
                                            data-action={ "/console/api/projections/" (name) "/held/" (row.aggregate_id) "/release" }
                                            { "Release the order" }
                                    } @else {
                                        code.small { "waybill-" (name) " held release " (row.aggregate_id) " --reason '…' --by you" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            Err(error) => { p.error { "The held table could not be read: " (html::text(&error.to_string())) } }
        }
    };
    list_page(&console, format!("Held in {name}"), body)
}
