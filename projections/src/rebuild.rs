//! Rebuilds, blue/green: the new state is built from the start of the stream in its own schema
//! (`<name>_next`) by its own consumer (`<name>_rebuild`), while readers keep the old state. Once it
//! has caught up, one transaction puts it in the old one's place, and the live consumer is recreated to
//! continue right after the last message the rebuild consumed — with several partitions, every
//! partition's consumer (`<name>-p<K>of<P>`, all P of them whichever this instance owns), since the
//! rebuilt state holds every partition's orders. A rebuild that fails or is stopped
//! leaves the old state and consumer untouched; the next rebuild starts afresh.

use std::sync::Arc;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::stream::ConsumerError;

use crate::consume::RunError;
use crate::consumer::BrokerError;
use crate::projection::Projection;
use crate::runner::{Runner, Tally};
use crate::schema::{self, SchemaError};

/// Why a rebuild or a reset failed. A failed rebuild leaves the old state and consumer in place (but
/// see [`RebuildError::CommitSwap`]).
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
    /// Consuming the stream into the new state failed.
    #[error("building the new state in schema {schema}")]
    Build {
        /// The new state's schema.
        schema: String,
        #[source]
        source: RunError,
    },
    /// The swap's transaction could not start or take the projection's turn.
    #[error("swapping the rebuilt state in")]
    Swap(#[source] sqlx::Error),
    /// The live consumer could not be recreated behind the rebuilt state.
    #[error(
        "recreating consumer {consumer} from stream sequence {start_sequence}; the old state stays \
         (rerun `rebuild`)"
    )]
    RecreateConsumer {
        /// The live consumer.
        consumer: String,
        /// Where it was to start.
        start_sequence: u64,
        #[source]
        source: ConsumerError,
    },
    /// The swap did not commit after the live consumer had moved: events in between are missing
    /// from the old state until the next rebuild.
    #[error("committing the swap; run `rebuild` again")]
    CommitSwap(#[source] sqlx::Error),
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
                ..self.config.clone()
            },
            upcasters: self.upcasters.clone(),
            database_url: self.database_url.clone(),
            schema: next_schema.clone(),
            consumer_name: next_consumer.clone(),
        };
        tracing::info!(
            projection = P::NAME,
            schema = %next_schema,
            consumer = %next_consumer,
            "rebuilding beside the live state"
        );
        let tally = builder
            .run(std::future::pending(), true, progress)
            .await
            .map_err(|source| RebuildError::Build {
                schema: next_schema.clone(),
                source,
            })?;
        let mut consumer = self.existing_consumer(&next_consumer).await?;
        let info = consumer
            .info()
            .await
            .map_err(|source| BrokerError::ConsumerInfo {
                consumer: next_consumer.clone(),
                source,
            })?;
        // Everything up to the ack floor is in the new state; the live consumer continues after it.
        let consumed_through = info.ack_floor.stream_sequence;
        builder.pool.close().await;
        #[cfg(feature = "fault-injection")]
        if self.config.fail_point == crate::runner::FailPoint::FailBeforeSwap {
            return Err(RebuildError::FailPoint);
        }

        let mut tx = self.pool.begin().await.map_err(RebuildError::Swap)?;
        // Live batches wait for the swap; one already under way finishes on the old state first.
        self.lock(&mut tx).await.map_err(RebuildError::Swap)?;
        schema::replace(&mut tx, &next_schema, P::NAME).await?;
        let stream = self.stream().await?;
        for partition in 0..self.config.partitions.count() {
            let name = self.partition_consumer(partition);
            let config = self.consumer_config(
                &name,
                DeliverPolicy::ByStartSequence {
                    start_sequence: consumed_through + 1,
                },
            );
            // A live `run` whose consumer just vanished recreates it (from the stream's start) as
            // soon as it notices: if it wins the race, delete its consumer and try again.
            let mut attempt = 0;
            loop {
                attempt += 1;
                self.delete_consumer(&name).await?;
                match stream.create_consumer(config.clone()).await {
                    Ok(_) => break,
                    Err(error) if attempt < 3 => {
                        tracing::warn!(
                            error = %ops::error_chain(&error),
                            attempt,
                            consumer = %name,
                            "recreating the live consumer failed; retrying"
                        );
                    }
                    Err(source) => {
                        return Err(RebuildError::RecreateConsumer {
                            consumer: name,
                            start_sequence: consumed_through + 1,
                            source,
                        });
                    }
                }
            }
        }
        if let Err(error) = tx.commit().await {
            // The consumer now starts after the rebuild, but the old state stayed: events in between
            // would be missing. Say so loudly; a second rebuild repairs it.
            tracing::error!(
                error = %ops::error_chain(&error),
                projection = P::NAME,
                "the swap did not commit after the consumer moved; run `rebuild` again"
            );
            return Err(RebuildError::CommitSwap(error));
        }
        self.delete_consumer(&next_consumer).await?;
        tracing::info!(
            projection = P::NAME,
            consumed_through,
            applied = tally.applied,
            "rebuilt state swapped in"
        );
        Ok(tally)
    }

    /// Wipes the projection's state (its schema recreated empty) and deletes its consumer, so the next
    /// run starts from the beginning of the stream. Readers see an empty model meanwhile: `rebuild`
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
