//! The fence at the broker: what the stream holds on an aggregate's subject, and whether it proves a
//! claimed row delivered.
//!
//! Every publish carries `Nats-Expected-Last-Subject-Sequence`. JetStream refuses it (error 10071) when
//! the subject's last message is not the one expected — a relay that stalled past the dedupe window and
//! publishes a claim it lost, a copy of an event that someone published by hand, or a store restored
//! from a backup that is behind its stream. The relay then reads the subject and [`judge`]s.
//!
//! A row counts as delivered only on proof: the message at the row's aggregate version is this event
//! (its `Nats-Msg-Id`). "A later version is on the subject" is not proof — after a restore the store
//! writes a *new* version 2 while the stream still holds the old versions 2 and 3. Anything the relay
//! cannot account for is a [`Divergence`]: never marked sent, reported loudly, and kept on the row
//! (its `divergence` column, `store::outbox::Divergence`) for `status`, the console and
//! `waybill outbox verify`.

use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use domain::wire;
use uuid::Uuid;

use crate::claim::ClaimedRow;

/// One message on an aggregate's subject, as far as the fence cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectMessage {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its `Nats-Msg-Id`, if any.
    pub msg_id: Option<String>,
    /// The aggregate and version it claims to be (headers first, then the body), if readable.
    pub aggregate: Option<(Uuid, i64)>,
}

/// What the stream says about publishing `row`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// The subject is empty, or its last message is an earlier version of the aggregate: publish,
    /// expecting this sequence.
    Expect(u64),
    /// The row's own message is in the stream at this sequence.
    Delivered(u64),
    /// The stream disagrees with the store.
    Diverged(Divergence),
}

/// What the subject's last message tells: a judgement, or where to look for the row's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading {
    /// Decided from the last message alone.
    Judged(Judgement),
    /// A later version is the subject's last message: read the subject from this sequence on to find
    /// the message at the row's version ([`judge_found`]).
    LookFrom(u64),
}

/// What the fence finds, as kept on the row: the types are the outbox's (`store::outbox`), which stores them.
pub use store::outbox::{Divergence, DivergenceKind};

/// A divergence at `message`, the stream message found in the row's place.
fn found_at(kind: DivergenceKind, message: &SubjectMessage, detail: String) -> Divergence {
    Divergence {
        kind,
        stream_sequence: Some(message.sequence),
        stream_msg_id: message.msg_id.clone(),
        detail,
    }
}

/// The subject kept moving during `rounds` fenced publishes.
pub fn unsettled(rounds: usize) -> Divergence {
    Divergence {
        kind: DivergenceKind::Unsettled,
        stream_sequence: None,
        stream_msg_id: None,
        detail: format!("the subject kept moving during {rounds} fenced publishes"),
    }
}

/// Reads the subject's last message (`None`: the subject holds nothing).
pub fn judge(row: &ClaimedRow, last: Option<&SubjectMessage>) -> Reading {
    let Some(last) = last else {
        // Nothing on the subject (a new aggregate, or its history was removed from the stream): the
        // fence is "no message yet".
        return Reading::Judged(Judgement::Expect(0));
    };
    if is_row(row, last) {
        return Reading::Judged(Judgement::Delivered(last.sequence));
    }
    Reading::Judged(match last.aggregate {
        Some((aggregate, version)) if aggregate == row.aggregate_id => {
            if version > row.aggregate_version {
                // Where this version should be: right after its predecessor, when that is known.
                let from = row
                    .previous_sequence
                    .and_then(|sequence| u64::try_from(sequence).ok())
                    .map_or(1, |sequence| sequence + 1);
                return Reading::LookFrom(from);
            } else if version < row.aggregate_version {
                // An earlier version last (its sequence was unknown to us, or a copy published by
                // hand under another id, as the demo does): fence on it.
                Judgement::Expect(last.sequence)
            } else {
                Judgement::Diverged(other_event(row, last))
            }
        }
        _ => Judgement::Diverged(foreign(row, last)),
    })
}

/// Decides from the first message on the subject, at or after [`Reading::LookFrom`]'s sequence,
/// that claims to be this aggregate at the row's version or later. Earlier versions (copies) are
/// skipped by the caller; `None`: the subject holds nothing there.
pub fn judge_found(row: &ClaimedRow, found: Option<&SubjectMessage>) -> Judgement {
    let Some(found) = found else {
        return Judgement::Diverged(Divergence {
            kind: DivergenceKind::Missing,
            stream_sequence: None,
            stream_msg_id: None,
            detail: format!(
                "a later version of {} is the subject's last message, but version {} is not on the subject",
                row.aggregate_id, row.aggregate_version
            ),
        });
    };
    if is_row(row, found) {
        return Judgement::Delivered(found.sequence);
    }
    match found.aggregate {
        Some((aggregate, version)) if aggregate == row.aggregate_id => {
            if version == row.aggregate_version {
                Judgement::Diverged(other_event(row, found))
            } else {
                Judgement::Diverged(found_at(
                    DivergenceKind::Missing,
                    found,
                    format!(
                        "version {} of {} is not in the stream; the first later message on its subject is version {version} at stream sequence {}",
                        row.aggregate_version, row.aggregate_id, found.sequence
                    ),
                ))
            }
        }
        _ => Judgement::Diverged(foreign(row, found)),
    }
}

/// A duplicate PubAck named `sequence`, but the stream holds no such message of this event there
/// (`found`: what it holds instead, if anything).
pub fn remembered_not_held(
    row: &ClaimedRow,
    sequence: u64,
    found: Option<SubjectMessage>,
) -> Divergence {
    Divergence {
        kind: DivergenceKind::Missing,
        stream_sequence: Some(sequence),
        stream_msg_id: found.and_then(|message| message.msg_id),
        detail: format!(
            "JetStream acknowledged event {} of {} as a duplicate at stream sequence {sequence}, but the stream no longer holds it there (deleted or purged inside the dedupe window)",
            row.event_id, row.aggregate_id
        ),
    }
}

/// Whether `message` is the row's own event.
pub fn is_row(row: &ClaimedRow, message: &SubjectMessage) -> bool {
    let mut buffer = Uuid::encode_buffer();
    message.msg_id.as_deref() == Some(&*row.event_id.hyphenated().encode_lower(&mut buffer))
}

fn other_event(row: &ClaimedRow, message: &SubjectMessage) -> Divergence {
    found_at(
        DivergenceKind::OtherEvent,
        message,
        format!(
            "stream sequence {} holds version {} of {} as event {}, the store as event {} (a store restored behind its stream, or a forged message)",
            message.sequence,
            row.aggregate_version,
            row.aggregate_id,
            message.msg_id.as_deref().unwrap_or("without a message id"),
            row.event_id
        ),
    )
}

fn foreign(row: &ClaimedRow, message: &SubjectMessage) -> Divergence {
    let what = match message.aggregate {
        Some((aggregate, version)) => format!("claims to be version {version} of {aggregate}"),
        None => "is not a readable event".to_owned(),
    };
    found_at(
        DivergenceKind::Foreign,
        message,
        format!(
            "stream sequence {} on the subject of {} {what} (message id {})",
            message.sequence,
            row.aggregate_id,
            message.msg_id.as_deref().unwrap_or("none")
        ),
    )
}

/// Reads the last message on `subject` (`None` when there is none).
pub async fn last_message(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
) -> Result<Option<SubjectMessage>, String> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(subject_message(&message))),
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(error) => Err(format!(
            "reading the last message on {subject}: {}",
            ops::error_chain(&error)
        )),
    }
}

/// Reads the message at `sequence` (`None` when the stream does not hold it).
pub async fn message_at_sequence(
    stream: &jetstream::stream::Stream<()>,
    sequence: u64,
) -> Result<Option<SubjectMessage>, String> {
    match stream.get_raw_message(sequence).await {
        Ok(message) => Ok(Some(subject_message(&message))),
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(error) => Err(format!(
            "reading stream sequence {sequence}: {}",
            ops::error_chain(&error)
        )),
    }
}

/// At most this many messages are read past the expected position looking for a row's version: each
/// is one request, and anything but a few copies there is a divergence anyway.
const MAX_WALK: usize = 64;

/// Reads `subject` from sequence `from` on and returns the first message that is not an earlier
/// version of `aggregate` than `version` (copies published by hand are skipped).
pub async fn message_at_version(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
    from: u64,
    aggregate: Uuid,
    version: i64,
) -> Result<Option<SubjectMessage>, String> {
    let mut sequence = from.max(1);
    for _ in 0..MAX_WALK {
        let message = match stream
            .get_first_raw_message_by_subject(subject, sequence)
            .await
        {
            Ok(message) => subject_message(&message),
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Ok(None);
            }
            Err(error) => {
                return Err(format!(
                    "reading {subject} from stream sequence {sequence}: {}",
                    ops::error_chain(&error)
                ));
            }
        };
        match message.aggregate {
            Some((id, v)) if id == aggregate && v < version => sequence = message.sequence + 1,
            _ => return Ok(Some(message)),
        }
    }
    Err(format!(
        "more than {MAX_WALK} earlier versions of {aggregate} on {subject} after stream sequence {from}"
    ))
}

/// One message read back from a subject: what the fence sees, and the body's own event id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBack {
    /// Sequence, message id and claimed identity.
    pub message: SubjectMessage,
    /// The `event_id` of the body, when it is an envelope.
    pub body_event_id: Option<Uuid>,
}

impl ReadBack {
    /// From a message's sequence, headers and body (read by a request or delivered by a consumer).
    pub fn from_parts(sequence: u64, headers: &async_nats::HeaderMap, body: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct Envelope {
            event_id: Uuid,
        }
        Self {
            message: SubjectMessage {
                sequence,
                msg_id: header(headers, wire::MSG_ID),
                aggregate: identity(headers, body),
            },
            body_event_id: serde_json::from_slice::<Envelope>(body)
                .ok()
                .map(|e| e.event_id),
        }
    }
}

/// Every message on `subject`, in stream order, one request each (for an aggregate or a few: a whole
/// stream is read with a consumer).
pub async fn read_subject<I>(
    stream: &jetstream::stream::Stream<I>,
    subject: &str,
) -> Result<Vec<ReadBack>, String> {
    let mut messages = Vec::new();
    let mut sequence = 1;
    loop {
        match stream
            .get_first_raw_message_by_subject(subject, sequence)
            .await
        {
            Ok(raw) => {
                sequence = raw.sequence + 1;
                messages.push(ReadBack::from_parts(
                    raw.sequence,
                    &raw.headers,
                    &raw.payload,
                ));
            }
            Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                return Ok(messages);
            }
            Err(error) => {
                return Err(format!(
                    "reading {subject} from stream sequence {sequence}: {}",
                    ops::error_chain(&error)
                ));
            }
        }
    }
}

fn subject_message(message: &jetstream::message::StreamMessage) -> SubjectMessage {
    ReadBack::from_parts(message.sequence, &message.headers, &message.payload).message
}

fn header(headers: &async_nats::HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.as_str().to_owned())
}

/// The aggregate id and version a message claims: from the routing headers when both parse, else from
/// the envelope fields of the body.
pub fn identity(headers: &async_nats::HeaderMap, body: &[u8]) -> Option<(Uuid, i64)> {
    let from_headers = header(headers, wire::AGGREGATE_ID)
        .and_then(|id| Uuid::parse_str(&id).ok())
        .zip(header(headers, wire::AGGREGATE_VERSION).and_then(|v| v.parse().ok()));
    from_headers.or_else(|| {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let id = Uuid::parse_str(value.get("aggregate_id")?.as_str()?).ok()?;
        Some((id, value.get("aggregate_version")?.as_i64()?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use chrono::Utc;

    fn row(version: i64, previous_sequence: Option<i64>) -> ClaimedRow {
        ClaimedRow {
            id: 1,
            attempts: 0,
            created_at: Utc::now(),
            traceparent: None,
            event_id: Uuid::from_u128(100 + u128::from(version.unsigned_abs())),
            event_type: "order.paid".into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(7),
            aggregate_version: version,
            body: Bytes::from_static(b"{}"),
            previous_sequence,
            tid: String::new(),
        }
    }

    fn message(sequence: u64, msg_id: &str, aggregate: Option<(u128, i64)>) -> SubjectMessage {
        SubjectMessage {
            sequence,
            msg_id: Some(msg_id.to_owned()),
            aggregate: aggregate.map(|(a, v)| (Uuid::from_u128(a), v)),
        }
    }

    fn kind(judgement: &Judgement) -> Option<DivergenceKind> {
        match judgement {
            Judgement::Diverged(divergence) => Some(divergence.kind),
            _ => None,
        }
    }

    /// The judgement of the last message alone (a lookup is not one).
    fn judged(row: &ClaimedRow, last: Option<&SubjectMessage>) -> Judgement {
        match judge(row, last) {
            Reading::Judged(judgement) => judgement,
            Reading::LookFrom(from) => panic!("looks from {from}"),
        }
    }

    #[test]
    fn an_empty_subject_is_fenced_at_zero() {
        assert_eq!(judged(&row(1, Some(0)), None), Judgement::Expect(0));
    }

    #[test]
    fn finding_the_row_itself_means_delivered_at_its_sequence() {
        let row = row(2, Some(39));
        let found = message(40, &row.event_id.to_string(), Some((7, 2)));
        assert_eq!(judged(&row, Some(&found)), Judgement::Delivered(40));
        assert_eq!(judge_found(&row, Some(&found)), Judgement::Delivered(40));
    }

    #[test]
    fn a_later_version_is_not_proof_the_version_at_the_row_is_looked_up() {
        let later = message(41, "v3", Some((7, 3)));
        assert_eq!(
            judge(&row(2, Some(20)), Some(&later)),
            Reading::LookFrom(21)
        );
        assert_eq!(
            judge(&row(2, None), Some(&later)),
            Reading::LookFrom(1),
            "an unknown predecessor: from the subject's start"
        );
    }

    #[test]
    fn another_event_at_the_rows_version_is_a_divergence() {
        // The store was restored behind the stream and decided a new version 2.
        let row = row(2, Some(20));
        let old_v2 = message(21, "the-old-v2", Some((7, 2)));
        let judgement = judge_found(&row, Some(&old_v2));
        assert_eq!(kind(&judgement), Some(DivergenceKind::OtherEvent));
        let Judgement::Diverged(divergence) = judgement else {
            unreachable!()
        };
        assert_eq!(divergence.stream_sequence, Some(21));
        assert_eq!(divergence.stream_msg_id.as_deref(), Some("the-old-v2"));
        assert!(
            divergence.detail.contains(&row.event_id.to_string()),
            "{divergence}"
        );
        // And when it is the subject's last message.
        assert_eq!(
            kind(&judged(&row, Some(&old_v2))),
            Some(DivergenceKind::OtherEvent)
        );
    }

    #[test]
    fn a_gap_where_the_row_should_be_is_a_divergence() {
        let row = row(2, Some(20));
        let v3 = message(22, "v3", Some((7, 3)));
        assert_eq!(
            kind(&judge_found(&row, Some(&v3))),
            Some(DivergenceKind::Missing)
        );
        assert_eq!(
            kind(&judge_found(&row, None)),
            Some(DivergenceKind::Missing)
        );
    }

    #[test]
    fn a_copy_of_an_earlier_version_is_fenced_on() {
        let found = message(42, "copy-of-v1", Some((7, 1)));
        assert_eq!(
            judged(&row(2, Some(10)), Some(&found)),
            Judgement::Expect(42)
        );
    }

    #[test]
    fn foreign_messages_are_divergences() {
        let other_aggregate = message(44, "x", Some((8, 1)));
        let garbage = message(45, "x", None);
        for found in [other_aggregate, garbage] {
            assert_eq!(
                kind(&judged(&row(2, Some(1)), Some(&found))),
                Some(DivergenceKind::Foreign),
                "{found:?}"
            );
            assert_eq!(
                kind(&judge_found(&row(2, Some(1)), Some(&found))),
                Some(DivergenceKind::Foreign),
                "{found:?}"
            );
        }
    }

    #[test]
    fn a_divergence_round_trips_through_its_stored_json() {
        let divergence = found_at(
            DivergenceKind::OtherEvent,
            &message(9, "m", Some((7, 2))),
            "d".into(),
        );
        let json = serde_json::to_value(&divergence).expect("json");
        assert_eq!(json["kind"], "other_event");
        assert_eq!(
            serde_json::from_value::<Divergence>(json).expect("back"),
            divergence
        );
    }
}
