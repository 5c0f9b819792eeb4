//! A bench run's figures: the JSON document (its keys are a contract for scripts), the table for
//! people, and the targets judged against the figures of this one run.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::Profile;
use super::pipeline::PipelineFigures;
use super::projections::ProjectionFigures;
use super::relay::RelayFigures;
use super::writers::WriterFigures;

/// Everything one run measured; a part not run is `None`.
#[derive(Debug)]
pub(super) struct Report {
    pub profile: Profile,
    pub writers: Option<Vec<(usize, WriterFigures)>>,
    pub relay: Option<RelayFigures>,
    pub projections: Option<ProjectionFigures>,
    pub pipeline: Option<PipelineFigures>,
    /// Wall time of the run.
    pub seconds: f64,
}

/// One target of the performance issue, judged.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Target {
    /// What is compared, as a formula over the JSON keys.
    pub name: &'static str,
    /// The measured value (a ratio, µs, ms or events/s).
    pub value: f64,
    /// The bound it must reach.
    pub bound: f64,
    pub met: bool,
}

impl Report {
    pub(super) fn new(profile: &Profile) -> Self {
        Self {
            profile: profile.clone(),
            writers: None,
            relay: None,
            projections: None,
            pipeline: None,
            seconds: 0.0,
        }
    }

    /// The targets whose figures this run has.
    pub(super) fn judge(&self) -> Vec<Target> {
        let mut targets = Vec::new();
        let mut at_least = |name, value: f64, bound| {
            targets.push(Target {
                name,
                value,
                bound,
                met: value >= bound,
            })
        };
        if let Some(relay) = &self.relay {
            at_least("relay.two / relay.one", relay.two / relay.one, 1.3);
            at_least("relay.hot / relay.best", relay.hot / relay.best, 0.8);
            at_least(
                "relay.best / relay.baseline",
                relay.best / relay.baseline,
                30.0,
            );
            at_least(
                "relay.best / relay.best_empty_table",
                relay.best / relay.best_empty_table,
                0.9,
            );
        }
        if let Some(projections) = &self.projections {
            at_least("projections.inventory", projections.inventory, 10_000.0);
            at_least("projections.points", projections.points, 10_000.0);
            at_least("projections.search", projections.search, 10_000.0);
        }
        if let Some(pipeline) = &self.pipeline {
            at_least(
                "e2e.rate (sustained)",
                if pipeline.e2e.sustained {
                    pipeline.e2e.offered as f64
                } else {
                    0.0
                },
                1_000.0,
            );
            at_least(
                "pipeline.events_per_s",
                pipeline.events_per_s as f64,
                2_500.0,
            );
        }
        // Upper bounds.
        if let Some(relay) = &self.relay {
            targets.push(Target {
                name: "relay.cpu_us.total",
                value: relay.cpu_us.total,
                bound: 60.0,
                met: relay.cpu_us.total <= 60.0,
            });
        }
        if let Some(pipeline) = &self.pipeline {
            targets.push(Target {
                name: "e2e.p99_ms",
                value: pipeline.e2e.p99_ms,
                bound: 50.0,
                met: pipeline.e2e.p99_ms <= 50.0,
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
        if let Some(pipeline) = &self.pipeline {
            let e2e = &pipeline.e2e;
            document["e2e"] = json!({
                "rate": e2e.offered, "achieved": e2e.achieved, "p50_ms": e2e.p50_ms,
                "p95_ms": e2e.p95_ms, "p99_ms": e2e.p99_ms, "max_ms": e2e.max_ms,
                "samples": e2e.samples, "sustained": e2e.sustained,
                "relayed_p50_ms": e2e.relayed_p50_ms, "relayed_p99_ms": e2e.relayed_p99_ms,
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
        if let Some(writers) = &self.writers {
            let _ = writeln!(
                out,
                "\ncommand side (orders through the store vs a plain two-row transaction)"
            );
            let _ = writeln!(
                out,
                "  {:>7} {:>12} {:>12} {:>7} {:>16}",
                "writers", "store/s", "plain/s", "ratio", "store p50/p99"
            );
            for (n, w) in writers {
                let _ = writeln!(
                    out,
                    "  {n:>7} {:>12.0} {:>12.0} {:>7.2} {:>16}",
                    w.store_per_s,
                    w.plain_per_s,
                    w.ratio,
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
            for (name, value) in [
                ("one relay, one lane", r.one),
                ("two relays, one lane each", r.two),
                ("one relay, default (best)", r.best),
                (
                    &format!("best, hot aggregates ({} versions)", r.hot_versions) as &str,
                    r.hot,
                ),
                ("best, empty table", r.best_empty_table),
                ("seed article's algorithm", r.baseline),
            ] {
                let _ = writeln!(out, "  {name:<34} {value:>10.0}");
            }
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
                "  CPU per event (best): {:.0} µs = relay {:.0} + PostgreSQL {:.0} + nats-server {:.0}",
                c.total, c.relay, c.postgres, c.nats
            );
            let c = &r.cpu_us_one_lane;
            let _ = writeln!(
                out,
                "  CPU per event (one lane): {:.0} µs = relay {:.0} + PostgreSQL {:.0} + nats-server {:.0}",
                c.total, c.relay, c.postgres, c.nats
            );
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
                "  {:>8} {:>9} {:>8} {:>8} {:>8} {:>11} {:>9} {:>9}",
                "offered",
                "accepted",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "relay p99",
                "waiting",
                "sustained"
            );
            for s in std::iter::once(&pl.e2e).chain(&pl.sweep) {
                let _ = writeln!(
                    out,
                    "  {:>8} {:>9.0} {:>8.1} {:>8.1} {:>8.1} {:>11.1} {:>9} {:>9}",
                    s.offered,
                    s.achieved,
                    s.p50_ms,
                    s.p95_ms,
                    s.p99_ms,
                    s.relayed_p99_ms,
                    s.backlog_at_end,
                    if s.sustained { "yes" } else { "no" }
                );
            }
            let _ = writeln!(
                out,
                "  highest sustained: {} events/s (first row: the steady measurement)",
                pl.events_per_s
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
                "  {} {:<38} {:>10.2} (bound {})",
                if t.met { "met   " } else { "MISSED" },
                t.name,
                t.value,
                t.bound
            );
        }
        out
    }
}

/// Cores and memory of this machine, as the figures depend on them.
fn machine() -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or_default();
    json!({"cores": cores, "memory_gib": (memory_kib as f64 / 1048576.0).round()})
}

/// `2 cores, 24 GiB`.
pub(super) fn machine_line() -> String {
    let m = machine();
    format!("{} cores, {} GiB", m["cores"], m["memory_gib"])
}
