//! A rebuild's handover: after the swap, the live consumers must continue right behind the rebuilt
//! state. PostgreSQL and JetStream cannot change together, so the move is written down first — a
//! row per consumer in the projection's `handover` table, committed by the swap's own transaction —
//! and carried out afterwards: by the rebuild, and again, idempotently, by any `run` that finds a row
//! not yet done (at start, and within seconds while running). A consumer never moves before its
//! state is the rebuilt one, so an interrupted rebuild (killed, or a JetStream error half-way
//! through the consumers) leaves either the old state with its old consumers, or the new state with
//! consumers that are moved later; never the old state behind moved consumers.

use async_nats::jetstream::consumer::DeliverPolicy;
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::consumer::BrokerError;
use crate::projection::Projection;
use crate::runner::Runner;

/// Why a recorded move could not be read, made or marked done.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("reading the rebuild's handover")]
    Read(#[source] sqlx::Error),
    /// The consumer could not be deleted or created at its new start.
    #[error("moving consumer {consumer} to stream sequence {start_sequence}")]
    Move {
        consumer: String,
        start_sequence: u64,
        #[source]
        source: BrokerError,
    },
    #[error("marking the move of consumer {consumer} done")]
    Mark {
        consumer: String,
        #[source]
        source: sqlx::Error,
    },
}

/// One recorded move.
#[derive(Debug, sqlx::FromRow)]
struct Move {
    consumer: String,
    start_sequence: i64,
    token: Uuid,
}

/// Records, in the caller's transaction (the swap's), that each of `consumers` must start at
/// `start_sequence`, in the `handover` table of `schema`. Returns the move's token, which the moved
/// consumers carry in their description.
pub(crate) async fn record(
    tx: &mut PgConnection,
    schema: &str,
    consumers: &[String],
    start_sequence: u64,
) -> sqlx::Result<Uuid> {
    let token = Uuid::now_v7();
    let start_sequence =
        i64::try_from(start_sequence).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    // Schema names are the projection's own (checked by `schema`), quoted.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".handover (consumer, start_sequence, token)
         SELECT consumer, $2, $3 FROM UNNEST($1::text[]) AS c(consumer)
         ON CONFLICT (consumer) DO UPDATE
             SET start_sequence = EXCLUDED.start_sequence, token = EXCLUDED.token,
                 recorded_at = now(), moved_at = NULL"
    )))
    .bind(consumers)
    .bind(start_sequence)
    .bind(token)
    .execute(&mut *tx)
    .await?;
    Ok(token)
}

/// What a moved consumer's description ends with.
fn marker(token: Uuid) -> String {
    format!("handover {token}")
}

impl<P: Projection> Runner<P> {
    /// Carries out every recorded move not yet done: deletes the consumer and creates it at its
    /// recorded start, then marks the move done. A consumer that already carries the move's token
    /// was moved by someone else (or before a crash): it is only marked. Returns how many moves were
    /// made or found made.
    pub(crate) async fn complete_handovers(&self) -> Result<usize, HandoverError> {
        let moves: Vec<Move> = sqlx::query_as(
            "SELECT consumer, start_sequence, token FROM handover WHERE moved_at IS NULL
             ORDER BY consumer",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(HandoverError::Read)?;
        for (done, step) in moves.iter().enumerate() {
            let start_sequence = u64::try_from(step.start_sequence.max(1)).unwrap_or(1);
            let failed = |source| HandoverError::Move {
                consumer: step.consumer.clone(),
                start_sequence,
                source,
            };
            let marker = marker(step.token);
            let moved = self
                .consumer_info(&step.consumer)
                .await
                .map_err(failed)?
                .is_some_and(|info| {
                    info.config
                        .description
                        .as_deref()
                        .is_some_and(|d| d.ends_with(&format!("({marker})")))
                });
            if !moved {
                self.delete_consumer(&step.consumer).await.map_err(failed)?;
                self.create_consumer_at(
                    &step.consumer,
                    DeliverPolicy::ByStartSequence { start_sequence },
                    Some(&marker),
                )
                .await
                .map_err(failed)?;
                tracing::info!(
                    projection = P::NAME,
                    consumer = %step.consumer,
                    start_sequence,
                    "moved the consumer behind the rebuilt state"
                );
            }
            #[cfg(feature = "fault-injection")]
            if done == 0
                && self.config.fail_point == crate::runner::FailPoint::AbortAfterFirstConsumerMoved
            {
                tracing::warn!("fail point: aborting after moving the first consumer");
                std::process::abort();
            }
            let _ = done;
            sqlx::query(
                "UPDATE handover SET moved_at = now()
                 WHERE consumer = $1 AND token = $2 AND moved_at IS NULL",
            )
            .bind(&step.consumer)
            .bind(step.token)
            .execute(&self.pool)
            .await
            .map_err(|source| HandoverError::Mark {
                consumer: step.consumer.clone(),
                source,
            })?;
        }
        Ok(moves.len())
    }

    /// True when a recorded move of consumer `name` is not done yet.
    pub(crate) async fn handover_pending(&self, name: &str) -> sqlx::Result<bool> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM handover WHERE consumer = $1 AND moved_at IS NULL)",
        )
        .bind(name)
        .fetch_one(&self.pool)
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[sqlx::test]
    async fn a_start_past_bigint_is_refused_and_records_nothing(pool: sqlx::PgPool) {
        sqlx::raw_sql(
            "CREATE SCHEMA h;
             CREATE TABLE h.handover (consumer TEXT PRIMARY KEY, start_sequence BIGINT NOT NULL,
                 token UUID NOT NULL, recorded_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                 moved_at TIMESTAMPTZ);",
        )
        .execute(&pool)
        .await
        .expect("table");
        let mut tx = pool.begin().await.expect("begin");
        // As an i64, u64::MAX was -1: a start no consumer can be moved to.
        let refused = record(&mut tx, "h", &["c".to_owned()], u64::MAX).await;
        assert!(
            matches!(refused, Err(sqlx::Error::Encode(_))),
            "{refused:?}"
        );
        record(&mut tx, "h", &["c".to_owned()], 7)
            .await
            .expect("an in-range start is recorded");
        tx.commit().await.expect("commit");
        let starts: Vec<i64> = sqlx::query_scalar("SELECT start_sequence FROM h.handover")
            .fetch_all(&pool)
            .await
            .expect("read");
        assert_eq!(starts, [7]);
    }
}
