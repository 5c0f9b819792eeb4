//! The deliberate failures only the testing twin `waybill-projection-faulty` asks for, and the check
//! that a fault is one the command would reach (and, for the checkpoint breaker, consented to).

#[cfg(feature = "fault-injection")]
use super::Common;
use crate::runner::FailPoint;

/// The testing twin's name and its flag that breaks the checkpoint check of `run` (for the chaos
/// harness's proof): `None` without the `fault-injection` feature, so that a build without it names
/// neither (the harness asks for them here).
#[cfg(feature = "fault-injection")]
pub const CHECKPOINT_BREAKING_TWIN: Option<(&str, &str)> =
    Some(("waybill-projection-faulty", "--ignore-checkpoint"));
/// See above: this build has no twin.
#[cfg(not(feature = "fault-injection"))]
pub const CHECKPOINT_BREAKING_TWIN: Option<(&str, &str)> = None;

/// The deliberate failures a faulty twin asks for; the projection binaries always run with none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Where `run` or `rebuild` stops on purpose.
    pub fail_point: FailPoint,
    /// `run` applies redelivered events again (a deliberately broken projection, which the chaos
    /// harness must catch); refused without its consent in the environment.
    #[cfg(feature = "fault-injection")]
    pub ignore_checkpoint: bool,
}

/// Refuses a fault that the command would never reach (a `run` fault given to `rebuild`, or the
/// reverse), and breaks this process's checkpoint check when asked — only with its consent in the
/// environment, so that a pasted command line cannot break a real projection.
#[cfg(feature = "fault-injection")]
pub(super) fn apply_faults(
    projection: &str,
    command: &Common,
    faults: Faults,
) -> Result<(), ops::Refused> {
    let for_run = faults.ignore_checkpoint || faults.fail_point == FailPoint::AbortAfterCommit;
    let for_rebuild = matches!(
        faults.fail_point,
        FailPoint::FailBeforeSwap
            | FailPoint::AbortAfterSwap
            | FailPoint::AbortAfterFirstConsumerMoved
    );
    match command {
        Common::Run(_) if for_rebuild => {
            return Err(ops::Refused::new(format!(
                "{:?} stops a rebuild; `run` never reaches it",
                faults.fail_point
            )));
        }
        Common::Rebuild if for_run => {
            return Err(ops::Refused::new(
                "--crash-after-commit and --ignore-checkpoint are faults of `run`, not `rebuild`",
            ));
        }
        Common::Run(_) | Common::Rebuild => {}
        _ if for_run || for_rebuild => {
            return Err(ops::Refused::new(
                "the fault flags apply to `run` and `rebuild` only",
            ));
        }
        _ => {}
    }
    if faults.ignore_checkpoint {
        if std::env::var(crate::plan::BREAK_CHECKPOINT_VAR).as_deref()
            != Ok(crate::plan::BREAK_CHECKPOINT_CONSENT)
        {
            return Err(ops::Refused::new(format!(
                "--ignore-checkpoint applies events twice on purpose; it runs only with {}={}",
                crate::plan::BREAK_CHECKPOINT_VAR,
                crate::plan::BREAK_CHECKPOINT_CONSENT
            )));
        }
        tracing::error!(
            projection,
            "deliberately broken: redelivered events will be applied again (--ignore-checkpoint)"
        );
        crate::plan::ignore_checkpoint();
    }
    Ok(())
}
