//! The console's lists: the outbox's dead rows (with replay, when actions are on), and each
//! projection's parked messages and held events (with redrive, discard and release buttons when
//! actions are on and the projection's operator API is known; else the command that does it).

use std::fmt::Write as _;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;

use super::Shared;
use super::html::{self, Section, esc, esc_bytes, esc_capped};
use super::readside;

/// Rows listed at most per page.
const LIMIT: i64 = 200;

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `GET /console/outbox/dead`.
pub async fn dead(State(console): State<Shared>) -> Response {
    console.viewed();
    let operator = console.operator();
    let rows = match relay::admin::dead_rows(&console.pool, LIMIT).await {
        Ok(rows) => rows,
        Err(error) => {
            tracing::error!(%error, "console cannot list dead rows");
            return html::error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Dead rows could not be read",
                "The database did not answer; the service log has the error.",
                operator,
            );
        }
    };
    let mut body = String::from(
        "<h1>Dead outbox rows</h1><p class=\"lead\">Events the relay gave up publishing after its \
         last attempt, oldest first; each holds back its order's later events. Replaying puts a row \
         back to pending with its attempts reset (the same as <code>waybill outbox dead replay</code>).</p>",
    );
    if operator {
        body.push_str(&operator_panel(
            false,
            "<button type=\"button\" data-replay=\"all\">Replay every dead row</button>",
        ));
    } else {
        body.push_str(
            "<p class=\"note\">Actions are off: this service was started without an operator token \
             (<code>--operator-token</code> or <code>WAYBILL_OPERATOR_TOKEN</code>). Run \
             <code>waybill outbox dead replay &lt;id&gt;</code> instead.</p>",
        );
    }
    if rows.is_empty() {
        body.push_str("<p data-testid=\"dead-empty\">No dead rows.</p>");
    } else {
        body.push_str(
            "<table class=\"grid\"><thead><tr><th scope=\"col\">Outbox id</th><th scope=\"col\">Order · version</th>\
             <th scope=\"col\">Event</th><th scope=\"col\">Attempts</th><th scope=\"col\">Dead since</th>\
             <th scope=\"col\">Reason</th><th scope=\"col\">Waiting behind</th><th scope=\"col\">Action</th></tr></thead><tbody>",
        );
        for row in &rows {
            let _ = write!(
                body,
                "<tr><td>{id}</td><td><a href=\"/console/orders/{order}\">{order}</a> · v{v}</td>\
                 <td>{ty}<br><code class=\"small\">{event}</code></td><td>{attempts}</td><td>{at}</td>\
                 <td class=\"error\">{reason}</td><td>{behind}</td><td>{action}</td></tr>",
                id = row.id,
                order = row.aggregate_id,
                v = row.aggregate_version,
                ty = esc(&row.event_type),
                event = row.event_id,
                attempts = row.attempts,
                at = row.dead_at.map(time).unwrap_or_default(),
                reason = esc_capped(row.dead_reason.as_deref().unwrap_or("")),
                behind = row.waiting_behind,
                action = if operator {
                    format!(
                        "<button type=\"button\" data-replay=\"{}\">Replay</button>",
                        row.id
                    )
                } else {
                    format!("<code>waybill outbox dead replay {}</code>", row.id)
                },
            );
        }
        body.push_str("</tbody></table>");
    }
    html::respond(
        StatusCode::OK,
        html::page("Dead rows", Section::Lists, operator, &body),
    )
}

/// The operator's inputs (token; with `decisions`, who acts and why, for the projection's operator log)
/// and the page's bulk `buttons`, with the line where results are shown.
fn operator_panel(decisions: bool, buttons: &str) -> String {
    let decisions = if decisions {
        "<p><label for=\"by\">Acting as</label> <input id=\"by\" autocomplete=\"username\" data-by> \
         <label for=\"reason\">Reason</label> <input id=\"reason\" size=\"40\" data-reason> \
         <span class=\"muted small\">both recorded in the projection's operator log; a discard or a \
         release needs a reason</span></p>"
    } else {
        ""
    };
    format!(
        "<div class=\"card operator\" data-operator-panel><label for=\"token\">Operator token</label> \
         <input id=\"token\" type=\"password\" autocomplete=\"off\" data-token> \
         <span class=\"muted small\">kept in this tab only; sent as Authorization: Bearer</span>\
         {decisions}<p>{buttons} <output data-result role=\"status\"></output></p></div>"
    )
}

/// Why a projection's list has no buttons: actions are off, or its operator API is not known.
fn no_actions(console: &Shared, name: &str) -> String {
    if console.operator() {
        format!(
            "<p class=\"note\">This service does not know the {name} projection's operator API: start \
             it with <code>--projection-api {name}=http://&lt;its --listen address&gt;</code> (and the \
             projection with the same operator token) to act from here.</p>"
        )
    } else {
        "<p class=\"note\">Actions are off: this service was started without an operator token \
         (<code>--operator-token</code> or <code>WAYBILL_OPERATOR_TOKEN</code>).</p>"
            .to_owned()
    }
}

fn unknown(console: &Shared, name: &str) -> Response {
    html::error_page(
        StatusCode::NOT_FOUND,
        "No such projection",
        &format!(
            "{name:?} is not a projection; there are {}.",
            readside::PROJECTIONS.join(", ")
        ),
        console.operator(),
    )
}

fn absent(name: &str) -> String {
    format!(
        "<p class=\"note\">The {name} projection was not found in this database: its schema is \
         absent (not started yet, or it keeps its state in another database).</p>",
        name = esc(name)
    )
}

/// `GET /console/projections/{name}/parked`.
pub async fn parked(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let Some(name) = readside::known(&name) else {
        return unknown(&console, &name);
    };
    let acts = console.acts_in(name);
    let mut body = format!(
        "<h1>Parked in {name}</h1><p class=\"lead\">Poison the {name} projection set aside with its \
         reason, newest first; each holds back its order's later versions. Redrive re-applies every \
         parked message (after an upgrade taught the code its shape); discard gives up on one on \
         purpose. On the command line, with the projection's <code>DATABASE_URL</code> and NATS \
         settings: <code>waybill-{name} redrive</code>, <code>waybill-{name} parked discard ID \
         --reason '…' --by you</code>.</p>"
    );
    if acts {
        body.push_str(&operator_panel(
            true,
            &format!(
                "<button type=\"button\" data-needs-reason data-action=\"/console/api/projections/{name}/redrive\" \
                 data-confirm=\"Redrive the parked messages of {name}?\">Redrive parked messages</button>"
            ),
        ));
    } else {
        body.push_str(&no_actions(&console, name));
    }
    match readside::parked(&console.pool, name, LIMIT).await {
        Ok(None) => body.push_str(&absent(name)),
        Ok(Some(rows)) if rows.is_empty() => {
            body.push_str("<p data-testid=\"parked-empty\">Nothing is parked.</p>")
        }
        Ok(Some(rows)) => {
            body.push_str(
                "<table class=\"grid\"><thead><tr><th scope=\"col\">Id</th><th scope=\"col\">Order · version</th>\
                 <th scope=\"col\">Stream seq · subject</th><th scope=\"col\">Reason</th>\
                 <th scope=\"col\">Body (start)</th><th scope=\"col\">Discard</th></tr></thead><tbody>",
            );
            for row in &rows {
                let order = match row.aggregate_id {
                    Some(id) => format!(
                        "<a href=\"/console/orders/{id}\">{id}</a> · v{}",
                        row.aggregate_version
                            .map_or("?".to_owned(), |v| v.to_string())
                    ),
                    None => "unreadable".to_owned(),
                };
                let _ = write!(
                    body,
                    "<tr><td>{id}<br><span class=\"small muted\">{at}</span></td><td>{order}</td>\
                     <td>{seq}<br><code class=\"small\">{subject}</code></td><td class=\"error\">{reason}</td>\
                     <td><details><summary>{size} bytes</summary><pre class=\"json\">{body}</pre></details></td>\
                     <td>{discard}</td></tr>",
                    id = row.id,
                    at = time(row.parked_at),
                    seq = row
                        .stream_sequence
                        .map_or("—".to_owned(), |s| s.to_string()),
                    subject = esc(&row.subject),
                    reason = esc_capped(&row.reason),
                    size = row.body_size,
                    body = esc_bytes(&row.body),
                    discard = if acts {
                        format!(
                            "<button type=\"button\" data-needs-reason \
                             data-action=\"/console/api/projections/{name}/parked/{}/discard\">Discard</button>",
                            row.id
                        )
                    } else {
                        format!(
                            "<code class=\"small\">waybill-{name} parked discard {} --reason '…' --by you</code>",
                            row.id
                        )
                    },
                );
            }
            body.push_str("</tbody></table>");
        }
        Err(error) => {
            tracing::warn!(projection = name, %error, "console cannot list parked messages");
            let _ = write!(
                body,
                "<p class=\"error\">The parked table could not be read: {}</p>",
                esc(&error.to_string())
            );
        }
    }
    html::respond(
        StatusCode::OK,
        html::page(
            &format!("Parked in {name}"),
            Section::Lists,
            console.operator(),
            &body,
        ),
    )
}

/// `GET /console/projections/{name}/held`.
pub async fn held(State(console): State<Shared>, Path(name): Path<String>) -> Response {
    console.viewed();
    let Some(name) = readside::known(&name) else {
        return unknown(&console, &name);
    };
    let acts = console.acts_in(name);
    let mut body = format!(
        "<h1>Held in {name}</h1><p class=\"lead\">Events that reached the {name} projection before \
         their predecessor, by order and version. They are applied as soon as the predecessor is. \
         Releasing an order skips its missing versions on purpose and applies what is held behind \
         them; on the command line: <code>waybill-{name} held release ORDER_ID --reason '…' --by \
         you</code>.</p>"
    );
    if acts {
        body.push_str(&operator_panel(true, ""));
    } else {
        body.push_str(&no_actions(&console, name));
    }
    match readside::held(&console.pool, name, LIMIT).await {
        Ok(None) => body.push_str(&absent(name)),
        Ok(Some(rows)) if rows.is_empty() => {
            body.push_str("<p data-testid=\"held-empty\">Nothing is held.</p>")
        }
        Ok(Some(rows)) => {
            body.push_str(
                "<table class=\"grid\"><thead><tr><th scope=\"col\">Order · version</th><th scope=\"col\">Held since</th>\
                 <th scope=\"col\">Waits for</th><th scope=\"col\">Release</th></tr></thead><tbody>",
            );
            for row in &rows {
                let waits = match row.behind_parked {
                    Some(id) => format!(
                        "v{} — parked as <a href=\"/console/projections/{name}/parked\">#{id}</a>",
                        row.waiting_for
                    ),
                    None => format!("v{}", row.waiting_for),
                };
                let _ = write!(
                    body,
                    "<tr><td><a href=\"/console/orders/{order}\">{order}</a> · v{v}</td><td>{at}</td>\
                     <td>{waits}</td><td>{release}</td></tr>",
                    order = row.aggregate_id,
                    release = if acts {
                        format!(
                            "<button type=\"button\" data-needs-reason \
                             data-action=\"/console/api/projections/{name}/held/{}/release\">Release the order</button>",
                            row.aggregate_id
                        )
                    } else {
                        format!(
                            "<code class=\"small\">waybill-{name} held release {} --reason '…' --by you</code>",
                            row.aggregate_id
                        )
                    },
                    v = row.version,
                    at = time(row.held_at),
                );
            }
            body.push_str("</tbody></table>");
        }
        Err(error) => {
            tracing::warn!(projection = name, %error, "console cannot list held events");
            let _ = write!(
                body,
                "<p class=\"error\">The held table could not be read: {}</p>",
                esc(&error.to_string())
            );
        }
    }
    html::respond(
        StatusCode::OK,
        html::page(
            &format!("Held in {name}"),
            Section::Lists,
            console.operator(),
            &body,
        ),
    )
}
