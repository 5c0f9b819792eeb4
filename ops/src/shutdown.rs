//! The shutdown future handed to every long-running `run`: Ctrl-C or SIGTERM, whichever comes first.
//!
//! The signals are listened for once per process, from the first call on, and remembered: a shutdown
//! future made (or first polled) after the signal came resolves at once. Listening afresh in each
//! future lost a SIGTERM that arrived while a projection was still starting (its read API's future
//! saw it, its runner's, made later, never did), and the process ran on until it was killed.

use std::future::Future;
use std::sync::OnceLock;

use tokio::sync::watch;

/// Whether a stop was asked for, set by the one listener of the process.
static STOP: OnceLock<watch::Receiver<bool>> = OnceLock::new();

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, including one that came before this call (after the
/// process's first call). Must be called inside a tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    let mut stop = STOP.get_or_init(listen).clone();
    async move {
        if stop.wait_for(|stop| *stop).await.is_err() {
            // The listener's runtime has ended (a test's runtime, in a process that runs several):
            // listen for this future alone.
            signal().await;
        }
    }
}

/// Starts the process's listener; its receiver says when a signal came.
fn listen() -> watch::Receiver<bool> {
    let (tell, stop) = watch::channel(false);
    let signal = signal();
    tokio::spawn(async move {
        signal.await;
        let _ = tell.send(true);
        // Kept until the runtime ends, so that later futures see `true`, not a closed channel.
        std::future::pending::<()>().await;
    });
    stop
}

/// Ctrl-C or SIGTERM, listened for from this call on.
fn signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        // Registered now, not when first polled: a signal between now and then is kept.
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            let interrupt = async {
                match interrupt {
                    Ok(mut stream) => stream.recv().await,
                    Err(error) => {
                        tracing::warn!(%error, "cannot listen for Ctrl-C");
                        std::future::pending().await
                    }
                }
            };
            let terminate = async {
                match terminate {
                    Ok(mut stream) => stream.recv().await,
                    Err(error) => {
                        tracing::warn!(%error, "cannot listen for SIGTERM");
                        std::future::pending().await
                    }
                }
            };
            tokio::select! {
                _ = interrupt => tracing::info!("Ctrl-C received, stopping"),
                _ = terminate => tracing::info!("SIGTERM received, stopping"),
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("Ctrl-C received, stopping");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A SIGTERM that came before a shutdown future was made still stops it: the case of a process
    /// whose runner starts after the signal.
    #[tokio::test]
    async fn a_signal_before_the_future_is_made_still_stops_it() {
        let first = shutdown_signal();
        // To this very process: its listener (installed by `first`) keeps it alive.
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success());
        tokio::time::timeout(Duration::from_secs(5), first)
            .await
            .expect("the first future resolves");
        let later = shutdown_signal();
        tokio::time::timeout(Duration::from_secs(1), later)
            .await
            .expect("a future made after the signal resolves at once");
    }
}
