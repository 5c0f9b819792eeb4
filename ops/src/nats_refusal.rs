//! What the NATS server refused this process. A publish or subscription its permissions do not allow
//! is answered by `-ERR 'Permissions Violation for Publish to "<subject>"'`, which the client
//! delivers as an event on the side; the JetStream request that was refused then only times out. The
//! last refusal is kept here, so that the timeout is reported as what it was
//! ([`crate::error_chain`]).

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long after a refusal a NATS timeout is put down to it: longer than a JetStream request waits
/// for its answer (5 s by default), much shorter than the 2 s retry loops take to make a new one.
const EXPLAINS_FOR: Duration = Duration::from_secs(15);

/// A permission the NATS server refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsRefusal {
    /// What was refused: `publish to`, `subscribe to`, …
    pub operation: String,
    /// The subject it was refused on.
    pub subject: String,
}

impl fmt::Display for NatsRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "permission denied by the NATS server: {} {}",
            self.operation, self.subject
        )
    }
}

static LAST: Mutex<Option<(Instant, NatsRefusal)>> = Mutex::new(None);

/// The client's event callback: keeps (and logs) permission violations, ignores everything else.
pub(crate) fn observe(event: &async_nats::Event) {
    let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) = event else {
        return;
    };
    let Some(refusal) = parse(text) else {
        return;
    };
    let mut last = LAST.lock().unwrap_or_else(|poison| poison.into_inner());
    // The same refusal again and again (every message's ack, say) is logged once in a while.
    let repeated = last
        .as_ref()
        .is_some_and(|(at, seen)| *seen == refusal && at.elapsed() < EXPLAINS_FOR);
    if !repeated {
        tracing::error!(
            operation = %refusal.operation,
            subject = %refusal.subject,
            "permission denied by the NATS server"
        );
    }
    *last = Some((Instant::now(), refusal));
}

/// The refusal that explains a NATS timeout happening now, if there was one shortly before.
pub fn recent_refusal() -> Option<NatsRefusal> {
    let last = LAST.lock().unwrap_or_else(|poison| poison.into_inner());
    last.as_ref()
        .filter(|(at, _)| at.elapsed() < EXPLAINS_FOR)
        .map(|(_, refusal)| refusal.clone())
}

/// Reads `Permissions Violation for Publish to "x"` (or `Subscription to "x"`, `Publish with Reply
/// of "x"`; a queue group may follow).
fn parse(text: &str) -> Option<NatsRefusal> {
    const PREFIX: &str = "permissions violation for ";
    let head = text.get(..PREFIX.len())?;
    if !head.eq_ignore_ascii_case(PREFIX) {
        return None;
    }
    let rest = &text[PREFIX.len()..];
    let (operation, quoted) = rest.split_once('"')?;
    let subject = quoted
        .split_once('"')
        .map_or(quoted, |(subject, _)| subject);
    let operation = operation.trim().to_ascii_lowercase();
    let operation = match operation.strip_prefix("subscription") {
        Some(rest) => format!("subscribe{rest}"),
        None => operation,
    };
    Some(NatsRefusal {
        operation,
        subject: subject.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_words_are_read() {
        assert_eq!(
            parse(r#"Permissions Violation for Publish to "$JS.API.CONSUMER.INFO.S.x-p0of2""#),
            Some(NatsRefusal {
                operation: "publish to".into(),
                subject: "$JS.API.CONSUMER.INFO.S.x-p0of2".into()
            })
        );
        let subscribe = parse(r#"Permissions Violation for Subscription to "a.b" using queue "q""#)
            .expect("subscription");
        assert_eq!(
            subscribe.to_string(),
            "permission denied by the NATS server: subscribe to a.b"
        );
        assert_eq!(parse("Authorization Violation"), None);
        assert_eq!(parse("short"), None);
    }
}
