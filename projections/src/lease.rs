//! Partitions that move by themselves: the instances of a projection share its P partitions through
//! leases in a NATS key-value bucket, so that nobody writes a `--partition` list and a dead, frozen
//! or stopped instance's partitions are taken over by the others within a bounded time.
//!
//! The bucket (`<stream>_leases_<projection>`, created when missing, as many replicas as the event
//! stream) keeps every key for at most the lease time (`max_age`), one revision each. An instance
//! writes `member.<P>.<id>` and, for each partition it holds, `owner.<K>of<P>` on every tick (a
//! third of the lease time): the members alive are the `member` keys that have not expired, and a
//! holder's write must name the revision it last wrote (`update`), so a lease that expired and was
//! taken by another instance cannot be renewed. Each instance aims at its fair share, ⌈P / members⌉:
//! it releases (deletes, at its own revision) partitions above it, so that a new instance finds free
//! ones, and takes (`create`, which succeeds only on an absent or deleted key) free ones below it.
//! An instance that dies stops renewing; its keys expire after the lease time and its partitions are
//! taken on the others' next tick. A graceful stop deletes them at once.
//!
//! A lease is liveness, not safety: two instances consuming one partition for a moment (a frozen
//! holder that wakes after its lease was taken) apply every event once all the same, because each
//! order's checkpoint moves only from the version its batch read and a partition's batches take
//! turns on the partition's lock (`runner.rs`). The holder gives a partition up as soon as its own
//! clock says the lease may have expired, before any other instance can have taken it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use tokio::sync::watch;

/// The default lease time: how long a dead instance's partitions wait before another takes them.
pub const DEFAULT_LEASE_TIME: Duration = Duration::from_secs(6);

/// Why the lease bucket could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The bucket could neither be opened nor created.
    #[error("opening the partition lease bucket {bucket}")]
    Bucket {
        /// The bucket's name.
        bucket: String,
        /// What the server answered.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What an instance needs to take part in sharing a projection's partitions.
#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// The bucket's name.
    pub bucket: String,
    /// How long a lease lasts without being renewed.
    pub lease_time: Duration,
    /// The partition count, P.
    pub count: u32,
    /// This instance's id in the bucket's keys.
    pub instance: String,
    /// Replicas of the bucket (those of the event stream).
    pub replicas: usize,
}

impl LeaseSettings {
    /// The settings of projection `projection` on stream `stream`, for this process.
    pub fn new(stream: &str, projection: &str, count: u32, lease_time: Duration) -> Self {
        Self {
            bucket: bucket_name(stream, projection),
            lease_time,
            count,
            instance: instance_id(),
            replicas: 1,
        }
    }

    fn member_key(&self, instance: &str) -> String {
        format!("member.{}.{instance}", self.count)
    }

    fn member_prefix(&self) -> String {
        format!("member.{}.", self.count)
    }

    fn owner_key(&self, partition: u32) -> String {
        format!("owner.{partition}of{}", self.count)
    }

    fn tick(&self) -> Duration {
        (self.lease_time / 3).max(Duration::from_millis(200))
    }
}

/// A name for this process among the projection's instances: its pid and 8 random hex digits.
pub fn instance_id() -> String {
    // A v7 id ends in random bits.
    let random = uuid::Uuid::now_v7().simple().to_string();
    format!("{}-{}", std::process::id(), &random[24..])
}

/// The lease bucket's name for projection `projection` on stream `stream` (only letters, digits,
/// `_` and `-`, as bucket names must be).
pub fn bucket_name(stream: &str, projection: &str) -> String {
    let clean = |text: &str| {
        text.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect::<String>()
    };
    format!("{}_leases_{}", clean(stream), clean(projection))
}

/// Opens the lease bucket, creating it when missing.
pub async fn open_bucket(
    jetstream: &jetstream::Context,
    settings: &LeaseSettings,
) -> Result<kv::Store, LeaseError> {
    if let Ok(store) = jetstream.get_key_value(&settings.bucket).await {
        return Ok(store);
    }
    jetstream
        .create_key_value(kv::Config {
            bucket: settings.bucket.clone(),
            description: "waybill: which instance applies which partition (leases)".to_owned(),
            history: 1,
            max_age: settings.lease_time,
            storage: jetstream::stream::StorageType::Memory,
            num_replicas: settings.replicas.max(1),
            ..Default::default()
        })
        .await
        .map_err(|source| LeaseError::Bucket {
            bucket: settings.bucket.clone(),
            source: source.into(),
        })
}

/// One held partition: the revision this instance last wrote, and until when (by its own clock,
/// measured from before the write was sent) the lease surely lasts.
#[derive(Debug, Clone, Copy)]
struct Held {
    revision: u64,
    until: Instant,
}

/// Keeps this instance's share of the partitions until `stop` turns true, publishing the partitions
/// it holds on `owned` (the partition loops follow it). Releases everything it holds on the way out.
pub async fn keep_share(
    store: kv::Store,
    settings: LeaseSettings,
    owned: std::sync::Arc<watch::Sender<BTreeSet<u32>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut held: BTreeMap<u32, Held> = BTreeMap::new();
    // Where this instance starts looking for free partitions: spread, so that instances starting
    // together do not all race for partition 0 first.
    let offset = settings
        .instance
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
        % settings.count.max(1);
    let mut ticker = tokio::time::interval(settings.tick());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
        tick(&store, &settings, &mut held, offset).await;
        let now: BTreeSet<u32> = held.keys().copied().collect();
        owned.send_if_modified(|current| {
            let changed = *current != now;
            if changed {
                tracing::info!(instance = %settings.instance, owned = ?now, "partitions owned");
                *current = now.clone();
            }
            changed
        });
    }
    // Stop the partition loops first (they finish their batch), then hand the partitions back.
    owned.send_replace(BTreeSet::new());
    for (partition, lease) in held {
        let _ = store
            .delete_expect_revision(settings.owner_key(partition), Some(lease.revision))
            .await;
    }
    let _ = store.delete(settings.member_key(&settings.instance)).await;
}

/// One round: renew membership and leases, count the members, give up or take partitions.
async fn tick(
    store: &kv::Store,
    settings: &LeaseSettings,
    held: &mut BTreeMap<u32, Held>,
    offset: u32,
) {
    let sent = Instant::now();
    let member = store
        .put(
            settings.member_key(&settings.instance),
            bytes::Bytes::from(settings.instance.clone()),
        )
        .await;
    // Renew what is held; a lease this clock cannot vouch for any more is given up at once.
    let mut lost = Vec::new();
    for (&partition, lease) in held.iter_mut() {
        match store
            .update(
                settings.owner_key(partition),
                bytes::Bytes::from(settings.instance.clone()),
                lease.revision,
            )
            .await
        {
            Ok(revision) => {
                *lease = Held {
                    revision,
                    until: sent + settings.lease_time,
                };
            }
            Err(error) => {
                let taken = matches!(error.kind(), kv::UpdateErrorKind::WrongLastRevision);
                // Given up a tick early: by the next one, the server may have let it expire.
                if taken || Instant::now() + settings.tick() >= lease.until {
                    tracing::warn!(
                        partition = %format!("{partition}of{}", settings.count),
                        instance = %settings.instance,
                        error = %error,
                        "partition lease lost; giving the partition up"
                    );
                    lost.push(partition);
                }
            }
        }
    }
    for partition in lost {
        held.remove(&partition);
    }
    if member.is_err() {
        // Without a membership the share cannot be judged: keep what is held, take nothing.
        return;
    }
    let Some(members) = count_members(store, settings).await else {
        return;
    };
    let count = settings.count;
    let share = count.div_ceil(members.max(1)) as usize;
    // Above the share: release the highest partitions, so a newcomer finds them free.
    while held.len() > share {
        let Some((&partition, &lease)) = held.iter().next_back() else {
            break;
        };
        held.remove(&partition);
        let _ = store
            .delete_expect_revision(settings.owner_key(partition), Some(lease.revision))
            .await;
        tracing::info!(
            partition = %format!("{partition}of{count}"),
            instance = %settings.instance,
            members,
            "partition released to share the work"
        );
    }
    // Below it: take free partitions (an absent, expired or deleted key).
    for step in 0..count {
        if held.len() >= share {
            break;
        }
        let partition = (offset + step) % count;
        if held.contains_key(&partition) {
            continue;
        }
        let before = Instant::now();
        if let Ok(revision) = store
            .create(
                settings.owner_key(partition),
                bytes::Bytes::from(settings.instance.clone()),
            )
            .await
        {
            held.insert(
                partition,
                Held {
                    revision,
                    until: before + settings.lease_time,
                },
            );
            tracing::info!(
                partition = %format!("{partition}of{count}"),
                instance = %settings.instance,
                members,
                "partition lease taken"
            );
        }
    }
}

/// The members whose `member` key has not expired (this instance included), or `None` when the
/// bucket could not be read.
async fn count_members(store: &kv::Store, settings: &LeaseSettings) -> Option<u32> {
    let prefix = settings.member_prefix();
    let mut keys = store.keys().await.ok()?;
    let mut members = 0u32;
    while let Some(key) = keys.next().await {
        if key.ok()?.starts_with(&prefix) {
            members += 1;
        }
    }
    Some(members)
}

/// Who holds which partition now, as the bucket says: partition → instance id.
pub async fn owners(store: &kv::Store, count: u32) -> BTreeMap<u32, String> {
    let mut owners = BTreeMap::new();
    for partition in 0..count {
        if let Ok(Some(value)) = store.get(format!("owner.{partition}of{count}")).await {
            owners.insert(partition, String::from_utf8_lossy(&value).into_owned());
        }
    }
    owners
}
