//! Nothing parked or held by any projection but what `hostile_publish` sent.

use anyhow::Context;
use serde_json::Value;
use sqlx::PgPool;

use super::findings::Verdict;
use crate::chaos::faults::Injected;

pub(super) async fn check_parked_and_held(
    verdict: &mut Verdict,
    pool: &PgPool,
    injected: &Injected,
) -> anyhow::Result<()> {
    for projection in projections::registry::names() {
        for (table, counts) in [("parked", &mut verdict.parked), ("held", &mut verdict.held)] {
            // Both names come from the registry and the list above, never from input.
            let sql = format!("SELECT stream_sequence, headers FROM {projection}.{table}");
            let rows: Vec<(Option<i64>, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(pool)
                .await
                .with_context(|| format!("reading {projection}.{table}"))?;
            counts.insert(projection.to_owned(), rows.len());
            let unexplained = rows
                .iter()
                .filter(|(sequence, headers)| {
                    let sent = sequence.is_some_and(|s| {
                        u64::try_from(s).is_ok_and(|s| injected.hostile_sequences.contains(&s))
                    });
                    !sent && !marked_hostile(headers)
                })
                .count();
            if unexplained > 0 {
                verdict.violations.push(format!(
                    "{projection} has {unexplained} {table} message(s) that hostile_publish did not send"
                ));
            }
        }
    }
    Ok(())
}

/// True when stored headers (a JSON object of name → value) carry the hostile mark: a hostile message
/// whose PubAck was lost still counts as hostile.
fn marked_hostile(headers: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, Value>>(headers).is_ok_and(|headers| {
        headers
            .keys()
            .any(|name| name.eq_ignore_ascii_case(crate::chaos::HOSTILE_HEADER))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_headers_carrying_the_chaos_mark_count_as_hostile() {
        assert!(marked_hostile(
            br#"{"Waybill-Chaos":"hostile","Nats-Msg-Id":"x"}"#
        ));
        assert!(marked_hostile(br#"{"waybill-chaos":"anything"}"#));
        assert!(!marked_hostile(br#"{"Nats-Msg-Id":"x"}"#));
        assert!(!marked_hostile(b"not json"));
    }
}
