//! Reading the outbox from PostgreSQL's write-ahead log (logical decoding through the `waybill_outbox`
//! publication) instead of polling it (`run --source wal`): the pgoutput decoder, the ledger of
//! confirmable positions, the slot and its checks, the streaming loop, and TLS on the replication session. docs/decisions/relay-wal.md
//! has the design and what is still to come.

pub mod ledger;
pub mod pgoutput;
pub mod slot;
pub mod stream;
pub mod tls;

pub use stream::WalSource;
