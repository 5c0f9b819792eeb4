//! Logging through `tracing` to standard error, as text for people or JSON for log shippers — every
//! line with its secrets hidden ([`crate::redact_text`]).

use std::io::{IsTerminal, Write};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// Installs the global subscriber. `RUST_LOG` overrides `default_filter` (e.g. `info` or
/// `waybill=debug,sqlx=warn`); `WAYBILL_LOG_FORMAT=json` switches to one JSON object per line.
pub fn init_logging(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let json = std::env::var("WAYBILL_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .with_writer(Redacting(std::io::stderr));
    // A second init (tests, or a binary that calls it twice) keeps the first subscriber.
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder.compact().try_init()
    };
}

/// A writer whose every event is redacted: the formatter writes each event into a writer of its
/// own, which passes it on, secrets hidden, when it is dropped.
#[derive(Debug, Clone, Copy)]
struct Redacting<M>(M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for Redacting<M> {
    type Writer = RedactedEvent<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        RedactedEvent {
            bytes: Vec::new(),
            out: self.0.make_writer(),
        }
    }
}

/// One event's bytes, written out redacted on drop.
#[derive(Debug)]
struct RedactedEvent<W: Write> {
    bytes: Vec<u8>,
    out: W,
}

impl<W: Write> Write for RedactedEvent<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.bytes.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<W: Write> Drop for RedactedEvent<W> {
    fn drop(&mut self) {
        if self.bytes.is_empty() {
            return;
        }
        let shown = crate::redact_text(&String::from_utf8_lossy(&self.bytes));
        // Nowhere to report a failed write to the log.
        let _ = self.out.write_all(shown.as_bytes());
        let _ = self.out.flush();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Debug, Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;

        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    #[test]
    fn log_lines_never_carry_a_secret_as_text_or_json() {
        crate::remember_secret("Log-Secret-ab#c");
        for json in [false, true] {
            let captured = Captured::default();
            let builder = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(Redacting(captured.clone()));
            let log = || {
                tracing::warn!(
                    url = "postgres://u:p,w#x@h/db",
                    token = "Log-Secret-ab#c",
                    "connecting with password=Log-Secret-ab#c"
                );
            };
            if json {
                tracing::subscriber::with_default(builder.json().finish(), log);
            } else {
                tracing::subscriber::with_default(builder.finish(), log);
            }
            let text = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
            assert!(text.contains("connecting"), "{text}");
            assert!(
                !text.contains("Log-Secret") && !text.contains("p,w#x"),
                "{text}"
            );
        }
    }
}
