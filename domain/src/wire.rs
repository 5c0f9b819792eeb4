//! How an event travels on NATS: its subject and headers. Pure functions and names only, shared by the
//! relay that publishes and the projections that consume, so both sides agree by construction.

use crate::envelope::EventEnvelope;

/// JetStream's dedupe header; always the event id.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The event type, e.g. `order.placed`.
pub const EVENT_TYPE: &str = "Waybill-Event-Type";
/// The payload version.
pub const EVENT_VERSION: &str = "Waybill-Event-Version";
/// The aggregate type, e.g. `order`.
pub const AGGREGATE_TYPE: &str = "Waybill-Aggregate-Type";
/// The aggregate id.
pub const AGGREGATE_ID: &str = "Waybill-Aggregate-Id";
/// The aggregate version: the per-aggregate order key.
pub const AGGREGATE_VERSION: &str = "Waybill-Aggregate-Version";
/// W3C trace context, when the command carried one.
pub const TRACEPARENT: &str = "traceparent";
/// The body's media type.
pub const CONTENT_TYPE: &str = "Content-Type";

/// Default subject prefix: subjects are `waybill.events.<aggregate type>.<aggregate id>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "waybill.events";
/// Default JetStream stream name.
pub const DEFAULT_STREAM: &str = "WAYBILL_EVENTS";

/// The subject for `envelope`: the prefix, the aggregate type, then the aggregate id — e.g.
/// `waybill.events.order.0190…`. Every event of one aggregate goes on one subject, whatever its type
/// (which travels in [`EVENT_TYPE`]): that is what lets the relay fence an aggregate's publishes with
/// `Nats-Expected-Last-Subject-Sequence`, and what keeps its order in any consumer of the subject.
pub fn subject(prefix: &str, envelope: &EventEnvelope) -> Result<String, String> {
    subject_for(prefix, &envelope.aggregate_type, envelope.aggregate_id)
}

/// [`subject`] from the routing facts alone.
pub fn subject_for(
    prefix: &str,
    aggregate_type: &str,
    aggregate_id: uuid::Uuid,
) -> Result<String, String> {
    check_subject_tokens(prefix, "subject prefix")?;
    check_subject_tokens(aggregate_type, "aggregate type")?;
    if aggregate_type.contains('.') {
        return Err(format!(
            "aggregate type {aggregate_type:?} must be one subject token (no dots)"
        ));
    }
    Ok(format!("{prefix}.{aggregate_type}.{aggregate_id}"))
}

/// The aggregate id a subject names: its last token, when that is a UUID.
pub fn aggregate_id_of_subject(subject: &str) -> Option<uuid::Uuid> {
    subject
        .rsplit('.')
        .next()
        .and_then(|token| uuid::Uuid::parse_str(token).ok())
}

/// The partition of an aggregate in a stream that splits `partitions` partitions, as the stream's
/// subject transform computes it (`{{partition(P,2)}}`, [`partition_transform`]): FNV-1a (32 bits) of
/// the id as the subject writes it (lowercase, hyphenated), modulo P. Computed here too because a
/// reader must find an aggregate's stored subject, and a projection catching up from the event store
/// must pick the same orders as its consumer's filter.
pub fn stream_partition(aggregate_id: uuid::Uuid, partitions: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let mut id = uuid::Uuid::encode_buffer();
    let hash = aggregate_id
        .hyphenated()
        .encode_lower(&mut id)
        .bytes()
        .fold(OFFSET, |hash, byte| {
            (hash ^ u32::from(byte)).wrapping_mul(PRIME)
        });
    hash % partitions.max(1)
}

/// The subject an aggregate's events are stored under: [`subject_for`]'s when the stream splits no
/// partitions (`partitions` ≤ 1), else `<prefix>.<K>.<aggregate type>.<aggregate id>` with K its
/// [`stream_partition`] — the relay publishes to the first, the stream's transform stores the second.
/// Every event of an aggregate is still on one subject, which is what the fence counts on.
pub fn stored_subject(
    prefix: &str,
    aggregate_type: &str,
    aggregate_id: uuid::Uuid,
    partitions: u32,
) -> Result<String, String> {
    let subject = subject_for(prefix, aggregate_type, aggregate_id)?;
    if partitions <= 1 {
        return Ok(subject);
    }
    let partition = stream_partition(aggregate_id, partitions);
    Ok(format!(
        "{prefix}.{partition}.{aggregate_type}.{aggregate_id}"
    ))
}

/// The stream's subject transform that splits `partitions` partitions at the broker: source
/// `<prefix>.*.*` (what the relay publishes), destination `<prefix>.{{partition(P,2)}}.{{wildcard(1)}}.
/// {{wildcard(2)}}` — the partition token goes before the aggregate type, so an aggregate's id stays
/// the subject's last token and its type the one before, for every reader.
pub fn partition_transform(prefix: &str, partitions: u32) -> (String, String) {
    (
        format!("{prefix}.*.*"),
        format!(
            "{prefix}.{{{{partition({partitions},2)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}"
        ),
    )
}

/// The partition count of a stream whose subject transform is `(source, destination)`: P when it is
/// [`partition_transform`]'s for `prefix`, `None` for any other transform.
pub fn partitions_of_transform(prefix: &str, source: &str, destination: &str) -> Option<u32> {
    let wanted_source = format!("{prefix}.*.*");
    if source != wanted_source {
        return None;
    }
    let count: u32 = destination
        .strip_prefix(&format!("{prefix}.{{{{partition("))?
        .split_once(",2)}}")?
        .0
        .parse()
        .ok()?;
    (partition_transform(prefix, count).1 == destination && count > 1).then_some(count)
}

/// The filter of partition `partition`'s messages in a stream that splits partitions.
pub fn partition_filter(prefix: &str, partition: u32) -> String {
    format!("{prefix}.{partition}.>")
}

/// The aggregate type and id tokens of a stored subject under `prefix`: `<prefix>.<type>.<id>`, or
/// `<prefix>.<K>.<type>.<id>` in a stream that splits partitions (K a number); `None` for any other
/// shape or an empty type. The id token is not checked (see [`parse_stored_subject`]).
pub fn stored_subject_tokens<'a>(prefix: &str, subject: &'a str) -> Option<(&'a str, &'a str)> {
    let rest = subject.strip_prefix(prefix)?.strip_prefix('.')?;
    let tokens: Vec<&str> = rest.split('.').collect();
    let (aggregate_type, id) = match tokens.as_slice() {
        [aggregate_type, id] => (*aggregate_type, *id),
        [partition, aggregate_type, id]
            if !partition.is_empty() && partition.bytes().all(|b| b.is_ascii_digit()) =>
        {
            (*aggregate_type, *id)
        }
        _ => return None,
    };
    (!aggregate_type.is_empty()).then_some((aggregate_type, id))
}

/// The aggregate type and id of a stored subject (see [`stored_subject_tokens`]), when its last
/// token is a UUID.
pub fn parse_stored_subject<'a>(prefix: &str, subject: &'a str) -> Option<(&'a str, uuid::Uuid)> {
    let (aggregate_type, id) = stored_subject_tokens(prefix, subject)?;
    Some((aggregate_type, uuid::Uuid::parse_str(id).ok()?))
}

/// The filter matching every subject under `prefix`.
pub fn all_subjects(prefix: &str) -> String {
    format!("{prefix}.>")
}

/// A dotted name is usable in a subject if every token is non-empty and free of wildcards and spaces.
pub fn check_subject_tokens(dotted: &str, what: &str) -> Result<(), String> {
    let bad = dotted.is_empty()
        || dotted.split('.').any(|token| {
            token.is_empty()
                || token
                    .chars()
                    .any(|c| c.is_whitespace() || c == '*' || c == '>')
        });
    if bad {
        Err(format!(
            "{what} {dotted:?} is not a valid NATS subject (empty token, space or wildcard)"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::EventEnvelope;
    use serde_json::json;
    use uuid::Uuid;

    fn envelope(event_type: &str) -> EventEnvelope {
        EventEnvelope {
            event_id: Uuid::nil(),
            event_type: event_type.into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(7),
            aggregate_version: 1,
            occurred_at: chrono::DateTime::UNIX_EPOCH,
            correlation_id: None,
            causation_id: None,
            payload: json!({}),
        }
    }

    #[test]
    fn every_event_of_an_aggregate_goes_on_its_subject() {
        let placed = subject("waybill.events", &envelope("order.placed")).expect("valid");
        let paid = subject("waybill.events", &envelope("order.paid")).expect("valid");
        assert_eq!(
            placed,
            "waybill.events.order.00000000-0000-0000-0000-000000000007"
        );
        assert_eq!(
            placed, paid,
            "the type travels in a header, not the subject"
        );
        assert_eq!(aggregate_id_of_subject(&placed), Some(Uuid::from_u128(7)));
        assert_eq!(aggregate_id_of_subject("waybill.events.order.x"), None);
    }

    #[test]
    fn a_split_stream_stores_an_aggregate_under_its_partition_and_the_transform_reads_back() {
        // Partitions as nats-server 2.15.1 computed them for these ids (`{{partition(2,2)}}`).
        for (id, partition) in [
            ("0190a1b2-0000-7000-8000-000000000001", 1),
            ("0190a1b2-0000-7000-8000-000000000002", 0),
            ("0190a1b2-0000-7000-8000-000000000003", 1),
        ] {
            let id = Uuid::parse_str(id).expect("uuid");
            assert_eq!(stream_partition(id, 2), partition, "{id}");
            assert_eq!(
                stored_subject("w.e", "order", id, 2).expect("valid"),
                format!("w.e.{partition}.order.{id}")
            );
            assert_eq!(
                stored_subject("w.e", "order", id, 1).expect("valid"),
                format!("w.e.order.{id}")
            );
        }
        let (source, destination) = partition_transform("w.e", 4);
        assert_eq!(source, "w.e.*.*");
        assert_eq!(
            destination,
            "w.e.{{partition(4,2)}}.{{wildcard(1)}}.{{wildcard(2)}}"
        );
        assert_eq!(
            partitions_of_transform("w.e", &source, &destination),
            Some(4)
        );
        assert_eq!(partitions_of_transform("x", &source, &destination), None);
        assert_eq!(
            partitions_of_transform("w.e", &source, "w.e.{{wildcard(1)}}"),
            None
        );
        assert_eq!(partition_filter("w.e", 3), "w.e.3.>");
        let id = Uuid::from_u128(7);
        for subject in [format!("w.e.order.{id}"), format!("w.e.1.order.{id}")] {
            assert_eq!(parse_stored_subject("w.e", &subject), Some(("order", id)));
        }
        for bad in [
            format!("w.e.x.order.{id}"),
            format!("w.e.1.2.order.{id}"),
            format!("w.e..{id}"),
            "w.e.order.x".to_owned(),
            format!("w.eorder.{id}"),
        ] {
            assert_eq!(parse_stored_subject("w.e", &bad), None, "{bad}");
        }
    }

    #[test]
    fn wildcards_and_blanks_are_refused() {
        for bad in [
            "order.*",
            "order..placed",
            "order placed",
            "",
            "order.>",
            "*",
            "a.b",
        ] {
            assert!(
                subject_for("p", bad, Uuid::from_u128(7)).is_err(),
                "{bad:?}"
            );
        }
        assert!(subject("bad prefix", &envelope("order.placed")).is_err());
    }
}
