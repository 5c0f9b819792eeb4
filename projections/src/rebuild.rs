//! Rebuilds, blue/green: the new state is built in its own schema (`<name>_next`) by its own consumer
//! (`<name>_rebuild`), started as every new consumer is (`catch_up.rs`): from the event store's
//! history, then the stream after it. Readers keep the old state meanwhile. Once it has caught up,
//! one transaction carries the operators' decisions over (`discards.rs`), puts the new state in the
//! old one's place and records where the live consumers must continue — every partition's
//! (`<name>-p<K>of<P>`, all P of them whichever this instance owns), since the rebuilt state holds
//! every partition's orders. Only after that commit are the consumers moved (`handover.rs`); a move
//! that a crash or a JetStream error interrupts is completed by the next `run`. A rebuild that fails
//! before the commit leaves the old state and consumers untouched; the next rebuild starts afresh.

use std::sync::Arc;

use async_nats::jetstream::consumer::DeliverPolicy;

use crate::consume::RunError;
use crate::consumer::BrokerError;
use crate::handover::{self, HandoverError};
use crate::projection::Projection;
use crate::runner::Runner;
use crate::schema::{self, SchemaError};
use crate::tally::Tally;

/// Why a rebuild or a reset failed. A failed rebuild leaves the old state and consumers in place (but
/// see [`RebuildError::Handover`]).
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// A schema could not be dropped, created or swapped.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// The stream or a consumer was unavailable.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// No connection to drop what an earlier rebuild left.
    #[error("clearing the leftovers of an earlier rebuild")]
    Leftovers(#[source] sqlx::Error),
    /// Building the new state failed, or there was no whole history to build it from; the old state
    /// and its consumers are untouched.
    #[error("building the new state in schema {schema}; the live state is unchanged")]
    Build {
        /// The new state's schema.
        schema: String,
        #[source]
        source: RunError,
    },
    /// The swap's transaction could not start, take the projection's turn, carry the operators'
    /// decisions over or record the handover; nothing changed.
    #[error("swapping the rebuilt state in")]
    Swap(#[source] sqlx::Error),
    /// The swap did not commit; nothing changed.
    #[error("committing the swap; the live state is unchanged")]
    CommitSwap(#[source] sqlx::Error),
    /// The rebuilt state is in place, but moving the live consumers behind it failed: `run` (at its
    /// start, or within seconds if it runs) completes the move.
    #[error(
        "the rebuilt state is in place, but moving the live consumers behind it failed; every \
         `run` of the projection completes the move (at its start, or within seconds if running)"
    )]
    Handover(#[source] HandoverError),
    /// The fail point stopped the rebuild before the swap.
    #[cfg(feature = "fault-injection")]
    #[error("fail point: the rebuild stops before the swap")]
    FailPoint,
    #[error("resetting the projection's state")]
    Reset(#[source] sqlx::Error),
}

impl<P: Projection> Runner<P> {
    /// Builds the projection's state anew beside the old one and swaps it in when caught up.
    pub async fn rebuild(
        &self,
        progress: impl FnMut(&Tally) + Send,
    ) -> Result<Tally, RebuildError> {
        let next_schema = format!("{}_next", P::NAME);
        let next_consumer = format!("{}_rebuild", P::NAME);
        // Leftovers of a rebuild that failed or was stopped: start afresh.
        self.delete_consumer(&next_consumer).await?;
        {
            let mut conn = self.pool.acquire().await.map_err(RebuildError::Leftovers)?;
            schema::drop(&mut conn, &next_schema).await?;
        }
        let builder = Runner {
            projection: Arc::clone(&self.projection),
            pool: schema::connect(&self.database_url, &next_schema, P::TABLES).await?,
            jetstream: self.jetstream.clone(),
            client: self.client.clone(),
            // One consumer builds every partition's orders.
            config: crate::runner::RunnerConfig {
                partitions: crate::partition::Partitions::single(),
                share: false,
                ..self.config.clone()
            },
            owned: Arc::new(tokio::sync::watch::Sender::new([0].into())),
            upcasters: self.upcasters.clone(),
            database_url: self.database_url.clone(),
            schema: next_schema.clone(),
            consumer_name: next_consumer.clone(),
            instance: self.instance.clone(),
        };
        tracing::info!(
            projection = P::NAME,
            schema = %next_schema,
            consumer = %next_consumer,
            "rebuilding beside the live state"
        );
        // A missing consumer starts from the event store's history (or refuses to start when neither
        // the store nor the stream holds all of it), then the stream after it, to the end.
        let tally = builder
            .run(std::future::pending(), true, progress)
            .await
            .map_err(|source| RebuildError::Build {
                schema: next_schema.clone(),
                source,
            })?;
        let info = builder
            .consumer_info(&next_consumer)
            .await?
            .ok_or_else(|| BrokerError::ConsumerGone {
                consumer: next_consumer.clone(),
            })?;
        // The new state holds everything up to where its consumer started (the catch-up's handover)
        // and everything acknowledged since; the ack floor stays 0 until a new consumer's first ack.
        let started_after = match info.config.deliver_policy {
            DeliverPolicy::ByStartSequence { start_sequence } => start_sequence.saturating_sub(1),
            _ => 0,
        };
        let consumed_through = info.ack_floor.stream_sequence.max(started_after);
        builder.pool.close().await;
        #[cfg(feature = "fault-injection")]
        if self.config.fail_point == crate::runner::FailPoint::FailBeforeSwap {
            return Err(RebuildError::FailPoint);
        }

        // A live schema of an older layout has no operator log or discards in today's shape to keep.
        let carry = schema::check_layout(&self.pool, P::NAME).await.is_ok();
        let consumers: Vec<String> = (0..self.config.partitions.count())
            .map(|partition| self.partition_consumer(partition))
            .collect();
        let mut tx = self.pool.begin().await.map_err(RebuildError::Swap)?;
        // Live batches wait for the swap; one already under way finishes on the old state first.
        self.lock(&mut tx).await.map_err(RebuildError::Swap)?;
        if carry {
            let carried = crate::discards::carry_over(&mut tx, P::NAME, &next_schema)
                .await
                .map_err(RebuildError::Swap)?;
            tracing::info!(
                projection = P::NAME,
                log_entries = carried.log_entries,
                discards_honoured = carried.honoured,
                discards_kept = carried.kept,
                "carried the operators' decisions over"
            );
        }
        schema::replace(&mut tx, &next_schema, P::NAME).await?;
        handover::record(&mut tx, P::NAME, &consumers, consumed_through + 1)
            .await
            .map_err(RebuildError::Swap)?;
        // Nothing has moved on the broker yet: a failed commit changes nothing.
        tx.commit().await.map_err(RebuildError::CommitSwap)?;
        #[cfg(feature = "fault-injection")]
        if self.config.fail_point == crate::runner::FailPoint::AbortAfterSwap {
            tracing::warn!("fail point: aborting after the swap, before moving any consumer");
            std::process::abort();
        }
        tracing::info!(
            projection = P::NAME,
            consumed_through,
            applied = tally.applied,
            from_store = tally.from_store,
            "rebuilt state swapped in; moving the live consumers behind it"
        );
        self.complete_handovers()
            .await
            .map_err(RebuildError::Handover)?;
        self.delete_consumer(&next_consumer).await?;
        Ok(tally)
    }

    /// Wipes the projection's state (its schema recreated empty) and deletes its consumer, so the next
    /// run starts as a first one (from the event store's history, or the stream's first message). Readers see an empty model meanwhile: `rebuild`
    /// is the way for a live projection; this is for benchmarks and tests.
    pub async fn reset(&self) -> Result<(), RebuildError> {
        let mut tx = self.pool.begin().await.map_err(RebuildError::Reset)?;
        self.lock(&mut tx).await.map_err(RebuildError::Reset)?;
        // The consumer goes first: if the wipe then fails, the state is replayed onto itself (the
        // checkpoints absorb it); the other way round, an empty state would resume mid-stream.
        for partition in 0..self.config.partitions.count() {
            self.delete_consumer(&self.partition_consumer(partition))
                .await?;
        }
        schema::reset(&mut tx, &self.schema, P::TABLES).await?;
        tx.commit().await.map_err(RebuildError::Reset)?;
        Ok(())
    }
}
