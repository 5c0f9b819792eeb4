//! Rebuilds, blue/green: the new state is built from the start of the stream in its own schema
//! (`<name>_next`) by its own consumer (`<name>_rebuild`), while readers keep the old state. Once it
//! has caught up, one transaction puts it in the old one's place, and the live consumer is recreated to
//! continue right after the last message the rebuild consumed. A rebuild that fails or is stopped
//! leaves the old state and consumer untouched; the next rebuild starts afresh.

use anyhow::Context;
use async_nats::jetstream::consumer::{DeliverPolicy, PullConsumer};
use std::sync::Arc;

use crate::projection::Projection;
use crate::runner::{Runner, Tally, is_not_found};
use crate::schema;

impl<P: Projection> Runner<P> {
    /// Builds the projection's state anew beside the old one and swaps it in when caught up.
    pub async fn rebuild(&self, progress: impl FnMut(&Tally) + Send) -> anyhow::Result<Tally> {
        let next_schema = format!("{}_next", P::NAME);
        let next_consumer = format!("{}_rebuild", P::NAME);
        // Leftovers of a rebuild that failed or was stopped: start afresh.
        self.delete_consumer(&next_consumer).await?;
        {
            let mut conn = self.pool.acquire().await?;
            schema::drop(&mut conn, &next_schema).await?;
        }
        let builder = Runner {
            projection: Arc::clone(&self.projection),
            pool: schema::connect(&self.database_url, &next_schema, P::TABLES).await?,
            jetstream: self.jetstream.clone(),
            client: self.client.clone(),
            config: self.config.clone(),
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
        let tally = builder.run(std::future::pending(), true, progress).await?;
        let mut consumer: PullConsumer = self
            .jetstream
            .get_stream(&self.config.stream)
            .await?
            .get_consumer(&next_consumer)
            .await
            .map_err(|e| anyhow::anyhow!("consumer {next_consumer}: {e}"))?;
        let info = consumer.info().await?;
        // Everything up to the ack floor is in the new state; the live consumer continues after it.
        let consumed_through = info.ack_floor.stream_sequence;
        builder.pool.close().await;
        #[cfg(feature = "fault-injection")]
        if self.config.fail_point == crate::runner::FailPoint::FailBeforeSwap {
            anyhow::bail!("fail point: the rebuild stops before the swap");
        }

        let mut tx = self.pool.begin().await?;
        // Live batches wait for the swap; one already under way finishes on the old state first.
        self.lock(&mut tx).await?;
        schema::replace(&mut tx, &next_schema, P::NAME).await?;
        let stream = self.jetstream.get_stream(&self.config.stream).await?;
        let config = self.consumer_config(DeliverPolicy::ByStartSequence {
            start_sequence: consumed_through + 1,
        });
        // A live `run` whose consumer just vanished recreates it (from the stream's start) as soon as
        // it notices: if it wins the race, delete its consumer and try again.
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.delete_consumer(&self.consumer_name).await?;
            match stream.create_consumer(config.clone()).await {
                Ok(_) => break,
                Err(error) if attempt < 3 => {
                    tracing::warn!(%error, attempt, consumer = %self.consumer_name, "recreating the live consumer failed; retrying");
                }
                Err(error) => {
                    return Err(anyhow::Error::new(error).context(format!(
                        "recreating consumer {} from stream sequence {}; the old state stays (rerun `rebuild`)",
                        self.consumer_name,
                        consumed_through + 1
                    )));
                }
            }
        }
        if let Err(error) = tx.commit().await {
            // The consumer now starts after the rebuild, but the old state stayed: events in between
            // would be missing. Say so loudly; a second rebuild repairs it.
            tracing::error!(%error, projection = P::NAME, "the swap did not commit after the consumer moved; run `rebuild` again");
            return Err(error).context("committing the swap");
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
    pub async fn reset(&self) -> anyhow::Result<()> {
        let mut tx = self.pool.begin().await?;
        self.lock(&mut tx).await?;
        // The consumer goes first: if the wipe then fails, the state is replayed onto itself (the
        // checkpoints absorb it); the other way round, an empty state would resume mid-stream.
        self.delete_consumer(&self.consumer_name).await?;
        schema::reset(&mut tx, &self.schema, P::TABLES).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn delete_consumer(&self, name: &str) -> anyhow::Result<()> {
        let stream = self.jetstream.get_stream(&self.config.stream).await?;
        match stream.delete_consumer(name).await {
            Ok(_) => {
                tracing::info!(consumer = name, "deleted consumer");
                Ok(())
            }
            Err(error) if is_not_found(&error) => Ok(()),
            Err(error) => Err(anyhow::anyhow!("deleting consumer {name}: {error}")),
        }
    }
}
