//! Upcasters: pure JSON-to-JSON steps that turn any stored `(event_type, event_version)` into the
//! current shape, so the domain enum only ever knows the newest version of each event.
//!
//! A step is keyed by `(event_type, from_version)` and produces `from_version + 1`; steps chain. An unknown
//! type, a version newer than this code knows, or a payload an old step cannot read is an error, never a
//! panic: consumers park such messages instead of crashing.
//!
//! Downcasters go the other way, for two-phase rollouts: while old readers are still running, writers
//! keep writing the older version ([`WriteVersions`], `--write-version order.placed=2`). A downcast is
//! accepted only when upcasting its result gives the event back unchanged: an event the older version
//! cannot represent is refused, never silently changed.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};

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

/// Why an event could not be written in an older version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DowncastError {
    /// No downcaster from `from_version`: the older version cannot be written at all.
    #[error("{event_type} cannot be written as v{to_version}: no downcaster from v{from_version}")]
    MissingStep {
        /// The event type.
        event_type: String,
        /// The version with no step down.
        from_version: i32,
        /// The version asked for.
        to_version: i32,
    },
    /// The older version has no room for what this event says.
    #[error(
        "this {event_type} cannot be represented in v{to_version}, which this service writes \
         (--write-version): {reason}"
    )]
    Unrepresentable {
        /// The event type.
        event_type: String,
        /// The version asked for.
        to_version: i32,
        /// What would be lost.
        reason: String,
    },
    /// Upcasting failed on the way back (a downcaster bug).
    #[error(transparent)]
    Upcast(#[from] UpcastError),
}

/// The registry of current versions and upcast steps.
#[derive(Debug, Clone, Default)]
pub struct Upcasters {
    current: BTreeMap<String, i32>,
    steps: BTreeMap<(String, i32), UpcastStep>,
    /// What each step is called, for people following a chain (the console, `waybill schema`).
    step_names: BTreeMap<(String, i32), &'static str>,
    /// Keyed by `(event_type, from_version)`: `from_version` → `from_version - 1`.
    down: BTreeMap<(String, i32), UpcastStep>,
    /// The newest version this reader accepts per type, when lower than current (`--max-version`):
    /// newer ones are refused as [`UpcastError::TooNew`], exactly as an older binary would.
    caps: BTreeMap<String, i32>,
}

impl Upcasters {
    /// The types of `E` at their current versions, with no steps (an aggregate whose events all
    /// are at version 1 needs none).
    pub fn for_events<E: crate::aggregate::DomainEvent>() -> Self {
        E::CURRENT_VERSIONS
            .iter()
            .fold(Self::default(), |upcasters, (event_type, version)| {
                upcasters.with_type(event_type, *version)
            })
    }

    /// The registry of every aggregate type's events (their names never overlap: each starts with
    /// its aggregate type).
    pub fn all() -> Self {
        use crate::aggregate::Aggregate;
        crate::order::Order::upcasters().merge(crate::customer::Customer::upcasters())
    }

    /// This registry and `other`'s together.
    pub fn merge(mut self, other: Self) -> Self {
        self.current.extend(other.current);
        self.steps.extend(other.steps);
        self.step_names.extend(other.step_names);
        self.down.extend(other.down);
        self.caps.extend(other.caps);
        self
    }

    /// The registry for order events: every version ever written (registered in
    /// `Order::upcasters()`).
    pub fn orders() -> Self {
        <crate::order::Order as crate::aggregate::Aggregate>::upcasters()
    }

    /// Like [`Upcasters::with_step`], with the name the step is shown by.
    pub fn with_named_step(
        mut self,
        event_type: &str,
        from_version: i32,
        name: &'static str,
        step: UpcastStep,
    ) -> Self {
        self.step_names
            .insert((event_type.to_owned(), from_version), name);
        self.with_step(event_type, from_version, step)
    }

    /// The name of the step from `from_version` of `event_type`, when it was registered with one.
    pub fn step_name(&self, event_type: &str, from_version: i32) -> Option<&'static str> {
        self.step_names
            .get(&(event_type.to_owned(), from_version))
            .copied()
    }

    /// Registers the downcaster from `from_version` to `from_version - 1` of `event_type`.
    pub fn with_downcast(mut self, event_type: &str, from_version: i32, step: UpcastStep) -> Self {
        self.down
            .insert((event_type.to_owned(), from_version), step);
        self
    }

    /// Refuses versions of `event_type` above `max` as too new, as a reader that only knew `max`
    /// would (`--max-version`). A cap at or above the current version changes nothing.
    pub fn capped(mut self, event_type: &str, max: i32) -> Self {
        self.caps.insert(event_type.to_owned(), max);
        self
    }

    /// Brings `payload`, an event of `event_type` in its current version, down to `to_version`, or
    /// says why it cannot be written that way.
    pub fn downcast(
        &self,
        event_type: &str,
        payload: Value,
        to_version: i32,
    ) -> Result<Value, DowncastError> {
        let current = self
            .current_version(event_type)
            .ok_or_else(|| UpcastError::UnknownType(event_type.to_owned()))?;
        if !(1..=current).contains(&to_version) {
            return Err(UpcastError::InvalidVersion {
                event_type: event_type.to_owned(),
                version: to_version,
            }
            .into());
        }
        let original = payload.clone();
        let down =
            (to_version + 1..=current)
                .rev()
                .try_fold(payload, |payload, from_version| {
                    let step = self
                        .down
                        .get(&(event_type.to_owned(), from_version))
                        .ok_or_else(|| DowncastError::MissingStep {
                            event_type: event_type.to_owned(),
                            from_version,
                            to_version,
                        })?;
                    step(payload).map_err(|reason| DowncastError::Unrepresentable {
                        event_type: event_type.to_owned(),
                        to_version,
                        reason,
                    })
                })?;
        // What readers will see: if it is not the event, the older version cannot carry it.
        let read_back = self.upcast_uncapped(event_type, to_version, down.clone())?;
        if read_back != original {
            return Err(DowncastError::Unrepresentable {
                event_type: event_type.to_owned(),
                to_version,
                reason: format!("it would be read back as {read_back}, not as {original}"),
            });
        }
        Ok(down)
    }

    /// Whether `event_type` can be written as `version` at all (a chain of downcasters reaches it).
    pub fn can_write(&self, event_type: &str, version: i32) -> bool {
        self.current_version(event_type).is_some_and(|current| {
            (1..=current).contains(&version)
                && (version + 1..=current)
                    .all(|v| self.down.contains_key(&(event_type.to_owned(), v)))
        })
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
        if let Some(max) = self.caps.get(event_type).copied()
            && version > max
        {
            return Err(UpcastError::TooNew {
                event_type: event_type.to_owned(),
                version,
                current: max,
            });
        }
        self.upcast_uncapped(event_type, version, payload)
    }

    fn upcast_uncapped(
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

/// `order.placed` v2 → v3: adds `channel`. Every order before v3 came through the web shop.
pub fn order_placed_v2_to_v3(v2: Value) -> Result<Value, String> {
    let Value::Object(mut fields) = v2 else {
        return Err("the payload is not an object".to_owned());
    };
    if fields.contains_key("channel") {
        return Err("v2 has no channel field".to_owned());
    }
    fields.insert("channel".to_owned(), json!(crate::values::Channel::Web));
    Ok(Value::Object(fields))
}

/// `order.placed` v3 → v2 (for writers that must keep writing v2): drops `channel`. Only a web order
/// survives the round trip; [`Upcasters::downcast`] refuses the others.
pub fn order_placed_v3_to_v2(v3: Value) -> Result<Value, String> {
    let Value::Object(mut fields) = v3 else {
        return Err("the payload is not an object".to_owned());
    };
    match fields.remove("channel") {
        Some(channel) if channel == json!(crate::values::Channel::Web) => Ok(Value::Object(fields)),
        Some(channel) => Err(format!(
            "v2 has no channel, and every v2 order is read as a web order; channel {channel} \
             needs v3 (switch writers to v3 once every reader knows it)"
        )),
        None => Err("the v3 payload has no channel".to_owned()),
    }
}

/// Which payload version writers write per event type (default: the current one). Set for the
/// expand phase of a rollout, while readers that know only the older version are still running.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteVersions(BTreeMap<String, i32>);

impl WriteVersions {
    /// Reads `TYPE=VERSION` (e.g. `order.placed=2`), checked against what `upcasters` can write.
    pub fn parse_one(text: &str, upcasters: &Upcasters) -> Result<(String, i32), String> {
        let (event_type, version) = text
            .split_once('=')
            .ok_or_else(|| format!("{text:?} is not TYPE=VERSION (e.g. order.placed=2)"))?;
        let event_type = event_type.trim();
        let current = upcasters
            .current_version(event_type)
            .ok_or_else(|| format!("unknown event type {event_type:?}"))?;
        let version: i32 = version
            .trim()
            .parse()
            .map_err(|_| format!("{version:?} is not a version number"))?;
        if !upcasters.can_write(event_type, version) {
            return Err(format!(
                "{event_type} cannot be written as v{version}: this code writes v{current}, and \
                 older versions only where a downcaster reaches them"
            ));
        }
        Ok((event_type.to_owned(), version))
    }

    /// From checked pairs.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, i32)>) -> Self {
        Self(pairs.into_iter().collect())
    }

    /// The version to write `event_type` as, if not the current one.
    pub fn get(&self, event_type: &str) -> Option<i32> {
        self.0.get(event_type).copied()
    }

    /// Whether every type is written in its current version.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Display for WriteVersions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pairs: Vec<String> = self.0.iter().map(|(t, v)| format!("{t}={v}")).collect();
        f.write_str(&pairs.join(","))
    }
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
        // The step alone: a later version's step must not change what this one is tested for.
        let out = order_placed_v1_to_v2(json!({"order_no": "A-1001", "amount_cents": 4200}))
            .expect("v1 upcasts");
        assert_eq!(
            out,
            json!({"customer_id": "legacy", "currency": "XXX", "lines": [], "total_cents": 4200})
        );
    }

    #[test]
    fn v2_placed_becomes_v3_as_a_web_order() {
        let v2 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1});
        let v3 = order_placed_v2_to_v3(v2).expect("v2 upcasts");
        assert_eq!(v3["channel"], "web");
        assert!(
            order_placed_v2_to_v3(v3).is_err(),
            "a v2 payload has no channel"
        );
        assert!(order_placed_v2_to_v3(json!([1])).is_err());
    }

    #[test]
    fn a_legacy_order_goes_through_every_step_to_the_current_shape() {
        let current = Upcasters::orders()
            .upcast(
                "order.placed",
                1,
                json!({"order_no": "A-1001", "amount_cents": 4200}),
            )
            .expect("v1 upcasts");
        let placed: crate::event::OrderPlaced =
            serde_json::from_value(current).expect("the current shape");
        assert_eq!(placed.total_cents, 4200);
    }

    #[test]
    fn a_web_order_downcasts_to_v2_and_reads_back_unchanged() {
        let upcasters = Upcasters::orders();
        let v3 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1, "channel": "web"});
        let v2 = upcasters
            .downcast("order.placed", v3.clone(), 2)
            .expect("a web order fits v2");
        assert_eq!(v2.get("channel"), None);
        assert_eq!(upcasters.upcast("order.placed", 2, v2), Ok(v3));
    }

    #[test]
    fn an_order_v2_cannot_represent_is_refused_not_changed() {
        let upcasters = Upcasters::orders();
        let v3 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1, "channel": "store"});
        let err = upcasters
            .downcast("order.placed", v3, 2)
            .expect_err("v2 has no channel");
        assert!(
            matches!(err, DowncastError::Unrepresentable { to_version: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("store"), "{err}");
        // No downcaster reaches v1: it cannot be written at all.
        assert!(!upcasters.can_write("order.placed", 1));
        assert!(upcasters.can_write("order.placed", 2));
        assert!(matches!(
            upcasters.downcast("order.placed", json!({}), 1),
            Err(DowncastError::MissingStep { .. } | DowncastError::Unrepresentable { .. })
        ));
    }

    #[test]
    fn a_downcast_that_loses_something_is_caught_by_the_round_trip() {
        // A careless downcaster that drops the field whatever it holds: the round trip refuses it.
        let upcasters = Upcasters::orders().with_downcast("order.placed", 3, |mut v| {
            v.as_object_mut().map(|o| o.remove("channel"));
            Ok(v)
        });
        let v3 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1, "channel": "phone"});
        let err = upcasters
            .downcast("order.placed", v3, 2)
            .expect_err("lossy");
        assert!(err.to_string().contains("read back"), "{err}");
    }

    #[test]
    fn write_versions_are_checked_against_what_can_be_written() {
        let upcasters = Upcasters::orders();
        assert_eq!(
            WriteVersions::parse_one("order.placed=2", &upcasters),
            Ok(("order.placed".to_owned(), 2))
        );
        for bad in [
            "order.placed",
            "order.placed=1",
            "order.placed=4",
            "order.placed=x",
            "order.teleported=1",
        ] {
            assert!(WriteVersions::parse_one(bad, &upcasters).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_capped_reader_refuses_newer_versions_as_an_old_binary_would() {
        let capped = Upcasters::orders().capped("order.placed", 2);
        let v3 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1, "channel": "web"});
        let err = capped
            .upcast("order.placed", 3, v3)
            .expect_err("too new for this reader");
        assert_eq!(
            err.to_string(),
            "order.placed v3 is newer than this code knows (current is v2)"
        );
        let v2 = json!({"customer_id": "a", "currency": "EUR", "lines": [], "total_cents": 1});
        assert!(capped.upcast("order.placed", 2, v2).is_ok());
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
