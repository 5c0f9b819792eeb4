//! The lab's one way to run the project's binaries as child processes — the demo's fleet, the
//! rollout story, the bench's relays and chaos's supervised fleet all start, signal, stop and
//! report them through here: found beside this executable, standard error to a log file of their
//! own, killed when dropped, stopped with SIGTERM and a grace period, and an early exit reported
//! with the end of its log.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use rustix::process::{Pid, Signal, kill_process};
use tokio::process::{Child, Command};

/// How long a process has to stop after SIGTERM before it is killed.
pub(crate) const GRACE: Duration = Duration::from_secs(15);

/// A sibling binary of this executable (cargo builds them all into the same directory).
pub(crate) fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let here = std::env::current_exe()?;
    let path = here.with_file_name(name);
    anyhow::ensure!(
        path.is_file(),
        "{} is missing: build every binary and the testing twins first (`cargo build --workspace \
         --bins --features lab/fault-injection`, as scripts/demo does)",
        path.display()
    );
    Ok(path)
}

/// Owned copies of `words`, as a [`Launch`] takes its arguments.
pub(crate) fn strings<S: AsRef<str>>(words: &[S]) -> Vec<String> {
    words.iter().map(|w| w.as_ref().to_owned()).collect()
}

/// What to start: `program` with `args`, its environment, and its name (which names its log).
#[derive(Debug, Clone)]
pub(crate) struct Launch<'a> {
    pub program: &'a Path,
    pub args: &'a [String],
    pub env: &'a [(String, String)],
    /// Start from an empty environment (only `env`): the process sees nothing of the harness's.
    pub clear_env: bool,
    /// Variables of the harness's environment the process must not inherit.
    pub unset: &'a [&'a str],
    pub name: &'a str,
}

impl Launch<'_> {
    /// Starts it with standard error appended to its log under `logs` (a restart appends to the
    /// same file).
    pub(crate) fn spawn(&self, logs: &Path) -> anyhow::Result<Child> {
        self.command(logs, Stdio::null())?
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.program.display()))
    }

    /// Runs it to its end (a one-off command: a migration, a redrive) and returns its standard
    /// output; its failure is an error with the end of its log.
    pub(crate) async fn output(&self, logs: &Path) -> anyhow::Result<Vec<u8>> {
        let output = self
            .command(logs, Stdio::piped())?
            .output()
            .await
            .with_context(|| format!("running {} ({})", self.name, self.program.display()))?;
        anyhow::ensure!(
            output.status.success(),
            "{} failed with {}{}",
            self.name,
            output.status,
            log_tail(logs, self.name)
        );
        Ok(output.stdout)
    }

    fn command(&self, logs: &Path, stdout: Stdio) -> anyhow::Result<Command> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path(logs, self.name))
            .with_context(|| format!("opening the log of {}", self.name))?;
        let mut command = Command::new(self.program);
        if self.clear_env {
            command.env_clear();
        }
        for name in self.unset {
            command.env_remove(name);
        }
        command
            .args(self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .kill_on_drop(true);
        Ok(command)
    }
}

/// Sends `signal` to `child`; false when it has no pid any more (it was reaped).
pub(crate) fn signal(child: &Child, signal: Signal) -> bool {
    match child
        .id()
        .and_then(|id| Pid::from_raw(i32::try_from(id).ok()?))
    {
        Some(pid) => kill_process(pid, signal).is_ok(),
        None => false,
    }
}

/// Stops every child: SIGTERM to all at once, then waits for each, killing one that is still there
/// after `grace` ([`GRACE`] for the project's services).
pub(crate) async fn stop_all<'a>(
    children: impl IntoIterator<Item = (&'a str, &'a mut Child)>,
    grace: Duration,
) {
    let children: Vec<_> = children.into_iter().collect();
    for (_, child) in &children {
        signal(child, Signal::TERM);
    }
    for (name, child) in children {
        if tokio::time::timeout(grace, child.wait()).await.is_err() {
            tracing::warn!(%name, "did not stop within {} s; killing it", grace.as_secs_f64());
            let _ = child.kill().await;
        }
    }
}

/// An error naming the first of `children` that has exited, with the end of its log.
pub(crate) fn first_exited<'a>(
    children: impl IntoIterator<Item = (&'a str, &'a mut Child)>,
    logs: &Path,
) -> anyhow::Result<()> {
    for (name, child) in children {
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!("{name} exited with {status}{}", log_tail(logs, name));
        }
    }
    Ok(())
}

/// The log file of the process `name` under `logs`.
pub(crate) fn log_path(logs: &Path, name: &str) -> PathBuf {
    logs.join(format!("{}.log", name.replace(' ', "-")))
}

/// Where the log of process `name` is and its last lines: an error from a run on another machine
/// (CI) must say why the process went, since its log directory is gone with the machine.
pub(crate) fn log_tail(logs: &Path, name: &str) -> String {
    const LINES: usize = 20;
    let path = log_path(logs, name);
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
    format!("; its log is {}, ending:\n{tail}", path.display())
}

/// The peak resident set of a process so far (VmHWM), in KiB; 0 when it cannot be read.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["-c".to_owned(), script.to_owned()]
    }

    #[tokio::test]
    async fn an_early_exit_is_reported_with_the_end_of_its_log() {
        let logs = tempfile::tempdir().expect("dir");
        let args = sh("echo first >&2; echo 'last words' >&2; exit 3");
        let launch = Launch {
            program: Path::new("/bin/sh"),
            args: &args,
            env: &[],
            clear_env: true,
            unset: &[],
            name: "short lived",
        };
        let mut child = launch.spawn(logs.path()).expect("starts");
        child.wait().await.expect("ends");
        let error =
            first_exited([("short lived", &mut child)], logs.path()).expect_err("it exited");
        let text = error.to_string();
        assert!(
            text.contains("short lived exited with exit status: 3"),
            "{text}"
        );
        assert!(text.contains("short-lived.log"), "{text}");
        assert!(text.ends_with("first\nlast words"), "{text}");
    }

    #[tokio::test]
    async fn stop_all_ends_a_process_that_ignores_sigterm_after_the_grace() {
        let logs = tempfile::tempdir().expect("dir");
        let polite = sh("sleep 30");
        let stubborn = sh("trap '' TERM; sleep 30");
        let start = |name, args| {
            Launch {
                program: Path::new("/bin/sh"),
                args,
                env: &[],
                clear_env: false,
                unset: &[],
                name,
            }
            .spawn(logs.path())
            .expect("starts")
        };
        let mut a = start("polite", &polite);
        let mut b = start("stubborn", &stubborn);
        // The trap must be set before the signal comes.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = std::time::Instant::now();
        stop_all(
            [("polite", &mut a), ("stubborn", &mut b)],
            Duration::from_millis(500),
        )
        .await;
        let (a, b) = (a.try_wait().expect("a"), b.try_wait().expect("b"));
        assert!(a.is_some() && b.is_some(), "both ended: {a:?} {b:?}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_log_tail_is_the_last_twenty_lines_and_names_the_file() {
        let logs = tempfile::tempdir().expect("a temporary directory");
        let text: Vec<String> = (1..=30).map(|i| format!("line {i}")).collect();
        std::fs::write(logs.path().join("order-service.log"), text.join("\n")).expect("write");
        let report = log_tail(logs.path(), "order service");
        assert!(report.contains("order-service.log"), "{report}");
        let last_twenty = text[10..].join("\n");
        assert!(report.ends_with(&format!(":\n{last_twenty}")), "{report}");
        assert!(
            !report.contains("line 10\n"),
            "only the last 20 lines: {report}"
        );
        // A process that never wrote its log still gets a report.
        assert!(log_tail(logs.path(), "waybill-relay").contains("waybill-relay.log"));
    }
}
