//! The guide `docs/guides/new-event-version.md`, carried out. Its worked example (the `###` sections
//! numbered 0, 1, … under "Worked example") is applied, from the guide's own text, to a copy of the
//! `domain` crate in a workspace of its own (with `xtask`, whose `cargo xtask` the guide runs, and
//! the README, whose table it edits): each `diff` block is applied, each `sh step` command is run,
//! the workspace must build after every section, and the `sh check` command must pass. So a guide
//! step that stops applying or building fails here, not in a newcomer's hands.
//!
//! The copy leaves out what `domain` needs only for its error-chain test (the `testkit`
//! dev-dependency, which would bring in the whole workspace; that test does not touch versions),
//! and the check's parts for crates the copy does not hold (`-p waybill`). Its target directory is
//! kept (under cargo's temporary folder for tests), so only the first run builds the dependencies;
//! that first run takes minutes, so the test is `#[ignore]`d and `scripts/test` runs it.
//!
//! When the example's event really gets that version in the code, this test fails: move the
//! example to the next version or to another event.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::{copy_tree, run, workspace};
use xtask::guide::{Block, apply, blocks, parse_diff};

/// The crates of the copied workspace.
const MEMBERS: [&str; 2] = ["domain", "xtask"];

/// A workspace of its own under `dir`: the root manifest with `MEMBERS` only, the lock file, the
/// toolchain, the cargo alias, the README and copies of the member crates.
fn copy_workspace(dir: &Path) {
    let root = workspace();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("root manifest");
    let members = format!(
        "members = [{}]",
        MEMBERS.map(|m| format!("\"{m}\"")).join(", ")
    );
    let manifest: Vec<String> = manifest
        .lines()
        .map(|line| {
            if line.starts_with("members = ") {
                members.clone()
            } else {
                line.to_owned()
            }
        })
        .collect();
    assert!(
        manifest.contains(&members),
        "the root manifest has no `members = […]` line"
    );
    std::fs::write(dir.join("Cargo.toml"), manifest.join("\n") + "\n").expect("write");
    for file in [
        "Cargo.lock",
        "rust-toolchain.toml",
        "README.md",
        ".cargo/config.toml",
    ] {
        std::fs::create_dir_all(dir.join(file).parent().expect("parent")).expect("mkdir");
        std::fs::copy(root.join(file), dir.join(file)).expect("copy");
    }
    for member in MEMBERS {
        copy_tree(&root.join(member), &dir.join(member), &["target"]);
    }
    // Without testkit (see the module's comment), and its one test that uses it.
    let domain_manifest = dir.join("domain/Cargo.toml");
    let text = std::fs::read_to_string(&domain_manifest).expect("domain manifest");
    let kept: Vec<&str> = text.lines().filter(|l| !l.contains("testkit")).collect();
    std::fs::write(&domain_manifest, kept.join("\n") + "\n").expect("write");
    std::fs::remove_file(dir.join("domain/tests/error_chains.rs")).expect("error_chains.rs");
}

/// Runs `cargo ARGS` in the copy, offline, with the kept target directory.
fn cargo(dir: &Path, target: &Path, args: &[&str], what: &str) {
    let started = Instant::now();
    let done = run(Command::new(env!("CARGO"))
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target)
        .env("CARGO_NET_OFFLINE", "true")
        .env_remove("CARGO_MANIFEST_DIR"));
    eprintln!(
        "guide: {what}: cargo {} ({:.1} s)",
        args.join(" "),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        done.code,
        0,
        "{what}: `cargo {}` failed in the guide's copy of the workspace ({}):\n{}{}",
        args.join(" "),
        dir.display(),
        done.stdout,
        done.stderr
    );
}

/// The worked example's sections, in order, each with its blocks.
fn steps(guide: &str) -> Vec<(String, Vec<Block>)> {
    let mut found: Vec<(String, Vec<Block>)> = Vec::new();
    for block in blocks(guide) {
        if !block.section.starts_with(|c: char| c.is_ascii_digit()) {
            continue;
        }
        match found.last_mut() {
            Some((section, list)) if *section == block.section => list.push(block),
            _ => found.push((block.section.clone(), vec![block])),
        }
    }
    found
}

/// A `cargo …` line of the guide as arguments.
fn cargo_args(line: &str) -> Vec<&str> {
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        words.first(),
        Some(&"cargo"),
        "the guide's commands are cargo commands: {line:?}"
    );
    words[1..].to_vec()
}

/// The crate a cargo command's `-p` names, if any.
fn package(args: &[&str]) -> Option<String> {
    args.iter()
        .position(|a| *a == "-p" || *a == "--package")
        .and_then(|at| args.get(at + 1))
        .map(|p| (*p).to_owned())
}

#[test]
#[ignore = "builds a copy of the domain crate: ~25 s once its dependencies are built, 3-5 min before \
            (run by scripts/test, or: cargo test -p xtask --test guide -- --ignored)"]
fn the_guide_builds_at_every_step_and_its_check_passes() {
    let guide_path = workspace().join(xtask::checklist::GUIDE);
    let guide = std::fs::read_to_string(&guide_path).expect("the guide");
    let steps = steps(&guide);
    assert!(
        steps.len() >= 5,
        "the worked example's numbered sections are missing: {steps:?}"
    );

    let kept = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("guide");
    let (dir, target) = (kept.join("workspace"), kept.join("target"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("the last run's copy is removed");
    }
    std::fs::create_dir_all(&dir).expect("mkdir");
    copy_workspace(&dir);

    let mut check = None;
    for (section, blocks) in &steps {
        for block in blocks {
            let at = format!("{}:{} ({section})", xtask::checklist::GUIDE, block.line);
            match block.info.as_str() {
                "diff" => {
                    let edits = parse_diff(&block.text).unwrap_or_else(|e| panic!("{at}: {e}"));
                    for edit in &edits {
                        apply(&dir, edit).unwrap_or_else(|e| panic!("{at}: {e}"));
                    }
                }
                "sh step" => {
                    for line in block.text.lines().filter(|l| !l.trim().is_empty()) {
                        cargo(&dir, &target, &cargo_args(line), &at);
                    }
                }
                "sh check" => {
                    assert_eq!(check, None, "{at}: one check command");
                    check = Some(block.text.trim().to_owned());
                }
                _ => {}
            }
        }
        if check.is_none() {
            cargo(
                &dir,
                &target,
                &["build", "--workspace"],
                &format!("after {section}"),
            );
        }
    }

    let check = check.expect("the guide's last step has a `sh check` block");
    assert_eq!(
        check,
        xtask::checklist::CHECK,
        "the guide's check and the checklist's are one command"
    );
    let mut skipped = Vec::new();
    for part in check.split("&&").map(str::trim) {
        let args = cargo_args(part);
        match package(&args) {
            Some(name) if !MEMBERS.contains(&name.as_str()) => skipped.push(part),
            _ => cargo(&dir, &target, &args, "the check"),
        }
    }
    // The snippets are code as the workspace formats it.
    cargo(&dir, &target, &["fmt", "--all", "--check"], "formatting");
    eprintln!("guide: not in the copy, so not run here: {skipped:?}");
}
