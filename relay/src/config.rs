//! Everything a relay instance is configured with, and the defaults an operator can rely on.

use std::time::Duration;

use crate::backoff::Backoff;

/// How long an outbox row may stay due while a WAL relay reads the slot before polling delivers it
/// (the WAL relay's own polling pass, and any polling relay standing by beside it): the slot carries
/// inserts only, so a row made due by an update (a dead row replayed, a row rewound by `outbox
/// repair`, a retry the session's opening drain left for later) never reaches the stream, and a WAL
/// relay cut off from NATS delivers nothing. One that keeps up marks a row within milliseconds, and
/// an aggregate handed to its polling passes within their 5 s period.
pub const UNDELIVERED_AFTER: Duration = Duration::from_secs(10);

/// The JetStream stream the relay publishes into.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSettings {
    /// Stream name (`WAYBILL_STREAM`).
    pub name: String,
    /// Subject prefix (`WAYBILL_SUBJECT_PREFIX`); the stream captures `<prefix>.>`.
    pub subject_prefix: String,
    /// How long JetStream remembers a `Nats-Msg-Id` (see ARCHITECTURE.md for how it is sized).
    pub duplicate_window: Duration,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: domain::wire::DEFAULT_STREAM.to_owned(),
            subject_prefix: domain::wire::DEFAULT_SUBJECT_PREFIX.to_owned(),
            duplicate_window: Duration::from_secs(120),
        }
    }
}

/// One relay instance's settings.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Recorded in `claimed_by`; defaults to `relay-<host>-<pid>`. Never used for fencing.
    pub relay_id: String,
    /// Where to publish.
    pub stream: StreamSettings,
    /// Aggregate heads claimed per step.
    pub batch_size: i64,
    /// Rows claimed per step at most, heads plus their following versions.
    pub max_rows: i64,
    /// Bytes of message bodies a step takes at most (the row that crosses it is taken; a step takes
    /// at least one row): what one lane holds in memory however large the rows are.
    pub max_claim_bytes: i64,
    /// Publishes awaiting their PubAck at once.
    pub max_in_flight: usize,
    /// Failed publishes before a row is dead.
    pub max_attempts: i32,
    /// Delays between attempts.
    pub backoff: Backoff,
    /// How long to wait for one PubAck.
    pub publish_timeout: Duration,
    /// Publishing in one step stops starting new messages after this long; the rest stay pending.
    pub step_deadline: Duration,
    /// How often to look for due rows when no notification arrives.
    pub poll_interval: Duration,
    /// A claim lives at most this long: PostgreSQL ends a claim transaction left idle this long, and
    /// other relays end one that is older (a relay frozen while reading its claim), releasing its rows.
    pub claim_idle_timeout: Duration,
    /// Steps run at once by [`crate::Relay::run`] and [`crate::Relay::drain`].
    pub lanes: usize,
    /// Sent rows older than this are deleted by [`crate::Relay::run`], continuously and in batches
    /// of [`RelayConfig::retention_batch`] (`None`: kept until `outbox purge`).
    pub retention: Option<Duration>,
    /// Rows deleted per statement by the retention sweep: short transactions, few locks, and dead
    /// tuples that autovacuum can take in steps.
    pub retention_batch: i64,
    /// The replication slot a WAL relay (`run --source wal`) reads, that [`crate::Relay::run`]
    /// stands by for: while a session reads it, the polling lanes claim nothing, and they claim
    /// again within a second of it being read no more. `None`: claim whatever reads the WAL.
    pub stand_by_for_slot: Option<String>,
    /// Deliberate publish failures, for tests and benchmarks only (none by default).
    #[cfg(feature = "fault-injection")]
    pub faults: PublishFaults,
}

/// Publish failures injected on purpose, to exercise retries and ordering under failure.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PublishFaults {
    /// Fraction of publishes that fail before reaching the server.
    pub before_send: f64,
    /// Fraction of publishes that reach the server and are stored, but whose PubAck is treated as lost
    /// (the ambiguous case: the retry is a duplicate).
    pub lost_ack: f64,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            relay_id: default_relay_id(),
            stream: StreamSettings::default(),
            batch_size: 1000,
            max_rows: 4000,
            max_claim_bytes: 16 * 1024 * 1024,
            max_in_flight: 4096,
            max_attempts: 12,
            backoff: Backoff::default(),
            publish_timeout: Duration::from_secs(5),
            step_deadline: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            claim_idle_timeout: Duration::from_secs(30),
            lanes: 2,
            retention: Some(Duration::from_secs(24 * 3600)),
            retention_batch: 1000,
            stand_by_for_slot: None,
            #[cfg(feature = "fault-injection")]
            faults: PublishFaults::default(),
        }
    }
}

impl RelayConfig {
    /// [`RelayConfig::lanes`], at least one, as PostgreSQL pools and peer seats count it (saturating:
    /// no machine runs 2^32 lanes).
    pub(crate) fn lane_count(&self) -> u32 {
        u32::try_from(self.lanes.max(1)).unwrap_or(u32::MAX)
    }

    /// The deliberate publish failures: none unless the `fault-injection` feature is on and asks.
    pub(crate) fn faults(&self) -> PublishFaults {
        #[cfg(feature = "fault-injection")]
        return self.faults;
        #[cfg(not(feature = "fault-injection"))]
        PublishFaults::default()
    }

    /// Refuses settings that would disable a safety net.
    pub fn validate(&self) -> Result<(), String> {
        if self.claim_idle_timeout < Duration::from_secs(1) {
            return Err(format!(
                "--claim-idle-timeout must be at least 1s (it is {}): it is how long a stalled relay may \
                 keep its rows",
                humantime::format_duration(self.claim_idle_timeout)
            ));
        }
        if self.poll_interval < Duration::from_millis(10) {
            return Err("--poll-interval must be at least 10ms".into());
        }
        Ok(())
    }

    /// How long to wait for one PubAck: the configured timeout, shortened to a quarter of the claim
    /// timeout so that a step's last publish always ends within its claim.
    pub fn effective_publish_timeout(&self) -> Duration {
        self.publish_timeout.min(self.claim_idle_timeout / 4)
    }

    /// How long after its start a step may keep starting publishes: the configured deadline, shortened
    /// to half the claim timeout. A publish started just before it ends within one publish timeout
    /// (a quarter), so a step has published everything by three quarters of the claim timeout and
    /// settles in the last quarter: a live step never outlives its own claim, and a transaction older
    /// than the claim timeout can only belong to a relay that stopped (which is what lets relays end
    /// such transactions). Counted from the step's start, so a relay that stalled while claiming does
    /// not start publishing late.
    pub fn effective_step_deadline(&self) -> Duration {
        self.step_deadline
            .min(self.claim_idle_timeout / 2)
            .max(Duration::from_millis(100))
    }

    /// How old another relay's claim transaction must be before this relay ends it: the claim timeout
    /// plus a margin for clocks and scheduling.
    pub fn stale_claim_age(&self) -> Duration {
        self.claim_idle_timeout + (self.claim_idle_timeout / 10).min(Duration::from_secs(1))
    }
}

/// How a relay names its PostgreSQL sessions (`application_name`), followed by its relay id. Relays
/// end each other's stalled claims by this prefix; nothing else may use it.
pub(crate) const APPLICATION_PREFIX: &str = "waybill-relay ";

/// The longest relay id a session's `application_name` keeps whole after the relay's prefix
/// (`waybill-relay `): PostgreSQL keeps 63 bytes of it, and turns bytes outside
/// printable ASCII into `?`. A polling standby knows the WAL relay's marks by that name
/// (`run/gate.rs`).
pub const RELAY_ID_KEPT: usize = 63 - APPLICATION_PREFIX.len();

/// Whether PostgreSQL keeps `relay_id` whole in the relay's `application_name`.
pub fn relay_id_kept_whole(relay_id: &str) -> bool {
    relay_id.len() <= RELAY_ID_KEPT && relay_id.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
}

/// `relay-<hostname>-<pid>`: tells instances apart in `claimed_by` and in logs. The host name is
/// cut (and kept to printable ASCII) so that the whole id, pid included, fits in
/// [`RELAY_ID_KEPT`] bytes: two relays of one long-named host must not share a name.
pub fn default_relay_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    relay_id_of(&host, std::process::id())
}

fn relay_id_of(host: &str, pid: u32) -> String {
    let pid = pid.to_string();
    let room = RELAY_ID_KEPT.saturating_sub("relay-".len() + 1 + pid.len());
    let host: String = host
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '-' })
        .take(room)
        .collect();
    format!("relay-{host}-{pid}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_relay_id_fits_the_session_name_whole_whatever_the_host() {
        assert_eq!(relay_id_of("shop-1", 42), "relay-shop-1-42");
        let long = "ip-172-31-45-120.eu-central-1.compute.internal.example";
        let (a, b) = (relay_id_of(long, 1_234_567), relay_id_of(long, 7_654_321));
        assert!(
            relay_id_kept_whole(&a) && relay_id_kept_whole(&b),
            "{a} {b}"
        );
        assert_ne!(a, b, "the pid survives the cut");
        assert!(a.ends_with("-1234567"), "{a}");
        assert!(relay_id_kept_whole(&relay_id_of("höst", 1)));
        assert!(!relay_id_kept_whole("relay-müller"));
        assert!(!relay_id_kept_whole(&"r".repeat(RELAY_ID_KEPT + 1)));
    }

    #[test]
    fn the_lane_count_is_at_least_one_and_saturates_instead_of_wrapping() {
        let with = |lanes| RelayConfig {
            lanes,
            ..RelayConfig::default()
        };
        assert_eq!(with(0).lane_count(), 1);
        assert_eq!(with(8).lane_count(), 8);
        // `as u32` made 2^32 lanes 0.
        assert_eq!(with(1 << 32).lane_count(), u32::MAX);
    }
}
