//! The console's client for the services beside it: the relays' `/metrics` and the projections'
//! operator API, both plain HTTP/1.1 on an operator's network, through reqwest. Each call is bounded
//! in time and in size: a service that does not answer, or a wrong URL that answers gigabytes, never
//! holds the console up by more than the timeout or makes it buffer more than the cap.

use std::fmt;
use std::time::Duration;

use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use bytes::Bytes;

/// An answer larger than this is refused: metrics are a few KiB, operator answers smaller still.
pub(crate) const MAX_ANSWER: usize = 1024 * 1024;

/// A service's base address: `http://host[:port][/path]`, checked when it is configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Where to connect: the host (an IPv6 address without brackets) and port.
    host: String,
    port: u16,
    /// The `Host` header and the URL's authority, as written.
    authority: Authority,
    /// The base path (no trailing slash, except for the root).
    path: PathAndQuery,
}

impl Endpoint {
    /// Reads an address given on the command line. Only `http://`, no credentials, and a path of
    /// visible ASCII (a URL cannot smuggle anything into a request).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if !text.contains("://") {
            return Err(format!(
                "{text:?} is not a URL: expected http://host:port/path"
            ));
        }
        let uri: Uri = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(format!(
                "{text:?}: only plain http:// is supported (the services' listeners speak plain HTTP)"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{text:?} names no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!(
                "{text:?}: credentials in the URL are not supported"
            ));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{text:?} names no host"));
        }
        let port = match authority.as_str().rsplit_once(':') {
            // The last colon of an IPv6 address without a port sits inside the brackets.
            Some((_, port)) if !port.ends_with(']') => port
                .parse::<u16>()
                .map_err(|_| format!("{text:?}: bad port {port:?}"))?,
            _ => 80,
        };
        let path = uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        Ok(Self {
            host: host.to_owned(),
            port,
            authority,
            path,
        })
    }

    /// The same service, at `path` (absolute, visible ASCII) below its base path.
    fn at(&self, path: &str) -> Result<PathAndQuery, String> {
        let base = self.path.path().trim_end_matches('/');
        format!("{base}{path}")
            .parse()
            .map_err(|e| format!("bad path {path:?}: {e}"))
    }

    /// The base path as configured.
    pub fn path(&self) -> &str {
        self.path.as_str()
    }

    /// The same host with another base path.
    pub fn with_path(&self, path: &'static str) -> Self {
        Self {
            path: PathAndQuery::from_static(path),
            ..self.clone()
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// An answer: its status and body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
}

/// What to send.
#[derive(Debug)]
pub(crate) struct Call<'a> {
    pub method: Method,
    /// Below the endpoint's base path; empty for the base path itself.
    pub path: &'a str,
    /// `Authorization`, when acting for the operator.
    pub authorization: Option<String>,
    /// A JSON body.
    pub json: Option<Vec<u8>>,
    /// Connect to last byte.
    pub timeout: Duration,
}

/// Sends one request and reads the whole answer, whatever its status.
pub(crate) async fn send(endpoint: &Endpoint, call: Call<'_>) -> Result<Answer, String> {
    let timeout = call.timeout;
    tokio::time::timeout(timeout, exchange(endpoint, call))
        .await
        .map_err(|_| format!("no answer within {} s", timeout.as_secs_f64()))?
}

/// One client for every upstream: no proxy from the environment (the services are on the operator's
/// network, and a proxy variable meant for the internet must not carry an operator's token), no
/// decompression (an answer is read as sent, or refused), HTTP/1.1.
static CLIENT: std::sync::LazyLock<reqwest::Client> = std::sync::LazyLock::new(|| {
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .user_agent("waybill-console")
        .build()
        .expect("a client without TLS or proxies builds")
});

async fn exchange(endpoint: &Endpoint, call: Call<'_>) -> Result<Answer, String> {
    let target = if call.path.is_empty() {
        endpoint.path.clone()
    } else {
        endpoint.at(call.path)?
    };
    let url = format!("http://{}{target}", endpoint.authority);
    let mut request = CLIENT
        .request(call.method, url)
        .header(header::ACCEPT_ENCODING, "identity");
    if let Some(authorization) = call.authorization {
        let mut value =
            HeaderValue::from_str(&authorization).map_err(|_| "bad authorization".to_owned())?;
        value.set_sensitive(true);
        request = request.header(header::AUTHORIZATION, value);
    }
    if let Some(json) = call.json {
        request = request
            .header(header::CONTENT_TYPE, "application/json")
            .body(json);
    }
    let mut response = request.send().await.map_err(|e| {
        if e.is_connect() {
            format!("cannot connect: {}", ops::error_chain(&e))
        } else {
            format!("no answer: {}", ops::error_chain(&e))
        }
    })?;
    if response
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return Err("the answer is compressed; only identity is read".to_owned());
    }
    if response
        .content_length()
        .is_some_and(|n| n > MAX_ANSWER as u64)
    {
        return Err(too_large());
    }
    let status = response.status();
    // Read chunk by chunk, so that an answer past the cap is refused before it is buffered.
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("cannot read the answer: {}", ops::error_chain(&e)))?
    {
        if body.len() + chunk.len() > MAX_ANSWER {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Answer {
        status,
        body: Bytes::from(body),
    })
}

fn too_large() -> String {
    format!("the answer is larger than {} KiB", MAX_ANSWER / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let url = Endpoint::parse("http://127.0.0.1:9464/metrics").expect("url");
        assert_eq!(
            (url.host.as_str(), url.port, url.path()),
            ("127.0.0.1", 9464, "/metrics")
        );
        assert_eq!(url.to_string(), "http://127.0.0.1:9464/metrics");
        let url = Endpoint::parse(" HTTP://[::1]:9 ").expect("url");
        assert_eq!((url.host.as_str(), url.port), ("::1", 9));
        let url = Endpoint::parse("http://[::1]/x").expect("url");
        assert_eq!((url.host.as_str(), url.port), ("::1", 80));
        let url = Endpoint::parse("http://relay-1.local/base/?x=1").expect("url");
        assert_eq!(url.port, 80);
        assert_eq!(
            url.at("/operator/redrive").expect("path").as_str(),
            "/base/operator/redrive"
        );
        for bad in [
            "127.0.0.1:9464",
            "https://127.0.0.1/metrics",
            "http://user:secret@127.0.0.1/metrics",
            "http://127.0.0.1:99999/metrics",
            "http:///metrics",
            "http://[::1/metrics",
            "http://ho st/metrics",
            "http://127.0.0.1/metrics\r\nX-Injected: 1",
            "http://127.0.0.1/m étrics",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[tokio::test]
    async fn an_unreachable_service_is_an_error_not_a_hang() {
        // A port nothing listens on: bind one, then close it.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let url = Endpoint::parse(&format!("http://127.0.0.1:{port}/")).expect("url");
        let error = send(&url, get()).await.expect_err("nothing listens");
        assert!(error.contains("connect"), "{error}");
    }

    #[tokio::test]
    async fn a_service_that_never_answers_costs_at_most_the_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let held = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.expect("accept");
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(socket);
        });
        let url = Endpoint::parse(&format!("http://127.0.0.1:{port}/")).expect("url");
        let error = send(&url, get()).await.expect_err("no answer");
        assert!(error.contains("no answer within"), "{error}");
        held.abort();
    }

    #[tokio::test]
    async fn answers_are_read_whatever_their_framing_and_capped() {
        for (raw, expected) in [
            (
                &b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"[..],
                Ok((200, &b"hello"[..])),
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
                Ok((200, b"abcde")),
            ),
            (b"HTTP/1.0 404 Not Found\r\n\r\nnope", Ok((404, b"nope"))),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 99999999\r\n\r\n",
                Err("larger"),
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 1\r\n\r\nx",
                Err("compressed"),
            ),
            (b"SSH-2.0-OpenSSH\r\n\r\n", Err("")),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let port = listener.local_addr().expect("addr").port();
            let raw = raw.to_vec();
            let server = tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let (mut socket, _) = listener.accept().await.expect("accept");
                let mut request = [0_u8; 1024];
                let _ = socket.read(&mut request).await;
                let _ = socket.write_all(&raw).await;
                let _ = socket.shutdown().await;
            });
            let url = Endpoint::parse(&format!("http://127.0.0.1:{port}/")).expect("url");
            let got = send(&url, get()).await;
            match expected {
                Ok((status, body)) => {
                    let answer = got.expect("an answer");
                    assert_eq!(answer.status.as_u16(), status);
                    assert_eq!(&answer.body[..], body);
                }
                Err(needle) => {
                    let error = got.expect_err("refused");
                    assert!(error.contains(needle), "{error}");
                }
            }
            server.abort();
        }
    }

    fn get() -> Call<'static> {
        Call {
            method: Method::GET,
            path: "",
            authorization: None,
            json: None,
            timeout: Duration::from_millis(500),
        }
    }
}
