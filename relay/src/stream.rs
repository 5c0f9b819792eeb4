//! Stream provisioning: create the JetStream stream the relay needs, or verify that an existing one
//! matches — and say exactly what differs instead of silently publishing into the wrong shape.

use async_nats::jetstream::{self, ErrorCode, context::GetStreamErrorKind, stream};

use crate::config::StreamSettings;

/// Why the stream could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// The stream exists with settings the relay cannot work with.
    #[error(
        "stream {name} exists but differs from what the relay needs: {}; \
         run `waybill-relay provision --update` to change it, or delete the stream",
        .differences.join("; ")
    )]
    Mismatch {
        /// The stream.
        name: String,
        /// One sentence per differing setting.
        differences: Vec<String>,
    },
    /// The stream holds messages under one partition split and was asked for another.
    #[error(
        "stream {name} is split into {have} partition(s) and holds messages: it cannot become {want} \
         (an order's next events would be stored under another subject than its earlier ones, and \
         the relay's fence would refuse them); provision a new stream with --stream-partitions \
         {want} (docs/scale-out.md, \"Partitions split by the server\")"
    )]
    Resplit {
        /// The stream.
        name: String,
        /// Its partitions now.
        have: u32,
        /// The partitions asked for.
        want: u32,
    },
    /// The server accepted the stream but did not keep some settings (an older server ignores fields).
    #[error("the server did not keep the requested settings of stream {name}: {}", .differences.join("; "))]
    NotApplied {
        /// The stream.
        name: String,
        /// What it kept instead.
        differences: Vec<String>,
    },
    /// Talking to JetStream failed.
    #[error("JetStream request failed")]
    JetStream(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A failed JetStream request, its error kept as the source.
fn request_failed(error: impl std::error::Error + Send + Sync + 'static) -> ProvisionError {
    ProvisionError::JetStream(Box::new(error))
}

/// The least `--max-age` accepted: far beyond what any publish or claim lives (the relay's fence
/// finds an aggregate whose earlier messages aged out as an empty subject, which is only safe when no
/// relay can still be publishing an earlier version of it), and long enough that a projection's
/// short outage stays within the stream (one behind it catches up from the event store instead).
pub const MIN_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// What `provision` (and `run`) may be told about the stream beyond its names and dedupe window;
/// `None` accepts what an existing stream has and gives a new one the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamLimits {
    /// Replicas on a NATS cluster (`--replicas`); default 1.
    pub replicas: Option<usize>,
    /// How long the stream keeps a message (`--max-age`); `Some(Duration::ZERO)` is no limit, the
    /// default. History lives in the event store, so a bounded stream costs projections nothing but
    /// a catch-up from the store after a long outage (docs/decisions/stream-retention.md).
    pub max_age: Option<std::time::Duration>,
    /// Partitions the broker splits the stream into (`--stream-partitions`): P > 1 gives the stream
    /// a subject transform that adds each aggregate's partition to its subject, so a projection's
    /// partition consumer is delivered its own partition's events only. Fixed when the stream is
    /// created (docs/scale-out.md); `Some(1)` is no split.
    pub partitions: Option<u32>,
}

/// The most partitions a stream may be split into (the projections' own limit).
pub const MAX_STREAM_PARTITIONS: u32 = 64;

fn with_partitions(
    mut config: stream::Config,
    subject_prefix: &str,
    partitions: u32,
) -> stream::Config {
    config.subject_transform = (partitions > 1).then(|| {
        let (source, destination) = domain::wire::partition_transform(subject_prefix, partitions);
        stream::SubjectTransform {
            source,
            destination,
        }
    });
    config
}

/// Why a `--max-age` is refused: too short for the relay's fence or shorter than the dedupe window.
pub fn check_max_age(
    max_age: std::time::Duration,
    duplicate_window: std::time::Duration,
) -> Result<(), String> {
    if max_age.is_zero() {
        return Ok(());
    }
    if max_age < MIN_MAX_AGE {
        return Err(format!(
            "--max-age {} is under {}: a message could age out while a relay may still publish              an earlier version of its aggregate",
            humantime::format_duration(max_age),
            humantime::format_duration(MIN_MAX_AGE)
        ));
    }
    if max_age < duplicate_window {
        return Err(format!(
            "--max-age {} is shorter than the dedupe window {}",
            humantime::format_duration(max_age),
            humantime::format_duration(duplicate_window)
        ));
    }
    Ok(())
}

/// The stream the relay needs: file storage, every subject under the prefix, the dedupe window, and no
/// count or size limit; no age limit unless [`StreamLimits::max_age`] asks for one (projections catch
/// up from the event store, not from the stream's first message).
pub fn wanted_config(settings: &StreamSettings) -> stream::Config {
    stream::Config {
        name: settings.name.clone(),
        description: Some(
            "waybill order events, published by waybill-relay from the outbox".to_owned(),
        ),
        subjects: vec![domain::wire::all_subjects(&settings.subject_prefix)],
        storage: stream::StorageType::File,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        duplicate_window: settings.duplicate_window,
        max_age: std::time::Duration::ZERO,
        max_messages: -1,
        max_bytes: -1,
        num_replicas: 1,
        ..Default::default()
    }
}

/// Every setting of `actual` that differs from `wanted`, in words.
pub fn differences(actual: &stream::Config, wanted: &stream::Config) -> Vec<String> {
    let mut found = Vec::new();
    let mut check = |what: &str, have: String, need: String| {
        if have != need {
            found.push(format!("{what} is {have}, needs {need}"));
        }
    };
    check(
        "subjects",
        format!("{:?}", actual.subjects),
        format!("{:?}", wanted.subjects),
    );
    check(
        "storage",
        format!("{:?}", actual.storage),
        format!("{:?}", wanted.storage),
    );
    check(
        "retention",
        format!("{:?}", actual.retention),
        format!("{:?}", wanted.retention),
    );
    check(
        "duplicate_window",
        humantime::format_duration(actual.duplicate_window).to_string(),
        humantime::format_duration(wanted.duplicate_window).to_string(),
    );
    let age = |age: std::time::Duration| {
        if age.is_zero() {
            "no limit".to_owned()
        } else {
            humantime::format_duration(age).to_string()
        }
    };
    check("max_age", age(actual.max_age), age(wanted.max_age));
    let prefix = wanted
        .subjects
        .first()
        .and_then(|s| s.strip_suffix(".>"))
        .unwrap_or_default();
    let split = |config: &stream::Config| match (
        &config.subject_transform,
        ops::stream_partitions(config, prefix),
    ) {
        (None, _) => "no split".to_owned(),
        (Some(_), 1) => "a subject transform of its own".to_owned(),
        (Some(_), count) => format!("split into {count} partitions"),
    };
    check("partitions", split(actual), split(wanted));
    check(
        "max_messages",
        actual.max_messages.to_string(),
        wanted.max_messages.to_string(),
    );
    check(
        "max_bytes",
        actual.max_bytes.to_string(),
        wanted.max_bytes.to_string(),
    );
    // Settings that drop history or acknowledgements: a per-subject limit keeps only the newest events
    // of an order, no_ack turns every publish into a timeout, a sealed stream refuses writes.
    if actual.max_messages_per_subject > 0 {
        found.push(format!(
            "max_messages_per_subject is {}, needs no limit",
            actual.max_messages_per_subject
        ));
    }
    if actual.no_ack {
        found.push("no_ack is true, needs false (the relay needs every PubAck)".to_owned());
    }
    if actual.sealed {
        found.push("the stream is sealed, needs to accept writes".to_owned());
    }
    // `wanted_config` asks for one replica; callers that do not name a count copy the stream's own
    // before comparing, so only an explicit `--replicas` can differ here.
    if actual.num_replicas.max(1) != wanted.num_replicas.max(1) {
        found.push(format!(
            "num_replicas is {}, needs {}",
            actual.num_replicas.max(1),
            wanted.num_replicas.max(1)
        ));
    }
    found
}

/// Creates the stream when it is missing; otherwise verifies it (and with `update`, changes it). An
/// existing stream keeps its replica count (see [`ensure_stream_with_replicas`]).
pub async fn ensure_stream(
    jetstream: &jetstream::Context,
    settings: &StreamSettings,
    update: bool,
) -> Result<stream::Info, ProvisionError> {
    ensure_stream_with_replicas(jetstream, settings, None, update).await
}

/// [`ensure_stream`] with a replica count (`--replicas`, `WAYBILL_STREAM_REPLICAS`): `Some(n)` creates
/// the stream with `n` replicas (3 on a three-node cluster keeps it writable while one node is down)
/// and requires an existing one to have `n` (or, with `update`, changes it to `n`); `None` creates one
/// replica and accepts whatever an existing stream has, so relays that are not told keep working
/// against a stream provisioned replicated.
pub async fn ensure_stream_with_replicas(
    jetstream: &jetstream::Context,
    settings: &StreamSettings,
    replicas: Option<usize>,
    update: bool,
) -> Result<stream::Info, ProvisionError> {
    let limits = StreamLimits {
        replicas,
        ..StreamLimits::default()
    };
    ensure_stream_with(jetstream, settings, &limits, update).await
}

/// [`ensure_stream`] with the replica count and the age limit an operator named: each one given is
/// required of an existing stream (or, with `update`, set on it), each one not given is accepted as
/// an existing stream has it and defaulted on a new one (one replica, no age limit).
pub async fn ensure_stream_with(
    jetstream: &jetstream::Context,
    settings: &StreamSettings,
    limits: &StreamLimits,
    update: bool,
) -> Result<stream::Info, ProvisionError> {
    let mut wanted = wanted_config(settings);
    if let Some(replicas) = limits.replicas {
        wanted.num_replicas = replicas;
    }
    if let Some(max_age) = limits.max_age {
        wanted.max_age = max_age;
    }
    if let Some(partitions) = limits.partitions {
        wanted = with_partitions(wanted, &settings.subject_prefix, partitions);
    }
    match jetstream.get_stream(&settings.name).await {
        Ok(mut existing) => {
            let info = existing.info().await.map_err(request_failed)?.clone();
            if limits.replicas.is_none() {
                // Not asked: an update must not scale a replicated stream down.
                wanted.num_replicas = info.config.num_replicas;
            }
            if limits.max_age.is_none() {
                // Not asked: a relay started without --max-age keeps the stream's retention.
                wanted.max_age = info.config.max_age;
            }
            if limits.partitions.is_none() {
                // Not asked: a relay started without --stream-partitions takes the stream's split.
                wanted.subject_transform = info.config.subject_transform.clone();
            }
            let prefix = &settings.subject_prefix;
            if update
                && ops::stream_partitions(&info.config, prefix)
                    != ops::stream_partitions(&wanted, prefix)
                && info.state.messages > 0
            {
                // The fence counts on every event of an aggregate being on one subject: a new split
                // would store an aggregate's next events under another subject than its earlier
                // ones, and every later publish would be refused as out of place.
                return Err(ProvisionError::Resplit {
                    name: settings.name.clone(),
                    have: ops::stream_partitions(&info.config, prefix),
                    want: ops::stream_partitions(&wanted, prefix),
                });
            }
            let differences = differences(&info.config, &wanted);
            if differences.is_empty() {
                return Ok(info);
            }
            if !update {
                return Err(ProvisionError::Mismatch {
                    name: settings.name.clone(),
                    differences,
                });
            }
            tracing::warn!(stream = %settings.name, ?differences, "updating the stream's settings");
            let updated = jetstream
                .update_stream(&wanted)
                .await
                .map_err(request_failed)?;
            verify_applied(updated, &wanted)
        }
        Err(error) if is_stream_not_found(&error) => {
            let mut created = jetstream
                .create_stream(wanted.clone())
                .await
                .map_err(request_failed)?;
            tracing::info!(stream = %settings.name, subjects = ?wanted.subjects, "created the stream");
            let info = created.info().await.map_err(request_failed)?.clone();
            verify_applied(info, &wanted)
        }
        Err(error) => Err(request_failed(error)),
    }
}

fn verify_applied(
    info: stream::Info,
    wanted: &stream::Config,
) -> Result<stream::Info, ProvisionError> {
    let differences = differences(&info.config, wanted);
    if differences.is_empty() {
        Ok(info)
    } else {
        Err(ProvisionError::NotApplied {
            name: wanted.name.clone(),
            differences,
        })
    }
}

fn is_stream_not_found(error: &jetstream::context::GetStreamError) -> bool {
    matches!(error.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}
