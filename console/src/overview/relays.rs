//! The overview's relay stage: what the database knows of the relays (sessions connected, the last
//! row sent, unsettled publishes, rows whose stream disagrees with the store — each named with both
//! event ids), a WAL relay's replication slot (reader, lag in bytes and seconds, WAL retained), and
//! the counters only the relays keep — duplicate PubAcks and fenced publishes, and whether a polling
//! relay stands by for a WAL relay — scraped from each relay's /metrics. One template, so that what else the console learns about the relays gets a
//! place of its own here.

use maud::{Markup, html};

use super::fields::{Fields, Format};
use super::stage as card;
use crate::pipeline::RelayView;
use crate::relays::RelayMetricsView;

/// The relay stage of the pipeline.
pub(super) fn stage(
    f: &Fields,
    relay: &RelayView,
    outbox: Option<&relay::admin::OutboxStatus>,
) -> Markup {
    card(
        "st-relay",
        html! { "Relays" },
        html! {
            dl {
                (f.row("publish rate", "snapshot.rates.published_per_s", Format::Rate))
                (f.row("connected", "snapshot.relay.connected", Format::Count))
                (f.row("last sent", "snapshot.relay.last_sent_at", Format::Time))
                (f.row("unsettled publishes", "snapshot.outbox.unsettled_publishes", Format::Count))
                (f.row("diverged from the stream", "snapshot.outbox.diverged", Format::Count))
            }
            (f.when("snapshot.outbox.diverged", divergences(outbox)))
            (slots(f, &relay.wal_slots))
            (counters(f, &relay.metrics))
            p.muted.small {
                "Publish rate is measured at the stream (new messages per second; copies the broker \
                 refused are not counted)."
            }
        },
    )
}

/// The rows the relay would not mark sent because the stream holds something else at their place (a
/// store restored behind its stream, a foreign message): an alarm, with what to run.
fn divergences(outbox: Option<&relay::admin::OutboxStatus>) -> Markup {
    let rows = outbox.map_or(&[][..], |o| o.divergences.as_slice());
    html! {
        div.error data-testid="divergences" {
            p {
                strong { "The stream disagrees with the store." }
                " These events are not marked sent and their aggregates wait. Compare with "
                code { "waybill outbox verify" } "; repair with " code { "waybill outbox repair --aggregate ID" }
                " (README, \"After a restore\")."
            }
            table.small {
                thead { tr { th { "aggregate" } th { "version" } th { "store event" } th { "in the stream" } th { "kind" } } }
                tbody {
                    @for row in rows {
                        tr {
                            td {
                                @if row.aggregate_type == "order" {
                                    a href={ "/console/orders/" (row.aggregate_id) } { (row.aggregate_type) " " (row.aggregate_id) }
                                } @else {
                                    (row.aggregate_type) " " (row.aggregate_id)
                                }
                            }
                            td { (row.aggregate_version) }
                            td { code { (row.event_id) } }
                            td {
                                code { (crate::html::capped(row.divergence.stream_msg_id.as_deref().unwrap_or("—"))) }
                                @if let Some(sequence) = row.divergence.stream_sequence { " at " (sequence) }
                            }
                            td { (row.divergence.kind.as_str()) }
                        }
                    }
                }
            }
        }
    }
}

/// The database's logical replication slots — a WAL relay reads one (`run --source wal`) — with
/// their reader and lag; nothing when there are none (polling relays only). A slot nobody reads
/// keeps WAL on the database's disk, and one that is `unreserved` is about to be invalidated: both
/// are said in words, not left to the numbers.
fn slots(f: &Fields, slots: &[relay::wal::slot::SlotState]) -> Markup {
    const BASE: &str = "snapshot.relay.wal_slots";
    if slots.is_empty() {
        return html! {};
    }
    html! {
        table.small data-testid="wal-slots" {
            thead { tr { th { "WAL slot" } th { "reader" } th { "behind" } th { "lag" } th { "retained" } th { "state" } } }
            tbody {
                @for (i, slot) in slots.iter().enumerate() {
                    @let at = format!("{BASE}.{i}");
                    tr data-testid={ "wal-slot-" (i) } {
                        td { code { (slot.name) } }
                        td {
                            (f.when(&format!("{at}.active"), html! { "pid " (f.field(&format!("{at}.active_pid"), Format::Count)) }))
                            (f.unless(&format!("{at}.active"), html! {
                                span.error { strong { "none" } ": WAL is kept until a relay reads the slot again" }
                            }))
                        }
                        td { (f.field(&format!("{at}.lag_bytes"), Format::Bytes)) }
                        td { (f.field(&format!("{at}.lag_seconds"), Format::Age)) }
                        td { (f.field(&format!("{at}.retained_bytes"), Format::Bytes)) }
                        td {
                            (f.field(&format!("{at}.wal_status"), Format::Text))
                            @match slot.wal_status.as_deref() {
                                Some("unreserved") => span.error { " — past max_slot_wal_keep_size, about to be invalidated" },
                                Some("lost") => span.error { " — invalidated: drop it; polling relays deliver meanwhile" },
                                _ => {
                                    @if slot.near_invalidation().is_some() {
                                        span.error { " — near max_slot_wal_keep_size: start its reader or drop it" }
                                    }
                                },
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Why the relays' own counters come from the relays.
fn why() -> Markup {
    html! {
        "Duplicate PubAcks and fenced publishes are counted only inside each relay process ("
        code { "waybill_relay_duplicate_acks_total" } ", " code { "waybill_relay_fenced_total" }
        " on its --metrics-listen): neither the database nor the stream records them."
    }
}

/// Duplicate PubAcks and fenced publishes, per relay and in total, or (without `--relay-metrics`)
/// explained. The relays are fixed at start, so the rows are rendered here and only their values
/// refreshed.
fn counters(f: &Fields, metrics: &RelayMetricsView) -> Markup {
    const BASE: &str = "snapshot.relay.metrics";
    if metrics.relays.is_empty() {
        return html! {
            p.muted.small data-testid="relay-metrics-off" {
                (why()) " Start " code { "waybill-console" } " with "
                code { "--relay-metrics http://<relay>/metrics" } " (once per relay, or "
                code { "WAYBILL_RELAY_METRICS" } ", comma-separated) to show them here."
            }
        };
    }
    html! {
        dl data-testid="relay-metrics" {
            (f.row("duplicate PubAcks", &format!("{BASE}.duplicate_acks"), Format::Count))
            (f.row("fenced publishes", &format!("{BASE}.fenced"), Format::Count))
            div.row {
                dt { "answering" }
                dd {
                    (f.field(&format!("{BASE}.reachable"), Format::Count)) " of "
                    (f.field(&format!("{BASE}.configured"), Format::Count))
                }
            }
        }
        ul.relays.small {
            @for (i, relay) in metrics.relays.iter().enumerate() {
                @let at = format!("{BASE}.relays.{i}");
                li data-testid={ "relay-metrics-" (i) } {
                    code { (relay.url) }
                    (f.when(&format!("{at}.reachable"), html! {
                        "duplicates " (f.field(&format!("{at}.duplicate_acks"), Format::Count))
                        " · fenced " (f.field(&format!("{at}.fenced"), Format::Count))
                        (f.when(&format!("{at}.standing_by"), html! {
                            strong data-testid={ "relay-standing-by-" (i) } { "standing by" }
                            " for the WAL relay reading its slot: it claims nothing while that one keeps up"
                        }))
                        (f.unless(&format!("{at}.exported"), html! {
                            span.muted {
                                "not exported yet: nothing claimed since it started, or not a relay"
                            }
                        }))
                    }))
                    (f.unless(&format!("{at}.reachable"), html! {
                        span.error {
                            strong { "unreachable" } ": " (f.field(&format!("{at}.error"), Format::Text))
                        }
                    }))
                }
            }
        }
        p.muted.small {
            (why()) " Scraped from each relay's /metrics with every sample (1 s timeout); the totals \
             are over the relays that answered, and a relay counts from its own start."
        }
    }
}

#[cfg(test)]
mod tests {
    use relay::admin::{DivergedRow, OutboxStatus, RowStatus};
    use relay::fence::{Divergence, DivergenceKind};
    use uuid::Uuid;

    use super::*;

    #[test]
    fn a_divergence_is_shown_with_both_event_ids_and_a_hostile_id_escaped() {
        let (store_event, aggregate) = (Uuid::now_v7(), Uuid::now_v7());
        let outbox = OutboxStatus {
            diverged: 1,
            divergences: vec![DivergedRow {
                event_id: store_event,
                aggregate_type: "order".into(),
                aggregate_id: aggregate,
                aggregate_version: 2,
                status: RowStatus::Failed,
                divergence: Divergence {
                    kind: DivergenceKind::OtherEvent,
                    stream_sequence: Some(41),
                    stream_msg_id: Some("<script>x</script>".into()),
                    detail: "d".into(),
                },
            }],
            ..OutboxStatus::default()
        };
        let fields = Fields::of(&serde_json::json!({"snapshot": {"outbox": &outbox}}));
        let relay = RelayView {
            connected: Some(1),
            last_sent_at: None,
            metrics: RelayMetricsView::default(),
            wal_slots: Vec::new(),
        };
        let page = stage(&fields, &relay, Some(&outbox)).into_string();
        assert!(!page.contains("wal-slots"), "no slot, no table: {page}");
        assert!(page.contains(&store_event.to_string()), "{page}");
        assert!(
            page.contains(&format!("/console/orders/{aggregate}")),
            "{page}"
        );
        assert!(
            page.contains("other_event") && page.contains("at 41"),
            "{page}"
        );
        assert!(
            page.contains("&lt;script&gt;") && !page.contains("<script>"),
            "{page}"
        );
        assert!(
            page.contains("<div data-when=\"snapshot.outbox.diverged\"><div class=\"error\""),
            "shown (not hidden) while any row diverges: {page}"
        );
    }

    #[test]
    fn a_wal_slot_is_shown_with_its_lag_and_a_slot_at_risk_says_so() {
        let slot = relay::wal::slot::SlotState {
            name: "waybill_outbox".into(),
            plugin: Some("pgoutput".into()),
            database: Some("shop".into()),
            in_this_database: true,
            active: false,
            active_pid: None,
            wal_status: Some("unreserved".into()),
            lag_bytes: Some(3 * 1024 * 1024),
            lag_seconds: None,
            retained_bytes: Some(5 * 1024 * 1024),
            safe_wal_size: Some(0),
            keep_bytes: Some(64 * 1024 * 1024),
        };
        let relay = RelayView {
            connected: Some(0),
            last_sent_at: None,
            metrics: RelayMetricsView::default(),
            wal_slots: vec![slot],
        };
        let fields = Fields::of(&serde_json::json!({"snapshot": {"relay": &relay}}));
        let page = stage(&fields, &relay, None).into_string();
        assert!(page.contains("data-testid=\"wal-slot-0\""), "{page}");
        assert!(page.contains("waybill_outbox"), "{page}");
        assert!(
            page.contains("3.0 MiB") && page.contains("5.0 MiB"),
            "{page}"
        );
        assert!(
            page.contains("WAL is kept until a relay reads the slot again"),
            "no reader is said in words: {page}"
        );
        assert!(page.contains("about to be invalidated"), "{page}");
    }
}
