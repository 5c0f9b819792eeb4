//! The overview's relay stage: what the database knows of the relays (sessions connected, the last
//! row sent, unsettled publishes, fence conflicts) and the counters only the relays keep — duplicate
//! PubAcks and fenced publishes, scraped from each relay's /metrics. One template, so that what else
//! the console learns about the relays gets a place of its own here.

use maud::{Markup, html};

use super::fields::{Fields, Format};
use super::stage as card;
use crate::relays::RelayMetricsView;

/// The relay stage of the pipeline.
pub fn stage(f: &Fields, metrics: &RelayMetricsView) -> Markup {
    card(
        "st-relay",
        html! { "Relays" },
        html! {
            dl {
                (f.row("publish rate", "snapshot.rates.published_per_s", Format::Rate))
                (f.row("connected", "snapshot.relay.connected", Format::Count))
                (f.row("last sent", "snapshot.relay.last_sent_at", Format::Time))
                (f.row("unsettled publishes", "snapshot.outbox.unsettled_publishes", Format::Count))
                (f.row("fence conflicts", "snapshot.outbox.fence_conflicts.length", Format::Count))
            }
            (counters(f, metrics))
            p.muted.small {
                "Publish rate is measured at the stream (new messages per second; copies the broker \
                 refused are not counted)."
            }
        },
    )
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
