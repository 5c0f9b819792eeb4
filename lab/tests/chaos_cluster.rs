//! `waybill-lab chaos --cluster`: the fleet on a three-node NATS cluster with the stream in three
//! replicas, each projection in two partition instances, and a NATS node SIGKILLed under load and
//! restarted — the report says so, and the verdict passes.
//!
//! Ignored by default: on nats-server 2.9.10 a leader change of the replicated stream sometimes lets a
//! republished message past the broker fence (a copy, a version out of order, or one missing: about
//! one run in three here; nats-server fixed clustered expected-sequence and dedupe handling in later
//! releases, see docs/scale-out.md). Run it with `cargo test -p lab --test chaos_cluster -- --ignored`.

use std::process::Command;

#[test]
#[ignore = "flaky on nats-server 2.9.10: the clustered stream's fence can fail on a leader change"]
fn a_fleet_on_a_nats_cluster_rides_out_a_killed_node() {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .args(["chaos", "--cluster", "--duration", "40s", "--json"])
        .args(["--faults", "nats_node_kill,relay_kill,projection_kill"])
        .output()
        .expect("waybill-lab runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the report is JSON");
    assert_eq!(report["nats_nodes"], 3, "{stderr}");
    assert_eq!(report["partitions"], 2, "{stderr}");
    assert!(
        report["faults"]["nats_node_kill"].as_u64() >= Some(1),
        "a node was killed: {report:#}"
    );
    let partition_instances = report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.ends_with("-p1")))
        .count();
    assert_eq!(partition_instances, 3, "one second instance per projection");
    assert_eq!(report["verdict"], "pass", "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}
