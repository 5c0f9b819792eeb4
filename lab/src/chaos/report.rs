//! The report: the verdict and what led to it, as a table for people and as JSON for programs, with
//! how long the system took to get back to its normal backlog after each kind of fault.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use super::Profile;
use super::faults::{FaultKind, Injected};
use super::fleet::ProcessSummary;
use super::load::Played;
use super::verdict::Verdict;
use super::watch::{Drained, Samples};

/// Everything the report is made of.
#[derive(Debug)]
pub(super) struct Inputs<'a> {
    pub seed: u64,
    pub profile: Profile,
    /// Where the relays read new outbox rows: `poll` or `wal`.
    pub relay_source: &'a str,
    pub duration: Duration,
    pub elapsed: Duration,
    pub verdict: &'a Verdict,
    pub played: &'a Played,
    pub injected: &'a Injected,
    pub samples: &'a Samples,
    pub drained: &'a Drained,
    pub stopped: &'a [ProcessSummary],
    pub database_url: &'a str,
    pub nats_url: &'a str,
    /// Nodes of the NATS cluster (1: a single server).
    pub nats_nodes: usize,
    /// What the private servers' binary says of its version (`nats-server --version`).
    pub nats_server: Option<String>,
    /// Partitions of each projection, one instance each.
    pub partitions: u32,
    pub stream: &'a str,
    pub logs: &'a Path,
}

/// The report, as JSON (the table is drawn from it).
#[derive(Debug)]
pub(super) struct Report(Value);

impl Report {
    /// Puts the report together.
    pub(super) fn new(inputs: Inputs<'_>) -> Self {
        let verdict = inputs.verdict;
        let faults: BTreeMap<&str, usize> = FaultKind::KNOWN
            .iter()
            .map(|k| (k.name(), inputs.injected.count(*k)))
            .collect();
        let (normal, recovery, peak_backlog, unrecovered) =
            recovery(inputs.injected, inputs.samples);
        let mut peak_rss: BTreeMap<String, f64> = inputs
            .stopped
            .iter()
            .map(|p| (p.name.clone(), round(p.peak_rss_mib)))
            .collect();
        peak_rss.insert(
            "nats-server".to_owned(),
            round(inputs.samples.nats_peak_rss_kib as f64 / 1024.0),
        );
        let sum = |counts: &BTreeMap<String, usize>| counts.values().sum::<usize>();
        let mut report = json!({
            "verdict": if verdict.pass() { "pass" } else { "fail" },
            "violations": verdict.violations,
            "seed": inputs.seed,
            "profile": format!("{:?}", inputs.profile).to_lowercase(),
            "duration_s": inputs.duration.as_secs_f64(),
            "elapsed_s": round(inputs.elapsed.as_secs_f64()),
            "faults": faults,
            "fault_log": inputs.injected.faults,
            "events": verdict.events,
            "orders": verdict.orders,
            "lifecycles": inputs.played.lifecycles,
            "accepted_commands": inputs.played.accepted.len(),
            "command_retries": inputs.played.retries,
            "replayed_retries": inputs.played.replayed,
            "abandoned_lifecycles": inputs.played.abandoned,
            "lost": verdict.lost(),
            "lost_commands": verdict.lost_commands,
            "missing_from_stream": verdict.missing_from_stream,
            "duplicates_in_stream": verdict.duplicates_in_stream,
            "out_of_order": verdict.out_of_order,
            "strangers_in_stream": verdict.strangers_in_stream,
            "projection_mismatches": verdict.projection_mismatches(),
            "mismatches": verdict.mismatches.iter().map(|(k, v)| (k.clone(), v.iter().take(10).cloned().collect::<Vec<_>>())).collect::<BTreeMap<_, _>>(),
            "outbox_unsent": verdict.outbox_unsent,
            "parked": sum(&verdict.parked),
            "held": sum(&verdict.held),
            "parked_by_projection": verdict.parked,
            "held_by_projection": verdict.held,
            "hostile_sent": inputs.injected.hostile_sent,
            "hostile_in_stream": verdict.hostile_in_stream,
            "drain_seconds": round(inputs.drained.seconds),
            "normal_backlog": normal,
            "recovery_seconds": recovery,
            "peak_backlog": peak_backlog,
            "not_recovered_before_next_fault": unrecovered,
            "peak_rss_mib": peak_rss,
            "processes": inputs.stopped,
            "database_url": inputs.database_url,
            "nats_url": inputs.nats_url,
            "stream": inputs.stream,
            "logs": inputs.logs.display().to_string(),
        });
        // Beside the macro's (which reaches its recursion limit with more keys).
        report["nats_nodes"] = json!(inputs.nats_nodes);
        report["partitions"] = json!(inputs.partitions);
        report["nats_server"] = json!(inputs.nats_server);
        report["relay_source"] = json!(inputs.relay_source);
        Self(report)
    }

    /// Prints the table (on standard error when `json`, so standard output is the JSON alone).
    pub(super) fn print(&self, json: bool) -> anyhow::Result<()> {
        let table = self.table();
        if json {
            eprint!("{table}");
            println!("{}", serde_json::to_string_pretty(&self.0)?);
        } else {
            print!("{table}");
        }
        Ok(())
    }

    fn table(&self) -> String {
        let r = &self.0;
        let mut out = String::new();
        let mut line = |label: &str, value: String| {
            out.push_str(&format!("  {label:<28} {value}\n"));
        };
        line(
            "verdict",
            r["verdict"].as_str().unwrap_or("?").to_uppercase(),
        );
        line(
            "seed / profile",
            format!("{} / {}", r["seed"], r["profile"].as_str().unwrap_or("?")),
        );
        line(
            "relays read by",
            r["relay_source"].as_str().unwrap_or("?").to_owned(),
        );
        line(
            "load / whole run",
            format!("{} s / {} s", r["duration_s"], r["elapsed_s"]),
        );
        line("drain after the load", format!("{} s", r["drain_seconds"]));
        line(
            "events / orders",
            format!("{} / {}", r["events"], r["orders"]),
        );
        line(
            "accepted commands",
            format!(
                "{} ({} retries, {} answered as replays, {} lifecycles abandoned)",
                r["accepted_commands"],
                r["command_retries"],
                r["replayed_retries"],
                r["abandoned_lifecycles"]
            ),
        );
        for key in [
            "lost",
            "duplicates_in_stream",
            "out_of_order",
            "strangers_in_stream",
            "projection_mismatches",
        ] {
            line(key, r[key].to_string());
        }
        line(
            "parked / held",
            format!(
                "{} / {} (hostile messages sent: {})",
                r["parked"], r["held"], r["hostile_sent"]
            ),
        );
        line("normal backlog", format!("<= {}", r["normal_backlog"]));
        out.push_str("  fault kind            count  worst recovery  peak backlog\n");
        for kind in FaultKind::KNOWN {
            let name = kind.name();
            if kind.needs_cluster() && r["nats_nodes"].as_u64().unwrap_or(1) < 2 {
                continue;
            }
            let recovery = r["recovery_seconds"][name]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.1} s"));
            let peak = r["peak_backlog"][name]
                .as_u64()
                .map_or_else(|| "-".to_owned(), |p| p.to_string());
            out.push_str(&format!(
                "    {name:<20} {:>5}  {recovery:>14}  {peak:>12}\n",
                r["faults"][name]
            ));
        }
        out.push_str("  peak RSS (MiB)        ");
        if let Some(rss) = r["peak_rss_mib"].as_object() {
            let parts: Vec<String> = rss.iter().map(|(k, v)| format!("{k} {v}")).collect();
            out.push_str(&parts.join(", "));
        }
        out.push('\n');
        for violation in r["violations"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  VIOLATION: {}\n",
                violation.as_str().unwrap_or("")
            ));
        }
        out.push_str(&format!(
            "  database {}  NATS {} ({} node(s) of {}, {} partition(s) per projection)  stream {}\n  logs {}\n",
            r["database_url"].as_str().unwrap_or(""),
            r["nats_url"].as_str().unwrap_or(""),
            r["nats_nodes"],
            r["nats_server"].as_str().unwrap_or("an unknown nats-server"),
            r["partitions"],
            r["stream"].as_str().unwrap_or(""),
            r["logs"].as_str().unwrap_or("")
        ));
        out
    }
}

fn round(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// The normal backlog (twice the 95th percentile before the first fault, at least 50) and, per kind,
/// the longest time from a fault being over until the backlog was back at or under it (looked for until
/// the next fault; faults after which it was not are counted apart), and the highest backlog seen from
/// a fault's strike until then.
#[allow(clippy::type_complexity)]
fn recovery(
    injected: &Injected,
    samples: &Samples,
) -> (
    u64,
    BTreeMap<&'static str, f64>,
    BTreeMap<&'static str, u64>,
    BTreeMap<&'static str, usize>,
) {
    let first_fault = injected.faults.first().map_or(f64::MAX, |f| f.at);
    let mut before: Vec<u64> = samples
        .backlog
        .iter()
        .filter(|s| s.at < first_fault)
        .filter_map(|s| s.backlog)
        .collect();
    before.sort_unstable();
    let p95 = before
        .get((before.len() * 95 / 100).min(before.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0);
    let normal = (p95 * 2).max(50);
    let mut worst: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut peaks: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut unrecovered: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (i, fault) in injected.faults.iter().enumerate() {
        if fault.error.is_some() {
            continue;
        }
        // A fault's recovery is looked for until the next fault strikes, not charged with its backlog.
        let until = injected.faults.get(i + 1).map_or(f64::MAX, |next| next.at);
        let Some(recovered) = samples
            .backlog
            .iter()
            .filter(|s| s.at >= fault.over && s.at < until)
            .find(|s| s.backlog.is_some_and(|b| b <= normal))
            .map(|s| s.at)
        else {
            *unrecovered.entry(fault.kind.name()).or_default() += 1;
            continue;
        };
        let entry = worst.entry(fault.kind.name()).or_default();
        *entry = round(entry.max(recovered - fault.over));
        let peak = samples
            .backlog
            .iter()
            .filter(|s| s.at >= fault.at && s.at <= recovered)
            .filter_map(|s| s.backlog)
            .max()
            .unwrap_or(0);
        let entry = peaks.entry(fault.kind.name()).or_default();
        *entry = (*entry).max(peak);
    }
    (normal, worst, peaks, unrecovered)
}
