//! Partitions: a projection's orders divided among instances by a stable hash of the order id, so
//! that several instances share the work while each order's events are still applied by one of them,
//! in stream order.
//!
//! The partition of an order is its id's 128 bits read as an unsigned big-endian integer (the UUID's
//! 32 hex digits as one number), modulo the partition count. This is a contract (DESIGN.md): every
//! instance of a projection must compute the same partition for the same order, whatever its version.
//!
//! A message's partition comes from its subject's last token, the aggregate id (the subject contract
//! `<prefix>.<aggregate_type>.<aggregate_id>`), so deciding needs no decoding. A message whose last
//! token is not a UUID is poison: partition 0 takes it, so it is parked exactly once. The trust check
//! parks a message whose body names another order than its subject, so an order's events — the ones
//! that are applied — all fall in the partition of its subject.
//!
//! Two layouts, chosen when the runner connects, each with its own function and its own consumer
//! names so that a consumer never changes function under its position:
//!
//! - **Split by the server** (the stream was provisioned with `--stream-partitions P`, nats-server
//!   2.10+, and the projection runs with the same P): the stream's subject transform stores each
//!   event under `<prefix>.<K>.<type>.<id>`, K = `domain::wire::stream_partition` (FNV-1a of the id,
//!   the server's own function), and partition K's consumer `<name>-s<K>of<P>` filters on
//!   `<prefix>.<K>.>`: the broker delivers each event once in all.
//! - **Split by the instance** (any other stream or P): partition K's consumer `<name>-p<K>of<P>`
//!   reads the whole stream and the runner acks the other partitions' messages without applying
//!   them (P deliveries per event); the partition is the id as a number modulo P.

use std::fmt;

use uuid::Uuid;

/// The most partitions a projection may be split into: each partition's consumer reads the whole
/// stream, so every partition multiplies the broker's delivery work.
pub const MAX_PARTITIONS: u32 = 64;

/// Why a partition layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    /// `--partitions 0`.
    #[error("--partitions must be at least 1")]
    NoPartitions,
    /// More partitions than [`MAX_PARTITIONS`].
    #[error(
        "--partitions {count} is more than {MAX_PARTITIONS}: every partition's consumer reads the whole stream"
    )]
    TooMany {
        /// The count asked for.
        count: u32,
    },
    /// A partition number outside `0..count`.
    #[error(
        "--partition {partition} does not exist with --partitions {count} (partitions are numbered 0 to {last})",
        last = count - 1
    )]
    OutOfRange {
        /// The partition asked for.
        partition: u32,
        /// The partition count.
        count: u32,
    },
}

/// How many partitions a projection is split into and which of them this instance applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitions {
    count: u32,
    owned: Vec<u32>,
    /// Split by the server (the stream's subject transform) rather than by the instance.
    by_server: bool,
}

impl Default for Partitions {
    fn default() -> Self {
        Self::single()
    }
}

impl Partitions {
    /// One partition holding every order: today's single consumer, named after the projection.
    pub fn single() -> Self {
        Self {
            count: 1,
            owned: vec![0],
            by_server: false,
        }
    }

    /// `count` partitions of which this instance owns `owned` (every one when empty). Refused: no
    /// partitions, more than [`MAX_PARTITIONS`], or an owned partition not below `count`.
    pub fn new(count: u32, owned: &[u32]) -> Result<Self, PartitionError> {
        if count == 0 {
            return Err(PartitionError::NoPartitions);
        }
        if count > MAX_PARTITIONS {
            return Err(PartitionError::TooMany { count });
        }
        if let Some(&partition) = owned.iter().find(|&&k| k >= count) {
            return Err(PartitionError::OutOfRange { partition, count });
        }
        let mut owned = if owned.is_empty() {
            (0..count).collect()
        } else {
            owned.to_vec()
        };
        owned.sort_unstable();
        owned.dedup();
        Ok(Self {
            count,
            owned,
            by_server: false,
        })
    }

    /// The same layout, split by the server: the stream splits this many partitions itself.
    pub fn split_by_server(self) -> Self {
        Self {
            by_server: self.count > 1,
            ..self
        }
    }

    /// True when the stream's subject transform splits the partitions and each consumer filters on
    /// its own (see the module's documentation).
    pub fn is_split_by_server(&self) -> bool {
        self.by_server
    }

    /// The partition count, P.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The partitions this instance applies, ascending.
    pub fn owned(&self) -> &[u32] {
        &self.owned
    }

    /// True for the unpartitioned layout (P = 1).
    pub fn is_single(&self) -> bool {
        self.count == 1
    }

    /// The partition of an order.
    pub fn of_aggregate(&self, aggregate_id: Uuid) -> u32 {
        if self.by_server {
            domain::wire::stream_partition(aggregate_id, self.count)
        } else {
            partition_of(aggregate_id, self.count)
        }
    }

    /// The filter of partition `partition`'s consumer: its own partition's subjects when the server
    /// splits, else every subject under `prefix`.
    pub fn filter(&self, prefix: &str, partition: u32) -> String {
        if self.by_server {
            domain::wire::partition_filter(prefix, partition)
        } else {
            domain::wire::all_subjects(prefix)
        }
    }

    /// The partition of a message, from its subject's last token (partition 0 when that is not a
    /// UUID: such a message is poison, and one partition must park it).
    pub fn of_subject(&self, subject: &str) -> u32 {
        if self.is_single() {
            return 0;
        }
        subject
            .rsplit('.')
            .next()
            .and_then(|token| Uuid::parse_str(token).ok())
            .map_or(0, |id| self.of_aggregate(id))
    }

    /// The durable consumer of partition `partition`: `base` itself when there is one partition (the
    /// consumer keeps its name), else `<base>-p<K>of<P>`, or `<base>-s<K>of<P>` split by the server.
    pub fn consumer_name(&self, base: &str, partition: u32) -> String {
        if self.is_single() {
            base.to_owned()
        } else {
            let split = if self.by_server { 's' } else { 'p' };
            format!("{base}-{split}{partition}of{}", self.count)
        }
    }

    /// How metrics and logs name a partition: `<K>of<P>`.
    pub fn label(&self, partition: u32) -> String {
        format!("{partition}of{}", self.count)
    }
}

impl fmt::Display for Partitions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let owned: Vec<String> = self.owned.iter().map(u32::to_string).collect();
        write!(f, "{} of {}", owned.join(","), self.count)
    }
}

/// The partition of `aggregate_id` among `count`: the id as a big-endian u128, modulo `count`.
#[allow(
    clippy::cast_possible_truncation,
    reason = "a remainder modulo a u32 fits in a u32"
)]
pub fn partition_of(aggregate_id: Uuid, count: u32) -> u32 {
    (aggregate_id.as_u128() % u128::from(count.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_is_the_id_as_a_number_modulo_the_count() {
        let id = Uuid::parse_str("00000000-0000-0000-0000-00000000000b").expect("uuid");
        assert_eq!(partition_of(id, 1), 0);
        assert_eq!(partition_of(id, 2), 1);
        assert_eq!(partition_of(id, 4), 3);
        // Fixed values: a change of the hash would move orders between partitions.
        let id = Uuid::parse_str("0190f6c2-7a1b-7c3d-8e4f-a1b2c3d4e5f6").expect("uuid");
        assert_eq!(partition_of(id, 3), (id.as_u128() % 3) as u32);
        assert_eq!(partition_of(id, 2), 0, "...f6 is even");
    }

    #[test]
    fn the_subject_names_the_partition_and_garbage_goes_to_partition_0() {
        let partitions = Partitions::new(4, &[]).expect("layout");
        let id = Uuid::parse_str("00000000-0000-0000-0000-000000000007").expect("uuid");
        assert_eq!(
            partitions.of_subject(&format!("waybill.events.order.{id}")),
            3
        );
        assert_eq!(partitions.of_subject("waybill.events.order.not-a-uuid"), 0);
        assert_eq!(partitions.of_subject(""), 0);
    }

    #[test]
    fn v7_ids_spread_over_the_partitions() {
        let partitions = Partitions::new(4, &[]).expect("layout");
        let mut counts = [0u32; 4];
        for _ in 0..4000 {
            counts[partitions.of_aggregate(Uuid::now_v7()) as usize] += 1;
        }
        assert!(counts.iter().all(|&n| n > 800), "{counts:?}");
    }

    #[test]
    fn inconsistent_layouts_are_refused() {
        assert_eq!(Partitions::new(0, &[]), Err(PartitionError::NoPartitions));
        assert_eq!(
            Partitions::new(2, &[2]),
            Err(PartitionError::OutOfRange {
                partition: 2,
                count: 2
            })
        );
        let message = Partitions::new(2, &[0, 5]).expect_err("5 of 2").to_string();
        assert!(message.contains("0 to 1"), "{message}");
        assert!(matches!(
            Partitions::new(MAX_PARTITIONS + 1, &[]),
            Err(PartitionError::TooMany { .. })
        ));
    }

    #[test]
    fn an_instance_owns_every_partition_unless_told_and_one_partition_keeps_the_name() {
        let all = Partitions::new(3, &[]).expect("layout");
        assert_eq!(all.owned(), &[0, 1, 2]);
        let some = Partitions::new(3, &[2, 0, 2]).expect("layout");
        assert_eq!(some.owned(), &[0, 2]);
        assert_eq!(some.consumer_name("points", 2), "points-p2of3");
        assert_eq!(Partitions::single().consumer_name("points", 0), "points");
        assert_eq!(some.to_string(), "0,2 of 3");
    }

    #[test]
    fn split_by_the_server_the_layout_takes_the_servers_function_its_names_and_filters() {
        let by_instance = Partitions::new(2, &[]).expect("layout");
        let by_server = by_instance.clone().split_by_server();
        assert!(by_server.is_split_by_server() && !by_instance.is_split_by_server());
        assert_eq!(by_server.consumer_name("points", 1), "points-s1of2");
        assert_eq!(by_server.filter("w.e", 1), "w.e.1.>");
        assert_eq!(by_instance.filter("w.e", 1), "w.e.>");
        // The server's partition (FNV-1a of the id), as nats-server 2.15.1 computed it.
        let id = Uuid::parse_str("0190a1b2-0000-7000-8000-000000000001").expect("uuid");
        assert_eq!(by_server.of_aggregate(id), 1);
        let id = Uuid::parse_str("0190a1b2-0000-7000-8000-000000000003").expect("uuid");
        assert_eq!(by_server.of_aggregate(id), 1);
        let id = Uuid::parse_str("0190a1b2-0000-7000-8000-000000000002").expect("uuid");
        assert_eq!(by_server.of_aggregate(id), 0);
        let id = Uuid::parse_str("0190a1b2-0000-7000-8000-00000000000a").expect("uuid");
        assert_ne!(
            by_server.of_aggregate(id),
            by_instance.of_aggregate(id),
            "two functions: a consumer never changes from one to the other (its own name)"
        );
        // A stored subject carries the partition before the type; the id is still the last token.
        assert_eq!(by_server.of_subject(&format!("w.e.1.order.{id}")), 1);
        assert!(!Partitions::single().split_by_server().is_split_by_server());
    }
}
