//! The operator's ways out, each one transaction recorded in the operator log with who and why:
//! `held release` skips an order's missing versions, `parked discard` gives up on a parked message,
//! `redrive` re-applies parked messages after an upgrade. They sit above the pipeline: they read and
//! write the held and parked tables and re-enter `apply` like a delivery would, and nothing
//! in the pipeline calls them.

mod discard;
mod redrive;
mod release;

use serde_json::Value;
use sqlx::PgConnection;

use crate::park::storable;

pub use discard::DiscardError;
pub use redrive::{RedriveError, RedriveRequest, Redriven};
pub use release::ReleaseError;

/// Writes an operator's action to `operator_log`.
pub(crate) async fn record_action(
    tx: &mut PgConnection,
    actor: &str,
    action: &str,
    target: &str,
    reason: &str,
    detail: &Value,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO operator_log (actor, action, target, reason, detail) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(storable(actor))
    .bind(action)
    .bind(storable(target))
    .bind(storable(reason))
    .bind(detail)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
