//! `/console/catalog`: every `(event type, version)` that can exist in storage, with its JSON Schema
//! and the upcast path to today's shape — from the same catalog `waybill schema` prints
//! (`domain::catalog`) and the same registry every reader upcasts with (`domain::Upcasters`).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use domain::Upcasters;
use domain::catalog::payload_schemas;
use maud::{Markup, html};
use serde::Serialize;
use serde_json::Value;

use crate::Shared;
use crate::html::{self, Section};

/// One step of an upcast chain.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Step {
    /// The version read.
    pub from: i32,
    /// The version written.
    pub to: i32,
    /// The function that does it, when the console knows its name.
    pub upcaster: String,
}

/// The steps from `version` of `event_type` to its current version: empty when it is current,
/// `None` when the type is unknown or the version is outside 1..=current.
///
/// One step per version, as the registry applies them, each by the name it was registered with.
pub(crate) fn chain(upcasters: &Upcasters, event_type: &str, version: i32) -> Option<Vec<Step>> {
    let current = upcasters.current_version(event_type)?;
    if version < 1 || version > current {
        return None;
    }
    Some(
        (version..current)
            .map(|from| Step {
                from,
                to: from + 1,
                upcaster: upcasters.step_name(event_type, from).map_or_else(
                    || format!("{event_type} v{from} → v{}", from + 1),
                    str::to_owned,
                ),
            })
            .collect(),
    )
}

/// A chain as text: `v1 → v2 (step) → …`, or "current" when empty.
pub(crate) fn describe(steps: &[Step]) -> String {
    if steps.is_empty() {
        return "current version: no upcast".to_owned();
    }
    steps
        .iter()
        .map(|s| format!("v{} → v{} by {}", s.from, s.to, s.upcaster))
        .collect::<Vec<_>>()
        .join(", then ")
}

/// One catalog entry.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Entry {
    /// The event type.
    pub event_type: &'static str,
    /// The payload version.
    pub event_version: i32,
    /// The type's current version.
    pub current_version: Option<i32>,
    /// The upcast path to the current version.
    pub upcast: Option<Vec<Step>>,
    /// The payload's JSON Schema.
    pub schema: Value,
}

fn entries() -> Vec<Entry> {
    let upcasters = Upcasters::all();
    payload_schemas()
        .into_iter()
        .map(|s| Entry {
            event_type: s.event_type,
            event_version: s.event_version,
            current_version: upcasters.current_version(s.event_type),
            upcast: chain(&upcasters, s.event_type, s.event_version),
            schema: s.schema,
        })
        .collect()
}

/// The anchor of an entry on the catalog page.
pub(crate) fn anchor(event_type: &str, version: i32) -> String {
    format!(
        "{}-v{version}",
        event_type.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    )
}

/// `GET /console/api/catalog`.
pub(crate) async fn api() -> Json<Vec<Entry>> {
    Json(entries())
}

/// `GET /console/catalog`.
pub(crate) async fn page(State(console): State<Shared>) -> Response {
    let entries = entries();
    html::respond(
        StatusCode::OK,
        html::page(
            "Catalog",
            Section::Catalog,
            console.operator(),
            render(&entries),
        ),
    )
}

fn render(entries: &[Entry]) -> Markup {
    let path = |e: &Entry, unknown: &str| {
        e.upcast
            .as_deref()
            .map_or_else(|| unknown.to_owned(), describe)
    };
    html! {
        h1 { "Event catalog" }
        p.lead {
            "Every event type and payload version that can exist in storage, with its JSON Schema \
             (draft 2020-12) and how readers bring it to today's shape. The same catalog as "
            code { "waybill schema" } "; as JSON at "
            a href="/console/api/catalog" { "/console/api/catalog" } "."
        }
        table.grid {
            caption { "Contents" }
            thead { tr { th scope="col" { "Event type" } th scope="col" { "Version" } th scope="col" { "Upcast path" } } }
            tbody {
                @for e in entries {
                    tr {
                        td { a href={ "#" (anchor(e.event_type, e.event_version)) } { (e.event_type) } }
                        td {
                            "v" (e.event_version)
                            @if e.current_version == Some(e.event_version) {
                                " " span.badge.ok { "current" }
                            }
                        }
                        td { (html::text(&path(e, "no upcast known: readers refuse it"))) }
                    }
                }
            }
        }
        @for e in entries {
            @let a = anchor(e.event_type, e.event_version);
            section.card id=(a) aria-labelledby={ (a) "-h" } {
                h2 id={ (a) "-h" } { (e.event_type) " " span.muted { "v" (e.event_version) } }
                p { (html::text(&path(e, "no upcast known"))) }
                details open {
                    summary { "JSON Schema" }
                    pre.json { (html::json_block(&e.schema)) }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legacy_placed_event_upcasts_through_named_steps() {
        let upcasters = Upcasters::all();
        let current = upcasters.current_version("order.placed").expect("known");
        let steps = chain(&upcasters, "order.placed", 1).expect("known");
        assert_eq!(
            i32::try_from(steps.len()),
            Ok(current - 1),
            "one step per version"
        );
        assert!(describe(&steps).contains("order_placed_v1_to_v2"));
        assert!(
            steps
                .iter()
                .all(|s| s.upcaster.starts_with("domain::upcast::")),
            "every order step is named: {steps:?}"
        );
        assert!(
            chain(&upcasters, "order.placed", current)
                .expect("current")
                .is_empty()
        );
        assert!(chain(&upcasters, "order.placed", current + 1).is_none());
        assert!(chain(&upcasters, "order.teleported", 1).is_none());
    }

    #[test]
    fn every_cataloged_version_has_a_path_to_the_current_one() {
        for entry in entries() {
            assert!(
                entry.upcast.is_some(),
                "{} v{}",
                entry.event_type,
                entry.event_version
            );
        }
    }
}
