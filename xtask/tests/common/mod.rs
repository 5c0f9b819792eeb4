//! What the xtask tests share: the workspace's folders, copies of them, and the tool run as a
//! maintainer runs it.

#![allow(
    dead_code,
    reason = "each test file uses its own part of these helpers"
)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub(crate) fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_owned()
}

/// Copies the folder `from` into `to`, recursively (`skip` names left out, e.g. `target`).
pub(crate) fn copy_tree(from: &Path, to: &Path, skip: &[&str]) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("readable") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name");
        if skip.iter().any(|s| name == *s) {
            continue;
        }
        if path.is_dir() {
            copy_tree(&path, &to.join(name), skip);
        } else {
            std::fs::copy(&path, to.join(name)).expect("copy");
        }
    }
}

/// A copy of the workspace's `domain/` (its source, schemas and fixtures) as `root/domain`.
pub(crate) fn copy_domain(root: &Path) -> PathBuf {
    let domain = root.join("domain");
    copy_tree(&workspace().join("domain"), &domain, &["target"]);
    domain
}

/// A finished run: exit code and output (testkit has the same; xtask cannot link it, since the
/// guide's copy of the workspace builds xtask with `domain` alone).
#[derive(Debug)]
pub(crate) struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Fails the test, with the output, unless it exited 0.
    pub(crate) fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{}{}", self.stdout, self.stderr);
        self
    }

    /// Standard output as JSON.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
    }
}

/// Runs `command` to its end.
pub(crate) fn run(command: &mut Command) -> Run {
    let output = command.output().expect("the command runs");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `cargo xtask ARGS` from `dir`, through the built binary.
pub(crate) fn xtask_in(dir: &Path, args: &[&str]) -> Run {
    run(Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .current_dir(dir))
}
