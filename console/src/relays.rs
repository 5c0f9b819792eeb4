//! The relays' own counters, scraped from their `/metrics` (`waybill-console run --relay-metrics URL`):
//! duplicate PubAcks and fenced publishes are counted only inside each relay process — neither the
//! database nor the stream records them — so the console asks each relay, one GET per relay per
//! sample ([`upstream`]). A relay that does not answer is shown as unreachable and left out of the
//! totals; it never delays the console by more than the timeout.

use std::time::Duration;

use axum::http::{Method, StatusCode};
use serde::Serialize;

use crate::prometheus;
use crate::upstream::{self, Call, Endpoint};

/// How long one scrape may take, connect to last byte. The console samples every 2 s, and every
/// relay is scraped at once, so a dead relay costs at most this much of a sample.
pub(crate) const SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);

/// The counters read from each relay.
const DUPLICATE_ACKS: &str = "waybill_relay_duplicate_acks_total";
const FENCED: &str = "waybill_relay_fenced_total";
/// The gauge a polling relay sets while it stands by for a WAL relay's slot (`run --slot`).
const STANDING_BY: &str = "waybill_relay_standing_by";

/// Reads a URL given to `--relay-metrics`: `http://host:port[/path]`, the path defaulting to the
/// relay's `/metrics`.
pub fn metrics_url(text: &str) -> Result<Endpoint, String> {
    let endpoint = Endpoint::parse(text)?;
    Ok(if endpoint.path() == "/" {
        endpoint.with_path("/metrics")
    } else {
        endpoint
    })
}

/// One relay, as scraped for this sample.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RelayScrape {
    /// Its metrics URL.
    pub url: String,
    /// Whether it answered 200 with a body within the timeout.
    pub reachable: bool,
    /// `waybill_relay_duplicate_acks_total`, summed over its label sets (0 when not exported yet).
    pub duplicate_acks: Option<u64>,
    /// `waybill_relay_fenced_total`, likewise.
    pub fenced: Option<u64>,
    /// Whether either counter was in the answer. A relay exports them from its first step that
    /// claimed rows, so a reachable relay without them has published nothing since it started (or
    /// the URL is not a relay's /metrics).
    pub exported: bool,
    /// Whether it is a polling relay standing by for a WAL relay (claiming nothing while the WAL
    /// relay reads the slot and keeps up); `None` when it exports no such gauge (a WAL relay, one
    /// that never looked at a slot, or not a relay).
    pub standing_by: Option<bool>,
    /// Samples of the two counters that were skipped as unreadable (NaN, negative, garbage).
    pub rejected_samples: usize,
    /// Why it could not be scraped.
    pub error: Option<String>,
}

/// The relays' counters: per relay, and summed over those that answered.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RelayMetricsView {
    /// Relays configured with `--relay-metrics`.
    pub configured: usize,
    /// Of those, how many answered this sample.
    pub reachable: usize,
    /// How many did not.
    pub unreachable: usize,
    /// Duplicate PubAcks, summed over the reachable relays (null when none answered). Each relay
    /// counts since it started, so a restart lowers the sum.
    pub duplicate_acks: Option<u64>,
    /// Fenced publishes, summed likewise.
    pub fenced: Option<u64>,
    /// Each relay, in the order configured.
    pub relays: Vec<RelayScrape>,
}

/// Scrapes every relay at once.
pub(crate) async fn scrape_all(urls: &[Endpoint]) -> RelayMetricsView {
    let relays = futures::future::join_all(urls.iter().map(scrape)).await;
    let answered: Vec<&RelayScrape> = relays.iter().filter(|r| r.reachable).collect();
    let total = |get: fn(&RelayScrape) -> Option<u64>| {
        (!answered.is_empty()).then(|| {
            answered
                .iter()
                .filter_map(|r| get(r))
                .fold(0_u64, u64::saturating_add)
        })
    };
    RelayMetricsView {
        configured: urls.len(),
        reachable: answered.len(),
        unreachable: relays.len() - answered.len(),
        duplicate_acks: total(|r| r.duplicate_acks),
        fenced: total(|r| r.fenced),
        relays,
    }
}

async fn scrape(url: &Endpoint) -> RelayScrape {
    let call = Call {
        method: Method::GET,
        path: "",
        authorization: None,
        json: None,
        timeout: SCRAPE_TIMEOUT,
    };
    let body = match upstream::send(url, call).await {
        Ok(answer) if answer.status == StatusCode::OK => answer.body,
        Ok(answer) => return failed(url, format!("answered {}, not 200", answer.status)),
        Err(error) => return failed(url, error),
    };
    let [duplicates, fenced, standing_by] = prometheus::sums(
        &String::from_utf8_lossy(&body),
        [DUPLICATE_ACKS, FENCED, STANDING_BY],
    );
    RelayScrape {
        url: url.to_string(),
        reachable: true,
        duplicate_acks: Some(duplicates.count()),
        fenced: Some(fenced.count()),
        exported: duplicates.samples + duplicates.rejected + fenced.samples + fenced.rejected > 0,
        standing_by: (standing_by.samples > 0).then_some(standing_by.total > 0.0),
        rejected_samples: duplicates.rejected + fenced.rejected,
        error: None,
    }
}

fn failed(url: &Endpoint, error: String) -> RelayScrape {
    tracing::debug!(%url, %error, "console cannot scrape a relay's metrics");
    RelayScrape {
        url: url.to_string(),
        reachable: false,
        duplicate_acks: None,
        fenced: None,
        exported: false,
        standing_by: None,
        rejected_samples: 0,
        error: Some(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreachable_relay_is_reported_and_left_out_of_the_totals() {
        // A port nothing listens on: bind one, then close it.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let url = metrics_url(&format!("http://127.0.0.1:{port}/metrics")).expect("url");
        let view = scrape_all(&[url]).await;
        assert_eq!(
            (view.configured, view.reachable, view.unreachable),
            (1, 0, 1)
        );
        assert_eq!((view.duplicate_acks, view.fenced), (None, None));
        let relay = &view.relays[0];
        assert!(!relay.reachable);
        assert!(
            relay
                .error
                .as_deref()
                .is_some_and(|e| e.contains("connect")),
            "{relay:?}"
        );
    }
}
