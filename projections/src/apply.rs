//! The transaction at the runner's heart, shared by delivery, redrive and release: decode and check
//! each message, let the [`Plan`] decide against the per-aggregate checkpoints and the held table,
//! apply through the projection, move the checkpoints, hold the gaps and park the poison — all in the
//! caller's ONE transaction, so a crash leaves either everything or nothing.

use std::collections::{BTreeMap, HashMap, HashSet};

use domain::{AnyEvent, OrderEvent, Upcasters};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::checkpoint::{Checkpoint, Facts};
use crate::decode::{Decoded, Poison, RawMessage, decode, decode_message};
use crate::held::{self, HeldRow};
use crate::park::{self, ParkError, ParkRecord};
use crate::plan::{Offer, Outcome, Plan, Slot, Verdict};
use crate::projection::{Projection, reads};

/// Why a batch (or a redriven or released message) could not be applied. Nothing of it is committed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The batch's transaction could not be opened with the projection's advisory lock (they travel
    /// together in one query).
    #[error("starting the batch's transaction and waiting for the projection's turn")]
    Begin(#[source] sqlx::Error),
    #[error("reading checkpoints")]
    ReadCheckpoints(#[source] sqlx::Error),
    /// Held events now due could not be taken out of the held table.
    #[error("taking held events")]
    TakeHeld(#[source] sqlx::Error),
    /// The projection's own `apply` failed.
    #[error("applying {events} events to the {projection} projection")]
    Project {
        projection: &'static str,
        /// How many events it was given.
        events: usize,
        #[source]
        source: sqlx::Error,
    },
    #[error("moving checkpoints")]
    MoveCheckpoints(#[source] sqlx::Error),
    /// Another transaction moved some of the batch's checkpoints after this one read them (an
    /// instance of another partition layout, say): the batch is rolled back and run again, when it
    /// finds those events applied.
    #[error("{moved} of the batch's checkpoints moved under it")]
    CheckpointsMoved {
        /// How many.
        moved: usize,
    },
    #[error("holding events that wait for their predecessor")]
    Hold(#[source] sqlx::Error),
    #[error(transparent)]
    Park(#[from] ParkError),
    #[error("committing the batch")]
    Commit(#[source] sqlx::Error),
}

/// What happens to a message that cannot be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnPoison {
    /// Park it (deliveries).
    Park,
    /// Report why, park nothing (redrive: the message is parked already).
    Report,
}

/// Decodes and checks every message, lets the plan decide against the checkpoints and the held table,
/// applies, moves the checkpoints, holds the gaps, and parks the poison (or, with
/// [`OnPoison::Report`], returns why). `force` sets one aggregate's checkpoint first (an operator's
/// release). One `(verdict, reason)` per message; the reason is set for parked ones.
pub(crate) async fn decide_and_apply<P: Projection>(
    tx: &mut PgConnection,
    projection: &P,
    upcasters: &Upcasters,
    messages: &[RawMessage],
    force: Option<(Uuid, i64)>,
    on_poison: OnPoison,
) -> Result<Vec<(Verdict, Option<String>)>, ApplyError> {
    let (decoded, poison) = decode_all::<P>(messages, upcasters);

    let mut aggregates: Vec<Uuid> = decoded
        .iter()
        .flatten()
        .map(|d| d.aggregate_id)
        .chain(force.map(|(id, _)| id))
        .collect();
    aggregates.sort();
    aggregates.dedup();
    let known = read_checkpoints(tx, &aggregates)
        .await
        .map_err(ApplyError::ReadCheckpoints)?;

    // The versions the batch starts from: a checkpoint moves only from the version read here.
    let read_versions: HashMap<Uuid, i64> = known
        .checkpoints
        .iter()
        .map(|(id, checkpoint)| (*id, checkpoint.version))
        .collect();
    let mut plan = Plan::new(messages.len(), known.checkpoints);
    if let Some((aggregate_id, version)) = force {
        plan.force(aggregate_id, version);
    }
    plan.offer_batch(
        decoded
            .iter()
            .enumerate()
            .filter_map(|(index, d)| d.as_ref().map(|d| offer(Slot::Batch(index), d)))
            .collect(),
    );
    let taken = take_due(tx, &mut plan, &known.with_held, upcasters).await?;
    let outcome = plan.finish();

    apply(tx, projection, &outcome, &decoded, &taken, &read_versions).await?;
    let to_hold: Vec<(&RawMessage, &Decoded)> = outcome
        .hold
        .iter()
        .filter_map(|&i| decoded[i].as_ref().map(|d| (&messages[i], d)))
        .collect();
    held::hold(tx, &to_hold).await.map_err(ApplyError::Hold)?;

    let mut results: Vec<(Verdict, Option<String>)> =
        outcome.verdicts.iter().map(|v| (*v, None)).collect();
    let mut to_park: Vec<ParkRecord> = Vec::new();
    for (index, poison) in poison {
        results[index].1 = Some(poison.reason.clone());
        to_park.push(ParkRecord::new(&messages[index], poison));
    }
    for (slot, reason) in &outcome.refuse {
        match *slot {
            Slot::Batch(index) => {
                results[index].1 = Some(reason.clone());
                to_park.push(park::refused(
                    &messages[index],
                    decoded[index].as_ref(),
                    reason,
                ));
            }
            // Out of the held table already: parked whatever `on_poison` says, or it is lost.
            Slot::Held(index) => park::park(tx, &taken[index].0.refused(reason)).await?,
        }
    }
    for (row, result) in &taken {
        if let Err(poison) = result {
            park::park(tx, &ParkRecord::new(&row.message(), poison.clone())).await?;
        }
    }
    if on_poison == OnPoison::Park {
        for record in &to_park {
            park::park(tx, record).await?;
        }
    }
    Ok(results)
}

/// Every message decoded, or `None` with its index and why among the poison. An event of a type the
/// projection does not read is poison here: deliveries of such types never reach this (the runner
/// acknowledges them unread); only a message parked by an older version and redriven can.
fn decode_all<P: Projection>(
    messages: &[RawMessage],
    upcasters: &Upcasters,
) -> (Vec<Option<Decoded>>, Vec<(usize, Poison)>) {
    let mut decoded: Vec<Option<Decoded>> = Vec::with_capacity(messages.len());
    let mut poison: Vec<(usize, Poison)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match decode_message(message, upcasters).and_then(declared::<P>) {
            Ok(event) => decoded.push(Some(event)),
            Err(reason) => {
                decoded.push(None);
                poison.push((index, reason));
            }
        }
    }
    (decoded, poison)
}

/// `decoded`, when `P` reads its aggregate type.
fn declared<P: Projection>(decoded: Decoded) -> Result<Decoded, Poison> {
    let aggregate_type = decoded.event.aggregate_type();
    if reads::<P>(aggregate_type) {
        Ok(decoded)
    } else {
        Err(Poison {
            reason: format!(
                "aggregate type {aggregate_type} is not read by the {} projection (it reads {})",
                P::NAME,
                P::AGGREGATES.join(", ")
            ),
            event_id: Some(decoded.event_id),
            aggregate_id: Some(decoded.aggregate_id),
            aggregate_version: Some(decoded.aggregate_version),
        })
    }
}

/// Chases the held table behind every checkpoint that moved, until nothing more moves, offering
/// what is due to the plan. Rows at or below the new checkpoint are stale and leave the table too.
/// Returns every row taken, decoded again because this code may be newer than the one that held it.
async fn take_due(
    tx: &mut PgConnection,
    plan: &mut Plan,
    with_held: &HashSet<Uuid>,
    upcasters: &Upcasters,
) -> Result<Vec<(HeldRow, Result<Decoded, Poison>)>, ApplyError> {
    let mut taken: Vec<(HeldRow, Result<Decoded, Poison>)> = Vec::new();
    loop {
        // Rows are added to the held table only after this loop, so an order without held rows at
        // the start of the transaction has none to take.
        let wanted: Vec<(Uuid, i64)> = plan
            .wanted()
            .into_iter()
            .filter(|(id, _)| with_held.contains(id))
            .collect();
        if wanted.is_empty() {
            return Ok(taken);
        }
        let rows = held::take(tx, &wanted)
            .await
            .map_err(ApplyError::TakeHeld)?;
        let mut offers = Vec::with_capacity(rows.len());
        for row in rows {
            let result = decode(&row.body, upcasters);
            if let Ok(decoded) = &result {
                offers.push(offer(Slot::Held(taken.len()), decoded));
            }
            taken.push((row, result));
        }
        plan.offer_held(offers);
    }
}

/// Applies what the plan chose, in its order, and moves the checkpoints with it.
async fn apply<P: Projection>(
    tx: &mut PgConnection,
    projection: &P,
    outcome: &Outcome,
    decoded: &[Option<Decoded>],
    taken: &[(HeldRow, Result<Decoded, Poison>)],
    read_versions: &HashMap<Uuid, i64>,
) -> Result<(), ApplyError> {
    let events: Vec<Decoded<P::Event>> = outcome
        .apply
        .iter()
        .map(|slot| {
            let event = match *slot {
                Slot::Batch(index) => decoded[index].as_ref(),
                Slot::Held(index) => taken[index].1.as_ref().ok(),
            };
            event
                .expect("the plan applies only decoded events")
                .narrow::<P::Event>()
                .expect("only the projection's own aggregate types are decoded for it")
        })
        .collect();
    if !events.is_empty() {
        projection
            .apply(tx, &events)
            .await
            .map_err(|source| ApplyError::Project {
                projection: P::NAME,
                events: events.len(),
                source,
            })?;
    }
    if outcome.checkpoints.is_empty() {
        return Ok(());
    }
    let last_event: HashMap<Uuid, Uuid> = events
        .iter()
        .map(|event| (event.aggregate_id, event.event_id))
        .collect();
    let written = move_checkpoints(tx, &outcome.checkpoints, &last_event, read_versions)
        .await
        .map_err(ApplyError::MoveCheckpoints)?;
    match outcome.checkpoints.len() - written {
        0 => Ok(()),
        moved => Err(ApplyError::CheckpointsMoved { moved }),
    }
}

/// What the checkpoint table knows of a batch's orders.
struct Known {
    checkpoints: HashMap<Uuid, Checkpoint>,
    /// The orders with events in the held table.
    with_held: HashSet<Uuid>,
}

/// An aggregate's checkpoint (absent before its first event) and whether anything is held for it.
#[derive(Debug, sqlx::FromRow)]
struct CheckpointRow {
    aggregate_id: Uuid,
    version: Option<i64>,
    total_cents: Option<i64>,
    has_held: bool,
}

async fn read_checkpoints(tx: &mut PgConnection, aggregates: &[Uuid]) -> sqlx::Result<Known> {
    // One round trip for the checkpoints and for which orders have held events: the held table is
    // then queried only for those, which is almost never.
    let rows: Vec<CheckpointRow> = sqlx::query_as(
        "SELECT a.aggregate_id, c.version, c.total_cents,
                EXISTS (SELECT 1 FROM held h WHERE h.aggregate_id = a.aggregate_id) AS has_held
         FROM UNNEST($1::uuid[]) AS a(aggregate_id)
         LEFT JOIN checkpoints c ON c.aggregate_id = a.aggregate_id",
    )
    .bind(aggregates)
    .fetch_all(&mut *tx)
    .await?;
    let with_held = rows
        .iter()
        .filter(|row| row.has_held)
        .map(|row| row.aggregate_id)
        .collect();
    let checkpoints = rows
        .into_iter()
        .filter_map(|row| {
            let version = row.version?;
            Some((
                row.aggregate_id,
                Checkpoint {
                    version,
                    total_cents: row.total_cents,
                },
            ))
        })
        .collect();
    Ok(Known {
        checkpoints,
        with_held,
    })
}

/// Moves the checkpoints, each only from the version the batch read (none read: only if still
/// absent); returns how many moved. Fewer than asked means another transaction applied some of these
/// orders meanwhile — batches of one partition layout never race (a partition's lock), but instances
/// started with different partition counts would: the row lock the upsert waits for, and this
/// condition checked on the committed row, keep one of them from applying an event a second time.
async fn move_checkpoints(
    tx: &mut PgConnection,
    moved: &BTreeMap<Uuid, Checkpoint>,
    last_event: &HashMap<Uuid, Uuid>,
    read_versions: &HashMap<Uuid, i64>,
) -> sqlx::Result<usize> {
    // An operator's release moves a checkpoint without an event: `event_id` stays NULL then.
    // `updated_at` is the statement's clock, not the transaction's start (`now()`): it is written after
    // the batch's changes, just before the commit, and `waybill bench` measures delivery latency by it.
    let written = sqlx::query(
        "INSERT INTO checkpoints (aggregate_id, version, event_id, total_cents, updated_at)
         SELECT aggregate_id, version, event_id, total_cents, clock_timestamp()
         FROM UNNEST($1::uuid[], $2::int8[], $3::uuid[], $4::int8[])
             AS m(aggregate_id, version, event_id, total_cents)
         ON CONFLICT (aggregate_id) DO UPDATE
             SET version = EXCLUDED.version, event_id = EXCLUDED.event_id,
                 total_cents = EXCLUDED.total_cents, updated_at = EXCLUDED.updated_at
             WHERE checkpoints.version IS NOT DISTINCT FROM
                 ($5::int8[])[array_position($1::uuid[], checkpoints.aggregate_id)]",
    )
    .bind(moved.keys().copied().collect::<Vec<_>>())
    .bind(moved.values().map(|c| c.version).collect::<Vec<_>>())
    .bind(
        moved
            .keys()
            .map(|id| last_event.get(id).copied())
            .collect::<Vec<_>>(),
    )
    .bind(moved.values().map(|c| c.total_cents).collect::<Vec<_>>())
    .bind(
        moved
            .keys()
            .map(|id| read_versions.get(id).copied())
            .collect::<Vec<_>>(),
    )
    .execute(&mut *tx)
    .await?;
    // At most one row per message in the batch.
    Ok(usize::try_from(written.rows_affected()).unwrap_or(usize::MAX))
}

fn offer(slot: Slot, decoded: &Decoded) -> Offer {
    Offer {
        slot,
        aggregate_id: decoded.aggregate_id,
        version: decoded.aggregate_version,
        facts: facts(&decoded.event),
    }
}

/// What later events of the aggregate are checked against: an order's total and payment (no other
/// aggregate type has such facts yet).
fn facts(event: &AnyEvent) -> Facts {
    match event {
        AnyEvent::Order(OrderEvent::Placed(placed)) => Facts::Placed {
            total_cents: placed.total_cents,
        },
        AnyEvent::Order(OrderEvent::Paid(paid)) => Facts::Paid {
            amount_cents: paid.amount_cents.get(),
        },
        AnyEvent::Order(OrderEvent::Cancelled(_) | OrderEvent::Shipped(_))
        | AnyEvent::Customer(_) => Facts::Other,
    }
}
