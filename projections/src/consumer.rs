//! The projection's durable JetStream consumers — one, named after the projection, or one per owned
//! partition (`<name>-p<K>of<P>`, each over the whole stream: see `partition.rs`): created when
//! missing (and refused when an existing one would deliver something else), measured for lag, deleted
//! and recreated by rebuilds.

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::{ConsumerInfoError, GetStreamError, RequestError};
use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
use async_nats::jetstream::{ErrorCode, stream};

use crate::projection::Projection;
use crate::runner::Runner;

/// Why the broker could not give a projection its stream or consumer.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The stream does not exist or the broker did not answer.
    #[error("opening stream {stream} (waybill-relay creates it)")]
    Stream {
        stream: String,
        #[source]
        source: GetStreamError,
    },
    #[error("reading the state of stream {stream}")]
    StreamInfo {
        stream: String,
        #[source]
        source: RequestError,
    },
    #[error("creating consumer {consumer}")]
    CreateConsumer {
        consumer: String,
        #[source]
        source: ConsumerError,
    },
    #[error("opening consumer {consumer}")]
    OpenConsumer {
        consumer: String,
        #[source]
        source: async_nats::Error,
    },
    #[error("reading the state of consumer {consumer}")]
    ConsumerInfo {
        consumer: String,
        #[source]
        source: ConsumerInfoError,
    },
    /// An existing consumer delivers other subjects or is acknowledged otherwise than the projection
    /// needs: consuming through it would skip or lose events.
    #[error(
        "consumer {consumer} exists with filter {actual_filter:?} and ack policy {actual_ack:?}, but the \
         projection needs {wanted_filter:?} and {wanted_ack:?}; delete it or run `rebuild`"
    )]
    ConsumerMismatch {
        consumer: String,
        /// Its filter subject.
        actual_filter: String,
        /// Its ack policy.
        actual_ack: AckPolicy,
        /// The filter subject the projection needs.
        wanted_filter: String,
        /// The ack policy the projection needs.
        wanted_ack: AckPolicy,
    },
    #[error("opening the message stream of consumer {consumer}")]
    Messages {
        consumer: String,
        #[source]
        source: async_nats::jetstream::consumer::StreamError,
    },
    #[error("deleting consumer {consumer}")]
    DeleteConsumer {
        consumer: String,
        #[source]
        source: ConsumerError,
    },
}

impl<P: Projection> Runner<P> {
    /// The durable consumer of `partition`.
    pub(crate) fn partition_consumer(&self, partition: u32) -> String {
        self.config
            .partitions
            .consumer_name(&self.consumer_name, partition)
    }

    pub(crate) fn consumer_config(
        &self,
        name: &str,
        deliver_policy: DeliverPolicy,
    ) -> pull::Config {
        let partitions = &self.config.partitions;
        let description = if partitions.is_single() {
            format!("waybill {} projection", P::NAME)
        } else {
            format!(
                "waybill {} projection, one of {} partitions",
                P::NAME,
                partitions.count()
            )
        };
        pull::Config {
            durable_name: Some(name.to_owned()),
            description: Some(description),
            deliver_policy,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.config.ack_wait,
            max_ack_pending: self.config.max_ack_pending,
            filter_subject: domain::wire::all_subjects(&self.config.subject_prefix),
            ..Default::default()
        }
    }

    pub(crate) async fn stream(&self) -> Result<stream::Stream, BrokerError> {
        self.jetstream
            .get_stream(&self.config.stream)
            .await
            .map_err(|source| BrokerError::Stream {
                stream: self.config.stream.clone(),
                source,
            })
    }

    /// The projection's durable consumer (its first owned partition's), created when missing. An
    /// existing one with another filter or ack policy is refused with the difference named.
    pub async fn consumer(&self) -> Result<PullConsumer, BrokerError> {
        let first = self.config.partitions.owned()[0];
        self.consumer_of(&self.partition_consumer(first)).await
    }

    /// Durable consumer `name`, created when missing, checked as [`Runner::consumer`] says.
    pub(crate) async fn consumer_of(&self, name: &str) -> Result<PullConsumer, BrokerError> {
        let wanted = self.consumer_config(name, DeliverPolicy::All);
        let mut consumer: PullConsumer = self
            .stream()
            .await?
            .get_or_create_consumer(name, wanted.clone())
            .await
            .map_err(|source| BrokerError::CreateConsumer {
                consumer: name.to_owned(),
                source,
            })?;
        let actual = consumer
            .info()
            .await
            .map_err(|source| BrokerError::ConsumerInfo {
                consumer: name.to_owned(),
                source,
            })?
            .config
            .clone();
        if actual.filter_subject != wanted.filter_subject || actual.ack_policy != wanted.ack_policy
        {
            return Err(BrokerError::ConsumerMismatch {
                consumer: name.to_owned(),
                actual_filter: actual.filter_subject,
                actual_ack: actual.ack_policy,
                wanted_filter: wanted.filter_subject,
                wanted_ack: wanted.ack_policy,
            });
        }
        if actual.ack_wait != wanted.ack_wait || actual.max_ack_pending != wanted.max_ack_pending {
            tracing::warn!(
                consumer = name,
                ack_wait = ?actual.ack_wait,
                max_ack_pending = actual.max_ack_pending,
                "the existing consumer keeps its own ack wait and ack-pending limit; `rebuild` recreates it with the new ones"
            );
        }
        Ok(consumer)
    }

    /// An existing consumer `name` on the stream.
    pub(crate) async fn existing_consumer(&self, name: &str) -> Result<PullConsumer, BrokerError> {
        self.stream()
            .await?
            .get_consumer(name)
            .await
            .map_err(|source| BrokerError::OpenConsumer {
                consumer: name.to_owned(),
                source,
            })
    }

    /// Messages in the stream not yet delivered to the consumer, and delivered but not acknowledged:
    /// summed over the owned partitions' consumers.
    pub async fn lag(&self) -> Result<(u64, u64), BrokerError> {
        let mut total = (0, 0);
        for &partition in self.config.partitions.owned() {
            let (pending, ack_pending) = self.lag_of(&self.partition_consumer(partition)).await?;
            total.0 += pending;
            total.1 += ack_pending;
        }
        Ok(total)
    }

    /// [`Runner::lag`] of one consumer.
    pub(crate) async fn lag_of(&self, name: &str) -> Result<(u64, u64), BrokerError> {
        let mut consumer = self.existing_consumer(name).await?;
        let info = consumer
            .info()
            .await
            .map_err(|source| BrokerError::ConsumerInfo {
                consumer: name.to_owned(),
                source,
            })?;
        Ok((info.num_pending, info.num_ack_pending as u64))
    }

    /// How many messages the stream holds (a rebuild's total).
    pub async fn stream_messages(&self) -> Result<u64, BrokerError> {
        let mut stream = self.stream().await?;
        let info = stream
            .info()
            .await
            .map_err(|source| BrokerError::StreamInfo {
                stream: self.config.stream.clone(),
                source,
            })?;
        Ok(info.state.messages)
    }

    /// Deletes consumer `name`; one that does not exist is fine.
    pub(crate) async fn delete_consumer(&self, name: &str) -> Result<(), BrokerError> {
        match self.stream().await?.delete_consumer(name).await {
            Ok(_) => {
                tracing::info!(consumer = name, "deleted consumer");
                Ok(())
            }
            Err(error) if is_not_found(&error) => Ok(()),
            Err(source) => Err(BrokerError::DeleteConsumer {
                consumer: name.to_owned(),
                source,
            }),
        }
    }
}

fn is_not_found(error: &ConsumerError) -> bool {
    matches!(error.kind(), ConsumerErrorKind::JetStream(e) if e.error_code() == ErrorCode::CONSUMER_NOT_FOUND)
}
