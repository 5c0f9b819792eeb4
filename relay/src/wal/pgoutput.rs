//! Decodes the pgoutput messages the WAL relay reads: relation descriptions and inserts into the
//! outbox (protocol version 1, text format). Begin, commit and logical messages are decoded by
//! `pgwire-replication`; every other message (update, delete, truncate, type, origin) is skipped.

use std::collections::HashMap;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use store::outbox::relaying::ClaimedRow;
use uuid::Uuid;

/// Why a pgoutput message could not be read. The stream is PostgreSQL's own, so any of these is a
/// bug or a protocol change: the relay stops rather than guess.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The message ended inside a field.
    #[error("pgoutput {message}: truncated")]
    Truncated { message: &'static str },
    /// A string was not terminated or not UTF-8.
    #[error("pgoutput {message}: malformed string")]
    BadString { message: &'static str },
    /// A tuple column of a kind this relay does not ask for (binary or an unknown marker).
    #[error("pgoutput insert: column {column} has kind {kind:?}")]
    ColumnKind { column: usize, kind: char },
    /// An insert into a relation no Relation message described first.
    #[error("pgoutput insert into relation {0} before its description")]
    UnknownRelation(u32),
    /// An insert into the outbox lacks a column the relay needs, or holds a value it cannot read.
    #[error("outbox insert: {0}")]
    Row(String),
}

/// One decoded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A relation's description: sent before the first change to it in a session, and again when its
    /// definition changed.
    Relation(Relation),
    /// A new row: the relation's id and each column's text value (`None` for NULL), in the
    /// relation's column order.
    Insert {
        relation: u32,
        values: Vec<Option<String>>,
    },
    /// Anything else (its tag): nothing the relay acts on.
    Skipped(u8),
}

/// A relation as pgoutput describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<String>,
}

/// Decodes one pgoutput message (the payload of an XLogData frame).
pub fn decode(data: &[u8]) -> Result<Change, DecodeError> {
    let Some((&tag, rest)) = data.split_first() else {
        return Err(DecodeError::Truncated { message: "message" });
    };
    let mut reader = Reader { rest, message: "" };
    match tag {
        b'R' => {
            reader.message = "relation";
            let id = reader.u32()?;
            let namespace = reader.string()?;
            let name = reader.string()?;
            let _replica_identity = reader.u8()?;
            let count = reader.u16()?;
            let mut columns = Vec::with_capacity(usize::from(count));
            for _ in 0..count {
                let _flags = reader.u8()?;
                columns.push(reader.string()?);
                let _type_id = reader.u32()?;
                let _type_modifier = reader.u32()?;
            }
            Ok(Change::Relation(Relation {
                id,
                namespace,
                name,
                columns,
            }))
        }
        b'I' => {
            reader.message = "insert";
            let relation = reader.u32()?;
            if reader.u8()? != b'N' {
                return Err(DecodeError::Truncated { message: "insert" });
            }
            let count = reader.u16()?;
            let mut values = Vec::with_capacity(usize::from(count));
            for column in 0..usize::from(count) {
                match reader.u8()? {
                    b'n' => values.push(None),
                    b't' => {
                        let length = reader.u32()? as usize;
                        let bytes = reader.take(length)?;
                        let text = std::str::from_utf8(bytes)
                            .map_err(|_| DecodeError::BadString { message: "insert" })?;
                        values.push(Some(text.to_owned()));
                    }
                    kind => {
                        return Err(DecodeError::ColumnKind {
                            column,
                            kind: char::from(kind),
                        });
                    }
                }
            }
            Ok(Change::Insert { relation, values })
        }
        other => Ok(Change::Skipped(other)),
    }
}

/// Reads big-endian fields off the front of a message.
struct Reader<'a> {
    rest: &'a [u8],
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < n {
            return Err(DecodeError::Truncated {
                message: self.message,
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let bytes = self.take(2)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let bytes = self.take(4)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let end = self
            .rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::BadString {
                message: self.message,
            })?;
        let text = std::str::from_utf8(&self.rest[..end]).map_err(|_| DecodeError::BadString {
            message: self.message,
        })?;
        self.rest = &self.rest[end + 1..];
        Ok(text.to_owned())
    }
}

/// The relations a session has described, and which of them is the outbox.
#[derive(Debug, Default)]
pub struct Relations {
    known: HashMap<u32, Relation>,
}

/// The outbox's columns an insert is read from: a publication must carry them all.
pub const COLUMNS_READ: [&str; 12] = [
    "id",
    "attempts",
    "created_at",
    "traceparent",
    "event_id",
    "event_type",
    "event_version",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "body",
    "status",
];

/// An insert into the outbox, read as the polling relay reads a claimed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxInsert {
    /// The row as a claim would have returned it (no `tid`, no known predecessor sequence yet).
    pub row: ClaimedRow,
    /// `pending` for every row the store writes; fixtures and restores may insert others.
    pub status: String,
}

impl Relations {
    /// Remembers a relation's description.
    pub fn describe(&mut self, relation: Relation) {
        self.known.insert(relation.id, relation);
    }

    /// An insert into `schema.table` read as an outbox row; `Ok(None)` for an insert into any other
    /// table of the publication — another schema's `outbox` included (a publication may list several).
    pub fn outbox_insert(
        &self,
        schema: &str,
        table: &str,
        relation: u32,
        values: &[Option<String>],
    ) -> Result<Option<OutboxInsert>, DecodeError> {
        let described = self
            .known
            .get(&relation)
            .ok_or(DecodeError::UnknownRelation(relation))?;
        if described.name != table || described.namespace != schema {
            return Ok(None);
        }
        let column = |name: &str| -> Result<Option<&str>, DecodeError> {
            let index = described
                .columns
                .iter()
                .position(|c| c == name)
                .ok_or_else(|| DecodeError::Row(format!("no column {name}")))?;
            Ok(values.get(index).and_then(|v| v.as_deref()))
        };
        let required = |name: &str| -> Result<&str, DecodeError> {
            column(name)?.ok_or_else(|| DecodeError::Row(format!("{name} is NULL")))
        };
        fn parsed<T: std::str::FromStr>(name: &str, text: &str) -> Result<T, DecodeError> {
            text.parse()
                .map_err(|_| DecodeError::Row(format!("{name} = {text:?} does not parse")))
        }
        let row = ClaimedRow {
            id: parsed("id", required("id")?)?,
            attempts: parsed("attempts", required("attempts")?)?,
            created_at: timestamp(required("created_at")?)?,
            traceparent: column("traceparent")?.map(str::to_owned),
            event_id: parsed::<Uuid>("event_id", required("event_id")?)?,
            event_type: required("event_type")?.to_owned(),
            event_version: parsed("event_version", required("event_version")?)?,
            aggregate_type: required("aggregate_type")?.to_owned(),
            aggregate_id: parsed::<Uuid>("aggregate_id", required("aggregate_id")?)?,
            aggregate_version: parsed("aggregate_version", required("aggregate_version")?)?,
            body: Bytes::from(required("body")?.to_owned()),
            previous_sequence: None,
            tid: String::new(),
        };
        Ok(Some(OutboxInsert {
            row,
            status: required("status")?.to_owned(),
        }))
    }
}

/// A `timestamptz` in PostgreSQL's text output (`2026-12-06 08:30:00.123456+00`, the session's
/// time zone offset in hours and maybe minutes).
fn timestamp(text: &str) -> Result<DateTime<Utc>, DecodeError> {
    // `%#z` reads `+00`, `+05:30` and `+0530` alike.
    DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| DecodeError::Row(format!("created_at = {text:?} does not parse: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relation_message(id: u32, name: &str, columns: &[&str]) -> Vec<u8> {
        relation_message_in(id, "public", name, columns)
    }

    fn relation_message_in(id: u32, namespace: &str, name: &str, columns: &[&str]) -> Vec<u8> {
        let mut m = vec![b'R'];
        m.extend(id.to_be_bytes());
        m.extend(namespace.as_bytes());
        m.push(0);
        m.extend(name.as_bytes());
        m.push(0);
        m.push(b'd');
        m.extend(u16::try_from(columns.len()).expect("few").to_be_bytes());
        for column in columns {
            m.push(0);
            m.extend(column.as_bytes());
            m.push(0);
            m.extend(25u32.to_be_bytes());
            m.extend(u32::MAX.to_be_bytes());
        }
        m
    }

    fn insert_message(id: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut m = vec![b'I'];
        m.extend(id.to_be_bytes());
        m.push(b'N');
        m.extend(u16::try_from(values.len()).expect("few").to_be_bytes());
        for value in values {
            match value {
                None => m.push(b'n'),
                Some(text) => {
                    m.push(b't');
                    m.extend(u32::try_from(text.len()).expect("short").to_be_bytes());
                    m.extend(text.as_bytes());
                }
            }
        }
        m
    }

    const COLUMNS: [&str; 13] = [
        "id",
        "event_id",
        "event_type",
        "event_version",
        "aggregate_id",
        "aggregate_version",
        "body",
        "status",
        "attempts",
        "created_at",
        "traceparent",
        "aggregate_type",
        "divergence",
    ];

    fn values<'a>(traceparent: Option<&'a str>, body: &'a str) -> Vec<Option<&'a str>> {
        vec![
            Some("42"),
            Some("0193a5c4-7c1e-7d2a-9a61-3f2b1c0d4e5f"),
            Some("order.placed"),
            Some("2"),
            Some("0193a5c4-0000-7000-8000-000000000001"),
            Some("7"),
            Some(body),
            Some("pending"),
            Some("0"),
            Some("2026-12-06 08:30:00.123456+00"),
            traceparent,
            Some("order"),
            None,
        ]
    }

    fn outbox_row(message: &[u8], relations: &Relations) -> Option<OutboxInsert> {
        match decode(message).expect("decodes") {
            Change::Insert { relation, values } => relations
                .outbox_insert("public", "outbox", relation, &values)
                .expect("an outbox row"),
            other => panic!("not an insert: {other:?}"),
        }
    }

    #[test]
    fn an_outbox_insert_reads_as_the_claim_reads_its_row() {
        let mut relations = Relations::default();
        let Change::Relation(relation) =
            decode(&relation_message(16384, "outbox", &COLUMNS)).expect("decodes")
        else {
            panic!("a relation")
        };
        relations.describe(relation);
        let body = "{\"order_id\":\"x\",\"note\":\"ünïcode \\u0000 kept as text\"}";
        let insert = outbox_row(&insert_message(16384, &values(None, body)), &relations)
            .expect("the outbox");
        assert_eq!(insert.status, "pending");
        let row = insert.row;
        assert_eq!(row.id, 42);
        assert_eq!(row.event_type, "order.placed");
        assert_eq!(row.event_version, 2);
        assert_eq!(row.aggregate_version, 7);
        assert_eq!(row.aggregate_type, "order");
        assert_eq!(row.traceparent, None);
        assert_eq!(&row.body[..], body.as_bytes());
        assert_eq!(
            row.created_at.to_rfc3339(),
            "2026-12-06T08:30:00.123456+00:00"
        );
        assert_eq!(row.previous_sequence, None);
    }

    #[test]
    fn columns_are_found_by_name_not_by_position() {
        let mut reversed: Vec<&str> = COLUMNS.to_vec();
        reversed.reverse();
        let mut relations = Relations::default();
        let Change::Relation(relation) =
            decode(&relation_message(7, "outbox", &reversed)).expect("decodes")
        else {
            panic!("a relation")
        };
        relations.describe(relation);
        let mut row = values(Some("00-abc-def-01"), "{}");
        row.reverse();
        let insert = outbox_row(&insert_message(7, &row), &relations).expect("the outbox");
        assert_eq!(insert.row.id, 42);
        assert_eq!(insert.row.traceparent.as_deref(), Some("00-abc-def-01"));
    }

    #[test]
    fn inserts_into_other_tables_are_not_outbox_rows() {
        let mut relations = Relations::default();
        let Change::Relation(relation) =
            decode(&relation_message(9, "events", &["position"])).expect("decodes")
        else {
            panic!("a relation")
        };
        relations.describe(relation);
        assert_eq!(
            outbox_row(&insert_message(9, &[Some("1")]), &relations),
            None
        );
        // Another schema's outbox, published by the same publication, is not this relay's.
        let Change::Relation(relation) =
            decode(&relation_message_in(10, "tenant_b", "outbox", &COLUMNS)).expect("decodes")
        else {
            panic!("a relation")
        };
        relations.describe(relation);
        let body = r#"{"a":1}"#;
        assert_eq!(
            outbox_row(&insert_message(10, &values(None, body)), &relations),
            None
        );
    }

    #[test]
    fn broken_messages_are_errors_not_guesses() {
        let relations = Relations::default();
        // An insert before its relation's description.
        let Change::Insert { relation, values } =
            decode(&insert_message(5, &[Some("1")])).expect("decodes")
        else {
            panic!("an insert")
        };
        assert_eq!(
            relations.outbox_insert("public", "outbox", relation, &values),
            Err(DecodeError::UnknownRelation(5))
        );
        // Cut anywhere inside, a message is truncated, never read short.
        let whole = insert_message(5, &[Some("hello"), None]);
        for cut in 1..whole.len() - 1 {
            assert!(decode(&whole[..cut]).is_err(), "cut at {cut}");
        }
        // A binary column (never asked for) is refused.
        let mut binary = insert_message(5, &[Some("x")]);
        binary[8] = b'b';
        assert!(matches!(
            decode(&binary),
            Err(DecodeError::ColumnKind { kind: 'b', .. })
        ));
        assert_eq!(decode(b"U\0\0"), Ok(Change::Skipped(b'U')));
        assert!(decode(b"").is_err());
    }

    #[test]
    fn timestamps_in_any_offset_read_as_utc() {
        let utc = |text| timestamp(text).expect("parses").to_rfc3339();
        assert_eq!(utc("2026-12-06 08:30:00+00"), "2026-12-06T08:30:00+00:00");
        assert_eq!(
            utc("2026-12-06 14:00:00.5+05:30"),
            "2026-12-06T08:30:00.500+00:00"
        );
        assert!(timestamp("yesterday").is_err());
    }
}
