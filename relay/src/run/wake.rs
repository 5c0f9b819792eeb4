//! The outbox notification listener that wakes idle lanes (polling is the backstop).

use std::sync::Arc;
use std::time::Duration;

use ops::error_chain;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;

/// Wakes the loop on every outbox notification; on a lost connection, wakes it too (notifications
/// may have been missed) and reconnects.
pub(super) async fn listen(pool: PgPool, wakes: Vec<Arc<Notify>>) {
    let wake_all = || wakes.iter().for_each(|w| w.notify_one());
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                if let Err(error) = listener.listen(store::OUTBOX_CHANNEL).await {
                    tracing::warn!(error = %error_chain(&error), "LISTEN failed; relying on polling");
                } else {
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(_)) => wake_all(),
                            Ok(None) => {
                                tracing::debug!("notification connection lost; reconnecting");
                                wake_all();
                            }
                            Err(error) => {
                                tracing::warn!(error = %error_chain(&error), "notification listener failed; relying on polling");
                                break;
                            }
                        }
                    }
                }
            }
            Err(error) => {
                tracing::warn!(error = %error_chain(&error), "cannot open the notification listener; relying on polling")
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
