//! `waybill bench` itself, at tiny sizes (its figures mean nothing here): it runs every part against
//! real PostgreSQL and a private nats-server, prints a JSON document with every key the performance
//! issue names, judges the targets from those figures, and draws its plot.

use std::process::Command;

#[test]
fn the_bench_measures_every_part_and_reports_every_key() {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let nats = testkit::NatsServer::start().expect("nats-server");
    let plot = tempfile::Builder::new()
        .suffix(".svg")
        .tempfile()
        .expect("a temporary file");
    let output = Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .args(["bench", "--tiny", "--json", "--plot"])
        .arg(plot.path())
        .args(["--nats-url", &nats.url()])
        .output()
        .expect("waybill-lab bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed:\n{stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON document on stdout");

    for writers in ["1", "4", "16"] {
        let ratio = report["writers"][writers]["ratio"].as_f64();
        assert!(
            ratio.is_some_and(|r| r > 0.0),
            "writers.{writers}.ratio: {report}"
        );
    }
    for key in [
        "one",
        "two",
        "three",
        "best",
        "hot",
        "baseline",
        "best_empty_table",
    ] {
        let rate = report["relay"][key].as_f64();
        assert!(rate.is_some_and(|r| r > 0.0), "relay.{key}: {report}");
    }
    // How much of the machine the one-, two- and three-relay drains kept busy, and the machine's
    // own yardstick, so that runs on machines of one size but different speed can be told apart.
    let cores = testkit::stats::machine_cpus() as f64;
    for key in ["one", "two", "three"] {
        let busy = report["relay"]["busy_cores"][key].as_f64();
        assert!(
            busy.is_some_and(|b| b > 0.0 && b <= cores + 0.05),
            "relay.busy_cores.{key}: {report}"
        );
    }
    assert!(
        report["machine"]["speed"].as_f64().is_some_and(|s| s > 0.0)
            && report["machine"]["wakeup_us"]
                .as_f64()
                .is_some_and(|us| us > 0.0)
            && report["machine"]["cpu"]
                .as_str()
                .is_some_and(|c| !c.is_empty()),
        "machine: {}",
        report["machine"]
    );
    // The server's own speed: a durable commit costs at least the round trip it takes.
    let server = &report["server"];
    let (round_trip, commit, commit_p90) = (
        server["round_trip_us"].as_f64().unwrap_or(0.0),
        server["commit_us"].as_f64().unwrap_or(0.0),
        server["commit_p90_us"].as_f64().unwrap_or(0.0),
    );
    assert!(
        round_trip > 0.0 && commit >= round_trip && commit_p90 >= commit,
        "server: {server}"
    );
    for key in ["one", "two", "best"] {
        // The drain proper cannot be slower than the same drain with the processes' start and end.
        let (drain, wall) = (
            report["relay"][key].as_f64().expect("a drain rate"),
            report["relay"]["wall"][key].as_f64().expect("a wall rate"),
        );
        assert!(
            wall > 0.0 && drain >= wall,
            "relay.{key} {drain} vs wall {wall}"
        );
    }
    // Every relayed event is marked sent by an UPDATE, so every drain writes WAL; and each drain says
    // whether a checkpoint ran beside it (this server shows both its counter and its last checkpoint).
    let relay = &report["relay"];
    for key in ["one", "two", "best"] {
        let wal = relay["wal_bytes_per_event"][key].as_f64();
        assert!(
            wal.is_some_and(|bytes| bytes > 100.0),
            "relay.wal_bytes_per_event.{key}: {relay}"
        );
        let rounds = relay["runs"][format!("checkpoint_{key}")].as_array();
        assert!(
            rounds.is_some_and(|r| !r.is_empty() && r.iter().all(serde_json::Value::is_boolean)),
            "relay.runs.checkpoint_{key}: {relay}"
        );
    }
    let cpu = &report["relay"]["cpu_us"];
    let parts: f64 = ["relay", "postgres", "nats"]
        .iter()
        .map(|k| cpu[k].as_f64().expect("a CPU share"))
        .sum();
    let total = cpu["total"].as_f64().expect("relay.cpu_us.total");
    assert!(total > 0.0 && (total - parts).abs() < 1e-6, "cpu_us: {cpu}");
    // Both relay sources, on one server with logical decoding: a backlog rate, CPU per event made of
    // its parts (the WAL sender's decoding a part of PostgreSQL's, and only the WAL relay's), and
    // percentiles from commit to PubAck (the stream's time) and to the mark.
    for source in ["poll", "wal"] {
        let figures = &report["sources"][source];
        assert!(
            figures["events_per_s"].as_f64().is_some_and(|r| r > 0.0),
            "sources.{source}: {report}"
        );
        let cpu = &figures["cpu_us"];
        let parts: f64 = ["relay", "postgres", "nats"]
            .iter()
            .map(|k| cpu[k].as_f64().expect("a CPU share"))
            .sum();
        let total = cpu["total"].as_f64().expect("cpu_us.total");
        assert!(
            total > 0.0 && (total - parts).abs() < 1e-6,
            "sources.{source}.cpu_us: {cpu}"
        );
        // Commit to PubAck, and commit to the mark.
        for to in ["ack", "mark"] {
            let (p50, p99) = (
                figures[format!("{to}_p50_ms")].as_f64().expect("p50"),
                figures[format!("{to}_p99_ms")].as_f64().expect("p99"),
            );
            assert!(
                p50 > 0.0 && p99 >= p50,
                "sources.{source}, {to}: p50 {p50}, p99 {p99}"
            );
        }
        let walsender = figures["walsender_us"].as_f64().expect("walsender_us");
        let postgres = cpu["postgres"].as_f64().expect("cpu_us.postgres");
        match source {
            // /proc counts CPU in 10 ms ticks: a small backlog's decoding may read as none.
            "wal" => assert!(
                (0.0..=postgres).contains(&walsender),
                "sources.wal: WAL sender {walsender} of PostgreSQL {postgres}"
            ),
            _ => assert!(walsender == 0.0, "sources.poll: WAL sender {walsender}"),
        }
    }
    for key in ["inventory", "points", "search"] {
        let rate = report["projections"][key].as_f64();
        assert!(rate.is_some_and(|r| r > 0.0), "projections.{key}: {report}");
    }
    // Split by the server: every instance count applies the stream with one delivery per event.
    let scaling = &report["projections"]["scaling"];
    let counts: Vec<u64> = scaling["instances"]
        .as_array()
        .expect("projections.scaling.instances")
        .iter()
        .map(|figure| {
            assert!(
                figure["events_per_s"].as_f64().is_some_and(|r| r > 0.0),
                "{figure}"
            );
            assert_eq!(figure["deliveries_per_event"], 1.0, "{figure}");
            figure["instances"].as_u64().expect("a count")
        })
        .collect();
    assert_eq!(counts, [1, 2, 4], "{scaling}");
    let takeover = scaling["takeover_seconds"]
        .as_f64()
        .expect("takeover_seconds");
    let lease = scaling["lease_seconds"].as_f64().expect("lease_seconds");
    assert!(
        takeover >= lease * 0.5 && takeover < lease * 4.0,
        "a dead instance's partitions wait about its lease: {scaling}"
    );
    assert_eq!(report["e2e"]["rate"], 100);
    let (p50, p99) = (
        report["e2e"]["p50_ms"].as_f64().expect("e2e.p50_ms"),
        report["e2e"]["p99_ms"].as_f64().expect("e2e.p99_ms"),
    );
    assert!(report["e2e"]["p95_ms"].is_f64());
    assert!(p50 > 0.0 && p50 <= p99, "e2e: {}", report["e2e"]);
    assert!(
        report["e2e"]["samples"].as_i64().is_some_and(|n| n >= 150),
        "every event of two seconds at 100/s is measured: {}",
        report["e2e"]
    );
    // Each step says what WAL the whole pipeline wrote per event (an order, its relay's mark and
    // three projections' checkpoints: well over a kilobyte) and whether a checkpoint ended during it.
    for step in std::iter::once(&report["e2e"])
        .chain(report["pipeline"]["sweep"].as_array().into_iter().flatten())
    {
        assert!(
            step["wal_bytes_per_event"]
                .as_f64()
                .is_some_and(|bytes| bytes > 1_000.0)
                && step["checkpoint_ended"].is_boolean(),
            "{step}"
        );
        // And how busy the machine's cores were meanwhile, and that time per event: something
        // worked (the pipeline's processes at the least), and no more than every core.
        let cores = testkit::stats::machine_cpus() as f64;
        assert!(
            step["busy_cores"]
                .as_f64()
                .is_some_and(|busy| busy > 0.0 && busy <= cores + 0.01)
                && step["machine_cpu_us_per_event"]
                    .as_f64()
                    .is_some_and(|us| us > 0.0),
            "{step}"
        );
    }
    let figure = report["pipeline"]["events_per_s"]
        .as_u64()
        .expect("pipeline.events_per_s");
    let sweep = report["pipeline"]["sweep"]
        .as_array()
        .expect("pipeline.sweep");
    assert_eq!(sweep.len(), 2);
    // The definitions: a sustained step accepted ≥ 99.5 % with no failure, drained within a
    // second and kept its p99 within 100 ms; the figure is a rate every step up to which is sustained.
    for step in sweep {
        if step["sustained"] == true {
            assert!(
                step["accepted_ratio"].as_f64().expect("accepted_ratio") >= 0.995
                    && step["failed"] == 0
                    && step["drain_seconds"].as_f64().expect("drain_seconds") <= 1.0
                    && step["p99_ms"].as_f64().expect("p99_ms") <= 100.0,
                "{step}"
            );
        }
        if step["offered"].as_u64().expect("offered") <= figure {
            assert_eq!(step["sustained"], true, "below the figure {figure}: {step}");
        }
    }
    for process in [
        "order service",
        "waybill-relay",
        "waybill-inventory",
        "postgres",
        "load generator",
    ] {
        let usage = &report["processes"][process];
        assert!(
            usage["peak_rss_kib"].as_u64().is_some_and(|kib| kib > 0)
                && usage["cpu_seconds"].as_f64().is_some_and(|s| s > 0.0),
            "{process}: {usage}"
        );
    }
    // Every target is judged from this run's figures, met or not.
    let targets = report["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 19, "{targets:?}");
    let all_met = targets.iter().all(|t| t["met"] == true);
    assert_eq!(report["all_targets_met"], all_met);

    let svg = std::fs::read_to_string(plot.path()).expect("the plot was written");
    assert!(
        svg.starts_with("<svg") && svg.contains("offered events/s"),
        "not the plot: {svg:.200}"
    );
}
