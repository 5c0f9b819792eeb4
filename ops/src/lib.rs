//! Process plumbing shared by every waybill binary: logging, shutdown signals and measurement helpers.

mod logging;
mod shutdown;
pub mod stats;

pub use logging::init_logging;
pub use shutdown::shutdown_signal;
