//! How a command-line run ends badly: a line on standard error (or a JSON object on standard output
//! with `--json`) and the exit code every waybill binary uses — 2 when the input was refused, 1 for
//! anything else.

use std::process::ExitCode;

/// Marks an error as the caller's input being refused (exit code 2): nothing was changed, and repeating
/// the same input will not help. The one way every binary says so: a `Refused` anywhere in an error's
/// chain makes [`report_failure`] exit 2. It prints as the error it wraps, causes included.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Refused(Box<dyn std::error::Error + Send + Sync + 'static>);

impl Refused {
    /// Refuses with `reason`: a message (`&str`, `String`) or an error whose causes are kept.
    pub fn new(reason: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self(reason.into())
    }
}

/// The command printed its own result, and the result is a failure (a check that found differences):
/// exit 1 without a second JSON document; in text mode the message goes to standard error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AlreadyReported(pub String);

/// Reports `error` and returns its exit code: 2 if `refused` or anything in its chain is [`Refused`].
pub fn report_failure(error: &anyhow::Error, refused: bool, json_output: bool) -> ExitCode {
    if let Some(reported) = error.downcast_ref::<AlreadyReported>() {
        if !json_output {
            eprintln!("error: {reported}");
        }
        return ExitCode::from(1);
    }
    let refused = refused || error.chain().any(|cause| cause.is::<Refused>());
    let kind = if refused { "refused" } else { "failed" };
    // Whatever a cause quotes, a password in a URL is not printed.
    let message = crate::redact_text(&error_chain(error.as_ref()));
    if json_output {
        let body = serde_json::json!({ "error": { "kind": kind, "message": message } });
        println!("{body}");
    } else {
        eprintln!("error: {message}");
    }
    ExitCode::from(if refused { 2 } else { 1 })
}

/// `error` and its causes, outermost first, joined by ": ": each `source()` once. A cause whose message
/// the previous one already ends with is not printed again (sqlx's errors quote their source in their
/// own message, e.g. "error communicating with database: refused" over "refused"). A NATS request
/// that timed out shortly after the server refused this process a permission is named as that
/// refusal ("permission denied by the NATS server: publish to SUBJECT"): the server answers a
/// refused request with nothing but that event, so "timed out" alone would send an operator looking
/// for a slow server.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = shown_cause(error);
    let mut previous = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let message = cause.to_string();
        if !previous.ends_with(&message) {
            text.push_str(": ");
            text.push_str(&shown_cause(cause));
        }
        previous = message;
        source = cause.source();
    }
    text
}

/// A cause's message, or the NATS refusal that explains it when it is a timeout.
fn shown_cause(cause: &(dyn std::error::Error + 'static)) -> String {
    let message = cause.to_string();
    // A database pool's timeout has nothing to do with NATS.
    if message.contains("timed out")
        && cause.downcast_ref::<sqlx::Error>().is_none()
        && let Some(refusal) = crate::nats_refusal::recent_refusal()
    {
        return format!("{refusal} (the request then timed out)");
    }
    message
}
