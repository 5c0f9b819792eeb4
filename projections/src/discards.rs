//! What operators decided, kept across a rebuild. A rebuild replaces the projection's schema, and
//! with it the `parked` table and the `operator_log`; built again from history, the new state parks
//! the same poison again, as open. So the swap's transaction, before the old schema goes, copies the
//! operator log into the new one and marks as discarded every message the new state parked that the
//! old one had discarded — the same message (same stream sequence and bytes), or the same event read
//! from the store instead of the stream (same event id, aggregate, version and envelope) — with the
//! original who, when and why. Discarded messages the new state did not park again are copied over
//! as they were, so a later rebuild still knows them.

use serde_json::Value;
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// A parked row as the matching needs it.
#[derive(Debug, Clone, sqlx::FromRow)]
struct ParkedRow {
    id: i64,
    stream_sequence: Option<i64>,
    body: Vec<u8>,
    body_size: i64,
    body_sha256: Vec<u8>,
    event_id: Option<Uuid>,
    aggregate_id: Option<Uuid>,
    aggregate_version: Option<i64>,
}

impl ParkedRow {
    fn whole_body(&self) -> Option<Value> {
        (self.body_size == i64::try_from(self.body.len()).unwrap_or(i64::MAX))
            .then(|| serde_json::from_slice(&self.body).ok())
            .flatten()
    }
}

/// True when `new` (parked by the rebuilt state) is the message `old` (discarded in the old state).
fn same_message(old: &ParkedRow, new: &ParkedRow) -> bool {
    if let (Some(a), Some(b)) = (old.stream_sequence, new.stream_sequence)
        && a == b
        && old.body_sha256 == new.body_sha256
    {
        return true;
    }
    // The same event, one copy from the stream and one from the store (whose bytes differ: the store
    // keeps columns, not the published text). A forged message that borrowed the event's id has
    // another envelope and does not match.
    if old.event_id.is_none()
        || old.event_id != new.event_id
        || old.aggregate_id != new.aggregate_id
        || old.aggregate_version != new.aggregate_version
    {
        return false;
    }
    match (old.whole_body(), new.whole_body()) {
        (Some(a), Some(b)) => a == b,
        // A body cut at 64 KiB cannot be compared; the event's identity has to do.
        _ => {
            old.body_size > i64::try_from(old.body.len()).unwrap_or(i64::MAX)
                || new.body_size > i64::try_from(new.body.len()).unwrap_or(i64::MAX)
        }
    }
}

/// What [`carry_over`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CarriedOver {
    /// Operator log entries copied.
    pub(crate) log_entries: u64,
    /// Messages the new state parked again, marked discarded as they were.
    pub(crate) honoured: u64,
    /// Discarded messages the new state did not park, copied as they were.
    pub(crate) kept: u64,
}

const COLUMNS: &str = "id, stream_sequence, body, body_size, body_sha256, event_id, aggregate_id, \
                       aggregate_version";

/// Copies the operator log of schema `from` into schema `into`, and its discards onto the parked
/// messages of `into` (see the module). Runs in the caller's transaction, the swap's; both schemas
/// are the projection's own names (checked by `schema`), quoted here.
pub(crate) async fn carry_over(
    tx: &mut PgConnection,
    from: &str,
    into: &str,
) -> sqlx::Result<CarriedOver> {
    let log_entries = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{into}\".operator_log (id, at, actor, action, target, reason, detail)
         OVERRIDING SYSTEM VALUE
         SELECT id, at, actor, action, target, reason, detail FROM \"{from}\".operator_log ORDER BY id"
    )))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT setval(pg_get_serial_sequence('\"{into}\".operator_log', 'id'), max(id))
         FROM \"{into}\".operator_log HAVING max(id) IS NOT NULL"
    )))
    .execute(&mut *tx)
    .await?;

    let discarded: Vec<ParkedRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM \"{from}\".parked WHERE discarded_at IS NOT NULL ORDER BY id"
    )))
    .fetch_all(&mut *tx)
    .await?;
    if discarded.is_empty() {
        return Ok(CarriedOver {
            log_entries,
            ..CarriedOver::default()
        });
    }
    let open: Vec<ParkedRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM \"{into}\".parked
         WHERE discarded_at IS NULL AND redriven_at IS NULL ORDER BY id"
    )))
    .fetch_all(&mut *tx)
    .await?;
    // (new id, old id) for every re-parked message; each old discard covers every copy of it.
    let mut honoured: Vec<(i64, i64)> = Vec::new();
    let mut kept: Vec<i64> = Vec::new();
    for old in &discarded {
        let copies: Vec<i64> = open
            .iter()
            .filter(|new| same_message(old, new))
            .map(|new| new.id)
            .collect();
        if copies.is_empty() {
            kept.push(old.id);
        }
        honoured.extend(copies.into_iter().map(|new| (new, old.id)));
    }
    honoured.sort_unstable();
    honoured.dedup_by_key(|(new, _)| *new);
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{into}\".parked n
         SET discarded_at = o.discarded_at, discarded_by = o.discarded_by,
             discard_reason = o.discard_reason
         FROM UNNEST($1::int8[], $2::int8[]) AS m(new_id, old_id)
         JOIN \"{from}\".parked o ON o.id = m.old_id
         WHERE n.id = m.new_id"
    )))
    .bind(honoured.iter().map(|(new, _)| *new).collect::<Vec<_>>())
    .bind(honoured.iter().map(|(_, old)| *old).collect::<Vec<_>>())
    .execute(&mut *tx)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{into}\".parked
             (stream_sequence, subject, headers, body, body_size, body_sha256, reason, event_id,
              aggregate_id, aggregate_version, parked_at, redriven_at, redrive_note, discarded_at,
              discarded_by, discard_reason)
         SELECT stream_sequence, subject, headers, body, body_size, body_sha256, reason, event_id,
                aggregate_id, aggregate_version, parked_at, redriven_at, redrive_note, discarded_at,
                discarded_by, discard_reason
         FROM \"{from}\".parked WHERE id = ANY($1) ORDER BY id"
    )))
    .bind(&kept)
    .execute(&mut *tx)
    .await?;
    Ok(CarriedOver {
        log_entries,
        honoured: honoured.len() as u64,
        kept: kept.len() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, sequence: Option<i64>, body: &str, event: Option<u128>) -> ParkedRow {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut hasher = DefaultHasher::new();
        body.hash(&mut hasher);
        ParkedRow {
            id,
            stream_sequence: sequence,
            body: body.as_bytes().to_vec(),
            body_size: i64::try_from(body.len()).expect("a test body"),
            body_sha256: hasher.finish().to_be_bytes().to_vec(),
            event_id: event.map(Uuid::from_u128),
            aggregate_id: event.map(|_| Uuid::from_u128(7)),
            aggregate_version: event.map(|_| 2),
        }
    }

    #[test]
    fn the_same_bytes_at_the_same_sequence_are_the_same_message() {
        let old = row(1, Some(40), "garbage", None);
        assert!(same_message(&old, &row(9, Some(40), "garbage", None)));
        assert!(!same_message(&old, &row(9, Some(41), "garbage", None)));
        assert!(
            !same_message(&old, &row(9, Some(40), "other garbage", None)),
            "another stream's message at that sequence"
        );
    }

    #[test]
    fn the_same_event_read_from_the_store_is_the_same_message() {
        let from_stream = row(1, Some(40), r#"{"a": 1, "b": [2]}"#, Some(5));
        let from_store = row(9, None, r#"{"b":[2],"a":1}"#, Some(5));
        assert!(same_message(&from_stream, &from_store));
        let forged = row(9, None, r#"{"a": 1, "b": [3]}"#, Some(5));
        assert!(
            !same_message(&from_stream, &forged),
            "an id borrowed by another envelope"
        );
        assert!(!same_message(
            &row(1, None, "x", None),
            &row(2, None, "x", None)
        ));
    }
}
