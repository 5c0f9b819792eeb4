//! What the built-in projections should hold, folded from the stored events by rules written here
//! again, not taken from the projections' code.

use std::collections::{BTreeMap, HashMap};

use uuid::Uuid;

use super::evidence::StoredEvent;

/// A loyalty point is earned per this many cents paid: the rule as the README states it, written
/// here again on purpose rather than taken from the projection's code.
const CENTS_PER_POINT: i64 = 100;

/// What the projections should hold, folded from the stored events.
#[derive(Debug, Default)]
pub(super) struct Folded {
    /// SKU → [reserved, shipped, released].
    pub(super) stock: BTreeMap<String, [i64; 3]>,
    /// Customer → points balance.
    pub(super) points: BTreeMap<String, i64>,
    /// Order → its search document.
    pub(super) documents: BTreeMap<Uuid, Document>,
    /// Order → its last version.
    pub(super) versions: BTreeMap<Uuid, i64>,
}

/// What the search index says of an order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Document {
    pub(super) status: String,
    pub(super) customer: String,
    pub(super) total_cents: i64,
}

/// The fold: each order's lines, customer and payment, and what each event does to stock and points.
pub(super) fn fold(events: &[StoredEvent]) -> Folded {
    #[derive(Default)]
    struct Order {
        customer: String,
        total_cents: i64,
        lines: Vec<(String, i64)>,
        paid: i64,
    }
    let mut folded = Folded::default();
    let mut orders: HashMap<Uuid, Order> = HashMap::new();
    for event in events {
        let order = orders.entry(event.aggregate_id).or_default();
        let payload = &event.payload;
        let status = match event.event_type.as_str() {
            "order.placed" => {
                order.customer = payload["customer_id"].as_str().unwrap_or("").to_owned();
                order.total_cents = payload["total_cents"].as_i64().unwrap_or(0);
                for line in payload["lines"].as_array().into_iter().flatten() {
                    let sku = line["sku"].as_str().unwrap_or("").to_owned();
                    let quantity = line["quantity"].as_i64().unwrap_or(0);
                    folded.stock.entry(sku.clone()).or_default()[0] += quantity;
                    order.lines.push((sku, quantity));
                }
                "placed"
            }
            "order.paid" => {
                order.paid = payload["amount_cents"].as_i64().unwrap_or(0);
                *folded.points.entry(order.customer.clone()).or_default() +=
                    order.paid / CENTS_PER_POINT;
                "paid"
            }
            "order.shipped" => {
                for (sku, quantity) in &order.lines {
                    let stock = folded.stock.entry(sku.clone()).or_default();
                    stock[0] -= quantity;
                    stock[1] += quantity;
                }
                "shipped"
            }
            "order.cancelled" => {
                for (sku, quantity) in &order.lines {
                    let stock = folded.stock.entry(sku.clone()).or_default();
                    stock[0] -= quantity;
                    stock[2] += quantity;
                }
                *folded.points.entry(order.customer.clone()).or_default() -=
                    order.paid / CENTS_PER_POINT;
                "cancelled"
            }
            other => other,
        };
        let document = folded.documents.entry(event.aggregate_id).or_default();
        document.status = status.to_owned();
        document.customer.clone_from(&order.customer);
        document.total_cents = order.total_cents;
        folded
            .versions
            .insert(event.aggregate_id, event.aggregate_version);
    }
    folded
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn event(order: u128, version: i64, event_type: &str, payload: Value) -> StoredEvent {
        StoredEvent {
            event_id: Uuid::from_u128(
                order * 100 + u128::try_from(version).expect("a positive version"),
            ),
            event_type: event_type.to_owned(),
            aggregate_id: Uuid::from_u128(order),
            aggregate_version: version,
            payload,
        }
    }

    #[test]
    fn the_fold_moves_stock_and_points_through_each_lifecycle() {
        let lines = json!([{"sku": "MUG", "quantity": 2, "unit_price_cents": 1250}, {"sku": "TEA", "quantity": 1, "unit_price_cents": 500}]);
        let placed =
            json!({"customer_id": "ann", "currency": "EUR", "lines": lines, "total_cents": 3000});
        let paid = json!({"amount_cents": 3000, "payment_ref": null});
        let events = vec![
            // shipped
            event(1, 1, "order.placed", placed.clone()),
            event(1, 2, "order.paid", paid.clone()),
            event(
                1,
                3,
                "order.shipped",
                json!({"carrier": "DHL", "tracking_number": "X"}),
            ),
            // refunded
            event(2, 1, "order.placed", placed.clone()),
            event(2, 2, "order.paid", paid),
            event(2, 3, "order.cancelled", json!({"reason": "r"})),
            // left placed
            event(3, 1, "order.placed", placed),
        ];
        let folded = fold(&events);
        assert_eq!(folded.stock["MUG"], [2, 2, 2]);
        assert_eq!(folded.stock["TEA"], [1, 1, 1]);
        assert_eq!(
            folded.points["ann"], 30,
            "one order's 30 points kept, the refund's taken back"
        );
        let status = |order| folded.documents[&Uuid::from_u128(order)].status.as_str();
        assert_eq!(status(1), "shipped");
        assert_eq!(status(2), "cancelled");
        assert_eq!(status(3), "placed");
        assert_eq!(folded.documents[&Uuid::from_u128(3)].total_cents, 3000);
        assert_eq!(folded.versions[&Uuid::from_u128(1)], 3);
        assert_eq!(folded.versions[&Uuid::from_u128(3)], 1);
    }
}
