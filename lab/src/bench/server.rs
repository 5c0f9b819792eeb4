//! The database server's own speed, taken once before a run: a round trip and a durable commit.
//!
//! Two machines of the same size and CPU gave end-to-end latencies 1.8× apart with the same code, and
//! the CPU yardstick did not tell them apart. Every event crosses several synchronous commits on its
//! way (the order's, the relay's journal record, each projection's batch), so how long the server
//! takes to make a commit durable — the disk's flush, mostly — belongs beside the yardstick in every
//! report. Measured on a database of its own, removed afterwards, with nothing else of the run going.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use testkit::stats::quantile;

use crate::demo::services::Services;

const DATABASE: &str = "waybill_bench_server";
/// Statements timed per figure, one after the other.
const SAMPLES: usize = 300;

/// The server's round trip and durable commit, µs.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ServerFigures {
    /// `SELECT 1`, median: the client, the connection and the server's statement path.
    pub round_trip_us: u64,
    /// A one-row insert committed with `synchronous_commit = on`, its own transaction: median and p90.
    pub commit_us: u64,
    pub commit_p90_us: u64,
}

impl ServerFigures {
    /// `round trip 95 µs, durable commit 310 µs (p90 420)`.
    pub(super) fn line(&self) -> String {
        format!(
            "round trip {} µs, durable commit {} µs (p90 {})",
            self.round_trip_us, self.commit_us, self.commit_p90_us
        )
    }
}

/// Measures on a fresh database of its own, then drops it.
pub(super) async fn measure(services: &Services) -> anyhow::Result<ServerFigures> {
    let url = services.database_url(DATABASE);
    crate::demo::drop_database(services, DATABASE).await?;
    ops::database::ensure_database(&url)
        .await
        .context("creating the database of the server's probe")?;
    let pool = ops::database::connect(&url, "waybill-bench", 1).await?;
    let figures = probe(&pool).await;
    pool.close().await;
    crate::demo::drop_database(services, DATABASE).await?;
    figures
}

async fn probe(pool: &PgPool) -> anyhow::Result<ServerFigures> {
    let mut connection = pool.acquire().await?;
    sqlx::query("SET synchronous_commit = on")
        .execute(&mut *connection)
        .await?;
    sqlx::query("CREATE TABLE commit_probe (n int4 NOT NULL)")
        .execute(&mut *connection)
        .await?;
    let mut round_trips = Vec::with_capacity(SAMPLES);
    let mut commits = Vec::with_capacity(SAMPLES);
    for n in 0..SAMPLES {
        let started = Instant::now();
        sqlx::query("SELECT 1").execute(&mut *connection).await?;
        round_trips.push(micros(started.elapsed()));
        let started = Instant::now();
        sqlx::query("INSERT INTO commit_probe VALUES ($1)")
            .bind(i32::try_from(n).unwrap_or(i32::MAX))
            .execute(&mut *connection)
            .await?;
        commits.push(micros(started.elapsed()));
    }
    round_trips.sort_unstable();
    commits.sort_unstable();
    Ok(ServerFigures {
        round_trip_us: quantile(&round_trips, 0.5),
        commit_us: quantile(&commits, 0.5),
        commit_p90_us: quantile(&commits, 0.9),
    })
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}
