//! The projection's durable JetStream consumers — one, named after the projection, or one per owned
//! partition (`<name>-p<K>of<P>`, each over the whole stream: see `partition.rs`): created where
//! `catch_up.rs` decides, checked when opened (every setting that would skip, lose or delay events is
//! named, and changed where the server allows it), measured for lag, deleted and recreated by
//! rebuilds.

use async_nats::jetstream::consumer::{
    self, AckPolicy, DeliverPolicy, FromConsumer, PullConsumer, pull,
};
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, GetStreamError, RequestError,
};
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
    /// An existing consumer would skip, lose or withhold events, in ways the server cannot change on
    /// an existing consumer (filter, ack, deliver or replay policy): consuming through it is refused.
    #[error(
        "consumer {consumer} exists with settings the projection cannot use: {}; delete it (the \
         projection then catches up from the event store and creates it anew) or run `rebuild`",
        .differences.join("; ")
    )]
    ConsumerMismatch {
        consumer: String,
        /// Every differing setting, in words (the ones the server could have changed too).
        differences: Vec<String>,
    },
    /// The server was asked to change an existing consumer's settings and refused.
    #[error("changing the settings of consumer {consumer} ({})", .differences.join("; "))]
    UpdateConsumer {
        consumer: String,
        /// What was to change.
        differences: Vec<String>,
        #[source]
        source: ConsumerError,
    },
    /// The server accepted a change of a consumer's settings but did not keep it.
    #[error("consumer {consumer} did not keep its new settings: {}", .differences.join("; "))]
    NotUpdated {
        consumer: String,
        /// What still differs.
        differences: Vec<String>,
    },
    #[error("opening the message stream of consumer {consumer}")]
    Messages {
        consumer: String,
        #[source]
        source: async_nats::jetstream::consumer::StreamError,
    },
    /// A consumer the runner had just used no longer exists.
    #[error("consumer {consumer} was deleted by someone else meanwhile")]
    ConsumerGone { consumer: String },
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

    /// The settings of consumer `name`, delivering from `deliver_policy` on.
    pub(crate) fn consumer_config(
        &self,
        name: &str,
        deliver_policy: DeliverPolicy,
    ) -> pull::Config {
        let partitions = &self.config.partitions;
        // Split by the server, each partition's consumer reads its own subjects only; any other
        // consumer of this runner (a rebuild's) reads the whole stream.
        let filter = (0..partitions.count())
            .find(|&k| self.partition_consumer(k) == name)
            .map_or_else(
                || domain::wire::all_subjects(&self.config.subject_prefix),
                |k| partitions.filter(&self.config.subject_prefix, k),
            );
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
            // Never give up on a message: one NAKed while the database is down must come back
            // however long the outage lasts (the runner parks poison itself, then terminates it).
            max_deliver: -1,
            max_ack_pending: self.config.max_ack_pending,
            filter_subject: filter,
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

    /// The stream's state now: its first and last sequence, how many messages it holds.
    pub(crate) async fn stream_state(&self) -> Result<stream::State, BrokerError> {
        let mut stream = self.stream().await?;
        let info = stream
            .info()
            .await
            .map_err(|source| BrokerError::StreamInfo {
                stream: self.config.stream.clone(),
                source,
            })?;
        Ok(info.state.clone())
    }

    /// Existing consumer `name`, checked against what the projection needs (`None`: there is none).
    /// A setting the server can change on an existing consumer (redelivery limit, ack wait,
    /// inactivity threshold, ack-pending limit, headers only, backoff, pull request limits) is
    /// changed, and each change logged; one it cannot (filter, ack, deliver or replay policy) is
    /// refused with every difference named.
    pub(crate) async fn open_consumer(
        &self,
        name: &str,
    ) -> Result<Option<PullConsumer>, BrokerError> {
        let Some(info) = self.consumer_info(name).await? else {
            return Ok(None);
        };
        let actual =
            pull::Config::try_from_consumer_config(info.config.clone()).map_err(|source| {
                BrokerError::OpenConsumer {
                    consumer: name.to_owned(),
                    source,
                }
            })?;
        let wanted = self.consumer_config(name, actual.deliver_policy);
        let found = differences(&actual, &wanted);
        if found.is_empty() {
            return self.existing_consumer(name).await.map(Some);
        }
        let described: Vec<String> = found.iter().map(ConsumerDifference::to_string).collect();
        if found.iter().any(|d| !d.updatable) {
            return Err(BrokerError::ConsumerMismatch {
                consumer: name.to_owned(),
                differences: described,
            });
        }
        tracing::warn!(
            consumer = name,
            changes = %described.join("; "),
            "the existing consumer had settings that could lose or delay events; changing them"
        );
        let mut updated: PullConsumer = self
            .stream()
            .await?
            // On nats-server 2.9 a create for an existing durable consumer updates it.
            .create_consumer(pull::Config {
                description: actual.description.clone(),
                ..wanted.clone()
            })
            .await
            .map_err(|source| BrokerError::UpdateConsumer {
                consumer: name.to_owned(),
                differences: described.clone(),
                source,
            })?;
        let kept = pull::Config::try_from_consumer_config(updated.cached_info().config.clone())
            .map_err(|source| BrokerError::OpenConsumer {
                consumer: name.to_owned(),
                source,
            })?;
        let left = differences(&kept, &wanted);
        if !left.is_empty() {
            return Err(BrokerError::NotUpdated {
                consumer: name.to_owned(),
                differences: left.iter().map(ConsumerDifference::to_string).collect(),
            });
        }
        // Refresh the handle's cached state, as a freshly opened consumer has it.
        let _ = updated.info().await;
        Ok(Some(updated))
    }

    /// Creates consumer `name` delivering from `deliver_policy` on, with `marker` appended to its
    /// description (a rebuild's handover names itself there). If another process created it
    /// meanwhile, that one is opened and checked instead.
    pub(crate) async fn create_consumer_at(
        &self,
        name: &str,
        deliver_policy: DeliverPolicy,
        marker: Option<&str>,
    ) -> Result<PullConsumer, BrokerError> {
        let mut config = self.consumer_config(name, deliver_policy);
        if let Some(marker) = marker {
            config.description = config.description.map(|d| format!("{d} ({marker})"));
        }
        match self.stream().await?.create_consumer(config).await {
            Ok(consumer) => {
                tracing::info!(consumer = name, ?deliver_policy, "created consumer");
                Ok(consumer)
            }
            Err(source) => match self.open_consumer(name).await {
                Ok(Some(consumer)) => {
                    tracing::info!(
                        consumer = name,
                        "another process created the consumer first; using it"
                    );
                    Ok(consumer)
                }
                _ => Err(BrokerError::CreateConsumer {
                    consumer: name.to_owned(),
                    source,
                }),
            },
        }
    }

    /// What the server says of consumer `name` (`None`: it does not exist).
    pub(crate) async fn consumer_info(
        &self,
        name: &str,
    ) -> Result<Option<consumer::Info>, BrokerError> {
        match self.stream().await?.consumer_info(name).await {
            Ok(info) => Ok(Some(info)),
            Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => Ok(None),
            Err(source) => Err(BrokerError::ConsumerInfo {
                consumer: name.to_owned(),
                source,
            }),
        }
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
        for partition in self.owned_partitions() {
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

    /// How many messages the stream holds.
    pub async fn stream_messages(&self) -> Result<u64, BrokerError> {
        Ok(self.stream_state().await?.messages)
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

/// One setting of an existing consumer that is not what the projection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerDifference {
    /// The setting, as the server names it.
    pub setting: &'static str,
    /// What the consumer has.
    pub actual: String,
    /// What the projection needs, and why.
    pub wanted: String,
    /// Whether nats-server 2.9 changes it on an existing consumer (checked on 2.9.10: the filter,
    /// redelivery limit, ack wait, inactivity threshold, ack-pending limit, headers-only, backoff and
    /// pull request limits yes; the ack, deliver and replay policies no). The filter is changeable
    /// but refused anyway: a consumer that filtered less than the whole stream has skipped events.
    pub updatable: bool,
}

impl std::fmt::Display for ConsumerDifference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} is {}, needs {}",
            self.setting, self.actual, self.wanted
        )
    }
}

/// Every setting of `actual` that would make the projection skip, lose or withhold events, or that
/// differs from the runner's own (`wanted`). Settings that do not change what is delivered (the
/// description, replicas, storage, sampling, waiting pulls) are not compared.
pub(crate) fn differences(actual: &pull::Config, wanted: &pull::Config) -> Vec<ConsumerDifference> {
    let mut found = Vec::new();
    let mut differ = |setting, actual: String, wanted: String, updatable| {
        found.push(ConsumerDifference {
            setting,
            actual,
            wanted,
            updatable,
        });
    };
    if actual.filter_subject != wanted.filter_subject {
        differ(
            "filter_subject",
            format!("{:?}", actual.filter_subject),
            format!(
                "{:?} (every event of the stream, or its partition's when the stream is split)",
                wanted.filter_subject
            ),
            false,
        );
    }
    if actual.ack_policy != wanted.ack_policy {
        differ(
            "ack_policy",
            format!("{:?}", actual.ack_policy),
            format!("{:?} (an ack only after the commit)", wanted.ack_policy),
            false,
        );
    }
    // A consumer delivers from the stream's first message, or from where the runner started it
    // (behind what it caught up from the event store, or behind a rebuild); any other start skips
    // events the state does not hold.
    if !matches!(
        actual.deliver_policy,
        DeliverPolicy::All | DeliverPolicy::ByStartSequence { .. }
    ) {
        differ(
            "deliver_policy",
            format!("{:?}", actual.deliver_policy),
            "All or ByStartSequence (events before the start would be missing)".to_owned(),
            false,
        );
    }
    if actual.replay_policy != wanted.replay_policy {
        differ(
            "replay_policy",
            format!("{:?}", actual.replay_policy),
            format!("{:?}", wanted.replay_policy),
            false,
        );
    }
    // 0 and -1 both mean "no limit" to the server.
    if actual.max_deliver > 0 {
        differ(
            "max_deliver",
            actual.max_deliver.to_string(),
            "no limit (a message NAKed while the database is down would be dropped)".to_owned(),
            true,
        );
    }
    if actual.ack_wait != wanted.ack_wait {
        differ(
            "ack_wait",
            humantime::format_duration(actual.ack_wait).to_string(),
            format!(
                "{} (--ack-wait)",
                humantime::format_duration(wanted.ack_wait)
            ),
            true,
        );
    }
    if !actual.inactive_threshold.is_zero() {
        differ(
            "inactive_threshold",
            humantime::format_duration(actual.inactive_threshold).to_string(),
            "none (the server would delete the consumer while the projection is down)".to_owned(),
            true,
        );
    }
    if actual.max_ack_pending != wanted.max_ack_pending {
        differ(
            "max_ack_pending",
            actual.max_ack_pending.to_string(),
            wanted.max_ack_pending.to_string(),
            true,
        );
    }
    if actual.headers_only {
        differ(
            "headers_only",
            "true".to_owned(),
            "false (the bodies are the events)".to_owned(),
            true,
        );
    }
    if !actual.backoff.is_empty() {
        differ(
            "backoff",
            format!("{:?}", actual.backoff),
            "none (redelivery after the ack wait)".to_owned(),
            true,
        );
    }
    for (setting, value) in [
        ("max_batch", actual.max_batch),
        ("max_bytes", actual.max_bytes),
    ] {
        if value > 0 {
            differ(
                setting,
                value.to_string(),
                "no limit (the runner pulls whole batches)".to_owned(),
                true,
            );
        }
    }
    if !actual.max_expires.is_zero() {
        differ(
            "max_expires",
            humantime::format_duration(actual.max_expires).to_string(),
            "no limit".to_owned(),
            true,
        );
    }
    found
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn wanted() -> pull::Config {
        pull::Config {
            durable_name: Some("inventory".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: 10_000,
            filter_subject: "waybill.events.>".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_consumer_as_the_runner_makes_it_differs_in_nothing() {
        let started_later = pull::Config {
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: 42 },
            description: Some("made by hand".into()),
            max_waiting: 512,
            ..wanted()
        };
        assert_eq!(differences(&started_later, &wanted()), vec![]);
    }

    #[test]
    fn every_setting_that_loses_or_delays_events_is_named() {
        let hostile = pull::Config {
            deliver_policy: DeliverPolicy::New,
            max_deliver: 3,
            ack_wait: Duration::from_secs(5),
            inactive_threshold: Duration::from_secs(60),
            headers_only: true,
            ..wanted()
        };
        let found = differences(&hostile, &wanted());
        let settings: Vec<&str> = found.iter().map(|d| d.setting).collect();
        assert_eq!(
            settings,
            [
                "deliver_policy",
                "max_deliver",
                "ack_wait",
                "inactive_threshold",
                "headers_only"
            ]
        );
        let updatable: Vec<bool> = found.iter().map(|d| d.updatable).collect();
        assert_eq!(updatable, [false, true, true, true, true]);
        assert_eq!(
            found[1].to_string(),
            "max_deliver is 3, needs no limit (a message NAKed while the database is down would be dropped)"
        );
    }
}
