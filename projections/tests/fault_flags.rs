//! The projections' fault flags live only in their twin: the projection binaries refuse them and
//! never show them, even in this build, which has the `fault-injection` feature on.

use std::process::{Command, Output};

/// Every fault flag the twin has.
const FAULT_FLAGS: [&str; 5] = [
    "--crash-after-commit",
    "--ignore-checkpoint",
    "--fail-before-swap",
    "--crash-after-swap",
    "--crash-after-first-consumer-moved",
];

fn run(program: &str, first: &[&str], args: &[&str]) -> Output {
    Command::new(program)
        .args(first)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("the binary runs")
}

/// The projection binaries, each with the arguments that come before its commands.
fn installed() -> [(&'static str, &'static [&'static str]); 5] {
    [
        (env!("CARGO_BIN_EXE_waybill-inventory"), &[]),
        (env!("CARGO_BIN_EXE_waybill-points"), &[]),
        (env!("CARGO_BIN_EXE_waybill-search"), &[]),
        (env!("CARGO_BIN_EXE_waybill-projection"), &["revenue"]),
        (env!("CARGO_BIN_EXE_waybill-projection"), &["customers"]),
    ]
}

#[test]
fn the_projection_binaries_have_no_fault_flag_even_in_a_fault_injection_build() {
    for (program, first) in installed() {
        for args in [&["--help"][..], &["run", "--help"], &["rebuild", "--help"]] {
            let help = run(program, first, args);
            assert!(
                help.status.success(),
                "{program} {first:?} {args:?}: {help:?}"
            );
            let text = String::from_utf8_lossy(&help.stdout);
            assert!(text.contains("Usage"), "{program} {args:?}: {text}");
            for flag in FAULT_FLAGS {
                assert!(
                    !text.contains(flag),
                    "{program} {first:?} {args:?} shows {flag}: {text}"
                );
            }
        }
        // Refused by the grammar (exit 2) before anything connects.
        for (command, flag) in [
            ("run", FAULT_FLAGS[0]),
            ("run", FAULT_FLAGS[1]),
            ("rebuild", FAULT_FLAGS[2]),
        ] {
            let refused = run(
                program,
                first,
                &[
                    command,
                    flag,
                    "--database-url",
                    "postgres://127.0.0.1:1/none",
                ],
            );
            assert_eq!(
                refused.status.code(),
                Some(2),
                "{program} {command} {flag}: {refused:?}"
            );
            assert!(
                String::from_utf8_lossy(&refused.stderr).contains(flag),
                "{refused:?}"
            );
        }
    }
}

#[test]
fn the_faulty_twin_names_its_flags_and_refuses_one_its_command_never_reaches() {
    let twin = env!("CARGO_BIN_EXE_waybill-projection-faulty");
    for name in ["inventory", "points", "search"] {
        let help = run(twin, &[name], &["run", "--help"]);
        assert!(help.status.success(), "{help:?}");
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(
            text.contains(&format!("waybill-projection-faulty {name} run")),
            "{text}"
        );
        for flag in FAULT_FLAGS {
            assert!(text.contains(flag), "{name}: {flag} missing from {text}");
        }
    }
    // A fault of `run` given to `rebuild` would silently do nothing: refused instead (exit 2).
    let refused = run(
        twin,
        &["inventory"],
        &[
            "rebuild",
            "--crash-after-commit",
            "--database-url",
            "postgres://127.0.0.1:1/none",
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not `rebuild`"),
        "{refused:?}"
    );
    let unknown = run(twin, &["revenue"], &["run"]);
    assert_eq!(unknown.status.code(), Some(2), "{unknown:?}");
}
