//! The HTTP order service as a library: the `waybill serve` binary and the demo (in `waybill-lab`)
//! both run it, so the demo need not link the rest of the command-line program.

pub mod http;
