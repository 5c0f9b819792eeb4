//! Reading the outbox from PostgreSQL's write-ahead log (logical decoding through the `waybill_outbox`
//! publication) instead of polling it: the parts built so far — the pgoutput decoder, the ledger of
//! confirmable positions and the slot's checks. docs/decisions/relay-wal.md has the design and what
//! is still to come (the streaming loop, the standby, the polling relay's takeover).

pub mod ledger;
pub mod pgoutput;
pub mod slot;
