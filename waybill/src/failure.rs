//! How a run ends badly: which errors are the caller's input (exit 2, marked [`ops::Refused`]) and
//! which are faults (exit 1), with a hint when the database was never migrated.

use store::CommandError;

/// A command's error as the program ends with it: a refusal (a domain rule said no; nothing was
/// written) is marked [`ops::Refused`] so that the run exits 2; anything else gets the migrate hint.
pub(crate) fn command_failure<E: std::error::Error + Send + Sync + 'static>(
    error: CommandError<E>,
) -> anyhow::Error {
    if error.is_refusal() {
        ops::Refused::new(error).into()
    } else {
        with_hint(error)
    }
}

/// Adds "run `waybill migrate`" to errors that come from a database that was never migrated.
pub(crate) fn with_hint(error: impl Into<anyhow::Error>) -> anyhow::Error {
    let error = error.into();
    let unmigrated = error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<sqlx::Error>())
        .any(ops::database::is_undefined_table);
    if unmigrated {
        error.context("the database has no waybill tables; run `waybill migrate` first")
    } else {
        error
    }
}

/// The URL with its password (in the user info or a query parameter) replaced, fit for messages and
/// logs.
pub(crate) fn redact(url: &str) -> String {
    ops::redact_url(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            redact("postgres://h:5432/db?user=u&password=secret"),
            "postgres://h:5432/db?user=u&password=***"
        );
        assert_eq!(redact("postgres://h:5432/db"), "postgres://h:5432/db");
    }
}
