//! A bench run's figures: the JSON document (its keys are a contract for scripts), the table for
//! people, and the targets judged against the figures of this one run.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::Profile;
use super::pipeline::{LoadStep, PipelineFigures};
use super::projections::ProjectionFigures;
use super::relay::RelayFigures;
use super::server::ServerFigures;
use super::sources::SourcesFigures;
use super::writers::WriterFigures;

/// Everything one run measured; a part not run is `None`.
#[derive(Debug)]
pub(super) struct Report {
    pub profile: Profile,
    pub writers: Option<Vec<(usize, WriterFigures)>>,
    pub relay: Option<RelayFigures>,
    pub projections: Option<ProjectionFigures>,
    pub pipeline: Option<PipelineFigures>,
    pub sources: Option<SourcesFigures>,
    /// The database server's round trip and durable commit, taken before the parts.
    pub server: Option<ServerFigures>,
    /// Wall time of the run.
    pub seconds: f64,
}

/// One target of the performance issue, judged.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Target {
    /// What is compared, as a formula over the JSON keys.
    pub name: &'static str,
    /// The measured value (a ratio, µs, ms or events/s): the rounds' median.
    pub value: f64,
    /// The bound it must reach.
    pub bound: f64,
    pub met: bool,
    /// The same figure in each round, where the bench has it per round (its spread).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<f64>,
}

/// `a / b`, round by round.
fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a / b).collect()
}

/// A projection's rate in each round, from `projections.runs`.
fn projection_rounds(projections: &ProjectionFigures, name: &str) -> Vec<f64> {
    projections.runs[name]
        .as_array()
        .map(|rounds| {
            rounds
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect()
        })
        .unwrap_or_default()
}

impl Report {
    pub(super) fn new(profile: &Profile) -> Self {
        Self {
            profile: profile.clone(),
            writers: None,
            relay: None,
            projections: None,
            pipeline: None,
            sources: None,
            server: None,
            seconds: 0.0,
        }
    }

    /// The targets whose figures this run has, judged on the rounds' medians.
    pub(super) fn judge(&self) -> Vec<Target> {
        let mut targets = Vec::new();
        let mut at_least = |name, value: f64, bound, rounds: Vec<f64>| {
            targets.push(Target {
                name,
                value,
                bound,
                met: value >= bound,
                rounds,
            })
        };
        if let Some(writers) = &self.writers {
            for (n, figures) in writers {
                let (name, bound) = match n {
                    1 => ("writers.1.ratio (store / plain SQL)", 1.0),
                    4 => ("writers.4.ratio (store / plain SQL)", 1.0),
                    16 => ("writers.16.ratio (store / plain SQL)", 1.5),
                    _ => continue,
                };
                at_least(name, figures.ratio, bound, figures.ratios.clone());
            }
        }
        if let Some(relay) = &self.relay {
            let runs = &relay.runs;
            // Each ratio as (name, numerator, denominator, bound), from the medians and round by round.
            for (name, (a, a_runs), (b, b_runs), bound) in [
                (
                    "relay.two / relay.one",
                    (relay.two, &runs.two),
                    (relay.one, &runs.one),
                    1.3,
                ),
                (
                    "relay.hot / relay.best",
                    (relay.hot, &runs.hot),
                    (relay.best, &runs.best),
                    0.8,
                ),
                (
                    "relay.best / relay.baseline",
                    (relay.best, &runs.best),
                    (relay.baseline, &runs.baseline),
                    30.0,
                ),
                (
                    "relay.best / relay.best_empty_table",
                    (relay.best, &runs.best),
                    (relay.best_empty_table, &runs.best_empty_table),
                    0.9,
                ),
            ] {
                at_least(name, a / b, bound, ratios(a_runs, b_runs));
            }
        }
        if let Some(sources) = &self.sources {
            let (wal, poll) = (&sources.wal, &sources.poll);
            at_least(
                "sources.wal.events_per_s / sources.poll.events_per_s",
                wal.events_per_s / poll.events_per_s,
                1.0,
                ratios(&wal.runs.events_per_s, &poll.runs.events_per_s),
            );
        }
        if let Some(projections) = &self.projections {
            for (name, value) in [
                ("projections.inventory", projections.inventory),
                ("projections.points", projections.points),
                ("projections.search", projections.search),
            ] {
                let rounds = projection_rounds(projections, &name["projections.".len()..]);
                at_least(name, value, 10_000.0, rounds);
            }
        }
        if let Some(pipeline) = &self.pipeline {
            let e2e = &pipeline.e2e;
            at_least(
                "e2e.rate (sustained)",
                if e2e.sustained {
                    e2e.offered as f64
                } else {
                    0.0
                },
                1_000.0,
                Vec::new(),
            );
            at_least(
                "pipeline.events_per_s",
                pipeline.events_per_s as f64,
                2_500.0,
                Vec::new(),
            );
        }
        let mut at_most = |name, value: f64, bound, rounds: Vec<f64>| {
            targets.push(Target {
                name,
                value,
                bound,
                met: value <= bound,
                rounds,
            })
        };
        if let Some(sources) = &self.sources {
            let (wal, poll) = (&sources.wal, &sources.poll);
            at_most(
                "sources.wal.cpu_us.total / sources.poll.cpu_us.total",
                wal.cpu_us.total / poll.cpu_us.total,
                0.6,
                ratios(&wal.runs.cpu_us_total, &poll.runs.cpu_us_total),
            );
            at_most(
                "sources.wal.ack_p99_ms",
                wal.ack_p99_ms,
                10.0,
                wal.runs.ack_p99_ms.clone(),
            );
        }
        if let Some(relay) = &self.relay {
            at_most(
                "relay.cpu_us.total",
                relay.cpu_us.total,
                50.0,
                relay.runs.cpu_us_total.clone(),
            );
        }
        if let Some(pipeline) = &self.pipeline {
            let e2e = &pipeline.e2e;
            let of = |f: fn(&LoadStep) -> f64| e2e.rounds.iter().map(f).collect();
            at_most("e2e.p50_ms", e2e.p50_ms, 10.0, of(|r| r.p50_ms));
            at_most("e2e.p99_ms", e2e.p99_ms, 30.0, of(|r| r.p99_ms));
            // The sweep's step at the pipeline's figure; when no step was sustained, the first step
            // (the one that stopped it), and the target is missed whatever its p99.
            let at_figure = pipeline
                .sweep
                .iter()
                .find(|step| step.offered == pipeline.events_per_s);
            let step = at_figure.or(pipeline.sweep.first());
            let p99 = step.map_or(0.0, |step| step.p99_ms);
            targets.push(Target {
                name: "pipeline p99_ms at events_per_s",
                value: p99,
                bound: 100.0,
                met: at_figure.is_some() && p99 <= 100.0,
                rounds: step.map_or_else(Vec::new, |s| s.rounds.iter().map(|r| r.p99_ms).collect()),
            });
        }
        targets
    }

    /// The JSON document.
    pub(super) fn json(&self, targets: &[Target]) -> Value {
        let mut document = json!({
            "profile": self.profile.name,
            "sizes": self.profile,
            "machine": machine(),
            "build": if cfg!(debug_assertions) { "debug" } else { "release" },
            "date": chrono::Utc::now().to_rfc3339(),
            "seconds": (self.seconds * 10.0).round() / 10.0,
            "targets": targets,
            "all_targets_met": targets.iter().all(|t| t.met),
        });
        if let Some(server) = &self.server {
            document["server"] = json!(server);
        }
        if let Some(writers) = &self.writers {
            document["writers"] = writers
                .iter()
                .map(|(n, figures)| (n.to_string(), json!(figures)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        if let Some(relay) = &self.relay {
            document["relay"] = json!(relay);
        }
        if let Some(projections) = &self.projections {
            document["projections"] = json!(projections);
        }
        if let Some(sources) = &self.sources {
            document["sources"] = json!(sources);
        }
        if let Some(pipeline) = &self.pipeline {
            let e2e = &pipeline.e2e;
            document["e2e"] = json!({
                "rate": e2e.offered, "achieved": e2e.achieved, "p50_ms": e2e.p50_ms,
                "p95_ms": e2e.p95_ms, "p99_ms": e2e.p99_ms, "max_ms": e2e.max_ms,
                "samples": e2e.samples, "sustained": e2e.sustained,
                "relayed_p50_ms": e2e.relayed_p50_ms, "relayed_p99_ms": e2e.relayed_p99_ms,
                "wal_bytes_per_event": e2e.wal_bytes_per_event,
                "checkpoint_ended": e2e.checkpoint_ended,
                "busy_cores": e2e.busy_cores,
                "machine_cpu_us_per_event": e2e.machine_cpu_us_per_event,
            });
            document["pipeline"] = json!({
                "events_per_s": pipeline.events_per_s,
                "sweep": pipeline.sweep,
            });
            document["processes"] = json!(pipeline.processes);
        }
        document
    }

    /// The table for people.
    pub(super) fn table(&self, targets: &[Target]) -> String {
        let mut out = String::new();
        let p = &self.profile;
        let _ = writeln!(
            out,
            "\nwaybill bench, {} profile, medians of {} rounds, {} build, {} — {:.0} s",
            p.name,
            p.rounds,
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            machine_line(),
            self.seconds
        );
        if let Some(server) = &self.server {
            let _ = writeln!(out, "PostgreSQL: {}", server.line());
        }
        if let Some(writers) = &self.writers {
            let _ = writeln!(
                out,
                "\ncommand side (orders through the store vs a plain two-row transaction)"
            );
            let _ = writeln!(
                out,
                "  {:>7} {:>12} {:>12} {:>7} {:>13} {:>16}",
                "writers", "store/s", "plain/s", "ratio", "ratio rounds", "store p50/p99"
            );
            for (n, w) in writers {
                let _ = writeln!(
                    out,
                    "  {n:>7} {:>12.0} {:>12.0} {:>7.2} {:>13} {:>16}",
                    w.store_per_s,
                    w.plain_per_s,
                    w.ratio,
                    spread(&w.ratios),
                    format!(
                        "{:.1}/{:.1} ms",
                        w.store_p50_us as f64 / 1e3,
                        w.store_p99_us as f64 / 1e3
                    )
                );
            }
        }
        if let Some(r) = &self.relay {
            let _ = writeln!(
                out,
                "\nrelay, draining {} events with {} sent rows present (events/s, first claim to last mark)",
                r.events, r.history
            );
            let hot = format!("best, hot aggregates ({} versions)", r.hot_versions);
            for (name, value, rounds) in [
                ("one relay, one lane", r.one, &r.runs.one),
                ("two relays, one lane each", r.two, &r.runs.two),
                ("three relays, one lane each", r.three, &r.runs.three),
                ("one relay, default (best)", r.best, &r.runs.best),
                (hot.as_str(), r.hot, &r.runs.hot),
                (
                    "best, empty table",
                    r.best_empty_table,
                    &r.runs.best_empty_table,
                ),
                ("seed article's algorithm", r.baseline, &r.runs.baseline),
            ] {
                let _ = writeln!(
                    out,
                    "  {name:<34} {value:>10.0}   rounds {}",
                    spread(rounds)
                );
            }
            let pairs: Vec<f64> = r
                .runs
                .two
                .iter()
                .zip(&r.runs.one)
                .map(|(two, one)| two / one)
                .collect();
            let _ = writeln!(
                out,
                "  two relays / one, round by round: {}",
                with_checkpoints_marked(&pairs, &r.runs.checkpoint_one, &r.runs.checkpoint_two)
            );
            let _ = writeln!(
                out,
                "  drains a checkpoint ended in: one relay {}, two {}, three {}, best {}; WAL per event: one {:.0} B, two {:.0} B, best {:.0} B",
                checkpoint_count(&r.runs.checkpoint_one),
                checkpoint_count(&r.runs.checkpoint_two),
                checkpoint_count(&r.runs.checkpoint_three),
                checkpoint_count(&r.runs.checkpoint_best),
                r.wal_bytes_per_event.one,
                r.wal_bytes_per_event.two,
                r.wal_bytes_per_event.best
            );
            let _ = writeln!(
                out,
                "  cores busy on the machine (of {}): one relay {:.2}, two {:.2}, three {:.2}",
                testkit::stats::machine_cpus(),
                r.busy_cores.one,
                r.busy_cores.two,
                r.busy_cores.three
            );
            let _ = writeln!(
                out,
                "  from the processes' start to their exit: one {:.0}, two {:.0} ({:.2}×), best {:.0}",
                r.wall.one,
                r.wall.two,
                r.wall.two / r.wall.one,
                r.wall.best
            );
            let c = &r.cpu_us;
            let _ = writeln!(
                out,
                "  CPU per event (best): {:.0} µs = relay {:.0} + PostgreSQL {:.0} + nats-server {:.0} (total, rounds {})",
                c.total,
                c.relay,
                c.postgres,
                c.nats,
                spread(&r.runs.cpu_us_total)
            );
            let c = &r.cpu_us_one_lane;
            let _ = writeln!(
                out,
                "  CPU per event (one lane): {:.0} µs = relay {:.0} + PostgreSQL {:.0} + nats-server {:.0}",
                c.total, c.relay, c.postgres, c.nats
            );
        }
        if let Some(so) = &self.sources {
            let _ = writeln!(
                out,
                "\nthe relay's sources side by side on {} (backlog of {} events; commit to PubAck at 1,000 events/s for {} s)",
                so.server, so.events, so.steady_seconds
            );
            for (name, f) in [("poll", &so.poll), ("wal", &so.wal)] {
                let c = &f.cpu_us;
                let _ = writeln!(
                    out,
                    "  {name:<5} {:>8.0} events/s (rounds {})   CPU {:.1} µs = relay {:.1} + PostgreSQL {:.1} (WAL sender {:.1}) + nats-server {:.1} (rounds {})   commit to PubAck p50 {:.1} ms, p99 {:.1} ms (rounds {}); to the mark p50 {:.1}, p99 {:.1} ms",
                    f.events_per_s,
                    spread(&f.runs.events_per_s),
                    c.total,
                    c.relay,
                    c.postgres,
                    f.walsender_us,
                    c.nats,
                    spread(&f.runs.cpu_us_total),
                    f.ack_p50_ms,
                    f.ack_p99_ms,
                    spread(&f.runs.ack_p99_ms),
                    f.mark_p50_ms,
                    f.mark_p99_ms
                );
            }
        }
        if let Some(pr) = &self.projections {
            let _ = writeln!(
                out,
                "\nprojections, applying {} events (events/s): inventory {:.0}, points {:.0}, search {:.0}",
                pr.events, pr.inventory, pr.points, pr.search
            );
            let sc = &pr.scaling;
            let each: Vec<String> = sc
                .instances
                .iter()
                .map(|i| {
                    format!(
                        "{} instance(s) {:.0}/s ({:.2} deliveries per event)",
                        i.instances, i.events_per_s, i.deliveries_per_event
                    )
                })
                .collect();
            let _ = writeln!(
                out,
                "  inventory on {} partitions split by the server: {}; a dead instance's partitions taken over in {:.1} s (lease {:.0} s)",
                sc.partitions,
                each.join(", "),
                sc.takeover_seconds,
                sc.lease_seconds
            );
        }
        if let Some(pl) = &self.pipeline {
            let _ = writeln!(
                out,
                "\npipeline over HTTP (commit to applied in all three projections)"
            );
            let _ = writeln!(
                out,
                "  {:>8} {:>9} {:>8} {:>7} {:>7} {:>7} {:>13} {:>9} {:>7} {:>9} {:>10} {:>6} {:>9}",
                "offered",
                "accepted",
                "accept%",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "p99 rounds",
                "relay p99",
                "drain s",
                "sustained",
                "WAL KB/ev",
                "busy",
                "CPU µs/ev"
            );
            for s in std::iter::once(&pl.e2e).chain(&pl.sweep) {
                let p99s: Vec<f64> = s.rounds.iter().map(|r| r.p99_ms).collect();
                let _ = writeln!(
                    out,
                    "  {:>8} {:>9.0} {:>8.2} {:>7.1} {:>7.1} {:>7.1} {:>13} {:>9.1} {:>7.1} {:>9} {:>10} {:>6} {:>9}",
                    s.offered,
                    s.achieved,
                    s.accepted_ratio * 100.0,
                    s.p50_ms,
                    s.p95_ms,
                    s.p99_ms,
                    spread(&p99s),
                    s.relayed_p99_ms,
                    s.drain_seconds,
                    if s.sustained { "yes" } else { "no" },
                    format!(
                        "{:.1}{}",
                        s.wal_bytes_per_event / 1000.0,
                        if s.checkpoint_ended == Some(true) {
                            " *"
                        } else {
                            ""
                        }
                    ),
                    s.busy_cores.map_or("?".to_owned(), |c| format!("{c:.2}")),
                    s.machine_cpu_us_per_event
                        .map_or("?".to_owned(), |us| format!("{us:.0}"))
                );
            }
            let _ = writeln!(
                out,
                "  highest rate with every step up to it sustained: {} events/s (first row: the steady \
                 measurement; each row the median of its rounds; sustained: ≥ 99.5 % accepted, none \
                 failed, drained within 1 s, p99 ≤ 100 ms; WAL: what the server wrote per event, * \
                 where a checkpoint ended during a round of the step; busy: the machine's cores busy \
                 during the step, of {}, everything on it counted, the load generator too; CPU µs/ev: \
                 that time per event)",
                pl.events_per_s,
                testkit::stats::machine_cpus()
            );
            let _ = writeln!(out, "  per process: peak RSS, CPU seconds");
            for (name, usage) in &pl.processes {
                let _ = writeln!(
                    out,
                    "    {name:<16} {:>8.1} MiB {:>8.1} s",
                    usage.peak_rss_kib as f64 / 1024.0,
                    usage.cpu_seconds
                );
            }
        }
        let _ = writeln!(out, "\ntargets");
        for t in targets {
            let _ = writeln!(
                out,
                "  {} {:<38} {:>10.2} (bound {}){}",
                if t.met { "met   " } else { "MISSED" },
                t.name,
                t.value,
                t.bound,
                if t.rounds.len() > 1 {
                    format!(", rounds {}", spread(&t.rounds))
                } else {
                    String::new()
                }
            );
        }
        out
    }
}

/// Each round's ratio, marked `(checkpoint)` where a checkpoint ended during either of its drains:
/// `1.31, 0.98 (checkpoint), 1.29`.
fn with_checkpoints_marked(ratios: &[f64], one: &[Option<bool>], two: &[Option<bool>]) -> String {
    ratios
        .iter()
        .enumerate()
        .map(|(round, ratio)| {
            let ran = |drains: &[Option<bool>]| drains.get(round).copied().flatten() == Some(true);
            if ran(one) || ran(two) {
                format!("{ratio:.2} (checkpoint)")
            } else {
                format!("{ratio:.2}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// How many drains a checkpoint ended in: `1 of 3`, or `unknown` when the server did not say.
fn checkpoint_count(drains: &[Option<bool>]) -> String {
    if drains.iter().any(Option::is_none) {
        return "unknown".to_owned();
    }
    let ran = drains.iter().filter(|ran| **ran == Some(true)).count();
    format!("{ran} of {}", drains.len())
}

/// `min–max` of a measurement's rounds (empty for one round).
pub(super) fn spread(values: &[f64]) -> String {
    if values.len() < 2 {
        return String::new();
    }
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let digits = if max.abs() >= 100.0 { 0 } else { 2 };
    format!("{min:.digits$}–{max:.digits$}")
}

/// Cores, memory, CPU model, single-core speed and cross-thread wake-up time of this machine, as the
/// figures depend on them: two runs on machines of the same size but different speed are told apart
/// by `speed` and `wakeup_us`.
pub(super) fn machine() -> Value {
    static MACHINE: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    MACHINE
        .get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
            let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
            let memory_kib: u64 = meminfo
                .lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
                .unwrap_or_default();
            let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
            let cpu = cpuinfo
                .lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map_or("unknown", |(_, model)| model.trim());
            json!({
                "cores": cores,
                "memory_gib": (memory_kib as f64 / 1048576.0).round(),
                "cpu": cpu,
                "speed": single_core_speed(),
                "wakeup_us": wakeup_round_trip_us(),
            })
        })
        .clone()
}

/// A fixed, CPU-bound workload on one core (a 64-bit mixing function, no memory traffic), in
/// millions of rounds per second: the median of five 100 ms trials. Not a benchmark of anything in
/// the project — a yardstick, so that a reader can see that two runs' machines differ in speed
/// before comparing their figures. Taken once per run, when the report first needs it (before any
/// measurement: [`super::run`] asks at the start).
fn single_core_speed() -> f64 {
    let trials: Vec<f64> = (0..5)
        .map(|_| {
            let started = Instant::now();
            let mut rounds = 0u64;
            let mut state = 0x9e37_79b9_7f4a_7c15_u64;
            while started.elapsed() < Duration::from_millis(100) {
                for _ in 0..10_000 {
                    state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let mut z = state;
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    state = std::hint::black_box(z ^ (z >> 31));
                }
                rounds += 10_000;
            }
            rounds as f64 / started.elapsed().as_secs_f64() / 1e6
        })
        .collect();
    (testkit::stats::median(trials) * 10.0).round() / 10.0
}

/// Two threads passing one byte back and forth over a socket pair, in µs per round trip: the median
/// of five trials of 2,000 (about half a second on a slow host). Each way wakes a thread that sleeps
/// in `read`, wherever the scheduler puts it (not pinned: often on the other core) — what every hop
/// of the pipeline pays (a round trip to PostgreSQL or NATS, a task woken on another worker).
/// Measured because the CPU yardstick does not see it: on virtual machines a wake-up across cores
/// may go through the hypervisor, and one machine here took 56 µs where the same round trip pinned
/// to one core took 9 (`perf bench sched pipe`). `0.0` when the probe could not run.
fn wakeup_round_trip_us() -> f64 {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    const ROUND_TRIPS: u32 = 2_000;
    let Ok((mut here, mut there)) = UnixStream::pair() else {
        return 0.0;
    };
    let echo = std::thread::Builder::new()
        .name("wake-up probe".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            while there.read_exact(&mut byte).is_ok() {
                if there.write_all(&byte).is_err() {
                    break;
                }
            }
        });
    let Ok(echo) = echo else {
        return 0.0;
    };
    let mut trials = Vec::new();
    let mut byte = [7u8; 1];
    'trials: for _ in 0..5 {
        let started = Instant::now();
        for _ in 0..ROUND_TRIPS {
            if here.write_all(&byte).is_err() || here.read_exact(&mut byte).is_err() {
                break 'trials;
            }
        }
        trials.push(started.elapsed().as_secs_f64() * 1e6 / f64::from(ROUND_TRIPS));
    }
    // Closing our end ends the echo thread's read.
    drop(here);
    let _ = echo.join();
    if trials.is_empty() {
        return 0.0;
    }
    (testkit::stats::median(trials) * 10.0).round() / 10.0
}

/// `2 cores (Intel(R) Xeon(R) Processor, speed 180.2, wake-up 9.5 µs), 24 GiB`.
pub(super) fn machine_line() -> String {
    let m = machine();
    let wakeup = match m["wakeup_us"].as_f64() {
        Some(us) if us > 0.0 => format!("{us}"),
        _ => "?".to_owned(),
    };
    format!(
        "{} cores ({}, speed {}, wake-up {wakeup} µs), {} GiB",
        m["cores"],
        m["cpu"].as_str().unwrap_or("unknown"),
        m["speed"],
        m["memory_gib"]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_a_checkpoint_ended_in_are_marked_and_counted() {
        let (one, two) = (
            [Some(false), Some(true), Some(false)],
            [Some(false), Some(false), Some(true)],
        );
        assert_eq!(
            with_checkpoints_marked(&[1.31, 0.98, 1.2], &one, &two),
            "1.31, 0.98 (checkpoint), 1.20 (checkpoint)"
        );
        assert_eq!(checkpoint_count(&one), "1 of 3");
        assert_eq!(
            checkpoint_count(&[Some(true), None]),
            "unknown",
            "not a guess"
        );
        assert_eq!(
            with_checkpoints_marked(&[1.5], &[None], &[None]),
            "1.50",
            "nothing said, nothing marked"
        );
    }
}
