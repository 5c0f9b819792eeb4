//! The relays' own counters, scraped from their `/metrics` (`waybill serve --relay-metrics URL`):
//! duplicate PubAcks and fenced publishes are counted only inside each relay process — neither the
//! database nor the stream records them — so the console asks each relay. One plain HTTP/1.1 GET per
//! relay per sample, with a short timeout and a size cap, over a Tokio `TcpStream`: a relay's
//! `--metrics-listen` speaks plain HTTP, and a hand-written request avoids adding an HTTP client to
//! the service for one GET. A relay that does not answer is shown as unreachable and left out of the
//! totals; it never delays the console by more than the timeout.

use std::fmt;
use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::prometheus;

/// How long one scrape may take, connect to last byte. The console samples every 2 s, and every
/// relay is scraped at once, so a dead relay costs at most this much of a sample.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);

/// A response larger than this is refused: a relay's metrics are a few KiB, and a wrong URL (or a
/// hostile endpoint) must not make the service buffer gigabytes.
pub const MAX_RESPONSE: usize = 1024 * 1024;

/// The counters read from each relay.
const DUPLICATE_ACKS: &str = "waybill_relay_duplicate_acks_total";
const FENCED: &str = "waybill_relay_fenced_total";

/// A relay's metrics endpoint: `http://host[:port][/path]` (the path defaults to `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsUrl {
    /// The host as written (an IPv6 address without its brackets).
    host: String,
    port: u16,
    /// The `Host` header: the authority as written.
    authority: String,
    /// Path and query, checked to be visible ASCII (nothing can be smuggled into the request).
    target: String,
}

impl MetricsUrl {
    /// Reads a URL given to `--relay-metrics`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let rest = match text.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
            Some((scheme, _)) => {
                return Err(format!(
                    "{scheme}:// is not supported: give the relay's plain-HTTP --metrics-listen \
                     address as http://host:port/metrics"
                ));
            }
            None => return Err("expected http://host:port/metrics".to_owned()),
        };
        let split = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, target) = rest.split_at(split);
        if authority.contains('@') {
            return Err(
                "credentials in the URL are not supported (a relay's /metrics has none)".to_owned(),
            );
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (addr, after) = v6
                .split_once(']')
                .ok_or_else(|| "an IPv6 address needs its closing ]".to_owned())?;
            addr.parse::<std::net::Ipv6Addr>()
                .map_err(|e| format!("bad IPv6 address {addr:?}: {e}"))?;
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| format!("unexpected {p:?} after the address"))?,
                ),
            };
            (addr, port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        // A name or an IPv4 address (an IPv6 one was checked above); nothing else can be connected
        // to, and nothing else is safe in the Host header.
        let plain = |h: &str| {
            !h.is_empty()
                && h.len() <= 253
                && h.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        };
        if !authority.starts_with('[') && !plain(host) {
            return Err(format!("bad host {host:?}"));
        }
        let port = match port {
            None => 80,
            Some(p) => p.parse().map_err(|_| format!("bad port {p:?}"))?,
        };
        // A fragment is never sent; an empty path is the relay's /metrics.
        let target = target.split('#').next().unwrap_or_default();
        let target = match target {
            "" => "/metrics".to_owned(),
            t if t.starts_with('?') => format!("/metrics{t}"),
            t => t.to_owned(),
        };
        if !target.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(
                "the path may hold only visible ASCII (percent-encode anything else)".to_owned(),
            );
        }
        Ok(Self {
            host: host.to_owned(),
            port,
            authority: authority.to_owned(),
            target,
        })
    }
}

impl fmt::Display for MetricsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.target)
    }
}

/// One relay, as scraped for this sample.
#[derive(Debug, Clone, Serialize)]
pub struct RelayScrape {
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
    /// Samples of the two counters that were skipped as unreadable (NaN, negative, garbage).
    pub rejected_samples: usize,
    /// Why it could not be scraped.
    pub error: Option<String>,
}

/// The relays' counters: per relay, and summed over those that answered.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RelayMetricsView {
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
pub async fn scrape_all(urls: &[MetricsUrl]) -> RelayMetricsView {
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

async fn scrape(url: &MetricsUrl) -> RelayScrape {
    let body = match tokio::time::timeout(SCRAPE_TIMEOUT, get(url)).await {
        Ok(Ok(body)) => body,
        Ok(Err(error)) => return failed(url, error),
        Err(_) => {
            return failed(
                url,
                format!("no answer within {} s", SCRAPE_TIMEOUT.as_secs_f64()),
            );
        }
    };
    let [duplicates, fenced] =
        prometheus::sums(&String::from_utf8_lossy(&body), [DUPLICATE_ACKS, FENCED]);
    RelayScrape {
        url: url.to_string(),
        reachable: true,
        duplicate_acks: Some(duplicates.count()),
        fenced: Some(fenced.count()),
        exported: duplicates.samples + duplicates.rejected + fenced.samples + fenced.rejected > 0,
        rejected_samples: duplicates.rejected + fenced.rejected,
        error: None,
    }
}

fn failed(url: &MetricsUrl, error: String) -> RelayScrape {
    tracing::debug!(%url, %error, "console cannot scrape a relay's metrics");
    RelayScrape {
        url: url.to_string(),
        reachable: false,
        duplicate_acks: None,
        fenced: None,
        exported: false,
        rejected_samples: 0,
        error: Some(error),
    }
}

/// One GET; the body of a 200 answer.
async fn get(url: &MetricsUrl) -> Result<Vec<u8>, String> {
    let mut stream = TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: waybill-console\r\n\
         Accept: text/plain;version=0.0.4\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n",
        url.target, url.authority
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("cannot send the request: {e}"))?;
    let mut buffer = Vec::with_capacity(16 * 1024);
    let mut chunk = [0_u8; 16 * 1024];
    loop {
        // Done as soon as the answer is complete: a server may keep the connection open despite
        // `Connection: close`.
        if let Some(body) = response(&buffer, false)? {
            return Ok(body);
        }
        let read = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("cannot read the answer: {e}"))?;
        if read == 0 {
            return response(&buffer, true)?
                .ok_or_else(|| "the connection closed before the answer was complete".to_owned());
        }
        if buffer.len() + read > MAX_RESPONSE {
            return Err(format!(
                "the answer is larger than {} KiB",
                MAX_RESPONSE / 1024
            ));
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
}

/// The body of a complete HTTP/1.x answer in `buffer`: `None` while it is incomplete, an error for
/// any status but 200 or a framing that cannot be read. `closed`: the server has closed the
/// connection (an answer with neither a length nor chunks ends there).
fn response(buffer: &[u8], closed: bool) -> Result<Option<Vec<u8>>, String> {
    let Some(head_end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buffer[..head_end])
        .map_err(|_| "the answer's headers are not text".to_owned())?;
    let body = &buffer[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let mut parts = status.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or_default(), parts.next());
    if !version.starts_with("HTTP/1.") {
        return Err("the answer is not HTTP/1".to_owned());
    }
    if code != Some("200") {
        // Only the status line: it is the server's, and short (the console shows it).
        let shown: String = status.chars().take(80).collect();
        return Err(format!("answered {shown:?}, not 200"));
    }
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(
                value
                    .parse::<usize>()
                    .map_err(|_| format!("bad Content-Length {value:?}"))?,
            );
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().ends_with("chunked");
        } else if name.eq_ignore_ascii_case("content-encoding")
            && !value.eq_ignore_ascii_case("identity")
        {
            return Err(format!(
                "the answer is {value}-encoded; only plain text is read"
            ));
        }
    }
    if chunked {
        return dechunk(body);
    }
    match length {
        Some(n) if n > MAX_RESPONSE => Err(format!(
            "the answer is larger than {} KiB",
            MAX_RESPONSE / 1024
        )),
        Some(n) if body.len() >= n => Ok(Some(body[..n].to_vec())),
        Some(_) => Ok(None),
        None if closed => Ok(Some(body.to_vec())),
        None => Ok(None),
    }
}

/// Decodes a chunked body: `None` until its last chunk has arrived.
fn dechunk(mut body: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size = std::str::from_utf8(&body[..line_end])
            .ok()
            .map(|l| l.split(';').next().unwrap_or_default().trim())
            .and_then(|s| usize::from_str_radix(s, 16).ok())
            .filter(|n| *n <= MAX_RESPONSE)
            .ok_or_else(|| "bad chunk size in the answer".to_owned())?;
        body = &body[line_end + 2..];
        if size == 0 {
            // Trailers, if any, are not needed.
            return Ok(Some(out));
        }
        if body.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let url = MetricsUrl::parse("http://127.0.0.1:9464/metrics").expect("url");
        assert_eq!(
            (url.host.as_str(), url.port, url.target.as_str()),
            ("127.0.0.1", 9464, "/metrics")
        );
        assert_eq!(url.to_string(), "http://127.0.0.1:9464/metrics");
        let url = MetricsUrl::parse(" HTTP://[::1]:9 ").expect("url");
        assert_eq!((url.host.as_str(), url.port), ("::1", 9));
        assert_eq!(url.to_string(), "http://[::1]:9/metrics");
        let url = MetricsUrl::parse("http://relay-1.local?x=1#frag").expect("url");
        assert_eq!((url.port, url.target.as_str()), (80, "/metrics?x=1"));
        for bad in [
            "127.0.0.1:9464",
            "https://127.0.0.1/metrics",
            "http://user:secret@127.0.0.1/metrics",
            "http://127.0.0.1:99999/metrics",
            "http://127.0.0.1:/metrics",
            "http:///metrics",
            "http://[::1/metrics",
            "http://ho st/metrics",
            "http://127.0.0.1/metrics\r\nX-Injected: 1",
            "http://127.0.0.1/m étrics",
            "http://::1:9/metrics",
        ] {
            assert!(MetricsUrl::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn answers() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(response(ok, false), Ok(Some(b"hello".to_vec())));
        assert_eq!(response(&ok[..ok.len() - 1], false), Ok(None));
        assert_eq!(response(b"HTTP/1.1 200 OK\r\n", false), Ok(None));
        let until_close = b"HTTP/1.0 200 OK\r\n\r\nab";
        assert_eq!(response(until_close, false), Ok(None));
        assert_eq!(response(until_close, true), Ok(Some(b"ab".to_vec())));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(response(chunked, false), Ok(Some(b"abcde".to_vec())));
        assert_eq!(response(&chunked[..chunked.len() - 5], false), Ok(None));
        let missing = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        assert!(response(missing, false).is_err_and(|e| e.contains("404")));
        let gzip = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\ncontent-length: 1\r\n\r\nx";
        assert!(response(gzip, false).is_err());
        let huge = b"HTTP/1.1 200 OK\r\ncontent-length: 999999999999\r\n\r\n";
        assert!(response(huge, false).is_err());
        let bad_chunk = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n";
        assert!(response(bad_chunk, false).is_err());
        assert!(response(b"SSH-2.0-OpenSSH\r\n\r\n", false).is_err());
    }

    #[tokio::test]
    async fn an_unreachable_relay_is_reported_and_left_out_of_the_totals() {
        // A port nothing listens on: bind one, then close it.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let url = MetricsUrl::parse(&format!("http://127.0.0.1:{port}/metrics")).expect("url");
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

    #[tokio::test]
    async fn a_relay_that_never_answers_costs_at_most_the_timeout() {
        // Accepts, reads, and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let held = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(socket);
        });
        let url = MetricsUrl::parse(&format!("http://127.0.0.1:{port}/")).expect("url");
        let started = std::time::Instant::now();
        let view = scrape_all(&[url]).await;
        assert!(started.elapsed() < SCRAPE_TIMEOUT + Duration::from_millis(500));
        assert!(
            view.relays[0]
                .error
                .as_deref()
                .is_some_and(|e| e.contains("no answer")),
            "{view:?}"
        );
        held.abort();
    }
}
