//! Whose fault a failed apply is. The database's — its session lost, a serialization failure or
//! deadlock, no resources left, a statement timeout, the projection's own tables or privileges gone —
//! and the messages are retried with a growing delay, never parked: parking a valid message for it
//! would hold its order until an operator redrives it. The message's — a value the read model
//! cannot store (a check constraint, a number out of range), anything else the statement refused —
//! and it is parked, alone.

use std::time::Duration;

use crate::apply::ApplyError;

/// Who failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// The database, or what it holds of the projection itself: try again later.
    Database,
    /// What the message holds: park it.
    Message,
}

/// The blame for `error`: the database's when any database error in its chain says so.
pub(crate) fn blame(error: &ApplyError) -> Blame {
    let database = crate::runner::sqlx_causes(error)
        .any(|cause| ops::database::is_transient(cause) || refuses_the_projection(cause));
    if database {
        Blame::Database
    } else {
        Blame::Message
    }
}

/// True when the database refuses the projection itself, whatever the message: a login or privilege
/// taken away (SQLSTATE 28, 42501), its schema or a table or column gone (3D, 3F, 42P01, 42703, …).
/// The statements are the code's own and take the message's values only as parameters, so a class
/// 42 error is never the message's doing; parking every message until someone notices would turn an
/// operator's slip into a mass redrive.
fn refuses_the_projection(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| ["28", "3D", "3F", "42"].contains(&code.get(..2).unwrap_or("")))
}

/// How long the broker waits before delivering again a message the database failed on, from how
/// many times it was delivered: 250 ms, doubled each time, at most 5 s — a database back from an
/// outage finds its backlog delivered within seconds, and a long one costs the broker at most one
/// redelivery per unacknowledged message every 5 s.
pub(crate) fn retry_delay(delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 5)).unwrap_or(5);
    (Duration::from_millis(250) * 2u32.pow(doublings)).min(Duration::from_secs(5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_database_is_not_the_messages_fault() {
        let closed = ApplyError::Begin(sqlx::Error::PoolClosed);
        assert_eq!(blame(&closed), Blame::Database);
        let parking = ApplyError::from(crate::park::ParkError::from(sqlx::Error::Io(
            std::io::ErrorKind::ConnectionReset.into(),
        )));
        assert_eq!(blame(&parking), Blame::Database, "found below two layers");
        let refused = ApplyError::Project {
            projection: "test",
            events: 1,
            source: sqlx::Error::RowNotFound,
        };
        assert_eq!(blame(&refused), Blame::Message);
    }

    #[test]
    fn retries_back_off_to_five_seconds() {
        assert_eq!(retry_delay(0), Duration::from_millis(250));
        assert_eq!(retry_delay(1), Duration::from_millis(250));
        assert_eq!(retry_delay(2), Duration::from_millis(500));
        assert_eq!(retry_delay(5), Duration::from_secs(4));
        assert_eq!(retry_delay(6), Duration::from_secs(5));
        assert_eq!(retry_delay(i64::MAX), Duration::from_secs(5));
    }
}
