//! `held release`: an order's missing versions skipped deliberately, and what waited behind them
//! applied.

use serde_json::{Value, json};
use uuid::Uuid;

use super::record_action;
use crate::apply::{ApplyError, OnPoison, decide_and_apply};
use crate::projection::Projection;
use crate::runner::Runner;

/// Why releasing an order failed; nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The operator's release was refused (exit code 2).
    #[error("releasing order {aggregate_id}")]
    Refused {
        /// The order.
        aggregate_id: Uuid,
        #[source]
        source: ops::Refused,
    },
    /// The release's reading or recording failed.
    #[error("releasing order {aggregate_id}")]
    Failed {
        /// The order.
        aggregate_id: Uuid,
        #[source]
        source: sqlx::Error,
    },
    /// The events held behind the skipped versions could not be applied.
    #[error("applying the events held for order {aggregate_id}")]
    Apply {
        /// The order.
        aggregate_id: Uuid,
        #[source]
        source: ApplyError,
    },
}

impl<P: Projection> Runner<P> {
    /// Skips the missing versions of `aggregate_id` deliberately: its checkpoint moves to just below
    /// its lowest held version, and every held event that then follows is applied, in one transaction.
    /// Recorded with who, when and why.
    pub async fn release(
        &self,
        aggregate_id: Uuid,
        actor: &str,
        reason: &str,
    ) -> Result<Value, ReleaseError> {
        let refused = |message: &str| ReleaseError::Refused {
            aggregate_id,
            source: ops::Refused::new(message),
        };
        let failed = |source| ReleaseError::Failed {
            aggregate_id,
            source,
        };
        if reason.trim().is_empty() {
            return Err(refused("a release needs a --reason"));
        }
        let mut tx = self.pool.begin().await.map_err(failed)?;
        self.lock(&mut tx).await.map_err(failed)?;
        let lowest: Option<i64> =
            sqlx::query_scalar("SELECT min(version) FROM held WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await
                .map_err(failed)?;
        let Some(lowest) = lowest else {
            return Err(refused("nothing is held for it"));
        };
        let checkpoint: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(version), 0) FROM checkpoints WHERE aggregate_id = $1",
        )
        .bind(aggregate_id)
        .fetch_one(&mut *tx)
        .await
        .map_err(failed)?;
        let skipped_to = (lowest - 1).max(checkpoint);
        decide_and_apply(
            &mut tx,
            &*self.projection,
            &self.upcasters,
            &[],
            Some((aggregate_id, skipped_to)),
            OnPoison::Park,
        )
        .await
        .map_err(|source| ReleaseError::Apply {
            aggregate_id,
            source,
        })?;
        let version: i64 =
            sqlx::query_scalar("SELECT version FROM checkpoints WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await
                .map_err(failed)?;
        let still_held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM held WHERE aggregate_id = $1")
                .bind(aggregate_id)
                .fetch_one(&mut *tx)
                .await
                .map_err(failed)?;
        let detail = json!({
            "skipped_versions": [checkpoint + 1, skipped_to],
            "applied_through": version,
            "still_held": still_held,
        });
        record_action(
            &mut tx,
            actor,
            "held release",
            &aggregate_id.to_string(),
            reason,
            &detail,
        )
        .await
        .map_err(failed)?;
        tx.commit().await.map_err(failed)?;
        tracing::info!(projection = P::NAME, %aggregate_id, actor, reason, skipped_from = checkpoint + 1,
                       skipped_to, applied_through = version, still_held, "held order released");
        Ok(json!({
            "aggregate_id": aggregate_id,
            "by": actor,
            "reason": reason,
            "skipped_from": checkpoint + 1,
            "skipped_to": skipped_to,
            "applied_through": version,
            "still_held": still_held,
        }))
    }
}
