//! `customer register`, `rename` and `show`: one customer command through the event store, and the
//! result printed (as `{customer_id, aggregate_id, aggregate_version, event_id, name, replayed}` with
//! `--json`).

use anyhow::Context;
use domain::{
    Aggregate, Customer, CustomerCommand, CustomerError, CustomerKey, RegisterCustomer,
    RenameCustomer,
};
use serde_json::json;
use store::{CommandContext, CommandOutcome, EventStore};

use crate::cli::{CustomerRegisterArgs, CustomerRenameArgs, CustomerShowArgs};
use crate::failure::{command_failure, with_hint};

/// Registers a customer.
pub(crate) async fn register(
    store: &EventStore,
    args: CustomerRegisterArgs,
    json: bool,
) -> anyhow::Result<()> {
    let key = CustomerKey::of(&args.customer);
    let command = CustomerCommand::Register(RegisterCustomer {
        customer_id: args.customer,
        name: args.name,
    });
    let context = CommandContext {
        idempotency_key: args.idempotency_key,
        ..CommandContext::default()
    };
    execute(store, key, command, context, json).await
}

/// Renames a customer.
pub(crate) async fn rename(
    store: &EventStore,
    args: CustomerRenameArgs,
    json: bool,
) -> anyhow::Result<()> {
    let key = CustomerKey::of(&args.customer);
    let command = CustomerCommand::Rename(RenameCustomer { name: args.name });
    let context = CommandContext {
        expected_version: args.expected_version,
        ..CommandContext::default()
    };
    execute(store, key, command, context, json).await
}

/// Shows a customer; an unknown handle is refused.
pub(crate) async fn show(
    store: &EventStore,
    args: CustomerShowArgs,
    json: bool,
) -> anyhow::Result<()> {
    let key = CustomerKey::of(&args.customer);
    let customer = store.load_as::<Customer>(key).await.map_err(with_hint)?;
    if customer.version() == 0 {
        return Err(ops::Refused::new(format!(
            "customer {} not found ({})",
            args.customer,
            CustomerError::NotFound(key)
        ))
        .into());
    }
    if json {
        println!(
            "{}",
            serde_json::to_string(&customer).context("encoding the customer")?
        );
    } else {
        println!(
            "customer {}\nname     {}\nversion  {}\nid       {}",
            args.customer,
            customer.name.as_ref().map_or("", |n| n.as_str()),
            customer.version,
            key
        );
    }
    Ok(())
}

async fn execute(
    store: &EventStore,
    key: CustomerKey,
    command: CustomerCommand,
    context: CommandContext,
    json: bool,
) -> anyhow::Result<()> {
    let outcome = store
        .execute(key, &command, &context)
        .await
        .map_err(command_failure)?;
    if !outcome.replayed
        && let Err(error) = store::notify_now(store.pool()).await
    {
        tracing::debug!(%error, "outbox notification failed; the relay's poll will find the row");
    }
    print_outcome(&outcome, json);
    Ok(())
}

fn print_outcome(outcome: &CommandOutcome<Customer>, json: bool) {
    let customer = &outcome.state;
    let handle = customer
        .customer_id
        .as_ref()
        .map_or_else(String::new, ToString::to_string);
    let name = customer.name.as_ref().map_or("", |n| n.as_str());
    if json {
        println!(
            "{}",
            json!({
                "customer_id": handle,
                "aggregate_id": outcome.id,
                "aggregate_version": outcome.aggregate_version,
                "event_id": outcome.event_ids.first(),
                "name": name,
                "replayed": outcome.replayed,
            })
        );
    } else {
        println!(
            "customer {handle} ({name}) at version {}{}",
            outcome.aggregate_version,
            if outcome.replayed {
                " (idempotent retry: nothing new written)"
            } else {
                ""
            }
        );
    }
}
