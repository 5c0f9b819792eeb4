//! Upcasters: pure JSON-to-JSON steps that turn any stored `(event_type, event_version)` into the
//! current shape, so the domain enum only ever knows the newest version of each event.
//!
//! A step is keyed by `(event_type, from_version)` and produces `from_version + 1`; steps chain. An unknown
//! type, a version newer than this code knows, or a payload an old step cannot read is an error, never a
//! panic: consumers park such messages instead of crashing.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::event::{CURRENT_VERSIONS, OrderEvent};

/// One step: a payload of version `n` in, version `n + 1` out, or why the old payload is unreadable.
pub type UpcastStep = fn(Value) -> Result<Value, String>;

/// Why a stored payload could not be brought to the current version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpcastError {
    /// No such event type is known to this code.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// Written by newer code than this; upgrading the reader fixes it.
    #[error("{event_type} v{version} is newer than this code knows (current is v{current})")]
    TooNew {
        /// The event type.
        event_type: String,
        /// The version found.
        version: i32,
        /// The newest version this code knows.
        current: i32,
    },
    /// Versions start at 1.
    #[error("{event_type} has invalid version {version}; versions start at 1")]
    InvalidVersion {
        /// The event type.
        event_type: String,
        /// The version found.
        version: i32,
    },
    /// The registry has a gap: a bug, caught by the fixture tests.
    #[error("no upcaster from {event_type} v{from_version}")]
    MissingStep {
        /// The event type.
        event_type: String,
        /// The version with no step onwards.
        from_version: i32,
    },
    /// An old payload did not have the shape its version promises.
    #[error("{event_type} v{from_version} payload cannot be upcast: {reason}")]
    Step {
        /// The event type.
        event_type: String,
        /// The version the failing step reads.
        from_version: i32,
        /// What the step found wrong.
        reason: String,
    },
}

/// The registry of current versions and upcast steps.
#[derive(Debug, Clone, Default)]
pub struct Upcasters {
    current: BTreeMap<String, i32>,
    steps: BTreeMap<(String, i32), UpcastStep>,
}

impl Upcasters {
    /// The registry for order events: every version ever written, up to [`CURRENT_VERSIONS`].
    pub fn orders() -> Self {
        let mut upcasters = Self::default();
        for (event_type, version) in CURRENT_VERSIONS {
            upcasters = upcasters.with_type(event_type, *version);
        }
        upcasters.with_step(OrderEvent::PLACED, 1, order_placed_v1_to_v2)
    }

    /// Declares an event type and its current version.
    pub fn with_type(mut self, event_type: &str, current_version: i32) -> Self {
        self.current.insert(event_type.to_owned(), current_version);
        self
    }

    /// Registers the step from `from_version` to `from_version + 1` of `event_type`.
    pub fn with_step(mut self, event_type: &str, from_version: i32, step: UpcastStep) -> Self {
        self.steps
            .insert((event_type.to_owned(), from_version), step);
        self
    }

    /// The current version of `event_type`, if the type is known.
    pub fn current_version(&self, event_type: &str) -> Option<i32> {
        self.current.get(event_type).copied()
    }

    /// Every `(event_type, version)` that can exist in storage: versions 1 to current of each type.
    pub fn all_versions(&self) -> Vec<(String, i32)> {
        self.current
            .iter()
            .flat_map(|(t, current)| (1..=*current).map(move |v| (t.clone(), v)))
            .collect()
    }

    /// Brings `payload`, written as `event_type` v`version`, to the current version.
    pub fn upcast(
        &self,
        event_type: &str,
        version: i32,
        payload: Value,
    ) -> Result<Value, UpcastError> {
        let current = self
            .current_version(event_type)
            .ok_or_else(|| UpcastError::UnknownType(event_type.to_owned()))?;
        if version < 1 {
            return Err(UpcastError::InvalidVersion {
                event_type: event_type.to_owned(),
                version,
            });
        }
        if version > current {
            return Err(UpcastError::TooNew {
                event_type: event_type.to_owned(),
                version,
                current,
            });
        }
        (version..current).try_fold(payload, |payload, from_version| {
            let step = self
                .steps
                .get(&(event_type.to_owned(), from_version))
                .ok_or_else(|| UpcastError::MissingStep {
                    event_type: event_type.to_owned(),
                    from_version,
                })?;
            step(payload).map_err(|reason| UpcastError::Step {
                event_type: event_type.to_owned(),
                from_version,
                reason,
            })
        })
    }
}

/// The customer id given to orders from before customers were recorded (`order.placed` v1).
pub const LEGACY_CUSTOMER: &str = "legacy";

/// The currency of v1 orders, which had none: ISO 4217's "no currency" code, rather than a guess.
pub const LEGACY_CURRENCY: &str = "XXX";

/// `order.placed` v1 `{order_no, amount_cents}` → v2 `{customer_id, currency, lines, total_cents}`.
///
/// Version 1 came from the first system, which knew neither customers, currencies nor lines. The step
/// keeps the amount as the total, records the customer as [`LEGACY_CUSTOMER`] and the currency as
/// [`LEGACY_CURRENCY`], and leaves `lines` empty (nothing is reserved in inventory for such an order).
/// `order_no` has no place in v2 and is dropped; the event id and aggregate id still identify the order.
pub fn order_placed_v1_to_v2(v1: Value) -> Result<Value, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PlacedV1 {
        #[allow(
            dead_code,
            reason = "read only to check the v1 shape; v2 has no field for it"
        )]
        order_no: String,
        amount_cents: i64,
    }
    let v1: PlacedV1 = serde_json::from_value(v1).map_err(|e| e.to_string())?;
    if v1.amount_cents < 0 {
        return Err(format!("amount_cents {} is negative", v1.amount_cents));
    }
    Ok(json!({
        "customer_id": LEGACY_CUSTOMER,
        "currency": LEGACY_CURRENCY,
        "lines": [],
        "total_cents": v1.amount_cents,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_type_is_an_error_not_a_panic() {
        let err = Upcasters::orders()
            .upcast("order.teleported", 1, json!({}))
            .expect_err("unknown");
        assert_eq!(err, UpcastError::UnknownType("order.teleported".into()));
    }

    #[test]
    fn a_version_newer_than_the_code_is_an_error() {
        let err = Upcasters::orders()
            .upcast("order.paid", 7, json!({}))
            .expect_err("too new");
        assert!(err.to_string().contains("v7 is newer"), "{err}");
    }

    #[test]
    fn version_zero_is_invalid() {
        let err = Upcasters::orders()
            .upcast("order.paid", 0, json!({}))
            .expect_err("v0");
        assert!(matches!(
            err,
            UpcastError::InvalidVersion { version: 0, .. }
        ));
    }

    #[test]
    fn a_current_payload_passes_through_untouched() {
        let payload = json!({"reason": "x"});
        let out = Upcasters::orders()
            .upcast("order.cancelled", 1, payload.clone())
            .expect("current");
        assert_eq!(out, payload);
    }

    #[test]
    fn legacy_placed_becomes_v2_with_the_amount_as_total() {
        let out = Upcasters::orders()
            .upcast(
                "order.placed",
                1,
                json!({"order_no": "A-1001", "amount_cents": 4200}),
            )
            .expect("v1 upcasts");
        assert_eq!(
            out,
            json!({"customer_id": "legacy", "currency": "XXX", "lines": [], "total_cents": 4200})
        );
    }

    #[test]
    fn a_malformed_legacy_payload_names_the_step() {
        let err = Upcasters::orders()
            .upcast("order.placed", 1, json!({"order_no": 5}))
            .expect_err("malformed");
        assert!(
            matches!(
                err,
                UpcastError::Step {
                    from_version: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_gap_in_the_chain_is_reported() {
        let upcasters =
            Upcasters::default()
                .with_type("x.happened", 3)
                .with_step("x.happened", 1, Ok);
        let err = upcasters
            .upcast("x.happened", 1, json!({}))
            .expect_err("gap");
        assert_eq!(
            err,
            UpcastError::MissingStep {
                event_type: "x.happened".into(),
                from_version: 2
            }
        );
    }
}
