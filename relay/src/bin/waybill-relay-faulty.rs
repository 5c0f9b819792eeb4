//! `waybill-relay-faulty`: `waybill-relay` that can be told to crash in the crash window, for the
//! tests, the demo and the chaos harness. It exists only in builds with the `fault-injection`
//! feature; it reads its own flag out of the command line and hands the rest to the relay's.

use std::ffi::OsString;
use std::process::ExitCode;

use relay::FailPoint;
use relay::app::{CRASHING_TWIN, Program, main as relay_main};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const AFTER_HELP: &str = "Testing only, this binary's own flag (anywhere on the line):\n  \
    --crash-after-publish  `run`: abort the process after the PubAcks, before marking anything sent";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // Aborts the process after the PubAcks, with the claim transaction still open (the SIGKILL case).
    let Some((name, crash_after_publish)) = CRASHING_TWIN else {
        unreachable!("the twin is built only with the fault-injection feature")
    };
    let (crash, args): (Vec<OsString>, Vec<OsString>) =
        std::env::args_os().partition(|arg| arg == crash_after_publish);
    let fail_point = if crash.is_empty() {
        FailPoint::None
    } else {
        FailPoint::AbortProcessAfterPublish
    };
    let program = Program {
        name,
        after_help: Some(AFTER_HELP),
        fail_point,
    };
    relay_main(args, program).await
}
