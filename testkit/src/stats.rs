//! Small measurement helpers for the benchmark programs and the lab's load generator: medians,
//! percentiles, resident memory and CPU time.

/// The median of `values` (the upper one of an even count); NaN for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The `q` quantile (0.0–1.0) of `sorted`, by nearest rank; 0 for none.
pub fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a rounded rank between 0 and len - 1"
    )]
    let rank = ((sorted.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted[rank]
}

/// p50, p99 and max of `values`.
pub fn percentiles(mut values: Vec<u64>) -> Percentiles {
    values.sort_unstable();
    Percentiles {
        p50: quantile(&values, 0.50),
        p99: quantile(&values, 0.99),
        max: quantile(&values, 1.0),
        count: values.len(),
    }
}

/// A latency summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest.
    pub max: u64,
    /// How many samples.
    pub count: usize,
}

/// What `/proc/<pid>/stat` says of a process: its CPU time and resident memory, from one read of
/// one small file (the load generator samples every process of a run 20 times a second, and
/// `/proc/<pid>/status`, which also has the memory, costs the kernel several times more to render).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessReading {
    /// CPU time (user + system) so far, in seconds.
    pub cpu_seconds: f64,
    /// Resident memory now, KiB (the same figure as `VmRSS`).
    pub resident_kib: u64,
}

/// `pid`'s [`ProcessReading`]; `None` once it is gone (or off Linux).
pub fn process_reading(pid: u32) -> Option<ProcessReading> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; the fields after its closing parenthesis are
    // fixed: field n of proc(5) is at index n - 3 here.
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let ticks = field(14)? + field(15)?;
    let pages = field(24)?;
    let page_kib = u64::try_from(rustix::param::page_size() / 1024).unwrap_or(4);
    Some(ProcessReading {
        // Linux reports in clock ticks of 1/100 s on every platform this runs on (USER_HZ).
        cpu_seconds: ticks as f64 / 100.0,
        resident_kib: pages * page_kib,
    })
}

/// Resident memory of process `pid` (or of this process for `None`) in KiB, from `/proc`; 0 elsewhere.
pub fn resident_kib(pid: Option<u32>) -> u64 {
    process_reading(pid.unwrap_or_else(std::process::id)).map_or(0, |r| r.resident_kib)
}

/// CPU time (user + system) of process `pid` so far, in seconds, from `/proc`; `None` once it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    process_reading(pid).map(|r| r.cpu_seconds)
}

/// The machine's CPU time since boot, in clock ticks: `(busy, total)` summed over every CPU, from
/// `/proc/stat`'s first line. Busy is everything but idle, iowait and steal: steal is time a virtual
/// CPU wanted to run and its host ran something else, no work done here.
pub fn machine_cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let total: u64 = ticks.iter().sum();
    // Fields 4, 5 and 8 are idle, iowait and steal; guest time is already counted in user.
    let idle = ticks.get(3)? + ticks.get(4).unwrap_or(&0) + ticks.get(7).unwrap_or(&0);
    Some((total - idle, total))
}

/// How many CPUs `/proc/stat` counts (its `cpuN` lines; 1 when it cannot be read): what
/// [`machine_cpu_ticks`] sums over, which may be more than this process may use (a cpuset, a
/// container's quota).
pub fn machine_cpus() -> usize {
    std::fs::read_to_string("/proc/stat")
        .map(|stat| {
            stat.lines()
                .filter(|l| {
                    l.strip_prefix("cpu")
                        .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0)
        .max(1)
}

/// Cores kept busy between two [`machine_cpu_ticks`] readings (by anything on the machine), out of
/// `cores`, which should be [`machine_cpus`]; `None` when either reading failed or no time passed.
pub fn busy_cores(start: Option<(u64, u64)>, end: Option<(u64, u64)>, cores: usize) -> Option<f64> {
    let ((busy0, total0), (busy1, total1)) = (start?, end?);
    let total = total1.checked_sub(total0).filter(|t| *t > 0)?;
    let busy = busy1.saturating_sub(busy0);
    Some(busy as f64 / total as f64 * cores as f64)
}

/// The ids of running processes whose command name is `name` (e.g. `nats-server`).
pub fn pids_named(name: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_quantiles_pick_the_expected_ranks() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        let p = percentiles((1..=100).collect());
        assert_eq!((p.p50, p.p99, p.max, p.count), (51, 99, 100, 100));
        assert_eq!(percentiles(vec![]).p50, 0);
    }

    #[test]
    fn this_process_has_resident_memory_and_cpu_time_that_grows_with_work() {
        assert!(resident_kib(None) > 0);
        let pid = std::process::id();
        let before = cpu_seconds(pid).expect("cpu time of this process");
        // Spin until the kernel's clock-tick accounting moves (10 ms ticks), within a generous bound.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut spun = 0u64;
        while cpu_seconds(pid).expect("cpu time") <= before && std::time::Instant::now() < deadline
        {
            spun = std::hint::black_box(spun.wrapping_add(1));
        }
        assert!(
            cpu_seconds(pid).expect("cpu time") > before,
            "cpu time never grew"
        );
    }

    #[test]
    fn resident_memory_from_stat_agrees_with_the_status_file() {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let vm_rss: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .expect("VmRSS");
        let from_stat = resident_kib(None);
        // Two reads a moment apart of a process that is running tests: close, not equal.
        assert!(
            from_stat.abs_diff(vm_rss) <= vm_rss / 4 + 1024,
            "stat says {from_stat} KiB, status {vm_rss} KiB"
        );
    }

    #[test]
    fn a_spinning_thread_keeps_at_least_part_of_a_core_busy() {
        let cores = machine_cpus();
        let start = machine_cpu_ticks();
        assert!(start.is_some(), "no machine CPU reading");
        let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
        let mut spun = 0u64;
        while std::time::Instant::now() < until {
            spun = std::hint::black_box(spun.wrapping_add(1));
        }
        let busy = busy_cores(start, machine_cpu_ticks(), cores).expect("busy cores");
        // This thread alone is one core for 300 ms; tick accounting and other work blur the edges.
        assert!(
            busy > 0.5 && busy <= cores as f64 + 0.01,
            "busy {busy} of {cores}"
        );
        assert_eq!(busy_cores(start, start, cores), None);
    }
}
