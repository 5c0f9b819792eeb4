//! The load: order lifecycles started at a steady rate against the order service over HTTP, every
//! command under its own `Idempotency-Key` and retried with that same key on a 5xx, a timeout or a
//! refused connection — what a careful client does while the service or its database restarts. What
//! the service accepted is recorded (with the event id it answered) for the verdict.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::watch::Clock;
use crate::http::{self, Answer, Http, Orders};

const SKUS: [(&str, i64); 8] = [
    ("MUG-BLUE", 1250),
    ("MUG-RED", 1250),
    ("TEA-GREEN", 500),
    ("TEA-BLACK", 450),
    ("LAMP", 4900),
    ("BOOK", 1999),
    ("PEN", 199),
    ("DESK", 24900),
];
/// Lifecycles in flight at most: when the service is down, ticks beyond this are skipped (counted).
const MAX_IN_FLIGHT: usize = 512;
/// How long after the load ends a command keeps being retried before its lifecycle is abandoned.
const GRACE: Duration = Duration::from_secs(90);

/// A command the service accepted (2xx).
#[derive(Debug, Clone)]
pub(super) struct Accepted {
    /// `place`, `pay`, `ship` or `cancel`.
    pub command: &'static str,
    pub order_id: Uuid,
    /// The first event the service said the command recorded (its `Event-Id` header).
    pub event_id: Uuid,
}

/// What the load did.
#[derive(Debug, Default)]
pub(super) struct Played {
    /// Lifecycles started.
    pub lifecycles: usize,
    /// Every accepted command.
    pub accepted: Vec<Accepted>,
    /// Attempts retried (5xx, timeout, connection refused).
    pub retries: u64,
    /// Retries answered as a replay (`Idempotent-Replayed: true`): the first attempt had been written.
    pub replayed: u64,
    /// Lifecycles given up because a command was still failing long after the load ended.
    pub abandoned: usize,
    /// Ticks skipped because too many lifecycles were in flight.
    pub throttled: u64,
    /// Answers that a correct service never gives to these commands (a 4xx to a well-formed command
    /// of a valid lifecycle, first attempt or retry): each is a violation.
    pub unexpected: Vec<String>,
}

/// The load generator while it runs: its workers and what they have recorded so far.
#[derive(Debug)]
pub(super) struct Load {
    task: tokio::task::JoinHandle<()>,
    played: Arc<Mutex<Played>>,
}

impl Load {
    /// Starts `rate` lifecycles per second for `duration`.
    pub(super) fn spawn(
        api: String,
        rate: f64,
        duration: Duration,
        seed: u64,
        clock: Clock,
    ) -> Self {
        let played = Arc::new(Mutex::new(Played::default()));
        let shared = played.clone();
        let task = tokio::spawn(async move {
            let orders = Orders::new(&api, Http::default());
            let deadline = duration + GRACE;
            let mut running = JoinSet::new();
            let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut i: u64 = 0;
            while clock.elapsed() < duration {
                ticker.tick().await;
                while running.try_join_next().is_some() {}
                if running.len() >= MAX_IN_FLIGHT {
                    lock(&shared).throttled += 1;
                    continue;
                }
                let lifecycle = Lifecycle {
                    orders: orders.clone(),
                    keys: format!("chaos-{seed}-{i}"),
                    rng: StdRng::seed_from_u64(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                    played: shared.clone(),
                    clock: clock.clone(),
                    deadline,
                };
                lock(&shared).lifecycles += 1;
                running.spawn(lifecycle.play());
                i += 1;
            }
            while running.join_next().await.is_some() {}
        });
        Self { task, played }
    }

    /// Waits for the lifecycles in flight to finish (or be abandoned) and returns what was played.
    pub(super) async fn finish(self) -> Played {
        let _ = self.task.await;
        std::mem::take(&mut *lock(&self.played))
    }
}

fn lock(played: &Mutex<Played>) -> std::sync::MutexGuard<'_, Played> {
    played.lock().unwrap_or_else(|e| e.into_inner())
}

/// One order's lifecycle: placed; then paid (three in four) and shipped, refunded or left paid, or
/// (one in four) cancelled unpaid or left placed.
struct Lifecycle {
    orders: Orders,
    keys: String,
    rng: StdRng,
    played: Arc<Mutex<Played>>,
    clock: Clock,
    deadline: Duration,
}

impl Lifecycle {
    async fn play(mut self) {
        if self.run().await.is_none() {
            lock(&self.played).abandoned += 1;
        }
    }

    async fn run(&mut self) -> Option<()> {
        let customer = format!("customer-{:02}", self.rng.random_range(1..=20));
        // Distinct SKUs: the domain wants a SKU's whole quantity on one line.
        let count = self.rng.random_range(1..=3);
        let lines: Vec<(&str, i64, i64)> = SKUS
            .choose_multiple(&mut self.rng, count)
            .map(|(sku, price)| (*sku, self.rng.random_range(1..=5), *price))
            .collect();
        let total: i64 = lines.iter().map(|(_, q, p)| q * p).sum();
        let body = http::place(
            &customer,
            Value::Array(
                lines
                    .iter()
                    .map(|(sku, quantity, price)| http::line(sku, *quantity, *price))
                    .collect(),
            ),
        );
        let order = self.command("place", "/orders".to_owned(), body).await?;
        let path = |action: &str| format!("/orders/{order}/{action}");
        if self.rng.random_bool(0.75) {
            let pay = http::pay(total, &format!("psp-{}", self.keys));
            self.command("pay", path("pay"), pay).await?;
            let next: f64 = self.rng.random();
            if next < 0.5 {
                let ship = http::ship("DHL", &format!("JD-{}", self.keys));
                self.command("ship", path("ship"), ship).await?;
            } else if next < 0.75 {
                let cancel = http::cancel("refund requested");
                self.command("cancel", path("cancel"), cancel).await?;
            }
        } else if self.rng.random_bool(0.5) {
            let cancel = http::cancel("changed my mind");
            self.command("cancel", path("cancel"), cancel).await?;
        }
        Some(())
    }

    /// Sends one command until the service answers it, retrying with the same key; returns the order
    /// id of an accepted command, `None` when it was refused or given up.
    async fn command(&mut self, name: &'static str, path: String, body: Value) -> Option<Uuid> {
        let key = format!("{}-{name}", self.keys);
        let mut delay = Duration::from_millis(100);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.orders.post(&path, &body, Some(&key)).await {
                Ok(answer) if answer.status.is_success() => {
                    if let Some(order) = self.accepted(name, &answer, attempt) {
                        return Some(order);
                    }
                    // Accepted, but the answer did not arrive whole: ask again under the same key.
                }
                Ok(answer) if !answer.status.is_server_error() => {
                    let text = answer.body.to_string();
                    self.unexpected(format!(
                        "{name} (key {key}, attempt {attempt}) answered {}: {}",
                        answer.status,
                        text.chars().take(300).collect::<String>()
                    ));
                    return None;
                }
                _ => {}
            }
            if self.clock.elapsed() > self.deadline {
                return None;
            }
            lock(&self.played).retries += 1;
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    fn accepted(&mut self, name: &'static str, answer: &Answer, attempt: u32) -> Option<Uuid> {
        let (Some(event_id), Some(order_id)) = (answer.event_id, answer.order_id()) else {
            tracing::warn!(
                command = name,
                "an accepted command's answer lacked its event id or order; asking again"
            );
            return None;
        };
        let mut played = lock(&self.played);
        if answer.replayed && attempt > 1 {
            played.replayed += 1;
        }
        played.accepted.push(Accepted {
            command: name,
            order_id,
            event_id,
        });
        Some(order_id)
    }

    fn unexpected(&self, what: String) {
        tracing::warn!(%what, "unexpected answer");
        lock(&self.played).unexpected.push(what);
    }
}
