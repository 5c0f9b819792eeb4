//! Publishing claimed runs to JetStream: every aggregate's run is a chain — a version is published only
//! after the previous version's PubAck — and all chains run at once, so thousands of PubAcks are in
//! flight while each aggregate stays in order.
//!
//! Pipelining an aggregate's versions without waiting put versions out of order whenever a publish
//! failed (measured: 768 per 100k at 1 % failures), hence the chains.
//!
//! Every publish is fenced: it carries `Nats-Expected-Last-Subject-Sequence`, the stream sequence of
//! the aggregate's previous version (from its row for a head, from the previous PubAck within a chain).
//! A refusal (10071) is judged from the subject's last message ([`crate::fence`]); the WAL relay's
//! remembered fences are read the same way but never followed back to an earlier version
//! ([`OnRefusal::Return`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self};
use async_nats::{HeaderMap, Subject};
use domain::wire;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use ops::error_chain;

use crate::claim::ClaimedRow;
use crate::config::PublishFaults;
use crate::fence::{self, Divergence, Judgement, Reading};

/// What happened to one claimed row.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// JetStream holds it: stored now, or already (a duplicate within the window, or found by the fence).
    Sent {
        /// The stream sequence of its message.
        sequence: u64,
        /// JetStream recognised the `Nats-Msg-Id` and did not store it again.
        duplicate: bool,
        /// The fence refused the publish and the stream showed this event at the row's version.
        fenced: bool,
        /// From publish to PubAck.
        latency: Duration,
    },
    /// The publish failed.
    Failed {
        /// Why, for `last_error` and `dead_reason`.
        error: String,
        /// The message may have been stored anyway (the ack timed out or the connection broke).
        ambiguous: bool,
        /// The fence found the stream disagreeing with the store (kept on the row).
        divergence: Option<Divergence>,
        /// The stream refused the expected sequence and the caller asked to decide itself
        /// ([`OnRefusal::Return`]): nothing was published.
        fence_moved: bool,
    },
    /// Not published in this step: an earlier version failed, the step ran out of time, the broker is
    /// disconnected, or the relay is stopping.
    NotAttempted,
}

impl Outcome {
    fn failed(error: String, ambiguous: bool) -> Self {
        Self::Failed {
            error,
            ambiguous,
            divergence: None,
            fence_moved: false,
        }
    }
}

/// What a publish does when the stream refuses the sequence it expected (error 10071).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// Read the subject and decide ([`crate::fence`]): a claim's rows, whose expected sequence was
    /// read from the predecessor's row, which the outbox says is sent.
    Judge,
    /// For a chain's first row that expects its predecessor's sequence (a version after the
    /// first, `previous_sequence` set): judge, but where the subject's last message is an earlier
    /// version, return [`Outcome::Failed`] with `fence_moved` instead of following it. The WAL
    /// relay's rows: that sequence is its memory of what it published, and a subject that moved
    /// back past it lost messages behind its back (`outbox repair` rewound the predecessor);
    /// following the earlier version would put the row ahead of its own unsent predecessor, so
    /// polling, which claims in the outbox's order, decides instead. Other rows are judged as always.
    Return,
}

/// Publishes every run; returns one outcome per row, in the same shape as `runs`.
#[allow(clippy::too_many_arguments)]
pub async fn publish_runs(
    jetstream: &jetstream::Context,
    stream: &str,
    subject_prefix: &str,
    runs: &[Vec<ClaimedRow>],
    max_in_flight: usize,
    deadline: Instant,
    stopping: &Arc<AtomicBool>,
    faults: PublishFaults,
    on_refusal: OnRefusal,
) -> Vec<Vec<Outcome>> {
    let client = jetstream.client();
    let stream = match jetstream.get_stream_no_info(stream).await {
        Ok(stream) => stream,
        Err(error) => {
            // Only an invalid name fails here (no request is made); nothing can be published.
            let outcome =
                Outcome::failed(format!("stream {stream}: {}", error_chain(&error)), false);
            return runs
                .iter()
                .map(|run| {
                    let mut outcomes = vec![outcome.clone()];
                    outcomes.resize(run.len(), Outcome::NotAttempted);
                    outcomes
                })
                .collect();
        }
    };
    let publisher = ChainPublisher {
        jetstream,
        stream: &stream,
        client: &client,
        subject_prefix,
        deadline,
        stopping,
        faults,
        on_refusal,
        partitions: tokio::sync::OnceCell::new(),
    };
    let mut results = vec![Vec::new(); runs.len()];
    let mut waiting = runs.iter().enumerate();
    let mut running = FuturesUnordered::new();
    loop {
        // Keep at most `max_in_flight` chains going; each has one PubAck outstanding at a time.
        while running.len() < max_in_flight.max(1) {
            let Some((index, run)) = waiting.next() else {
                break;
            };
            running.push(publisher.publish_chain(index, run));
        }
        match running.next().await {
            Some((index, outcomes)) => results[index] = outcomes,
            None => return results,
        }
    }
}

/// Publishes per-aggregate chains; holds what every chain of a step shares.
struct ChainPublisher<'a> {
    jetstream: &'a jetstream::Context,
    stream: &'a jetstream::stream::Stream<()>,
    client: &'a async_nats::Client,
    subject_prefix: &'a str,
    deadline: Instant,
    stopping: &'a AtomicBool,
    faults: PublishFaults,
    on_refusal: OnRefusal,
    /// The partitions the stream splits (its subject transform), read once per step and only when a
    /// subject must be read back: the relay publishes to `<prefix>.<type>.<id>`, a split stream
    /// stores under `<prefix>.<K>.<type>.<id>`, and the fence reads what is stored.
    partitions: tokio::sync::OnceCell<u32>,
}

/// Publishes after a fence refusal, per row, before the row counts as diverged: the stream can
/// change between the refusal and the reading (another relay publishing the same aggregate).
const FENCE_ROUNDS: usize = 3;

impl ChainPublisher<'_> {
    /// Publishes one aggregate's run in version order, stopping at the first failure.
    async fn publish_chain(&self, index: usize, run: &[ClaimedRow]) -> (usize, Vec<Outcome>) {
        let mut outcomes = Vec::with_capacity(run.len());
        // One subject per chain, not per row: every row of a run is the same aggregate. (Building and
        // checking it for each publish was a visible share of the relay's CPU.)
        let subject = match run.first().map(|head| {
            wire::subject_for(self.subject_prefix, &head.aggregate_type, head.aggregate_id)
        }) {
            Some(Ok(subject)) => Subject::from(subject),
            Some(Err(error)) => {
                outcomes.push(Outcome::failed(error, false));
                outcomes.resize(run.len(), Outcome::NotAttempted);
                return (index, outcomes);
            }
            None => return (index, outcomes),
        };
        let mut expected = run
            .first()
            .and_then(|head| head.previous_sequence)
            .and_then(|sequence| u64::try_from(sequence).ok());
        let mut remembered = run
            .first()
            .is_some_and(|head| head.aggregate_version > 1 && expected.is_some());
        for row in run {
            // Stopping, out of time, or the broker is gone: leave the rest pending, untouched. A publish
            // into a disconnected client would only wait for its timeout and burn an attempt.
            if self.stopping.load(Ordering::Relaxed)
                || Instant::now() >= self.deadline
                || self.client.connection_state() != State::Connected
            {
                break;
            }
            let outcome = self
                .publish_fenced(row, &subject, expected, remembered)
                .await;
            remembered = false;
            expected = match &outcome {
                Outcome::Sent { sequence, .. } => Some(*sequence),
                _ => None,
            };
            let failed = matches!(outcome, Outcome::Failed { .. });
            outcomes.push(outcome);
            if failed {
                break;
            }
        }
        outcomes.resize(run.len(), Outcome::NotAttempted);
        (index, outcomes)
    }

    /// Publishes `row` on `subject` expecting `expected` as the subject's last sequence (`None`: ask
    /// the stream); `remembered`: that expectation is the caller's memory ([`OnRefusal::Return`]).
    async fn publish_fenced(
        &self,
        row: &ClaimedRow,
        subject: &Subject,
        expected: Option<u64>,
        remembered: bool,
    ) -> Outcome {
        let mut expected = expected;
        for _ in 0..FENCE_ROUNDS {
            let expect = match expected {
                Some(sequence) => sequence,
                None => match self.judge(row).await {
                    Ok(Judgement::Expect(sequence)) => sequence,
                    Ok(Judgement::Delivered(sequence)) => return fenced(row, sequence),
                    Ok(Judgement::Diverged(divergence)) => {
                        return diverged(row, subject, divergence);
                    }
                    Err(error) => return Outcome::failed(error, false),
                },
            };
            match publish_one(self.jetstream, subject, row, expect, self.faults).await {
                Attempt::Done(Outcome::Sent {
                    sequence,
                    duplicate: true,
                    latency,
                    ..
                }) => return self.check_duplicate(row, subject, sequence, latency).await,
                Attempt::Done(outcome) => return outcome,
                // The subject moved on without us: read it and decide again, or let the caller.
                Attempt::WrongLastSequence(refusal) => {
                    tracing::debug!(event_id = %row.event_id, expected = expect, %refusal, "fence refused the publish");
                    if remembered && self.on_refusal == OnRefusal::Return {
                        return self.judge_moved(row, subject, expect, &refusal).await;
                    }
                    expected = None;
                }
            }
        }
        diverged(row, subject, fence::unsettled(FENCE_ROUNDS))
    }

    /// [`OnRefusal::Return`]'s reading of a refused remembered fence: the stream holding this very
    /// event (another relay published it) is a delivery, a subject that contradicts the store is a
    /// divergence as always, and only a subject whose last message is an earlier version — the row
    /// would follow it with its predecessor missing — is returned as moved, for the caller to decide.
    async fn judge_moved(
        &self,
        row: &ClaimedRow,
        subject: &Subject,
        expected: u64,
        refusal: &str,
    ) -> Outcome {
        match self.judge(row).await {
            Ok(Judgement::Delivered(sequence)) => fenced(row, sequence),
            Ok(Judgement::Diverged(divergence)) => diverged(row, subject, divergence),
            Ok(Judgement::Expect(last)) => Outcome::Failed {
                error: format!(
                    "expected stream sequence {expected} as the subject's last ({refusal}); it is {last}, an earlier version"
                ),
                ambiguous: false,
                divergence: None,
                fence_moved: true,
            },
            Err(error) => Outcome::failed(error, false),
        }
    }

    /// A duplicate PubAck says JetStream remembers the event's id, not that it still holds the message:
    /// one deleted (or purged) inside the dedupe window is still acknowledged as a duplicate. Reading
    /// the acknowledged sequence back costs a request, only after a retry (duplicates are rare), and
    /// turns "remembered" into "held".
    async fn check_duplicate(
        &self,
        row: &ClaimedRow,
        subject: &Subject,
        sequence: u64,
        latency: Duration,
    ) -> Outcome {
        match fence::message_at_sequence(self.stream, sequence).await {
            Ok(Some(found)) if fence::is_row(row, &found) => Outcome::Sent {
                sequence,
                duplicate: true,
                fenced: false,
                latency,
            },
            Ok(found) => diverged(
                row,
                subject,
                fence::remembered_not_held(row, sequence, found),
            ),
            Err(error) => Outcome::failed(
                format!("checking the duplicate PubAck at stream sequence {sequence}: {error}"),
                true,
            ),
        }
    }

    /// The subject `row`'s aggregate is stored under (see [`wire::stored_subject`]).
    async fn stored_subject(&self, row: &ClaimedRow) -> Result<String, String> {
        let partitions = self
            .partitions
            .get_or_try_init(|| async {
                let info = self.stream.get_info().await.map_err(|error| {
                    format!("reading the stream's settings: {}", error_chain(&error))
                })?;
                Ok::<_, String>(ops::stream_partitions(&info.config, self.subject_prefix))
            })
            .await?;
        wire::stored_subject(
            self.subject_prefix,
            &row.aggregate_type,
            row.aggregate_id,
            *partitions,
        )
    }

    /// Reads the subject and decides: its last message, and when that is a later version, the message
    /// at the row's version.
    async fn judge(&self, row: &ClaimedRow) -> Result<Judgement, String> {
        let subject = &self.stored_subject(row).await?;
        let last = fence::last_message(self.stream, subject).await?;
        match fence::judge(row, last.as_ref()) {
            Reading::Judged(judgement) => Ok(judgement),
            Reading::LookFrom(from) => {
                let found = fence::message_at_version(
                    self.stream,
                    subject,
                    from,
                    row.aggregate_id,
                    row.aggregate_version,
                )
                .await?;
                Ok(fence::judge_found(row, found.as_ref()))
            }
        }
    }
}

/// The stream holds this very event at the row's version (published before, by this relay or
/// another): count it and mark it sent.
fn fenced(row: &ClaimedRow, sequence: u64) -> Outcome {
    tracing::info!(event_id = %row.event_id, aggregate_id = %row.aggregate_id, aggregate_version = row.aggregate_version, stream_sequence = sequence, "fence: this event is in the stream already; marking sent");
    Outcome::Sent {
        sequence,
        duplicate: false,
        fenced: true,
        latency: Duration::ZERO,
    }
}

/// The stream disagrees with the store: never marked sent; said loudly, kept on the row.
fn diverged(row: &ClaimedRow, subject: &str, divergence: Divergence) -> Outcome {
    let error = format!("divergence on {subject}: {divergence}");
    tracing::error!(
        aggregate_type = %row.aggregate_type,
        aggregate_id = %row.aggregate_id,
        aggregate_version = row.aggregate_version,
        event_id = %row.event_id,
        stream_msg_id = divergence.stream_msg_id.as_deref().unwrap_or("-"),
        stream_sequence = ?divergence.stream_sequence,
        kind = divergence.kind.as_str(),
        expected_previous_sequence = ?row.previous_sequence,
        "the stream disagrees with the store: not marking sent (retried with backoff; `waybill outbox verify` compares them)"
    );
    Outcome::Failed {
        error,
        ambiguous: false,
        divergence: Some(divergence),
        fence_moved: false,
    }
}

/// One publish's result: an outcome, or a fence refusal to judge.
enum Attempt {
    Done(Outcome),
    WrongLastSequence(String),
}

async fn publish_one(
    jetstream: &jetstream::Context,
    subject: &Subject,
    row: &ClaimedRow,
    expected_last_sequence: u64,
    faults: PublishFaults,
) -> Attempt {
    if faults.before_send > 0.0 && rand::random_bool(faults.before_send.min(1.0)) {
        return Attempt::Done(Outcome::failed("injected fault: not sent".into(), false));
    }
    let message = PublishMessage::build()
        .payload(row.body.clone())
        .headers(headers(row))
        .expected_last_subject_sequence(expected_last_sequence);
    let started = Instant::now();
    let ack = match jetstream.send_publish(subject.clone(), message).await {
        Ok(ack) => ack,
        Err(error) => {
            return Attempt::Done(Outcome::failed(
                format!("publish: {}", error_chain(&error)),
                ambiguous(error.kind()),
            ));
        }
    };
    Attempt::Done(match ack.await {
        Ok(_) if faults.lost_ack > 0.0 && rand::random_bool(faults.lost_ack.min(1.0)) => {
            Outcome::failed("injected fault: PubAck lost".into(), true)
        }
        // Sequence 0 means "not stored" (no stream message has it). Some nats-server releases answer
        // a Msg-Id they have only staged on a clustered stream (proposed, not yet applied, e.g. our
        // earlier publish whose PubAck timed out) with `duplicate: true, seq: 0` and no error, and a
        // leader change can then drop that proposal (nats-server#5827, #6415). Taken as delivered,
        // the row would be marked sent with stream_seq 0 though the stream may never get it. So it
        // is an ambiguous failure, retried until the server knows the sequence (a duplicate with
        // it) or the window forgets the id (then the fence decides).
        Ok(ack) if ack.sequence == 0 => Outcome::failed(
            format!(
                "pub ack: sequence 0 (duplicate: {}): the server has not stored the message yet",
                ack.duplicate
            ),
            true,
        ),
        Ok(ack) => Outcome::Sent {
            sequence: ack.sequence,
            duplicate: ack.duplicate,
            fenced: false,
            latency: started.elapsed(),
        },
        Err(error) if error.kind() == PublishErrorKind::WrongLastSequence => {
            return Attempt::WrongLastSequence(error_chain(&error));
        }
        Err(error) => Outcome::failed(
            format!("pub ack: {}", error_chain(&error)),
            ambiguous(error.kind()),
        ),
    })
}

/// The routing facts as headers, so consumers can route without parsing the body.
fn headers(row: &ClaimedRow) -> HeaderMap {
    let mut headers = HeaderMap::new();
    // UUIDs are encoded into a stack buffer rather than through `Display` (`to_string`).
    let mut buffer = uuid::Uuid::encode_buffer();
    headers.insert(
        wire::MSG_ID,
        &*row.event_id.hyphenated().encode_lower(&mut buffer),
    );
    headers.insert(wire::EVENT_TYPE, row.event_type.as_str());
    headers.insert(wire::EVENT_VERSION, row.event_version.to_string().as_str());
    headers.insert(
        wire::AGGREGATE_ID,
        &*row.aggregate_id.hyphenated().encode_lower(&mut buffer),
    );
    headers.insert(
        wire::AGGREGATE_VERSION,
        row.aggregate_version.to_string().as_str(),
    );
    if let Some(traceparent) = &row.traceparent {
        headers.insert(wire::TRACEPARENT, traceparent.as_str());
    }
    headers
}

/// Whether a failure of this kind may still have stored the message.
fn ambiguous(kind: PublishErrorKind) -> bool {
    matches!(
        kind,
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use chrono::Utc;
    use uuid::Uuid;

    /// A broker that answers a publish with `ack`, as JetStream would: a plain subscriber on a subject
    /// no stream holds replies with the PubAck's JSON.
    async fn publish_answered_with(ack: &'static str) -> Outcome {
        match attempt_answered_with(ack).await {
            Attempt::Done(outcome) => outcome,
            Attempt::WrongLastSequence(refusal) => panic!("refused: {refusal}"),
        }
    }

    /// Like [`publish_answered_with`], the attempt itself (a fence refusal is not an outcome yet).
    async fn attempt_answered_with(ack: &'static str) -> Attempt {
        let server = testkit::NatsServer::start().expect("nats-server");
        let client = async_nats::connect(server.url()).await.expect("connect");
        let mut requests = client.subscribe("fake.events.>").await.expect("subscribe");
        let responder = client.clone();
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                if let Some(reply) = request.reply {
                    let _ = responder.publish(reply, ack.into()).await;
                }
            }
        });
        client.flush().await.expect("flush");
        let row = ClaimedRow {
            id: 1,
            attempts: 0,
            created_at: Utc::now(),
            traceparent: None,
            event_id: Uuid::from_u128(102),
            event_type: "order.paid".into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(7),
            aggregate_version: 2,
            body: Bytes::from_static(b"{}"),
            previous_sequence: Some(5),
            tid: String::new(),
        };
        let jetstream = jetstream::new(client);
        let subject = Subject::from("fake.events.order.7");
        publish_one(&jetstream, &subject, &row, 5, PublishFaults::default()).await
    }

    // The fence's refusal is told by JetStream's error code (10071), whatever its description says:
    // a server that words it differently is still refused, and a description that reads like one
    // under another code is an ordinary failure.
    #[tokio::test]
    async fn a_fence_refusal_is_its_error_code_not_its_words() {
        let refused = attempt_answered_with(
            r#"{"error":{"code":400,"err_code":10071,"description":"the subject moved on"}}"#,
        )
        .await;
        assert!(matches!(refused, Attempt::WrongLastSequence(_)));
        let other = attempt_answered_with(
            r#"{"error":{"code":400,"err_code":10070,"description":"wrong last sequence: 5"}}"#,
        )
        .await;
        assert!(
            matches!(
                other,
                Attempt::Done(Outcome::Failed {
                    divergence: None,
                    ..
                })
            ),
            "another error code is not a fence refusal"
        );
    }

    // What some nats-server releases answer for a Msg-Id they have only staged on a clustered stream
    // (nats-server#5827); the staged proposal can be lost to a leader change, so the row must not be
    // marked sent on it.
    #[tokio::test]
    async fn a_duplicate_ack_without_a_sequence_is_not_a_delivery() {
        let outcome = publish_answered_with(r#"{"stream":"S","seq":0,"duplicate": true}"#).await;
        assert!(
            matches!(
                outcome,
                Outcome::Failed {
                    ambiguous: true,
                    divergence: None,
                    ..
                }
            ),
            "{outcome:?}"
        );
    }

    #[tokio::test]
    async fn a_duplicate_ack_with_its_sequence_is_a_delivery() {
        let outcome = publish_answered_with(r#"{"stream":"S","seq":42,"duplicate": true}"#).await;
        assert!(
            matches!(
                outcome,
                Outcome::Sent {
                    sequence: 42,
                    duplicate: true,
                    fenced: false,
                    ..
                }
            ),
            "{outcome:?}"
        );
    }
}
