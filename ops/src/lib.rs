//! Process plumbing shared by every waybill binary: logging, shutdown signals, PostgreSQL connections,
//! the hardened HTTP edge, the metrics and health endpoint, private broker instances, and measurement helpers for the benchmark programs.

pub mod database;
mod edge;
mod exit;
mod local_nats;
mod local_postgres;
mod logging;
mod nats;
mod redact;
mod shutdown;
pub mod stats;
mod telemetry;

pub use edge::{EdgeConfig, Served, serve_with};
pub use exit::{Refused, error_chain, report_failure};
pub use local_nats::{NatsServer, find_binary, free_port, free_ports, unique_temp_dir};
pub use local_postgres::{PostgresServer, reachable};
pub use logging::init_logging;
pub use nats::NatsConnection;
pub use redact::redact_url;
pub use shutdown::shutdown_signal;
pub use telemetry::{HealthCheck, install_metrics_recorder, serve, telemetry_routes};
