//! The outbox relay: claims outbox rows, publishes them to NATS JetStream with `Nats-Msg-Id = event_id`
//! in per-aggregate order, and settles them as sent, failed (with backoff) or dead.
//!
//! A claim is a set of row locks held by one short transaction that claims, publishes and settles
//! (ARCHITECTURE.md explains the choice). [`Relay::step`] is one such transaction; [`Relay::run`] loops.

pub mod admin;
pub mod app;
pub mod backoff;
pub mod claim;
pub mod cli;
pub mod config;
pub mod fence;
pub mod metrics;
pub mod peers;
pub mod publish;
pub mod repair;
mod run;
pub mod step;
mod step_report;
pub mod stream;
pub mod verify;
pub mod wal;

pub use backoff::Backoff;
#[cfg(feature = "fault-injection")]
pub use config::PublishFaults;
pub use config::{RelayConfig, StreamSettings};
pub use run::{ConnectError, Relay, RunSummary};
pub use step::{FailPoint, StepError, StepReport};
pub use stream::{
    MAX_STREAM_PARTITIONS, MIN_MAX_AGE, ProvisionError, StreamLimits, check_max_age, ensure_stream,
    ensure_stream_with, ensure_stream_with_replicas,
};
