//! The fence at the broker: what the stream's last message on an aggregate's subject says about a row.
//!
//! Every publish carries `Nats-Expected-Last-Subject-Sequence`. JetStream refuses it (error 10071) when
//! the subject's last message is not the one expected — a relay that stalled past the dedupe window and
//! publishes a claim it lost, or a copy of an event that someone published by hand. The relay then reads
//! that last message and [`judge`]s: the row was delivered already (it, or a later version, is there),
//! the expectation was merely stale (the last message is an earlier version, e.g. a hand-made copy: fence
//! on it and publish), or a real conflict (something else is on the subject).
//!
//! The same reading answers when a head's expectation is unknown (its predecessor's row was purged).

use async_nats::jetstream::{self, stream::LastRawMessageErrorKind};
use domain::wire;
use uuid::Uuid;

use crate::claim::ClaimedRow;

/// The last message on a subject, as far as the fence cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastMessage {
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
    /// The row is in the stream already: its own message is the last one (`Some(sequence)`), or a later
    /// version of the aggregate is (`None`: it went before that one, at a sequence not looked up).
    Delivered(Option<u64>),
    /// Something the relay cannot account for is on the subject.
    Conflict(String),
}

/// Decides from the subject's last message (`None`: the subject holds nothing).
pub fn judge(row: &ClaimedRow, last: Option<&LastMessage>) -> Judgement {
    let Some(last) = last else {
        // Nothing on the subject (a new aggregate, or its history was removed from the stream): the
        // fence is "no message yet".
        return Judgement::Expect(0);
    };
    if last.msg_id.as_deref() == Some(row.event_id.to_string().as_str()) {
        return Judgement::Delivered(Some(last.sequence));
    }
    match last.aggregate {
        Some((aggregate, version)) if aggregate == row.aggregate_id => {
            if version > row.aggregate_version {
                Judgement::Delivered(None)
            } else if version < row.aggregate_version {
                Judgement::Expect(last.sequence)
            } else {
                Judgement::Conflict(format!(
                    "stream sequence {} holds version {version} of this aggregate under another message id ({})",
                    last.sequence,
                    last.msg_id.as_deref().unwrap_or("none")
                ))
            }
        }
        Some((aggregate, version)) => Judgement::Conflict(format!(
            "stream sequence {} on this subject claims to be version {version} of aggregate {aggregate}",
            last.sequence
        )),
        None => Judgement::Conflict(format!(
            "stream sequence {} on this subject is not a readable event (message id {})",
            last.sequence,
            last.msg_id.as_deref().unwrap_or("none")
        )),
    }
}

/// Reads the last message on `subject` (`None` when there is none).
pub async fn last_message(
    stream: &jetstream::stream::Stream<()>,
    subject: &str,
) -> Result<Option<LastMessage>, String> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(LastMessage {
            sequence: message.sequence,
            msg_id: header(&message.headers, wire::MSG_ID),
            aggregate: identity(&message.headers, &message.payload),
        })),
        Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(error) => Err(format!(
            "reading the last message on {subject}: {}",
            ops::error_chain(&error)
        )),
    }
}

fn header(headers: &async_nats::HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.as_str().to_owned())
}

/// The aggregate id and version a message claims: from the routing headers when both parse, else from
/// the envelope fields of the body.
fn identity(headers: &async_nats::HeaderMap, body: &[u8]) -> Option<(Uuid, i64)> {
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

    fn row(version: i64) -> ClaimedRow {
        ClaimedRow {
            id: 1,
            attempts: 0,
            created_at: Utc::now(),
            traceparent: None,
            event_id: Uuid::from_u128(100 + version as u128),
            event_type: "order.paid".into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(7),
            aggregate_version: version,
            body: Bytes::from_static(b"{}"),
            previous_sequence: None,
            tid: String::new(),
        }
    }

    fn last(sequence: u64, msg_id: &str, aggregate: Option<(u128, i64)>) -> LastMessage {
        LastMessage {
            sequence,
            msg_id: Some(msg_id.to_owned()),
            aggregate: aggregate.map(|(a, v)| (Uuid::from_u128(a), v)),
        }
    }

    #[test]
    fn an_empty_subject_is_fenced_at_zero() {
        assert_eq!(judge(&row(1), None), Judgement::Expect(0));
    }

    #[test]
    fn finding_the_row_itself_means_delivered_at_its_sequence() {
        let row = row(2);
        let found = last(40, &row.event_id.to_string(), Some((7, 2)));
        assert_eq!(judge(&row, Some(&found)), Judgement::Delivered(Some(40)));
    }

    #[test]
    fn a_later_version_means_this_one_went_before_it() {
        let found = last(41, "other", Some((7, 3)));
        assert_eq!(judge(&row(1), Some(&found)), Judgement::Delivered(None));
    }

    #[test]
    fn a_copy_of_an_earlier_version_is_fenced_on() {
        let found = last(42, "copy-of-v1", Some((7, 1)));
        assert_eq!(judge(&row(2), Some(&found)), Judgement::Expect(42));
    }

    #[test]
    fn anything_else_is_a_conflict() {
        let same_version_other_id = last(43, "forged", Some((7, 2)));
        let other_aggregate = last(44, "x", Some((8, 1)));
        let garbage = last(45, "x", None);
        for found in [same_version_other_id, other_aggregate, garbage] {
            assert!(
                matches!(judge(&row(2), Some(&found)), Judgement::Conflict(_)),
                "{found:?}"
            );
        }
    }
}
