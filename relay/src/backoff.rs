//! Retry delays: an exponential-ish schedule with jitter, so rows that failed together do not all
//! come back in the same instant.

use std::time::Duration;

use rand::Rng;

/// The delay before retry `n` is `schedule[n - 1]` (the last entry repeats), times a random factor in
/// `[1 - jitter, 1 + jitter]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    schedule: Vec<Duration>,
    jitter: f64,
}

impl Default for Backoff {
    /// 1 s, 5 s, 30 s, 2 min, 10 min, with ±20 % jitter.
    fn default() -> Self {
        Self::new([1, 5, 30, 120, 600].map(Duration::from_secs).to_vec(), 0.2)
    }
}

impl Backoff {
    /// A schedule (at least one entry) and a jitter fraction in `[0, 1)`.
    pub fn new(schedule: Vec<Duration>, jitter: f64) -> Self {
        let schedule = if schedule.is_empty() {
            vec![Duration::from_secs(1)]
        } else {
            schedule
        };
        Self {
            schedule,
            jitter: jitter.clamp(0.0, 0.99),
        }
    }

    /// Parses `1s,5s,30s,2m,10m`.
    pub fn parse_schedule(text: &str) -> Result<Vec<Duration>, String> {
        text.split(',')
            .map(|part| {
                humantime::parse_duration(part.trim()).map_err(|e| format!("{part:?}: {e}"))
            })
            .collect()
    }

    /// The delay before the retry that follows failure number `failures` (1-based).
    pub fn delay(&self, failures: i32, rng: &mut impl Rng) -> Duration {
        let index = usize::try_from(failures.max(1) - 1)
            .unwrap_or(0)
            .min(self.schedule.len() - 1);
        let base = self.schedule[index].as_secs_f64();
        let factor = if self.jitter > 0.0 {
            rng.random_range(1.0 - self.jitter..=1.0 + self.jitter)
        } else {
            1.0
        };
        Duration::from_secs_f64(base * factor)
    }

    /// The schedule without jitter, for display.
    pub fn schedule(&self) -> &[Duration] {
        &self.schedule
    }

    /// The jitter fraction.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_follow_the_schedule_within_the_jitter() {
        let backoff = Backoff::default();
        let mut rng = rand::rng();
        for (failures, base) in [
            (1, 1.0),
            (2, 5.0),
            (3, 30.0),
            (4, 120.0),
            (5, 600.0),
            (9, 600.0),
        ] {
            for _ in 0..50 {
                let d = backoff.delay(failures, &mut rng).as_secs_f64();
                assert!(
                    (base * 0.8..=base * 1.2).contains(&d),
                    "failure {failures}: {d}"
                );
            }
        }
    }

    #[test]
    fn jitter_spreads_the_delays() {
        let backoff = Backoff::default();
        let mut rng = rand::rng();
        let delays: std::collections::BTreeSet<_> =
            (0..20).map(|_| backoff.delay(3, &mut rng)).collect();
        assert!(delays.len() > 10, "{delays:?}");
    }

    #[test]
    fn schedules_parse_from_text() {
        let schedule = Backoff::parse_schedule("1s, 500ms,2m").expect("valid");
        assert_eq!(
            schedule,
            vec![
                Duration::from_secs(1),
                Duration::from_millis(500),
                Duration::from_secs(120)
            ]
        );
        assert!(Backoff::parse_schedule("soon").is_err());
    }
}
