//! `waybill-relay`: moves outbox rows to NATS JetStream, and the operator commands over the outbox.

use std::process::ExitCode;

use relay::app::{Program, main as relay_main};

// The relay allocates and frees many small buffers per message (headers, subjects, acks); glibc's
// allocator spent a fifth of the relay's CPU on them (measured with perf), mimalloc much less.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    relay_main(std::env::args_os().collect(), Program::relay()).await
}
