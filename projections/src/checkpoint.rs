//! The checkpoint verdict on one event, pure: against its order's checkpoint, an event was applied
//! before (a duplicate), is the next one to apply, must wait for a missing predecessor, or contradicts
//! what the projection already knows of its order (to be parked). [`crate::plan::Plan`] runs it over a
//! whole batch and the held table.
//!
//! The event id is not an input: the version alone orders an aggregate's events, and the checkpoint's
//! event id is kept for operators, not for deciding.

/// An aggregate's checkpoint and the facts about it that later events are checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// The last applied version (0: nothing yet).
    pub version: i64,
    /// The order's total, from its `order.placed` (`None` if unknown).
    pub total_cents: Option<i64>,
}

impl Checkpoint {
    /// The checkpoint after applying an event of `version` with `facts`.
    pub fn after(mut self, version: i64, facts: &Facts) -> Self {
        self.version = version;
        if let Facts::Placed { total_cents } = facts {
            self.total_cents = Some(*total_cents);
        }
        self
    }
}

/// The facts of an event that its order's earlier events constrain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Facts {
    /// `order.placed`: sets the order's total.
    Placed {
        /// Its total.
        total_cents: i64,
    },
    /// `order.paid`: pays exactly the total, always.
    Paid {
        /// The amount.
        amount_cents: i64,
    },
    /// Nothing to check.
    Other,
}

/// What the checkpoint says about one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// At or below the checkpoint: applied before, so acknowledged and skipped.
    Duplicate,
    /// Exactly the next version, consistent with its order: apply it and move the checkpoint.
    Apply,
    /// Beyond the next version: keep it until its predecessor is applied.
    Hold,
    /// The next version, but it contradicts what is known of its order: park it with this reason.
    Refuse(String),
}

/// Decides an event of `version` with `facts` against its order's `checkpoint`.
pub fn decide(checkpoint: &Checkpoint, version: i64, facts: &Facts) -> Decision {
    if version <= checkpoint.version {
        Decision::Duplicate
    } else if version > checkpoint.version + 1 {
        Decision::Hold
    } else if let Some(reason) = contradiction(facts, checkpoint) {
        Decision::Refuse(reason)
    } else {
        Decision::Apply
    }
}

/// Why an event cannot follow what is known of its order, if it cannot.
fn contradiction(facts: &Facts, checkpoint: &Checkpoint) -> Option<String> {
    match (facts, checkpoint.total_cents) {
        (Facts::Paid { amount_cents }, Some(total)) if *amount_cents != total => Some(format!(
            "order.paid of {amount_cents} cents for an order whose total is {total} cents"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLACED: Checkpoint = Checkpoint {
        version: 1,
        total_cents: Some(2500),
    };

    #[test]
    fn versions_at_or_below_the_checkpoint_are_duplicates() {
        assert_eq!(decide(&PLACED, 1, &Facts::Other), Decision::Duplicate);
        assert_eq!(
            decide(&PLACED, 0, &Facts::Placed { total_cents: 1 }),
            Decision::Duplicate
        );
        // Whatever it claims: an applied version is never checked again.
        assert_eq!(
            decide(&PLACED, 1, &Facts::Paid { amount_cents: 1 }),
            Decision::Duplicate
        );
    }

    #[test]
    fn the_next_version_applies() {
        assert_eq!(
            decide(
                &Checkpoint::default(),
                1,
                &Facts::Placed { total_cents: 2500 }
            ),
            Decision::Apply
        );
        assert_eq!(decide(&PLACED, 2, &Facts::Other), Decision::Apply);
    }

    #[test]
    fn a_version_beyond_the_next_is_held() {
        assert_eq!(
            decide(&Checkpoint::default(), 2, &Facts::Other),
            Decision::Hold
        );
        // Held before it is checked: its order may still change by the versions in between.
        assert_eq!(
            decide(&PLACED, 3, &Facts::Paid { amount_cents: 1 }),
            Decision::Hold
        );
    }

    #[test]
    fn a_payment_of_the_total_applies() {
        assert_eq!(
            decide(&PLACED, 2, &Facts::Paid { amount_cents: 2500 }),
            Decision::Apply
        );
    }

    #[test]
    fn a_payment_that_is_not_the_total_is_refused_with_both_amounts() {
        let Decision::Refuse(reason) = decide(&PLACED, 2, &Facts::Paid { amount_cents: 999 })
        else {
            panic!("a payment of another amount than the total must be refused");
        };
        assert!(
            reason.contains("999 cents") && reason.contains("total is 2500"),
            "{reason}"
        );
    }

    #[test]
    fn a_payment_for_an_order_of_unknown_total_applies() {
        // An operator's release can move a checkpoint past `order.placed`: nothing to check against.
        let released = Checkpoint {
            version: 1,
            total_cents: None,
        };
        assert_eq!(
            decide(&released, 2, &Facts::Paid { amount_cents: 1 }),
            Decision::Apply
        );
    }

    #[test]
    fn applying_moves_the_version_and_a_placement_sets_the_total() {
        assert_eq!(
            Checkpoint::default().after(1, &Facts::Placed { total_cents: 700 }),
            Checkpoint {
                version: 1,
                total_cents: Some(700)
            }
        );
        assert_eq!(
            PLACED.after(2, &Facts::Paid { amount_cents: 2500 }),
            Checkpoint {
                version: 2,
                total_cents: Some(2500)
            }
        );
    }
}
