//! `/console`: the pipeline left to right — commands, events, outbox, relays, stream, projections —
//! with charts of the last minutes. Rendered on the server with the latest snapshot (so it reads
//! complete before any script runs), then refreshed by the script from `/console/api/overview`: every
//! value the script updates carries its JSON path in `data-k` and its format in `data-f`.

mod chart;
mod fields;
mod relays;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};
use serde::Serialize;

use crate::Shared;
use crate::html::{self, Section};
use crate::pipeline::{HISTORY_LEN, Series, Snapshot};
use crate::stream::PartitionView;

pub(crate) use chart::image as chart_image;
use fields::{Fields, Format};

/// The overview API's answer.
#[derive(Debug, Serialize)]
pub(crate) struct Overview {
    /// The pipeline now.
    pub snapshot: Snapshot,
    /// The charts' data.
    pub series: Series,
    /// Whether state-changing actions exist on this console.
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
pub(crate) async fn api(State(console): State<Shared>) -> Json<Overview> {
    Json(Overview::now(&console).await)
}

/// `GET /console`.
pub(crate) async fn page(State(console): State<Shared>) -> Response {
    let overview = Overview::now(&console).await;
    html::respond(
        StatusCode::OK,
        html::page(
            "Pipeline",
            Section::Overview,
            overview.operator,
            render(&overview),
        ),
    )
}

/// The page: the lead, the pipeline's stages left to right, and the charts. Each stage is a
/// template of its own; a new one is a function here (or a module, as the relays' is) and a line in
/// the list below.
fn render(overview: &Overview) -> Markup {
    let f = Fields::of(overview);
    let s = &overview.snapshot;
    let minutes = HISTORY_LEN * 2 / 60;
    html! {
        h1 { "Pipeline" }
        p.lead {
            "Live from PostgreSQL and NATS, refreshed every 2 s (as JSON at "
            a href="/console/api/overview" { "/console/api/overview" } "). Read at "
            (f.field("snapshot.taken_at", Format::Time)) "."
        }
        div.pipeline role="list" {
            (commands(&f))
            (events(&f))
            (outbox(&f))
            (relays::stage(&f, &s.relay, s.outbox.as_ref()))
            (stream(&f, &s.stream.name))
            (projections(&f, s))
        }
        div.charts {
            figure.card {
                figcaption { "Throughput, per second (last " (minutes) " min while watched)" }
                (chart::chart("throughput"))
            }
            figure.card {
                figcaption { "Backlog: outbox unsent, projections behind" }
                (chart::chart("backlog"))
            }
        }
    }
}

/// One stage of the pipeline: a card in the list, labelled by its heading.
fn stage(id: &str, title: Markup, body: Markup) -> Markup {
    stage_with_class("card stage", id, title, body)
}

fn stage_with_class(class: &str, id: &str, title: Markup, body: Markup) -> Markup {
    html! {
        section class=(class) role="listitem" aria-labelledby=(id) {
            h2 id=(id) { (title) }
            (body)
        }
    }
}

fn commands(f: &Fields) -> Markup {
    stage(
        "st-commands",
        html! { "Commands" },
        html! {
            dl { (f.row("accepted", "snapshot.rates.events_per_s", Format::Rate)) }
            p.muted.small {
                "Accepted commands, measured as events appended (each accepted command appends one). \
                 Refused commands write nothing, so the database cannot count them; see "
                code { "waybill_http_requests_total" } " on the order service's --metrics-listen."
            }
        },
    )
}

fn events(f: &Fields) -> Markup {
    stage(
        "st-events",
        html! { "Events" },
        html! {
            dl {
                div.row.big {
                    dt { "stored" }
                    dd data-testid="events-stored" { (f.field("snapshot.events.stored", Format::Count)) }
                }
                (f.row("last recorded", "snapshot.events.last_recorded_at", Format::Time))
            }
            (f.error("snapshot.events.error"))
        },
    )
}

fn outbox(f: &Fields) -> Markup {
    stage(
        "st-outbox",
        html! { "Outbox" },
        html! {
            dl {
                (f.row("pending", "snapshot.outbox.pending", Format::Count))
                (f.row("failed", "snapshot.outbox.failed", Format::Count))
                (f.row("dead", "snapshot.outbox.dead", Format::Count))
                (f.row("oldest pending", "snapshot.outbox.oldest_pending_age_seconds", Format::Age))
                (f.row("orders held back", "snapshot.outbox.aggregates_held_back", Format::Count))
            }
            p { a href="/console/outbox/dead" { "dead rows, with replay" } }
            (f.error("snapshot.outbox_error"))
        },
    )
}

fn stream(f: &Fields, name: &str) -> Markup {
    stage(
        "st-stream",
        html! { "Stream " span.muted { (html::text(name)) } },
        html! {
            (f.when("snapshot.stream.available", html! {
                dl {
                    (f.row("last sequence", "snapshot.stream.last_sequence", Format::Count))
                    (f.row("messages", "snapshot.stream.messages", Format::Count))
                    (f.row("bytes", "snapshot.stream.bytes", Format::Bytes))
                    (f.row("first sequence", "snapshot.stream.first_sequence", Format::Count))
                }
            }))
            (f.unless("snapshot.stream.available", html! {
                p.error { strong { "unavailable" } ": " (f.field("snapshot.stream.reason", Format::Text)) }
            }))
        },
    )
}

fn projections(f: &Fields, s: &Snapshot) -> Markup {
    stage_with_class(
        "card stage projections",
        "st-proj",
        html! { "Projections" },
        html! {
            @for (i, p) in s.projections.iter().enumerate() {
                @let base = format!("snapshot.projections.{i}");
                @let name = p.state.name;
                section.projection aria-labelledby={ "pj-" (name) } data-testid={ "projection-" (name) } {
                    h3 id={ "pj-" (name) } { (name) }
                    @if let Some(about) = p.about {
                        p.small.muted data-testid={ "about-" (name) } {
                            "read model: " (html::text(about)) " (reads " (p.reads.join(", ")) ")"
                        }
                    }
                    (f.when(&format!("{base}.found"), html! {
                        dl {
                            (f.row("applied", &format!("{base}.applied"), Format::Count))
                            (f.row("rate", &format!("snapshot.rates.applied_per_s.{name}"), Format::Rate))
                            (f.row("behind stream", &format!("{base}.behind_stream"), Format::Count))
                            (f.row("behind store", &format!("{base}.behind_store"), Format::Count))
                            (f.row("held", &format!("{base}.held"), Format::Count))
                            (f.row("parked", &format!("{base}.parked"), Format::Count))
                        }
                        (partitions(f, &base, &p.partitions))
                        p.small {
                            @if p.about.is_some() {
                                a href={ "/console/projections/" (name) "/document" } { "document" } " · "
                            }
                            a href={ "/console/projections/" (name) "/parked" } { "parked" } " · "
                            a href={ "/console/projections/" (name) "/held" } { "held" }
                        }
                    }))
                    (f.unless(&format!("{base}.found"), html! {
                        p.muted {
                            "not found in this database (its schema is absent: not started yet, or it \
                             keeps its state in another database)"
                        }
                    }))
                    (f.error(&format!("{base}.error")))
                }
            }
            p.muted.small {
                "Behind stream: messages its consumer has not settled (from NATS; its partitions' \
                 consumers together when it is partitioned). Behind store: events of the aggregate \
                 types it reads stored, minus events applied (from its checkpoints). A partition's \
                 holder is the instance whose lease it is (pid-random)."
            }
        },
    )
}

/// A partitioned projection's partitions: each one's consumer, how far behind, and the instance that
/// holds it now (its lease), refreshed with the rest.
fn partitions(f: &Fields, base: &str, partitions: &[PartitionView]) -> Markup {
    html! {
        @if !partitions.is_empty() {
            @let split = if partitions.iter().all(|p| p.split_by_server) {
                "split by the server: each partition's consumer is delivered its own events"
            } else {
                "split by the instances: each partition's consumer reads the whole stream"
            };
            details.partitions open {
                summary { (partitions.len()) " partitions, " (split) }
                table {
                    thead { tr { th { "partition" } th { "behind" } th { "held by" } } }
                    tbody {
                        @for (j, partition) in partitions.iter().enumerate() {
                            @let at = format!("{base}.partitions.{j}");
                            tr data-testid={ "partition-" (partition.consumer.name) } {
                                td { (partition.partition) }
                                td { (f.field(&format!("{at}.consumer.num_pending"), Format::Count)) }
                                td { (f.field(&format!("{at}.owner"), Format::Text)) }
                            }
                        }
                    }
                }
            }
        }
    }
}
