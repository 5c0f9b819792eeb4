//! The relay's fault flag lives only in its twin: `waybill-relay` refuses `--crash-after-publish`
//! and never shows it, even in this build, which has the `fault-injection` feature on.

use std::process::{Command, Output};

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("the binary runs")
}

#[test]
fn the_installed_relay_has_no_fault_flag_even_in_a_fault_injection_build() {
    let relay = env!("CARGO_BIN_EXE_waybill-relay");
    for args in [&["--help"][..], &["run", "--help"]] {
        let help = run(relay, args);
        assert!(help.status.success(), "{args:?}: {help:?}");
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(text.contains("Usage"), "{args:?}: {text}");
        assert!(
            !text.contains("crash-after"),
            "{args:?} shows a fault flag: {text}"
        );
    }
    // Refused by the grammar (exit 2) before anything connects.
    let refused = run(
        relay,
        &[
            "run",
            "--once",
            "--crash-after-publish",
            "--database-url",
            "postgres://127.0.0.1:1/none",
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--crash-after-publish"),
        "{refused:?}"
    );
}

#[test]
fn the_faulty_twin_names_its_flag_and_takes_the_relays_command_line() {
    let help = run(
        env!("CARGO_BIN_EXE_waybill-relay-faulty"),
        &["run", "--help"],
    );
    assert!(help.status.success(), "{help:?}");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("waybill-relay-faulty run"), "{text}");
    assert!(text.contains("--crash-after-publish"), "{text}");
    assert!(text.contains("--claim-idle-timeout"), "{text}");
}
