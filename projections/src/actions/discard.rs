//! `parked discard`: a parked message given up on purpose, never to be redriven.

use serde_json::{Value, json};
use uuid::Uuid;

use super::record_action;
use crate::park::storable;
use crate::projection::Projection;
use crate::runner::Runner;

/// Why a discard failed; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum DiscardError {
    /// The operator's discard was refused (exit code 2).
    #[error("discarding parked message {id}")]
    Refused {
        /// The parked message.
        id: i64,
        #[source]
        source: ops::Refused,
    },
    /// The discard's update or recording failed.
    #[error("discarding parked message {id}")]
    Failed {
        /// The parked message.
        id: i64,
        #[source]
        source: sqlx::Error,
    },
}

impl<P: Projection> Runner<P> {
    /// Marks a parked message as dealt with, on purpose: it will not be redriven. Recorded with who,
    /// when and why. Held events waiting behind it stay held: `held release` skips the version.
    pub async fn discard(&self, id: i64, actor: &str, reason: &str) -> Result<Value, DiscardError> {
        let refused = |message: &str| DiscardError::Refused {
            id,
            source: ops::Refused::new(message),
        };
        let failed = |source| DiscardError::Failed { id, source };
        if reason.trim().is_empty() {
            return Err(refused("a discard needs a --reason"));
        }
        let mut tx = self.pool.begin().await.map_err(failed)?;
        self.lock(&mut tx).await.map_err(failed)?;
        let row: Option<(Option<Uuid>, Option<i64>)> = sqlx::query_as(
            "UPDATE parked SET discarded_at = now(), discarded_by = $2, discard_reason = $3
             WHERE id = $1 AND discarded_at IS NULL AND redriven_at IS NULL
             RETURNING aggregate_id, aggregate_version",
        )
        .bind(id)
        .bind(storable(actor))
        .bind(storable(reason))
        .fetch_optional(&mut *tx)
        .await
        .map_err(failed)?;
        let Some((aggregate_id, aggregate_version)) = row else {
            return Err(refused(
                "it does not exist, or was already redriven or discarded",
            ));
        };
        let held_behind: i64 = match aggregate_id {
            Some(aggregate) => {
                sqlx::query_scalar("SELECT count(*) FROM held WHERE aggregate_id = $1")
                    .bind(aggregate)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(failed)?
            }
            None => 0,
        };
        let detail = json!({"aggregate_id": aggregate_id, "aggregate_version": aggregate_version,
                            "held_behind": held_behind});
        record_action(
            &mut tx,
            actor,
            "parked discard",
            &id.to_string(),
            reason,
            &detail,
        )
        .await
        .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        tracing::info!(
            projection = P::NAME,
            id,
            actor,
            reason,
            held_behind,
            "parked message discarded"
        );
        Ok(json!({"discarded": id, "by": actor, "reason": reason,
                  "aggregate_id": aggregate_id, "aggregate_version": aggregate_version,
                  "held_behind": held_behind}))
    }
}
