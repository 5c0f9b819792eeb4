//! The operator commands' answers: `redrive`, `parked list|discard`, `held list|release`, printed as
//! lines for a person or as JSON.

use serde_json::json;

use super::args::{Common, HeldCommand, ParkedCommand};
use crate::held;
use crate::park;
use crate::projection::Projection;
use crate::runner::Runner;

/// Carries out an operator command (`run` and `rebuild` are not ones) and prints its answer.
pub(super) async fn answer<P: Projection>(
    runner: &Runner<P>,
    command: Common,
    json_output: bool,
) -> anyhow::Result<()> {
    match command {
        Common::Run(_) | Common::Rebuild => {
            unreachable!("run and rebuild are dispatched before the operator commands")
        }
        Common::Redrive {
            reason,
            limit,
            operator,
        } => {
            // A redrive only re-applies what the code now understands; unlike a discard or a release
            // it decides nothing, so an unnamed operator is recorded as such rather than refused.
            let actor = operator.name().unwrap_or_else(|_| "unnamed".to_owned());
            let request = crate::actions::RedriveRequest {
                actor: &actor,
                reason: &reason,
                limit: limit.map(|n| n.max(1)),
            };
            let report = runner.redrive(&request).await?;
            if json_output {
                println!("{}", json!({"projection": P::NAME, "redriven": report}));
            } else if report.is_empty() {
                println!("nothing parked to redrive");
            } else {
                for r in report {
                    println!(
                        "{:>6}  {:<10} {}",
                        r.id,
                        format!("{:?}", r.outcome).to_lowercase(),
                        r.reason.unwrap_or_default()
                    );
                }
            }
        }
        Common::Parked(ParkedCommand::List { limit, before, all }) => {
            let parked = park::list(runner.pool(), limit, before, all).await?;
            if json_output {
                println!("{}", serde_json::to_string(&parked)?);
            } else if parked.is_empty() {
                println!("nothing parked");
            } else {
                for p in parked {
                    println!(
                        "{:>6}  seq {:<8} {}  {}",
                        p.id,
                        p.stream_sequence.map_or("-".into(), |s| s.to_string()),
                        p.subject,
                        p.reason
                    );
                }
            }
        }
        Common::Parked(ParkedCommand::Discard {
            id,
            reason,
            operator,
        }) => {
            let done = runner.discard(id, &operator.name()?, &reason).await?;
            if json_output {
                println!("{done}");
            } else {
                println!(
                    "parked message {id} discarded ({} event(s) of its order still held)",
                    done["held_behind"]
                );
            }
        }
        Common::Held(HeldCommand::List { limit, after }) => {
            let held = held::list(runner.pool(), limit, after).await?;
            if json_output {
                println!("{}", serde_json::to_string(&held)?);
            } else if held.is_empty() {
                println!("nothing held");
            } else {
                for h in held {
                    println!(
                        "{}:{}  since {}  {}",
                        h.aggregate_id,
                        h.version,
                        h.since.format("%F %T"),
                        h.reason
                    );
                }
            }
        }
        Common::Held(HeldCommand::Release {
            aggregate,
            reason,
            operator,
        }) => {
            let done = runner
                .release(aggregate, &operator.name()?, &reason)
                .await?;
            if json_output {
                println!("{done}");
            } else {
                println!(
                    "order {aggregate}: skipped versions {}..={}, applied through version {}, {} still held",
                    done["skipped_from"],
                    done["skipped_to"],
                    done["applied_through"],
                    done["still_held"]
                );
            }
        }
    }
    Ok(())
}
