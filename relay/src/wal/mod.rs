//! Reading the outbox from PostgreSQL's write-ahead log (logical decoding through the `waybill_outbox`
//! publication) instead of polling it (`run --source wal`): the pgoutput decoder, the ledger of
//! confirmable positions, the slot and its checks, and the streaming loop. docs/decisions/relay-wal.md
//! has the design and what is still to come.

pub mod ledger;
pub mod pgoutput;
pub mod slot;
pub mod stream;

pub use stream::WalSource;

/// How long an outbox row may stay due while a WAL relay reads the slot before polling delivers it
/// (the WAL relay's own polling pass, and any polling relay standing by beside it): the slot carries
/// inserts only, so a row made due by an update (a dead row replayed, a row rewound by `outbox
/// repair`, a retry the session's opening drain left for later) never reaches the stream, and a WAL
/// relay cut off from NATS delivers nothing. One that keeps up marks a row within milliseconds, and
/// an aggregate handed to its polling passes within their 5 s period.
pub const UNDELIVERED_AFTER: std::time::Duration = std::time::Duration::from_secs(10);
