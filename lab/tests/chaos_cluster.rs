//! `waybill-lab chaos --cluster`: the fleet on a three-node NATS cluster with the stream in three
//! replicas split by the server into two partitions, each projection in two instances sharing them,
//! and a NATS node SIGKILLed under load and restarted — the report says so, and the verdict passes.
//!
//! Ignored in the default run: it takes minutes, and a cluster's elections run on the machine's
//! timing, not the seed's. On nats-server 2.9.10 a leader change sometimes let a republished message
//! past the broker fence (about one run in three); on the installed 2.15.1, `waybill chaos --cluster`
//! passed seeds 1 to 5 with a node killed, frozen and a leader stepped down (docs/scale-out.md). Run
//! it with `cargo test -p lab --test chaos_cluster -- --ignored`.

use std::process::Command;

#[test]
#[ignore = "minutes long, and a cluster's elections follow the machine's timing: run by hand"]
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
    assert_eq!(
        partition_instances,
        projections::registry::names().len(),
        "one second instance per projection and read model"
    );
    assert_eq!(report["verdict"], "pass", "{stderr}");
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}
