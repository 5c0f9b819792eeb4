//! Golden fixtures: every `(event_type, event_version)` that can exist in storage has a literal envelope
//! under `domain/fixtures/`, and each must upcast and decode with today's code.

use std::collections::BTreeSet;

use domain::{OrderEvent, Upcasters};

mod common;
use common::fixtures;

#[test]
fn every_version_that_can_exist_has_a_fixture() {
    let expected: BTreeSet<(String, i32)> = Upcasters::all().all_versions().into_iter().collect();
    let present: BTreeSet<(String, i32)> = fixtures()
        .into_iter()
        .map(|(_, e)| (e.event_type, e.event_version))
        .collect();
    assert_eq!(
        present, expected,
        "add a fixture for every version (and no stray ones)"
    );
}

#[test]
fn fixture_file_names_match_their_contents() {
    for (name, envelope) in fixtures() {
        assert_eq!(
            name,
            format!("{}.v{}.json", envelope.event_type, envelope.event_version)
        );
    }
}

#[test]
fn every_fixture_upcasts_and_decodes() {
    let upcasters = Upcasters::all();
    for (name, envelope) in fixtures() {
        let event = envelope
            .decode_any(&upcasters)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(event.event_type(), envelope.event_type, "{name}");
    }
}

#[test]
fn current_version_fixtures_round_trip_exactly() {
    // Re-encoding a decoded current payload must give back the fixture's JSON: a renamed or retyped
    // field in a published version fails here (it needs a new version instead).
    let upcasters = Upcasters::all();
    for (name, envelope) in fixtures() {
        if upcasters.current_version(&envelope.event_type) != Some(envelope.event_version) {
            continue;
        }
        let event = envelope
            .decode_any(&upcasters)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(event.to_payload(), envelope.payload, "{name}");
        assert_eq!(event.event_version(), envelope.event_version, "{name}");
    }
}

#[test]
fn the_legacy_order_placed_folds_into_a_placed_order() {
    let (_, v1) = fixtures()
        .into_iter()
        .find(|(name, _)| name == "order.placed.v1.json")
        .expect("v1 fixture");
    let event = v1.decode(&Upcasters::all()).expect("v1 decodes");
    let OrderEvent::Placed(placed) = &event else {
        panic!("expected order.placed, got {event:?}")
    };
    assert_eq!(placed.total_cents, 4200);
    assert_eq!(placed.customer_id.as_str(), domain::upcast::LEGACY_CUSTOMER);
    let order = domain::Order::fold(domain::OrderId::from_uuid(v1.aggregate_id), [&event]);
    assert_eq!(order.status, domain::OrderStatus::Placed);
    assert_eq!(order.total_cents, 4200);
}
