//! The run itself: it drained, carried out every fault it was asked for, and the order service
//! accepted commands and answered as it should.

use super::evidence::Evidence;
use super::findings::Verdict;

/// Adds a violation for each way the run fell short of what it was asked to test.
pub(super) fn check_conduct(verdict: &mut Verdict, evidence: &Evidence<'_>) {
    if !evidence.drained.complete {
        verdict.violations.push(format!(
            "the system did not drain within {:.0} s after the load; still to do: {:?}",
            evidence.drained.seconds, evidence.drained.remaining
        ));
    }
    for kind in evidence.kinds {
        if evidence.injected.count(*kind) == 0 {
            verdict.violations.push(format!(
                "no {} fault was carried out: the run did not test what it was asked to",
                kind.name()
            ));
        }
    }
    for fault in &evidence.injected.faults {
        if let Some(error) = &fault.error {
            verdict.violations.push(format!(
                "the {} fault at {:.1} s could not be carried out: {error}",
                fault.kind.name(),
                fault.at
            ));
        }
    }
    if evidence.played.accepted.is_empty() {
        verdict
            .violations
            .push("the order service accepted no command at all".to_owned());
    }
    if evidence.played.abandoned > 0 {
        verdict.violations.push(format!(
            "{} lifecycle(s) were abandoned: a command still failed long after the load ended",
            evidence.played.abandoned
        ));
    }
    for unexpected in evidence.played.unexpected.iter().take(5) {
        verdict
            .violations
            .push(format!("the order service answered wrongly: {unexpected}"));
    }
}
