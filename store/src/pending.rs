//! One append waiting for a writer: what group commit's queue and an aggregate's lane hold.

use domain::EventEnvelope;
use tokio::sync::oneshot;
use uuid::Uuid;

use crate::alone::Unwritten;
use crate::outbox::Part;

/// One append waiting for a writer.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) aggregate_id: Uuid,
    pub(crate) expected_version: i64,
    pub(crate) events: Vec<EventEnvelope>,
    pub(crate) traceparent: Option<String>,
    /// How many of the append's events were written: all, or none when the aggregate was not at the
    /// expected version.
    pub(crate) done: oneshot::Sender<Result<u64, Unwritten>>,
}

impl Pending {
    pub(crate) fn part(&self) -> Part<'_> {
        Part::new(
            self.expected_version,
            &self.events,
            self.traceparent.as_deref(),
        )
    }
}
