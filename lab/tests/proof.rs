//! The harness can fail: projections run with their checkpoint check broken on purpose (`run
//! --ignore-checkpoint` of their testing twin, `waybill-projection-faulty`) apply replayed events
//! again, and `waybill-lab chaos` must say so — exit 1, verdict `fail`, the inventory differing from
//! the fold — while finding nothing else wrong.

use std::process::Command;

#[test]
fn a_projection_that_ignores_its_checkpoint_fails_the_verdict() {
    testkit::build_workspace_binaries(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new(env!("CARGO_BIN_EXE_waybill-lab"))
        .args(["chaos", "--duration", "40s", "--seed", "11", "--json"])
        .args(["--faults", "hostile_publish", "--broken-checkpoint"])
        .output()
        .expect("waybill-lab runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(1),
        "a broken build must fail the run; its output:\n{stderr}"
    );
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the report is JSON");
    assert_eq!(report["verdict"], "fail", "{stderr}");
    let replays = report["fault_log"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| {
            f["detail"]
                .as_str()
                .is_some_and(|d| d.contains("replay of a real event"))
        })
        .count();
    assert!(
        replays > 0,
        "no replay was published, so the proof proves nothing: {report:#}"
    );
    assert!(
        report["mismatches"]["inventory"]
            .as_array()
            .is_some_and(|m| !m.is_empty()),
        "the inventory applied replays twice, so it differs from the fold: {report:#}"
    );
    // Every read model of the registry ran too and was judged against its own fold.
    for model in projections::registry::MODELS {
        assert!(
            report["mismatches"][model.name()].is_array(),
            "the read model {} was not judged: {report:#}",
            model.name()
        );
    }
    // Only the projection is broken: the rest of the pipeline still holds.
    assert_eq!(report["lost"], 0, "{report:#}");
    assert_eq!(report["duplicates_in_stream"], 0, "{report:#}");
    assert_eq!(report["out_of_order"], 0, "{report:#}");
}
