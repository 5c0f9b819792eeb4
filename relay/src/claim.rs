//! Claiming: one statement locks a batch of aggregate heads and their following versions with
//! `FOR UPDATE SKIP LOCKED`, inside the short transaction that will also settle them. The statement is
//! the outbox's own (`store::outbox::relaying`); here the claimed rows become per-aggregate runs.
//!
//! A row is a head when every earlier version of its aggregate is sent. Row locks, not a `processing`
//! status, mark the claim: PostgreSQL releases them when the relay's session ends, however it ends.

pub use store::outbox::relaying::{ClaimedRow, begin, claim};

/// Groups claimed rows (ordered by aggregate, then version) into per-aggregate runs of consecutive
/// versions, head first. Returns the runs and how many rows were left out.
///
/// A run stops at the first gap: a version we could not lock (someone else holds it) must not be
/// overtaken by a later one. Rows after a gap are left out of this step and stay pending.
pub fn into_runs(rows: Vec<ClaimedRow>) -> (Vec<Vec<ClaimedRow>>, usize) {
    let mut runs: Vec<Vec<ClaimedRow>> = Vec::new();
    let mut closed = false;
    let mut left_out = 0;
    for row in rows {
        match runs.last_mut() {
            Some(run) if run[0].aggregate_id == row.aggregate_id => {
                let next = run.last().map_or(0, |r| r.aggregate_version) + 1;
                if !closed && row.aggregate_version == next {
                    run.push(row);
                } else {
                    closed = true;
                    left_out += 1;
                }
            }
            _ => {
                closed = false;
                runs.push(vec![row]);
            }
        }
    }
    (runs, left_out)
}

/// The outbox ids in `runs`.
pub fn row_ids(runs: &[Vec<ClaimedRow>]) -> Vec<i64> {
    runs.iter().flatten().map(|r| r.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use chrono::Utc;
    use uuid::Uuid;

    fn row(aggregate: u128, version: i64) -> ClaimedRow {
        ClaimedRow {
            id: version,
            attempts: 0,
            created_at: Utc::now(),
            traceparent: None,
            event_id: Uuid::now_v7(),
            event_type: "order.paid".into(),
            event_version: 1,
            aggregate_type: "order".into(),
            aggregate_id: Uuid::from_u128(aggregate),
            aggregate_version: version,
            body: Bytes::from_static(b"{}"),
            previous_sequence: None,
            tid: String::new(),
        }
    }

    #[test]
    fn rows_group_into_runs_per_aggregate() {
        let (runs, left_out) =
            into_runs(vec![row(1, 1), row(1, 2), row(1, 3), row(2, 5), row(2, 6)]);
        let shape: Vec<Vec<i64>> = runs
            .iter()
            .map(|r| r.iter().map(|x| x.aggregate_version).collect())
            .collect();
        assert_eq!(shape, vec![vec![1, 2, 3], vec![5, 6]]);
        assert_eq!(left_out, 0);
    }

    #[test]
    fn a_gap_ends_the_run_and_later_versions_wait() {
        let (runs, left_out) = into_runs(vec![row(1, 1), row(1, 3), row(1, 4), row(2, 1)]);
        let shape: Vec<Vec<i64>> = runs
            .iter()
            .map(|r| r.iter().map(|x| x.aggregate_version).collect())
            .collect();
        assert_eq!(shape, vec![vec![1], vec![1]]);
        assert_eq!(
            left_out, 2,
            "versions 3 and 4 must not overtake the missing 2"
        );
    }
}
