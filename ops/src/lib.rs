//! Process plumbing shared by every waybill binary: logging, shutdown signals, PostgreSQL connections,
//! the hardened HTTP edge, and the metrics and health endpoint. What only tests, benchmarks and the lab
//! need (private servers, measurement helpers) lives in `testkit`.

pub mod command_line;
pub mod connection;
pub mod database;
mod edge;
mod exit;
mod logging;
mod nats;
mod nats_refusal;
mod nodelay;
pub mod operator;
mod redact;
mod shutdown;
mod telemetry;

pub use connection::{DEFAULT_DATABASE_URL, DatabaseArgs, StreamConnection};
pub use edge::{EdgeConfig, Served, serve_with};
pub use exit::{AlreadyReported, Refused, error_chain, report_failure};
pub use logging::init_logging;
pub use nats::{NatsConnection, stream_partitions};
pub use nats_refusal::{NatsRefusal, recent_refusal};
pub use operator::OperatorToken;
pub use redact::{redact_text, redact_url, remember_secret, remember_secrets_in};
pub use shutdown::shutdown_signal;
pub use telemetry::{HealthCheck, install_metrics_recorder, serve, telemetry_routes};
