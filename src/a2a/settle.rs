//! A task whose run ended without its end being stored gets it here.
//!
//! The handler stores every update the executor streams, and stops at the
//! first it cannot store (a store that failed over, a connection reset):
//! it drops the executor's stream, which cancels the run, and nothing
//! writes the task's end. Nor when the update it could not store was the
//! terminal one. The task would read SUBMITTED or WORKING for ever (and
//! never be pruned), while a subscriber following its turn sees it end.
//!
//! So when the executor's stream is dropped, a [`Settle`] looks again once
//! the turn has ended: a task still not terminal then gets the end the turn
//! had (COMPLETED with the turn's answer, or FAILED), written until the
//! store takes it (for at most [`SETTLE_FOR`]). A task that ended is not
//! written (the store refuses to change a terminal task anyway). The
//! cancel path (CancelTask) stores CANCELED itself and disarms it.
//!
//! A task whose replica died mid-run has nobody to settle it: its turn's
//! lease expires and a replica still alive marks the turn failed ("the
//! serving replica stopped"). That replica hears of each turn it failed
//! ([`Turns::expired_turns`]) and settles the turn's task the same way
//! ([`settle_expired`]), so the task reads FAILED and takes follow-ups as
//! a task that ended.
//!
//! A settle holds the turn engine ([`Turns::hold`]) until it is done, so
//! that a shutdown waits for it as for the run whose stream it follows;
//! once the server drains, it retries a store that refuses for
//! [`SETTLE_WHILE_DRAINING`] at most, and stops when shutdown cuts the runs
//! ([`Turns::cut_requested`]). What it could not store is left to the next
//! start (which fails the tasks left unfinished on SQLite) or to another
//! replica ([`reconcile`]).
//!
//! That news is lost where the replica that failed the turn dies before
//! settling, where too many turns failed at once, or where the store would
//! not take the end for [`SETTLE_FOR`]. So every replica also looks, now
//! and then, for tasks still SUBMITTED or WORKING that nothing updated for
//! a lease, and settles those whose latest turn has ended ([`reconcile`]).

use std::sync::Arc;
use std::time::Duration;

use a2a::{Artifact, Message, Part, Role, Task, TaskState, TaskStatus};
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::domain::TurnKey;
use crate::store::a2a_tasks::{A2aTasks, named_session};
use crate::store::{TurnOutcome, TurnState};
use crate::turn::Turns;

/// How long a task's end is retried for before it is left to the next
/// reader's eyes (and the log).
pub(crate) const SETTLE_FOR: Duration = Duration::from_secs(600);
/// How long, once the server drains, a task's end is retried for while
/// the store refuses it: shutdown waits for a settle.
pub(crate) const SETTLE_WHILE_DRAINING: Duration = Duration::from_secs(5);
/// Earlier turns searched for the answer of the task's turn.
const ANSWER_SEARCH: usize = 64;

/// Armed while a run's stream is live; settles the task when dropped.
pub(crate) struct Settle {
    armed: Option<Armed>,
}

struct Armed {
    turns: Arc<Turns>,
    task_id: String,
    context_id: String,
    key: TurnKey,
    /// Held from arming to the settle's end, so that shutdown's wait for
    /// idle never sees a gap between the run's stream and its settle.
    hold: TaskTrackerToken,
}

impl Settle {
    pub(crate) fn new(
        turns: Arc<Turns>,
        task_id: String,
        context_id: String,
        key: TurnKey,
    ) -> Self {
        let hold = turns.hold();
        Settle {
            armed: Some(Armed {
                turns,
                task_id,
                context_id,
                key,
                hold,
            }),
        }
    }

    /// The task's end is someone else's to store (CancelTask's).
    pub(crate) fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        let Some(a) = self.armed.take() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let _hold = a.hold;
            settle(a.turns, a.task_id, Some(a.context_id), a.key).await;
        });
    }
}

/// Settles the task of every turn this process marks failed because its
/// replica stopped, for as long as `turns` lives.
pub(crate) fn settle_expired(turns: &Arc<Turns>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let mut expired = turns.expired_turns();
    let turns = Arc::downgrade(turns);
    rt.spawn(async move {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            let key = match expired.recv().await {
                Ok(key) => key,
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(
                        turns = missed,
                        "a2a: too many turns failed at once to settle their tasks; those tasks end when subscribed to"
                    );
                    continue;
                }
                Err(RecvError::Closed) => return,
            };
            let Some(task_id) = task_of(&key) else {
                continue;
            };
            let Some(turns) = turns.upgrade() else {
                return;
            };
            tokio::spawn(settle(turns, task_id.to_owned(), None, key));
        }
    });
}

/// Why a task whose run is gone (never started, or its turn removed) ends.
const RUN_GONE: &str = "the task's run is gone; send the message again";

/// Tasks [`reconcile`] reads per page, and at most per pass.
const RECONCILE_PAGE: usize = 100;
const RECONCILE_PASS: usize = 1000;

/// Settles, every `every` (each replica at its own moment within it), the
/// tasks still SUBMITTED or WORKING, not updated for `quiet`, whose latest
/// turn has ended, for as long as `turns` lives. A pass reads at most
/// [`RECONCILE_PASS`] tasks and the next goes on from there (from the
/// oldest again after the newest), so tasks that stay unfinished (their
/// runs still going) cannot keep it from the rest. The first pass runs
/// within `every` of the start: a replica that starts after a crash
/// settles what the crash left.
pub(crate) fn reconcile(turns: &Arc<Turns>, every: Duration, quiet: Duration) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let turns = Arc::downgrade(turns);
    rt.spawn(async move {
        let spread = every.mul_f64(fastrand::f64());
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + spread, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut from = None;
        loop {
            tick.tick().await;
            let Some(turns) = turns.upgrade() else {
                return;
            };
            let now = std::time::SystemTime::now();
            match reconcile_pass(&turns, now - quiet, now - ORPHAN_QUIET, &mut from).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(tasks = n, "a2a: settled tasks whose runs had ended"),
                Err(e) => {
                    tracing::debug!(error = %e, "a2a: cannot look for tasks left unsettled now")
                }
            }
        }
    });
}

/// How long a task may stay SUBMITTED without a session before it is
/// taken for one whose run never started (its replica died, or its store
/// failed, between storing it and starting its run): it is failed.
const ORPHAN_QUIET: Duration = Duration::from_secs(600);

/// One pass of [`reconcile`] over tasks last updated before `before`, from
/// just after `from`, which it moves on; returns how many it settled.
/// `orphaned_before`: SUBMITTED tasks without a session, last updated
/// before it, are failed.
async fn reconcile_pass(
    turns: &Turns,
    before: std::time::SystemTime,
    orphaned_before: std::time::SystemTime,
    from: &mut Option<crate::store::a2a_tasks::UnfinishedKey>,
) -> Result<usize, String> {
    let tasks = turns.store().a2a_tasks();
    let orphaned_before = crate::store::to_micros(orphaned_before);
    let (mut seen, mut settled) = (0, 0);
    while seen < RECONCILE_PASS {
        let page = tasks
            .unfinished(before, from.as_ref(), RECONCILE_PAGE)
            .await
            .map_err(|e| e.to_string())?;
        seen += page.len();
        let last = page.len() < RECONCILE_PAGE;
        for found in page {
            *from = Some(found.key.clone());
            let Some(session) = named_session(&found.task) else {
                // Its executor never tied it to a session: no turn of it
                // ever started.
                if found.task.status.state == TaskState::Submitted && found.key.0 < orphaned_before
                {
                    let mut task = found.task;
                    let task_id = task.id.clone();
                    task.status = TaskStatus {
                        state: TaskState::Failed,
                        message: Some(Message {
                            context_id: Some(task.context_id.clone()),
                            task_id: Some(task_id.clone()),
                            ..Message::new(Role::Agent, vec![Part::text(RUN_GONE)])
                        }),
                        timestamp: Some(chrono::Utc::now()),
                    };
                    match tasks.update(task).await {
                        Ok(_) => {
                            tracing::warn!(task = %task_id, "a2a: failed a task whose run never started");
                            settled += 1;
                        }
                        Err(e) => {
                            tracing::debug!(task = %task_id, error = %e.message, "a2a: cannot fail the task yet")
                        }
                    }
                }
                continue;
            };
            let task_id = found.task.id;
            let prefix = format!("{task_id}.");
            let latest = latest_turn(&**turns.store(), session, &prefix)
                .await
                .map_err(|e| e.to_string())?;
            let Some(turn) = latest else {
                continue;
            };
            if !turn.state.is_terminal() {
                continue;
            }
            let key = turn.key;
            match settle_once(turns, &*tasks, &task_id, None, &key).await {
                Ok(true) => settled += 1,
                Ok(false) => {}
                Err(why) => {
                    tracing::debug!(task = %task_id, error = %why, "a2a: cannot settle the task yet")
                }
            }
        }
        if last {
            // The newest read: the next pass starts from the oldest.
            *from = None;
            break;
        }
    }
    Ok(settled)
}

/// The latest turn of a task: the last of `session`'s turns whose request
/// id starts with `prefix` (`<task id>.`).
pub(crate) async fn latest_turn(
    store: &dyn crate::store::Store,
    session: crate::domain::SessionId,
    prefix: &str,
) -> crate::store::StoreResult<Option<crate::store::TurnRecord>> {
    const PAGE: usize = 1000;
    let (mut latest, mut after) = (None, None);
    loop {
        let page = store.list_turns(session, after.as_ref(), PAGE).await?;
        if let Some(t) = page
            .iter()
            .rev()
            .find(|t| t.key.request_id.as_str().starts_with(prefix))
        {
            latest = Some(t.clone());
        }
        if page.len() < PAGE {
            return Ok(latest);
        }
        after = page.last().map(crate::store::TurnCursor::after);
    }
}

/// The task a turn of the A2A face belongs to: its request id is
/// `<task id>.<turn index>`.
fn task_of(key: &TurnKey) -> Option<&str> {
    let (task, index) = key.request_id.as_str().rsplit_once('.')?;
    (!task.is_empty() && !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
        .then_some(task)
}

/// `context_id`: the task's context as its executor knows it; `None` for a
/// turn that only names the task ([`settle_expired`]), whose task must then
/// be of the turn's session. Once shutdown cuts the runs, it stops at the
/// first attempt that does not settle the task.
async fn settle(turns: Arc<Turns>, task_id: String, context_id: Option<String>, key: TurnKey) {
    let tasks = turns.store().a2a_tasks();
    let mut give_up = tokio::time::Instant::now() + SETTLE_FOR;
    let mut draining = false;
    let mut wait = Duration::from_millis(50);
    loop {
        match settle_once(&turns, &*tasks, &task_id, context_id.as_deref(), &key).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(why) => {
                tracing::debug!(task = %task_id, error = %why, "a2a: cannot settle the task yet");
                if turns.is_draining() && !std::mem::replace(&mut draining, true) {
                    give_up = give_up.min(tokio::time::Instant::now() + SETTLE_WHILE_DRAINING);
                }
            }
        }
        if tokio::time::Instant::now() + wait > give_up {
            tracing::warn!(task = %task_id, "a2a: the task's end could not be stored; it reads as not ended");
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = turns.cut_requested() => {
                tracing::warn!(task = %task_id, "a2a: shutdown cut the runs before the task's end was stored; it reads as not ended");
                return;
            }
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

/// The end of a task whose turn ended with `outcome` (`None`: the turn is
/// gone, never having ended), and the status message that says why.
pub(crate) fn task_end(outcome: Option<&TurnOutcome>) -> (TaskState, Option<String>) {
    match outcome {
        Some(o) if o.code == tonic::Code::Ok as i32 => (TaskState::Completed, None),
        // Stopped on purpose (agents.v1 CancelTurn), as a CancelTask would.
        Some(o) if *o == crate::grpc::status::cancelled_by_request() => (TaskState::Canceled, None),
        Some(o) if o.state == TurnState::Cancelled => (
            TaskState::Failed,
            Some("the task's updates could not be stored; its run was stopped".to_owned()),
        ),
        Some(o) => (TaskState::Failed, Some(o.message.clone())),
        None => (TaskState::Failed, Some(RUN_GONE.to_owned())),
    }
}

/// True when there is nothing left to do: the task ended, or is gone, or
/// now has the end its turn had.
async fn settle_once(
    turns: &Turns,
    tasks: &dyn A2aTasks,
    task_id: &str,
    context_id: Option<&str>,
    key: &TurnKey,
) -> Result<bool, String> {
    let Some(mut task) = tasks.get(task_id).await.map_err(|e| e.message)? else {
        return Ok(true);
    };
    if !matches!(task.status.state, TaskState::Submitted | TaskState::Working) {
        return Ok(true);
    }
    if context_id.is_none() && named_session(&task).is_some_and(|s| s != key.session_id) {
        // A turn of another session whose request id looks like a task's.
        return Ok(true);
    }
    let context_id = context_id.unwrap_or(&task.context_id).to_owned();
    let store = turns.store();
    let turn = store.get_turn(key).await.map_err(|e| e.to_string())?;
    let outcome = match turn {
        Some(t) if t.state.is_terminal() => t.outcome,
        // Running: look again once it has ended.
        Some(_) => return Ok(false),
        // Gone (its claim withdrawn, its session deleted): it never ended.
        None => None,
    };
    let (state, why) = task_end(outcome.as_ref());
    if state == TaskState::Completed {
        // The answer as the turn stored it: the artifact may lack the
        // chunks whose updates were not stored.
        let history = store
            .history(key.session_id, ANSWER_SEARCH)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(t) = history
            .iter()
            .find(|t| t.request_id == key.request_id.as_str())
        {
            set_answer(&mut task, &t.answer);
        }
    }
    task.status = TaskStatus {
        state: state.clone(),
        message: why.map(|w| Message {
            context_id: Some(context_id),
            task_id: Some(task_id.to_owned()),
            ..Message::new(Role::Agent, vec![Part::text(w)])
        }),
        timestamp: Some(chrono::Utc::now()),
    };
    tasks.update(task).await.map_err(|e| e.message)?;
    tracing::warn!(task = %task_id, state = ?state, "a2a: stored the end of a task whose run ended without it");
    Ok(true)
}

/// The answer artifact, replaced by `answer` whole.
fn set_answer(task: &mut Task, answer: &str) {
    let artifact = Artifact {
        artifact_id: super::executor::ANSWER_ARTIFACT_ID.into(),
        name: Some("answer".into()),
        description: None,
        parts: vec![Part::text(answer)],
        metadata: None,
        extensions: None,
    };
    let artifacts = task.artifacts.get_or_insert_with(Vec::new);
    match artifacts
        .iter_mut()
        .find(|a| a.artifact_id == artifact.artifact_id)
    {
        Some(a) => *a = artifact,
        None => artifacts.push(artifact),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{RequestId, SessionId};

    fn key(rid: &str) -> TurnKey {
        TurnKey {
            session_id: SessionId::generate(),
            request_id: RequestId::parse(rid).unwrap(),
        }
    }

    /// A turn stopped by CancelTurn ends its task CANCELED, as CancelTask
    /// would; a turn cancelled otherwise (its updates not stored) FAILED.
    #[test]
    fn a_turn_cancelled_by_cancel_turn_ends_its_task_canceled() {
        let by_request = crate::grpc::status::cancelled_by_request();
        assert_eq!(task_end(Some(&by_request)), (TaskState::Canceled, None));
        let other = TurnOutcome {
            message: "the client went away".into(),
            ..by_request
        };
        assert_eq!(task_end(Some(&other)).0, TaskState::Failed);
        assert_eq!(task_end(None).0, TaskState::Failed);
    }

    #[test]
    fn only_a_request_id_shaped_like_a_tasks_turn_names_a_task() {
        assert_eq!(task_of(&key("0d1f-task.0")), Some("0d1f-task"));
        assert_eq!(task_of(&key("a.b.12")), Some("a.b"));
        for not in ["r1", "r1.", ".3", "r1.x", "r1.3a"] {
            assert_eq!(task_of(&key(not)), None, "{not}");
        }
    }
}
