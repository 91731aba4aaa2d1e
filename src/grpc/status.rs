//! The one table from errors to `tonic::Status`.
//!
//! A status message is for the caller: it names what went wrong and what to
//! do, never echoes input, model output or internals. The full cause goes to
//! the log, with the turn's ids, where it is emitted.

use tonic::{Code, Status};

use crate::agent::AgentError;
use crate::domain::InvalidInput;
use crate::store::{StoreError, TurnOutcome, TurnState};
use crate::turn::{Failure, RunError, StoreDown};

/// A call without acceptable credentials (refused before decoding).
pub fn unauthenticated(e: crate::auth::Unauthenticated) -> Status {
    Status::unauthenticated(e.to_string())
}

/// A caller acting for a user it may not act for.
pub fn permission_denied(e: crate::auth::Denied) -> Status {
    Status::permission_denied(e.to_string())
}

/// A request refused for bad input.
pub fn invalid(e: InvalidInput) -> Status {
    Status::invalid_argument(e.to_string())
}

/// A store failure as a status; the cause goes to the log.
pub fn store(e: StoreError) -> Status {
    match e {
        // Refused without a store call: the outage was logged once by the
        // health check, so each refusal (there may be thousands a second)
        // only at debug. The status carries the cause for the callers'
        // own refusal lines ([`is_store_down`]).
        StoreError::Unavailable(cause) if cause.is::<StoreDown>() => {
            tracing::debug!(error = %cause, "session store unavailable");
            let mut s = Status::unavailable(STORE_UNAVAILABLE);
            s.set_source(std::sync::Arc::new(StoreDown));
            s
        }
        StoreError::Unavailable(cause) => {
            tracing::warn!(error = %format!("{cause:#}"), "session store unavailable");
            Status::unavailable(STORE_UNAVAILABLE)
        }
        StoreError::Unexpected(cause) => {
            tracing::error!(error = %format!("{cause:#}"), "session store error");
            Status::internal("internal error in the session store")
        }
    }
}

/// What a caller is told when the session store cannot be reached.
const STORE_UNAVAILABLE: &str = "the session store is unavailable; retry later";

/// Whether `s` refused a call because the store is known to be down (its
/// last health check failed, [`StoreDown`]): the caller logs that refusal
/// at debug, as [`store`] does.
pub fn is_store_down(s: &Status) -> bool {
    std::error::Error::source(s).is_some_and(|e| e.is::<StoreDown>())
}

/// A Run refused before its stream started.
pub fn run_error(e: RunError, agents: &crate::agent::AgentRegistry) -> Status {
    match e {
        RunError::SessionNotFound => Status::not_found("session not found"),
        RunError::UnknownAgent => Status::not_found(format!(
            "unknown agent; this server serves: {}",
            agents.names().collect::<Vec<_>>().join(", ")
        )),
        RunError::RequestIdReused => Status::already_exists(
            "request_id was already used for a different message in this session",
        ),
        RunError::Busy { limit } => Status::resource_exhausted(format!(
            "too many runs in progress (limit {limit}); retry later"
        )),
        RunError::UserBusy { limit } => Status::resource_exhausted(format!(
            "this user has too many runs in progress (limit {limit}); retry when one has ended"
        )),
        RunError::TooManyFollowers { limit } => Status::resource_exhausted(format!(
            "too many streams following turns (limit {limit}); retry later"
        )),
        RunError::ShuttingDown => {
            Status::unavailable("the server is shutting down; retry on another replica")
        }
        RunError::TurnNotFound => Status::not_found("turn not found"),
        RunError::SessionBusy => Status::failed_precondition(
            "the session has a turn in progress; retry when it has ended",
        ),
        RunError::Store(e) => store(e),
    }
}

/// The outcome of a turn whose replica stopped (its lease expired, or the
/// process was restarted) before it ended. Such a turn is never run again.
pub fn replica_stopped() -> TurnOutcome {
    TurnOutcome {
        state: TurnState::Failed,
        code: Code::Unavailable as i32,
        message: "the serving replica stopped before the run finished; send a new request_id to run it again".into(),
    }
}

/// The outcome of a turn whose caller went away while it was being claimed:
/// the agent never started.
pub fn claim_abandoned() -> TurnOutcome {
    TurnOutcome {
        state: TurnState::Cancelled,
        code: Code::Cancelled as i32,
        message: "the client cancelled the call before the run started".into(),
    }
}

/// The outcome of a running turn that CancelTurn stopped: recorded by the
/// replica that served the cancel, whichever runs the turn.
pub fn cancelled_by_request() -> TurnOutcome {
    TurnOutcome {
        state: TurnState::Cancelled,
        code: Code::Cancelled as i32,
        message: "cancelled by CancelTurn".into(),
    }
}

/// A `page_token` that this server did not hand out.
pub fn bad_page_token() -> Status {
    Status::invalid_argument(
        "page_token is malformed; pass the next_page_token of the previous page",
    )
}

pub fn bad_turn_page_token() -> Status {
    Status::invalid_argument(
        "turn_page_token is malformed; pass the next_turn_page_token of the previous page",
    )
}

/// How a turn that ended with `result` is recorded (and so replayed).
pub fn outcome(result: &Result<(), Failure>) -> TurnOutcome {
    match result {
        Ok(()) => TurnOutcome {
            state: TurnState::Completed,
            code: Code::Ok as i32,
            message: String::new(),
        },
        Err(f) => failure_outcome(f),
    }
}

fn failure_outcome(f: &Failure) -> TurnOutcome {
    let (state, code, message): (TurnState, Code, String) = match f {
        Failure::Deadline { by_server: false } => (
            TurnState::DeadlineExceeded,
            Code::DeadlineExceeded,
            "the call's deadline passed before the run finished".into(),
        ),
        Failure::Deadline { by_server: true } => (
            TurnState::DeadlineExceeded,
            Code::DeadlineExceeded,
            "the run exceeded the server's maximum run duration".into(),
        ),
        Failure::SlowConsumer => (
            TurnState::Failed,
            Code::ResourceExhausted,
            "the client stopped reading events; the run was cancelled".into(),
        ),
        Failure::Shutdown => (
            TurnState::Failed,
            Code::Unavailable,
            "the server shut down before the run finished".into(),
        ),
        Failure::StoppedFollowing(f) => match **f {
            Failure::Shutdown => (
                TurnState::Failed,
                Code::Unavailable,
                "the server shut down while following the turn; attach to it again".into(),
            ),
            Failure::SlowConsumer => (
                TurnState::Failed,
                Code::ResourceExhausted,
                "the client stopped reading events; it stopped following the turn, which goes on (attach to it again)".into(),
            ),
            // The follower's own bound, not the turn's: the turn may have
            // completed, or still run.
            Failure::Deadline { by_server: true } => (
                TurnState::DeadlineExceeded,
                Code::DeadlineExceeded,
                "following the turn exceeded the server's maximum call duration; attach to it again".into(),
            ),
            ref f => return failure_outcome(f),
        },
        // Never a turn's outcome: the turn completed, this call did not
        // get its end.
        Failure::Undelivered(f) => {
            let (code, why) = match **f {
                Failure::SlowConsumer => (
                    Code::ResourceExhausted,
                    "the client stopped reading events",
                ),
                Failure::Deadline { by_server: false } => {
                    (Code::DeadlineExceeded, "the call's deadline passed")
                }
                Failure::Deadline { by_server: true } => (
                    Code::DeadlineExceeded,
                    "the call exceeded the server's maximum run duration",
                ),
                Failure::ClientGone => (Code::Cancelled, "the client cancelled the call"),
                _ => (Code::Unavailable, "the server stopped serving the call"),
            };
            (
                TurnState::Completed,
                code,
                format!("{why} before the final answer was delivered; the turn completed: send its request_id again to replay it"),
            )
        }
        Failure::ClientGone => (
            TurnState::Cancelled,
            Code::Cancelled,
            "the client cancelled the call".into(),
        ),
        Failure::Agent(AgentError::Unavailable { message, .. }) => {
            (TurnState::Failed, Code::Unavailable, message.clone())
        }
        Failure::Agent(AgentError::FailedPrecondition(m)) => {
            (TurnState::Failed, Code::FailedPrecondition, m.clone())
        }
        Failure::Agent(AgentError::InvalidInput(m)) => {
            (TurnState::Failed, Code::InvalidArgument, m.clone())
        }
        Failure::Agent(AgentError::Unexpected(_)) => (
            TurnState::Failed,
            Code::Internal,
            "the agent failed; the server log has the cause".into(),
        ),
        Failure::NoFinalAnswer => (
            TurnState::Failed,
            Code::Internal,
            "the agent ended without a final answer".into(),
        ),
        Failure::LeaseLost => return replica_stopped(),
        Failure::CancelledByRequest => return cancelled_by_request(),
        Failure::Removed => (
            TurnState::Failed,
            Code::NotFound,
            "the turn was removed while it was streamed (its session deleted, or pruned past the retention)".into(),
        ),
        Failure::Store(StoreError::Unavailable(_)) => (
            TurnState::Failed,
            Code::Unavailable,
            STORE_UNAVAILABLE.into(),
        ),
        Failure::Store(StoreError::Unexpected(_)) => (
            TurnState::Failed,
            Code::Internal,
            "internal error in the session store".into(),
        ),
        Failure::Stored(o) => return o.clone(),
    };
    TurnOutcome {
        state,
        code: code as i32,
        message,
    }
}

/// Trailer on a status that is a turn's recorded outcome: a retry with the
/// same request_id gets the same answer, so clients do not retry it.
pub const TURN_OUTCOME_HEADER: &str = "agentd-turn-outcome";

/// Trailer on a recorded outcome whose agent said when to try again (a
/// model server's `Retry-After`), where the standard pushback is left out
/// because a resend with the same request_id would only replay it: the
/// milliseconds after which a new turn (a new request_id) may succeed.
/// Sent on the call that ran the turn only, not on its replays.
pub const RETRY_AFTER_HEADER: &str = "agentd-retry-after-ms";

/// The status that ends a stream that failed with `f`. `resend_runs_again`:
/// the same request sent again is a new turn (its request_id was made up
/// by the server), not a replay of this one.
pub fn failure(f: Failure, resend_runs_again: bool) -> Status {
    let retry_after = match &f {
        Failure::Agent(AgentError::Unavailable { retry_after, .. }) => *retry_after,
        _ => None,
    };
    // The turn's own outcome: stored, so a resend with the same request_id
    // replays it. A store failure (an outcome not confirmed stored among
    // them), a follower's own end or a final answer this call did not
    // deliver is not, and may pass.
    let recorded = !matches!(
        f,
        Failure::Store(_)
            | Failure::StoppedFollowing(_)
            | Failure::Removed
            | Failure::Undelivered(_)
    );
    let o = outcome(&Err(f));
    let mut status = Status::new(Code::from(o.code), o.message);
    if recorded {
        status.metadata_mut().insert(
            TURN_OUTCOME_HEADER,
            tonic::metadata::MetadataValue::from_static("recorded"),
        );
    }
    // The standard gRPC retry pushback, honoured by retrying clients: only
    // on a status a resend may cure. A recorded outcome's resend (the same
    // request, so the same request_id) only replays it, however long the
    // caller waited (the `recorded` trailer says so); unless the server
    // made the request_id up, when a resend is a new turn.
    if let Some(after) = retry_after
        && let Ok(v) = after.as_millis().to_string().parse()
    {
        let key = if !recorded || resend_runs_again {
            "grpc-retry-pushback-ms"
        } else {
            RETRY_AFTER_HEADER
        };
        status.metadata_mut().insert(key, v);
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unexpected_agent_errors_do_not_leak_their_cause() {
        let f = Failure::Agent(AgentError::Unexpected(anyhow::anyhow!(
            "prompt said: my password is hunter2"
        )));
        let s = failure(f, false);
        assert_eq!(s.code(), Code::Internal);
        assert!(!s.message().contains("hunter2"), "{}", s.message());
    }

    #[test]
    fn a_stored_outcome_is_reproduced_exactly() {
        let o = TurnOutcome {
            state: TurnState::Failed,
            code: Code::Unavailable as i32,
            message: "x".into(),
        };
        assert_eq!(outcome(&Err(Failure::Stored(o.clone()))), o);
        let s = failure(Failure::Stored(o), false);
        assert_eq!((s.code(), s.message()), (Code::Unavailable, "x"));
    }

    #[test]
    fn a_recorded_unavailable_has_a_pushback_only_where_a_resend_runs_again() {
        let overloaded = || {
            Failure::Agent(AgentError::Unavailable {
                message: "the model is overloaded; retry later".into(),
                retry_after: Some(std::time::Duration::from_secs(2)),
            })
        };
        // The caller's own request_id: a resend replays the outcome.
        let s = failure(overloaded(), false);
        assert_eq!(s.code(), Code::Unavailable);
        assert!(s.metadata().get(TURN_OUTCOME_HEADER).is_some());
        assert!(s.metadata().get("grpc-retry-pushback-ms").is_none());
        assert_eq!(s.message(), "the model is overloaded; retry later");
        // A request_id the server made up: a resend is a new turn.
        let s = failure(overloaded(), true);
        assert!(s.metadata().get(TURN_OUTCOME_HEADER).is_some());
        assert_eq!(
            s.metadata()
                .get("grpc-retry-pushback-ms")
                .map(|v| v.to_str().unwrap()),
            Some("2000")
        );
    }
}
