//! A debounced "new outbox rows" hint for relays.
//!
//! `NOTIFY` takes a cluster-wide lock when its transaction commits (measured here: 16 writers fell from
//! 7.8k to 2.9k commits/s with a NOTIFY in every transaction). So writers never notify inside their own
//! transaction: they poke this notifier, which sends at most one `pg_notify` per interval from its own
//! connection. Relays treat it as a hint only and keep polling, because a listener that is reconnecting
//! misses notifications.

use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;

/// The channel relays `LISTEN` on.
pub const OUTBOX_CHANNEL: &str = "waybill_outbox";

/// A cheap, cloneable handle that coalesces pokes into occasional notifications.
#[derive(Debug, Clone)]
pub struct OutboxNotifier {
    pokes: mpsc::Sender<()>,
}

impl OutboxNotifier {
    /// Starts the background task; it ends when the last handle is dropped.
    pub fn spawn(pool: PgPool, min_interval: Duration) -> Self {
        // Capacity one: a poke while one is already queued is absorbed, which is the debounce.
        let (pokes, mut rx) = mpsc::channel::<()>(1);
        tokio::spawn(async move {
            while rx.recv().await.is_some() {
                if let Err(error) = notify_now(&pool).await {
                    // A lost hint only delays the relay until its next poll; not worth more than debug.
                    tracing::debug!(%error, "outbox notification failed");
                }
                tokio::time::sleep(min_interval).await;
            }
        });
        Self { pokes }
    }

    /// Signals that new outbox rows were committed. Never blocks.
    pub fn poke(&self) {
        let _ = self.pokes.try_send(());
    }
}

/// Sends one notification right away (for one-shot processes such as the CLI).
pub async fn notify_now(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(OUTBOX_CHANNEL)
        .execute(pool)
        .await
        .map(|_| ())
}
