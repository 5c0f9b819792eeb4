//! `place`, `pay`, `cancel`, `ship` and `show`: run one command through the event store and print the
//! result.

use anyhow::Context;
use domain::{
    CancelOrder, Order, OrderCommand, OrderError, OrderId, OrderStatus, PayOrder, PlaceOrder,
    ShipOrder,
};
use serde_json::json;
use store::{CommandContext, CommandOutcome, EventStore};
use uuid::Uuid;

use crate::cli::{CancelArgs, PayArgs, PlaceArgs, ShipArgs, ShowArgs, WriteOptions};
use crate::failure::{command_failure, with_hint};

/// Places an order under a new (or the given) id.
pub(crate) async fn place(store: &EventStore, args: PlaceArgs, json: bool) -> anyhow::Result<()> {
    let order_id = args
        .order_id
        .unwrap_or_else(|| OrderId::from_uuid(Uuid::now_v7()));
    let command = OrderCommand::Place(PlaceOrder {
        customer_id: args.customer,
        currency: args.currency,
        lines: args.lines,
        channel: args.channel,
    });
    execute(store, order_id, command, &args.write, json).await
}

/// Pays an order.
pub(crate) async fn pay(store: &EventStore, args: PayArgs, json: bool) -> anyhow::Result<()> {
    let command = OrderCommand::Pay(PayOrder {
        amount_cents: args.amount,
        payment_ref: args.payment_ref,
    });
    execute(store, args.order_id, command, &args.write, json).await
}

/// Cancels an order.
pub(crate) async fn cancel(store: &EventStore, args: CancelArgs, json: bool) -> anyhow::Result<()> {
    let command = OrderCommand::Cancel(CancelOrder {
        reason: args.reason,
    });
    execute(store, args.order_id, command, &args.write, json).await
}

/// Ships an order.
pub(crate) async fn ship(store: &EventStore, args: ShipArgs, json: bool) -> anyhow::Result<()> {
    let command = OrderCommand::Ship(ShipOrder {
        carrier: args.carrier,
        tracking_number: args.tracking_number,
    });
    execute(store, args.order_id, command, &args.write, json).await
}

/// Shows the folded order; an unknown id is refused.
pub(crate) async fn show(store: &EventStore, args: ShowArgs, json: bool) -> anyhow::Result<()> {
    let order = store.load(args.order_id).await.map_err(with_hint)?;
    if order.status == OrderStatus::New {
        return Err(ops::Refused::new(OrderError::NotFound(args.order_id)).into());
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(&order).context("encoding the order")?
        );
    } else {
        print!("{}", describe(&order));
    }
    Ok(())
}

async fn execute(
    store: &EventStore,
    order_id: OrderId,
    command: OrderCommand,
    write: &WriteOptions,
    json: bool,
) -> anyhow::Result<()> {
    let context = CommandContext {
        idempotency_key: write.idempotency_key.clone(),
        expected_version: write.expected_version,
        correlation_id: write.correlation_id,
        traceparent: None,
    };
    let outcome = store
        .execute(order_id, &command, &context)
        .await
        .map_err(command_failure)?;
    tracing::info!(
        order_id = %outcome.id,
        command = command.verb(),
        version = outcome.aggregate_version,
        replayed = outcome.replayed,
        "command applied"
    );
    if !outcome.replayed {
        // One-shot process: hint the relay right away instead of through the debounced notifier.
        if let Err(error) = store::notify_now(store.pool()).await {
            tracing::debug!(%error, "outbox notification failed; the relay's poll will find the row");
        }
    }
    print_outcome(&command, &outcome, json);
    Ok(())
}

fn print_outcome(command: &OrderCommand, outcome: &CommandOutcome, json: bool) {
    let event_id = outcome.event_ids.first();
    if json {
        let body = json!({
            "order_id": outcome.id,
            "aggregate_version": outcome.aggregate_version,
            "event_id": event_id,
            "status": outcome.state.status,
            "replayed": outcome.replayed,
        });
        println!("{body}");
        return;
    }
    let past = match command {
        OrderCommand::Place(_) => "placed",
        OrderCommand::Pay(_) => "paid",
        OrderCommand::Cancel(_) => "cancelled",
        OrderCommand::Ship(_) => "shipped",
    };
    let replay = if outcome.replayed {
        " (idempotent retry: nothing new written)"
    } else {
        ""
    };
    println!(
        "{past} order {} at version {}{replay}",
        outcome.id, outcome.aggregate_version
    );
    if let Some(event_id) = event_id {
        println!("event {event_id}");
    }
}

/// A human-readable summary of an order.
fn describe(order: &Order) -> String {
    let mut text = format!(
        "order    {}\nstatus   {}\nversion  {}\n",
        order.order_id, order.status, order.version
    );
    if let (Some(customer), Some(currency)) = (&order.customer_id, &order.currency) {
        text += &format!(
            "customer {customer}\ntotal    {} {currency}\n",
            order.total_cents
        );
    }
    if let Some(channel) = order.channel {
        text += &format!("channel  {channel}\n");
    }
    for line in &order.lines {
        text += &format!(
            "  {:<20} {:>8} × {:>10}\n",
            line.sku.as_str(),
            line.quantity.get(),
            line.unit_price_cents.get()
        );
    }
    if let Some(reference) = &order.payment_ref {
        text += &format!("paid     {} (ref {reference})\n", order.paid_cents);
    }
    if let Some(reason) = &order.cancel_reason {
        text += &format!("cancel   {reason}\n");
    }
    if let (Some(carrier), Some(tracking)) = (&order.carrier, &order.tracking_number) {
        text += &format!("shipped  {carrier} {tracking}\n");
    }
    text
}
