//! Projection services: inventory, loyalty points and a search index, each a separate binary with its
//! own schema and durable JetStream consumer, and the read models of `src/models/` (one file each,
//! run by `waybill-projection <name>`), all built on one shared consumer runner that applies every
//! event exactly once in effect and in per-aggregate order.

pub mod accounts;
mod actions;
mod apply;
mod blame;
mod catch_up;
pub mod checkpoint;
pub mod cli;
mod consume;
mod consumer;
pub mod decode;
mod discards;
mod handover;
pub mod held;
pub mod history;
pub mod http;
pub mod inventory;
pub mod kit;
pub mod lease;
pub mod metrics;
pub mod model_cli;
pub mod operator_api;
pub mod park;
pub mod partition;
pub mod plan;
pub mod points;
pub mod projection;
mod rebuild;
pub mod registry;
pub mod runner;
pub mod schema;
pub mod search;
mod tally;

pub use actions::{DiscardError, RedriveError, RedriveRequest, Redriven, ReleaseError};
pub use apply::ApplyError;
pub use catch_up::StartError;
pub use consume::RunError;
pub use consumer::{BrokerError, ConsumerDifference};
pub use decode::{Decoded, Poison, RawMessage};
pub use handover::HandoverError;
pub use held::HeldError;
pub use history::HistoryError;
pub use inventory::Inventory;
pub use park::{ParkError, ParkedError};
pub use partition::{PartitionError, Partitions};
pub use plan::Verdict;
pub use points::Points;
pub use projection::Projection;
pub use rebuild::RebuildError;
pub use runner::{ConnectError, FailPoint, Runner, RunnerConfig};
pub use schema::SchemaError;
pub use search::Search;
pub use tally::Tally;
