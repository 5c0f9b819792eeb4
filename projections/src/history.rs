//! The event store's `events` table read as a projection's history: one REPEATABLE READ snapshot,
//! read in pages by `position`, each row turned into the message the relay would have published
//! for it (subject, headers, envelope), so that it goes through the same decode, upcast, checkpoint
//! and apply path as a delivery. The read side does not link the event store's crate: the columns
//! are the storage contract's (DESIGN.md), read here.

use domain::{EventEnvelope, wire};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::decode::{RawMessage, relay_headers};

/// Why the event store's history could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The projection may not read `events` there, or there is no such table: history can only come
    /// from the stream.
    #[error(
        "the projection cannot read the event store's events table ({why}): grant its role SELECT on \
         it (`waybill roles create`), or name the event store's database with --events-url"
    )]
    Unavailable {
        /// What PostgreSQL said, in words.
        why: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The event store's database could not be reached.
    #[error("connecting to the event store's database")]
    Connect(#[source] sqlx::Error),
    /// Reading a page of events failed.
    #[error("reading the event store's events table")]
    Read(#[source] sqlx::Error),
}

impl HistoryError {
    /// True when the events table cannot be read at all, as opposed to a failure worth retrying.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}

/// Sorts a failed statement into "no access" (a permanent state of the deployment) or a failure.
fn classify(error: sqlx::Error, failed: fn(sqlx::Error) -> HistoryError) -> HistoryError {
    let why = match error.as_database_error().and_then(|e| e.code()).as_deref() {
        Some("42501") => Some("permission denied"),
        Some("42P01") => Some("no events table in that database"),
        Some("3D000") => Some("no such database"),
        Some("28000" | "28P01") => Some("the login was refused"),
        _ => None,
    };
    match why {
        Some(why) => HistoryError::Unavailable { why, source: error },
        None => failed(error),
    }
}

/// One stored event as the catch-up reads it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct StoredEvent {
    pub(crate) position: i64,
    event_id: Uuid,
    event_type: String,
    event_version: i32,
    aggregate_type: String,
    pub(crate) aggregate_id: Uuid,
    aggregate_version: i64,
    occurred_at: chrono::DateTime<chrono::Utc>,
    correlation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    payload: serde_json::Value,
}

impl StoredEvent {
    /// The message the relay publishes for this event: its subject under `prefix`, the relay's
    /// headers and the envelope as the body. It has no stream sequence (0): it was read from the
    /// store, and a parked copy says so with an empty `stream_sequence`.
    pub(crate) fn message(self, prefix: &str) -> RawMessage {
        let envelope = EventEnvelope {
            event_id: self.event_id,
            event_type: self.event_type,
            event_version: self.event_version,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            aggregate_version: self.aggregate_version,
            occurred_at: self.occurred_at,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            payload: self.payload,
        };
        // An aggregate type that cannot be a subject token still gets a subject naming its id, so
        // the decoder parks it with its reason instead of the catch-up failing.
        let subject = wire::subject(prefix, &envelope).unwrap_or_else(|_| {
            format!(
                "{prefix}.{}.{}",
                envelope.aggregate_type.replace(['.', ' ', '*', '>'], "_"),
                envelope.aggregate_id
            )
        });
        RawMessage {
            stream_sequence: 0,
            subject,
            headers: Some(relay_headers(&envelope)),
            body: envelope.to_json().into(),
        }
    }
}

/// The event store's history at one moment: every event committed before the snapshot began, and
/// nothing committed after. Events are immutable, so the snapshot never conflicts with writers.
pub(crate) struct Snapshot {
    tx: Transaction<'static, Postgres>,
    after: i64,
    /// The highest position in the snapshot (0 when it holds no event): at least the number of
    /// events it holds (identity values are never reused; rolled-back inserts leave gaps).
    pub(crate) last_position: i64,
}

impl Snapshot {
    /// Opens a pool of one connection on the event store's database (the URL's own default schema,
    /// not the projection's search path) and takes the snapshot.
    pub(crate) async fn take(url: &str, application: &str) -> Result<(PgPool, Self), HistoryError> {
        let pool = ops::database::connect(url, application, 1)
            .await
            .map_err(|error| classify(error, HistoryError::Connect))?;
        let snapshot = Self::begin(&pool).await;
        match snapshot {
            Ok(snapshot) => Ok((pool, snapshot)),
            Err(error) => {
                pool.close().await;
                Err(error)
            }
        }
    }

    async fn begin(pool: &PgPool) -> Result<Self, HistoryError> {
        let mut tx = pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .await
            .map_err(HistoryError::Read)?;
        // The first statement fixes the snapshot.
        let last_position: i64 =
            sqlx::query_scalar("SELECT coalesce(max(position), 0) FROM events")
                .fetch_one(&mut *tx)
                .await
                .map_err(|error| classify(error, HistoryError::Read))?;
        Ok(Self {
            tx,
            after: 0,
            last_position,
        })
    }

    /// The next `limit` events of the aggregate types `types` by position (empty at the end). Keyset
    /// pagination on the primary key: each page is one index range, however far the catch-up is.
    pub(crate) async fn next_page(
        &mut self,
        limit: usize,
        types: &[&str],
    ) -> Result<Vec<StoredEvent>, HistoryError> {
        let page: Vec<StoredEvent> = sqlx::query_as(
            "SELECT position, event_id, event_type, event_version, aggregate_type, aggregate_id,
                    aggregate_version, occurred_at, correlation_id, causation_id, payload
             FROM events WHERE position > $1 AND aggregate_type = ANY($3)
             ORDER BY position LIMIT $2",
        )
        .bind(self.after)
        .bind(i64::try_from(limit.max(1)).unwrap_or(i64::MAX))
        .bind(types)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(HistoryError::Read)?;
        if let Some(last) = page.last() {
            self.after = last.position;
        }
        Ok(page)
    }

    /// Where the last page ended.
    pub(crate) fn position(&self) -> i64 {
        self.after
    }
}

/// Every event of the aggregate types `types` in the event store (reached through `pool`'s search
/// path), by position — each aggregate's in version order — decoded as `E`. For a model's pure fold
/// ([`crate::kit::ReadModel::expected`]); an event that does not decode is an error here, not poison:
/// the store holds only what the command side wrote.
pub async fn store_events<E: crate::decode::ProjectionEvent>(
    pool: &PgPool,
    types: &[&str],
) -> anyhow::Result<Vec<crate::decode::Decoded<E>>> {
    let rows: Vec<StoredEvent> = sqlx::query_as(
        "SELECT position, event_id, event_type, event_version, aggregate_type, aggregate_id,
                aggregate_version, occurred_at, correlation_id, causation_id, payload
         FROM events WHERE aggregate_type = ANY($1) ORDER BY position",
    )
    .bind(types)
    .fetch_all(pool)
    .await?;
    let upcasters = domain::Upcasters::all();
    rows.into_iter()
        .map(|row| {
            let (id, version) = (row.event_id, row.aggregate_version);
            let message = row.message("");
            let decoded = crate::decode::decode(&message.body, &upcasters).map_err(|poison| {
                anyhow::anyhow!("event {id} (version {version}): {}", poison.reason)
            })?;
            decoded
                .narrow::<E>()
                .ok_or_else(|| anyhow::anyhow!("event {id} is not of the model's event type"))
        })
        .collect()
}
