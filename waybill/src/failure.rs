//! How a run ends badly: the error, and whether it was the caller's input (exit 2) or a fault (exit 1).

use std::process::ExitCode;

use store::CommandError;

/// An error that ends the program, classified for its exit code.
#[derive(Debug)]
pub struct Failure {
    /// True when the input was refused: nothing was written, and retrying the same input is pointless.
    pub refused: bool,
    /// What went wrong, with its causes.
    pub error: anyhow::Error,
}

impl Failure {
    /// The caller's input was refused (exit code 2).
    pub fn refused(error: impl Into<anyhow::Error>) -> Self {
        Self {
            refused: true,
            error: error.into(),
        }
    }

    /// Reports the failure and returns the exit code.
    pub fn report(&self, json_output: bool) -> ExitCode {
        ops::report_failure(&self.error, self.refused, json_output)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Self {
            refused: false,
            error,
        }
    }
}

impl From<CommandError> for Failure {
    fn from(error: CommandError) -> Self {
        Self {
            refused: error.is_refusal(),
            error: with_hint(error),
        }
    }
}

/// Adds "run `waybill migrate`" to errors that come from a database that was never migrated.
pub fn with_hint(error: impl Into<anyhow::Error>) -> anyhow::Error {
    let error = error.into();
    let unmigrated = error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<sqlx::Error>())
        .any(store::is_undefined_table);
    if unmigrated {
        error.context("the database has no waybill tables; run `waybill migrate` first")
    } else {
        error
    }
}

/// The URL with its password (in the user info or a query parameter) replaced, fit for messages and
/// logs.
pub fn redact(url: &str) -> String {
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
