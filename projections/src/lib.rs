//! Projection services: inventory, loyalty points and a search index, each a separate binary with its
//! own schema and durable JetStream consumer, built on one shared consumer runner that applies every
//! event exactly once in effect and in per-aggregate order.

pub mod cli;
mod consume;
pub mod decode;
pub mod held;
pub mod http;
pub mod inventory;
pub mod metrics;
pub mod park;
pub mod plan;
pub mod points;
pub mod projection;
mod rebuild;
pub mod runner;
pub mod schema;
pub mod search;

pub use decode::{Decoded, Poison, RawMessage};
pub use inventory::Inventory;
pub use plan::Verdict;
pub use points::Points;
pub use projection::Projection;
pub use runner::{FailPoint, Runner, RunnerConfig, Tally};
pub use search::Search;
