//! The request handler both A2A bindings serve: the crate's
//! `DefaultRequestHandler` on our task store, plus SubscribeToTask for a task
//! that runs on another replica, and each request's metrics (method,
//! outcome, duration; see `Observed`), whichever binding it came over.
//!
//! `DefaultRequestHandler` can only resubscribe to an execution of its own
//! process (it keeps them in memory), and answers TaskNotFound for a task
//! that is running anywhere else. Every task runs as a turn of the turn
//! engine, and turns are followed from any replica (stored events, then live
//! ones, then the outcome), so a subscription that misses here follows the
//! task's turn instead:
//!
//! ```text
//! SubscribeToTask ─▶ DefaultRequestHandler ─▶ running here: its live stream
//!                  └ TaskNotFound, task in the store and not terminal
//!                     ─▶ the task's latest turn (session of its context, request id "<task>.<n>")
//!                     ─▶ Turns::attach ─▶ the task snapshot, then every event of the turn mapped
//!                        as the executor maps them (the first answer chunk replaces the
//!                        snapshot's), then the task's end as the store has it (else as
//!                        `settle` stores it for the turn's outcome), or an error when this replica
//!                        stops following for its own reasons (shutting down, a slow reader,
//!                        its store reads failing): the task runs on, so the caller
//!                        subscribes again or looks with GetTask
//!                  └ TaskNotFound, task in the store waiting for input (INPUT_REQUIRED)
//!                     ─▶ the task snapshot alone: nothing runs until a reply
//! ```
//!
//! A task whose replica died is ended when its turn's lease expires: the
//! replica that fails the turn (UNAVAILABLE) writes FAILED into the task
//! (see `settle`), and so does a follower that sees the turn end so.
//!
//! A task another replica cancels (CancelTask served there marks it CANCELED
//! in the store) is noticed here within a second: the executor reads the
//! task of each run live here back from the store every second, and one
//! found ended stops its run (the turn is cancelled) and ends with the
//! stored status (see `executor`). Should the run's next update come first,
//! the store refuses it: the inner handler then stops the run (it drops the
//! executor's stream, which cancels the turn) and ends the task's streams
//! with that refusal. Every stream of a task served here, and a blocking
//! SendMessage, turns that refusal, when the task it names is terminal in
//! the store, into the task's end: its stored terminal status (CANCELED), as
//! every stream of a task must end.
//!
//! The crate keeps 32 updates of a run for its subscribers, and drops one
//! that falls further behind (a reader slower than the model) with an
//! INTERNAL error. Every stream of a task served here picks up again
//! instead, from the task as it stands: the Task (its artifacts hold every
//! chunk so far), then the updates after it (`Handler::resuming`).
//!
//! A task is its owner's alone (the caller that created it; without
//! authentication every caller is one anonymous user). Every call runs as its
//! caller (`as_caller`: ListTasks lists the caller's tasks, a new task is the
//! caller's), and GetTask, CancelTask, SubscribeToTask and a message into an
//! existing task first check that the task is the caller's: another's is
//! TaskNotFound, as if it did not exist. A context is the caller's own too:
//! its session is derived from (caller, contextId), so another caller using
//! the same contextId gets a conversation of its own.

use std::sync::Arc;

use a2a::*;
use a2a_server::{DefaultRequestHandler, RequestHandler, ServiceParams};
use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::executor::{self, Job};
use crate::domain::UserId;
use crate::domain::{RequestId, TurnKey};
use crate::store::a2a_tasks::{A2aTasks, as_caller, task_session};
use crate::turn::Turns;

/// Store reads while waiting for a new task's turn to be claimed.
const TURN_WAIT_POLLS: u32 = 50;

pub struct Handler {
    /// Shared with the streams it opens, which subscribe again through it
    /// ([`resuming`]).
    inner: Arc<DefaultRequestHandler>,
    turns: Arc<Turns>,
    tasks: Arc<dyn A2aTasks>,
    /// `--max-input-bytes`: a message's text past it is refused.
    max_input_bytes: usize,
    /// Authentication is on: each call's caller is named by the
    /// authentication layers.
    authenticated: bool,
    /// The session store's health, as the turn engine's upkeep checks it
    /// (the task store is in the same database).
    store_ok: tokio::sync::watch::Receiver<bool>,
}

impl Handler {
    pub fn new(
        inner: DefaultRequestHandler,
        turns: Arc<Turns>,
        tasks: Arc<dyn A2aTasks>,
        max_input_bytes: usize,
        authenticated: bool,
    ) -> Self {
        Self {
            inner: Arc::new(inner),
            store_ok: turns.store_health(),
            turns,
            tasks,
            max_input_bytes,
            authenticated,
        }
    }

    /// The caller of a call, once its version is one we speak (that check
    /// comes first, as the inner handler's authorizer would make it) and
    /// while the store answers: with its database known to be away (the
    /// health check failed), the call is refused at once, as agents.v1's
    /// Runs are, instead of each failing its own store call (and logging
    /// a warning) through the outage.
    fn caller(&self, params: &ServiceParams) -> Result<UserId, A2AError> {
        super::version::check(params)?;
        if !*self.store_ok.borrow() {
            return Err(crate::store::a2a_tasks::unavailable());
        }
        executor::caller(params, self.authenticated)
    }

    /// Refuses a task that is not `caller`'s exactly as one that does not
    /// exist (spec: never reveal a resource the caller may not access).
    async fn check_owner(&self, caller: &UserId, task_id: &str) -> Result<(), A2AError> {
        if task_id.len() > executor::MAX_ID_BYTES {
            return Err(A2AError::task_not_found(&shown_id(task_id)));
        }
        match self.tasks.owner(task_id).await? {
            Some(owner) if owner == *caller => Ok(()),
            _ => Err(A2AError::task_not_found(&shown_id(task_id))),
        }
    }

    /// Every part of a message must be text our agents read: a text part
    /// (declaring no media type, or `text/plain`), or bytes declared
    /// `text/plain` that are UTF-8; `text/plain` with any parameters (a
    /// charset), in any case. A data part (JSON), a URL, other bytes or
    /// text declared as another media type is ContentTypeNotSupported,
    /// before any task is made. This is the only check of the parts: the
    /// handler's compares declared media types exactly (and refused
    /// `text/plain; charset=utf-8`), and lets a part that declares none
    /// through (a data part was made a task only to be REJECTED; a URL
    /// beside text was dropped unread).
    fn check_parts(message: &Message) -> Result<(), A2AError> {
        for (i, p) in message.parts.iter().enumerate() {
            let what = match &p.content {
                PartContent::Text(_)
                    if p.media_type
                        .as_deref()
                        .is_none_or(|m| m.is_empty() || executor::is_text_plain(m)) =>
                {
                    continue;
                }
                PartContent::Text(_) => "text declared as another media type than text/plain",
                PartContent::Raw(_) if executor::raw_text(p).is_some() => continue,
                PartContent::Raw(_) => "bytes that are not UTF-8 text/plain",
                PartContent::Url(_) => "a URL (not fetched)",
                PartContent::Data(_) => "structured data",
            };
            return Err(A2AError::new(
                error_code::CONTENT_TYPE_NOT_SUPPORTED,
                format!("part {i} is {what}; the agents read text parts (text/plain) only"),
            ));
        }
        Ok(())
    }

    /// Push notifications are off (the card says so): a message asking
    /// for them is refused before the handler stores anything. The handler
    /// refuses its push config only after it has stored the task, and runs
    /// nothing for it: the task would read SUBMITTED for ever.
    fn check_push(req: &SendMessageRequest) -> Result<(), A2AError> {
        let asks = req
            .configuration
            .as_ref()
            .is_some_and(|c| c.task_push_notification_config.is_some());
        if asks {
            return Err(A2AError::push_notification_not_supported());
        }
        Ok(())
    }

    /// A message into an existing task continues it only where the task
    /// waits for one (INPUT_REQUIRED, AUTH_REQUIRED). One still submitted or
    /// working is refused here, on every replica: the handler refuses it
    /// only on the replica that runs it, and elsewhere started a second run
    /// of the task beside the first. A terminal task is the handler's to
    /// refuse.
    async fn check_continuable(&self, task_id: &str) -> Result<(), A2AError> {
        match self.tasks.get(task_id).await? {
            Some(t) if matches!(t.status.state, TaskState::Submitted | TaskState::Working) => {
                Err(A2AError::unsupported_operation(format!(
                    "task {task_id} is still working; send the next message once it ends or asks for input"
                )))
            }
            _ => Ok(()),
        }
    }

    /// Follows a task of `caller`'s that is not terminal and runs elsewhere.
    async fn follow_remote(
        turns: &Arc<Turns>,
        tasks: &Arc<dyn A2aTasks>,
        caller: &UserId,
        task_id: &str,
    ) -> Result<EventStream, A2AError> {
        let prefix = format!("{task_id}.");
        for _ in 0..TURN_WAIT_POLLS {
            let Some(task) = tasks.get(task_id).await? else {
                return Err(A2AError::task_not_found(task_id));
            };
            if task.status.state.is_terminal() {
                return Err(terminal(task_id));
            }
            if !matches!(task.status.state, TaskState::Submitted | TaskState::Working) {
                // Waiting for input: nothing runs, here or elsewhere. The
                // stream is the task as it waits (spec: a subscription
                // begins with the Task), and ends there; the reply starts
                // a stream of its own.
                return Ok(Box::pin(futures::stream::once(async move {
                    Ok(StreamResponse::Task(task))
                })));
            }
            let session = task_session(&task);
            let latest = super::settle::latest_turn(&**turns.store(), session, &prefix)
                .await
                .map_err(crate::store::a2a_tasks::a2a_err)?;
            let Some(turn) = latest else {
                if task.status.state == TaskState::Working {
                    // Working without a turn: a scripted (conformance) task,
                    // which only its own replica can stream.
                    return Err(A2AError::unsupported_operation(
                        "the task runs on another replica and cannot be followed; use GetTask",
                    ));
                }
                // Submitted, its turn not claimed yet: look again shortly.
                tokio::time::sleep(turns.config().follow_poll).await;
                continue;
            };
            let key = TurnKey {
                session_id: session,
                request_id: RequestId::parse(turn.key.request_id.as_str().to_owned())
                    .map_err(|_| A2AError::internal("the task's turn is malformed"))?,
            };
            let started = turns
                .attach(caller, key.clone(), None, None)
                .await
                .map_err(|e| {
                    tracing::warn!(task = %task_id, error = %e, "a2a: cannot follow the task's turn");
                    A2AError::unsupported_operation(
                        "the task runs on another replica and cannot be followed now; use GetTask",
                    )
                })?;
            tracing::info!(task = %task_id, mode = started.mode.as_str(), "a2a: following a task run elsewhere");
            let job = Job::follower(task.id.clone(), task.context_id.clone());
            let (tasks, store) = (tasks.clone(), turns.store().clone());
            let poll = turns.config().follow_poll;
            return Ok(Box::pin(async_stream::stream! {
                yield Ok(StreamResponse::Task(task));
                let mut updates = std::pin::pin!(executor::updates(job, started.stream));
                let mut end = None;
                while let Some(update) = updates.next().await {
                    match update {
                        Ok(StreamResponse::StatusUpdate(u)) if u.status.state.is_terminal() => {
                            end = Some(u);
                            break;
                        }
                        other => yield other,
                    }
                }
                // Ended with an error (this replica stopped following), or
                // the end as the store has it.
                if let Some(end) = end {
                    let outcome = store.get_turn(&key).await.ok().flatten().and_then(|t| t.outcome);
                    let end = stored_end(&*tasks, end, outcome, poll).await;
                    yield Ok(StreamResponse::StatusUpdate(end));
                }
            }));
        }
        Err(A2AError::unsupported_operation(
            "the task has not started running yet; subscribe again or use GetTask",
        ))
    }
}

type EventStream = BoxStream<'static, Result<StreamResponse, A2AError>>;

/// How long a follower waits for the end of a task whose turn was
/// cancelled, not by CancelTurn, to be stored: by the CancelTask that
/// stopped it (CANCELED), or by the settle of a run whose updates could
/// not be stored (FAILED). The turn's outcome does not tell which.
const STORED_END_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The end a follower tells of a task whose turn ended with `outcome`:
/// the task's end as the store has it, once it has one, so that the
/// stream and GetTask agree; else `end`, what `settle` stores for the
/// outcome. A task whose replica died (its lease expired and the turn was
/// failed for it) has nobody else to write its end, so the follower writes
/// `end`.
async fn stored_end(
    tasks: &dyn A2aTasks,
    end: TaskStatusUpdateEvent,
    outcome: Option<crate::store::TurnOutcome>,
    poll: std::time::Duration,
) -> TaskStatusUpdateEvent {
    let orphaned = outcome == Some(crate::grpc::status::replica_stopped());
    let undecided = outcome.is_some_and(|o| {
        o.state == crate::store::TurnState::Cancelled
            && o != crate::grpc::status::cancelled_by_request()
    });
    let give_up = tokio::time::Instant::now()
        + if undecided {
            STORED_END_WAIT
        } else {
            std::time::Duration::ZERO
        };
    loop {
        match tasks.get(&end.task_id).await {
            Ok(Some(t)) if t.status.state.is_terminal() => {
                return TaskStatusUpdateEvent {
                    status: t.status,
                    ..end
                };
            }
            Ok(Some(mut t)) if orphaned => {
                t.status = end.status.clone();
                if let Err(e) = tasks.update(t).await {
                    tracing::warn!(task = %end.task_id, error = %e.message, "a2a: cannot record the end of an orphaned task");
                }
                return end;
            }
            _ => {}
        }
        if tokio::time::Instant::now() + poll > give_up {
            return end;
        }
        tokio::time::sleep(poll).await;
    }
}

/// A task id as an error quotes it: printable, and at most 64 characters
/// (what a caller sent may be anything, and is echoed to it).
fn shown_id(id: &str) -> String {
    const MOST: usize = 64;
    let mut shown: String = id
        .chars()
        .take(MOST)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if id.chars().nth(MOST).is_some() {
        shown.push('…');
    }
    shown
}

/// `params`, with the current span's trace context when they carry none.
/// The inner handler runs a task on a tokio task of its own, outside the
/// call's span, and the task's span takes its parent from the params'
/// `traceparent` ([`executor`]): a call sent without one would start a
/// trace apart from its own RPC span.
fn traced(params: &ServiceParams) -> std::borrow::Cow<'_, ServiceParams> {
    use opentelemetry::trace::TraceContextExt as _;
    let sent = crate::telemetry::trace::extract_params(params);
    if sent.span().span_context().is_valid() {
        return std::borrow::Cow::Borrowed(params);
    }
    let mut params = params.clone();
    crate::telemetry::trace::inject_params(&mut params);
    std::borrow::Cow::Owned(params)
}

/// The task an error ended elsewhere: the task named by the store's refusal
/// of an update to a task already terminal, when it is terminal in the store
/// (see the module docs: cancelled through another replica). Any other error
/// stays an error (a subscriber that fell behind, say, must not see a clean
/// end).
async fn ended_elsewhere(tasks: &dyn A2aTasks, e: &A2AError) -> Option<Task> {
    let id = crate::store::a2a_tasks::refused_task_id(e)?;
    match tasks.get(id).await {
        Ok(Some(t)) if t.status.state.is_terminal() => {
            tracing::info!(task = %t.id, state = ?t.status.state, error = %e.message, "a2a: the task ended elsewhere; answering its stored status");
            Some(t)
        }
        _ => None,
    }
}

/// Times in a row one stream of a task picks up again after the handler
/// dropped it for falling behind ([`Handler::resuming`]) without an update
/// delivered in between: a reader slower than its run all along resumes
/// as often as it falls behind, each time from a snapshot that holds all
/// it missed, so it catches up by skipping updates.
const MAX_RESUMES: u32 = 8;
/// Times in all one stream picks up again: each resume is a task read and
/// a snapshot of every chunk so far, so a reader that keeps falling behind
/// a long run does not cost that without end.
const MAX_RESUMES_IN_ALL: u32 = 64;

/// The crate's answer to a subscriber that fell more than its buffer (32
/// updates) behind the run: an INTERNAL error with its generic message (the
/// cause goes only to its log). Other errors of ours say more.
fn fell_behind(e: &A2AError) -> bool {
    e.code == error_code::INTERNAL_ERROR && e.message == "Internal error"
}

/// The task an update belongs to.
fn task_of(update: &StreamResponse) -> Option<&str> {
    match update {
        StreamResponse::Task(t) => Some(&t.id),
        StreamResponse::StatusUpdate(u) => Some(&u.task_id),
        StreamResponse::ArtifactUpdate(u) => Some(&u.task_id),
        StreamResponse::Message(_) => None,
    }
}

/// What a task's stream needs to pick up again once the call that opened
/// it has returned.
struct Resume {
    inner: Arc<DefaultRequestHandler>,
    turns: Arc<Turns>,
    tasks: Arc<dyn A2aTasks>,
    caller: UserId,
    params: ServiceParams,
}

impl Resume {
    /// The task `id` from where it stands: a subscription to its run here
    /// (the task as it stands, then every update after it); once that run
    /// is over, the task as stored, when it has ended or waits for input;
    /// otherwise its turn, followed as another replica's would be.
    async fn resume(&self, id: &str) -> Result<EventStream, A2AError> {
        let req = SubscribeToTaskRequest {
            id: id.to_owned(),
            tenant: None,
        };
        let again = as_caller(
            self.caller.clone(),
            self.inner.subscribe_to_task(&self.params, req),
        )
        .await;
        if let Ok(events) = again {
            return Ok(events);
        }
        match self.tasks.get(id).await? {
            None => Err(A2AError::task_not_found(&shown_id(id))),
            Some(t) if !matches!(t.status.state, TaskState::Submitted | TaskState::Working) => {
                Ok(Box::pin(futures::stream::once(async move {
                    Ok(StreamResponse::Task(t))
                })))
            }
            Some(_) => Handler::follow_remote(&self.turns, &self.tasks, &self.caller, id).await,
        }
    }
}

impl Handler {
    /// `events` of a task (`task_id`, or the one its first update names),
    /// as the caller gets them:
    ///
    /// - The error of a task that ended elsewhere becomes the task's stored
    ///   terminal status ([`ended_elsewhere`]).
    /// - A stream the crate dropped for falling behind its run (a reader
    ///   slower than the model: the crate keeps 32 updates per run) picks
    ///   up again from the task as it stands ([`Resume::resume`]): the
    ///   Task, whose artifacts hold every chunk sent so far, replaces what
    ///   the caller has (spec: a Task in a stream is the task's state), and
    ///   the updates after it follow. Before, the caller got an INTERNAL
    ///   "Internal error" and lost the rest of the run.
    fn resuming(
        &self,
        caller: UserId,
        params: &ServiceParams,
        task_id: Option<String>,
        events: EventStream,
    ) -> EventStream {
        let resume = Resume {
            inner: self.inner.clone(),
            turns: self.turns.clone(),
            tasks: self.tasks.clone(),
            caller,
            params: params.clone(),
        };
        Box::pin(async_stream::stream! {
            let mut events = events;
            let mut task_id = task_id;
            let mut resumed = 0;
            let mut resumed_in_all = 0;
            while let Some(item) = events.next().await {
                let e = match item {
                    Ok(update) => {
                        if task_id.is_none() {
                            task_id = task_of(&update).map(str::to_owned);
                        }
                        // An update past the snapshot: the stream moves
                        // again. Only resumes that deliver nothing count
                        // against the bound.
                        if !matches!(update, StreamResponse::Task(_)) {
                            resumed = 0;
                        }
                        yield Ok(update);
                        continue;
                    }
                    Err(e) => e,
                };
                if let Some(t) = ended_elsewhere(&*resume.tasks, &e).await {
                    yield Ok(StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                        task_id: t.id,
                        context_id: t.context_id,
                        status: t.status,
                        metadata: None,
                    }));
                    return;
                }
                let may_resume = fell_behind(&e) && resumed < MAX_RESUMES && resumed_in_all < MAX_RESUMES_IN_ALL;
                if let Some(id) = task_id.as_deref().filter(|_| may_resume) {
                    resumed += 1;
                    resumed_in_all += 1;
                    match resume.resume(id).await {
                        Ok(more) => {
                            if resumed_in_all == 1 {
                                tracing::info!(task = %id, "a2a: a stream fell behind its run; it goes on from the task as it stands");
                            } else {
                                tracing::debug!(task = %id, resumed_in_all, "a2a: a stream fell behind its run again");
                            }
                            crate::telemetry::metrics::a2a_stream_resumed();
                            events = more;
                            continue;
                        }
                        Err(why) => {
                            tracing::warn!(task = %id, error = %why.message, "a2a: a stream fell behind its run and cannot go on");
                        }
                    }
                }
                yield Err(e);
                return;
            }
        })
    }
}

/// The crate's `apply_history_length` (not public): the last
/// `history_length` messages of the history, none for 0 or less.
fn trim_history(task: &mut Task, history_length: Option<i32>) {
    let (Some(n), Some(history)) = (history_length, task.history.as_mut()) else {
        return;
    };
    let keep = usize::try_from(n).unwrap_or(0);
    if history.len() > keep {
        history.drain(..history.len() - keep);
    }
}

/// One A2A request in the metrics (`agentd_a2a_requests_total` and
/// `agentd_a2a_request_seconds`), recorded when it ends: a unary request
/// when it is answered, a streaming one when its stream ends. The outcome is
/// `OK`, the reason of the A2A error it ended with, or `CANCELLED` when the
/// caller went away first (the request or its stream was dropped).
struct Observed {
    method: &'static str,
    started: std::time::Instant,
    outcome: Option<&'static str>,
}

tokio::task_local! {
    /// Set once a JSON-RPC request reaches a method of the handler (see
    /// [`count_refusals`]).
    static DISPATCHED: std::cell::Cell<bool>;
}

/// Counts the JSON-RPC requests refused before they reach a method, which
/// [`Observed`] never sees: a body that is not JSON (`PARSE_ERROR`) or not a
/// JSON-RPC request (`INVALID_REQUEST`), an unknown method
/// (`METHOD_NOT_FOUND`), params that do not fit the method
/// (`INVALID_PARAMS`), an unsupported `A2A-Version`
/// (`VERSION_NOT_SUPPORTED`). They count as method `unknown` (a method name
/// the caller made up is no label), with the reason of the JSON-RPC error
/// answered; a refusal without one (a body over the size limit) as
/// `INVALID_REQUEST`.
pub async fn count_refusals(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if req.method() != axum::http::Method::POST || req.uri().path() != "/" {
        return next.run(req).await;
    }
    let started = std::time::Instant::now();
    let (resp, dispatched) = DISPATCHED
        .scope(std::cell::Cell::new(false), async {
            let resp = next.run(req).await;
            (resp, DISPATCHED.with(|d| d.get()))
        })
        .await;
    if dispatched {
        return resp;
    }
    // A refusal is one JSON object, which may quote what was sent (a
    // method name, a value the parser did not take): at most
    // `QUOTED` characters of its message go back. One that is not JSON
    // (or past the request's own size) becomes a plain invalid request.
    const QUOTED: usize = 256;
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 8 << 20)
        .await
        .unwrap_or_default();
    let mut doc = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .filter(|v| v["error"].is_object())
        .unwrap_or_else(|| {
            serde_json::json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": a2a::error_code::INVALID_REQUEST, "message": "invalid request"}})
        });
    if let Some(message) = doc["error"]["message"].as_str()
        && message.chars().nth(QUOTED).is_some()
    {
        let cut: String = message.chars().take(QUOTED).collect();
        doc["error"]["message"] = serde_json::Value::String(format!("{cut}…"));
    }
    let code = doc["error"]["code"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok());
    let outcome = code.map_or("INVALID_REQUEST", a2a::errors::error_reason);
    tracing::debug!(
        outcome,
        "a2a: JSON-RPC request refused before reaching a method"
    );
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let body = axum::body::Body::from(doc.to_string());
    crate::telemetry::metrics::a2a_request("unknown", outcome, started.elapsed());
    axum::response::Response::from_parts(parts, body)
}

impl Observed {
    fn start(method: &'static str) -> Self {
        let _ = DISPATCHED.try_with(|d| d.set(true));
        Self {
            method,
            started: std::time::Instant::now(),
            outcome: None,
        }
    }

    fn unary<T>(mut self, r: Result<T, A2AError>) -> Result<T, A2AError> {
        match &r {
            Ok(_) => self.outcome = Some("OK"),
            Err(e) => self.failed(e),
        }
        r
    }

    /// Records the error as the outcome; one on the server's side is
    /// logged as a warning, a caller's mistake (an unknown task, bad
    /// parameters) at debug. The store unreachable is at debug too: the
    /// failed store call logged its warning, and an outage the health
    /// check found is logged once, as it starts, not with every call it
    /// refuses.
    fn failed(&mut self, e: &A2AError) {
        let reason = error_reason(e.code);
        self.outcome = Some(reason);
        let store_away = crate::store::a2a_tasks::store_failure(e) == Some(true);
        if matches!(reason, "INTERNAL_ERROR" | "INVALID_AGENT_RESPONSE") && !store_away {
            tracing::warn!(method = self.method, outcome = reason, error = %e.message, "a2a: request failed");
        } else {
            tracing::debug!(method = self.method, outcome = reason, error = %e.message, "a2a: request refused");
        }
    }

    /// The stream's outcome is its last error, else `OK` once it ends.
    fn stream(mut self, r: Result<EventStream, A2AError>) -> Result<EventStream, A2AError> {
        let events = match r {
            Ok(events) => events,
            Err(e) => {
                self.failed(&e);
                return Err(e);
            }
        };
        Ok(Box::pin(async_stream::stream! {
            let mut obs = self;
            let mut events = events;
            while let Some(item) = events.next().await {
                if let Err(e) = &item {
                    obs.failed(e);
                }
                yield item;
            }
            obs.outcome.get_or_insert("OK");
        }))
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        crate::telemetry::metrics::a2a_request(
            self.method,
            self.outcome.unwrap_or("CANCELLED"),
            self.started.elapsed(),
        );
    }
}

fn terminal(task_id: &str) -> A2AError {
    A2AError::unsupported_operation(format!(
        "task {task_id} has already reached a terminal state"
    ))
}

#[async_trait]
impl RequestHandler for Handler {
    async fn send_message(
        &self,
        params: &ServiceParams,
        req: SendMessageRequest,
    ) -> Result<SendMessageResponse, A2AError> {
        let obs = Observed::start("SendMessage");
        obs.unary(
            async {
                let caller = self.caller(params)?;
                Self::check_push(&req)?;
                Self::check_parts(&req.message)?;
                executor::check_request(&req, self.max_input_bytes, self.turns.agents())?;
                if let Some(id) = &req.message.task_id {
                    self.check_owner(&caller, id).await?;
                    self.check_continuable(id).await?;
                }
                let history_length = req.configuration.as_ref().and_then(|c| c.history_length);
                match as_caller(caller, self.inner.send_message(&traced(params), req)).await {
                    Err(e) => match ended_elsewhere(&*self.tasks, &e).await {
                        Some(mut t) => {
                            trim_history(&mut t, history_length);
                            Ok(SendMessageResponse::Task(t))
                        }
                        None => Err(e),
                    },
                    ok => ok,
                }
            }
            .await,
        )
    }

    async fn send_streaming_message(
        &self,
        params: &ServiceParams,
        req: SendMessageRequest,
    ) -> Result<EventStream, A2AError> {
        let obs = Observed::start("SendStreamingMessage");
        obs.stream(
            async {
                let caller = self.caller(params)?;
                Self::check_push(&req)?;
                Self::check_parts(&req.message)?;
                executor::check_request(&req, self.max_input_bytes, self.turns.agents())?;
                if let Some(id) = &req.message.task_id {
                    self.check_owner(&caller, id).await?;
                    self.check_continuable(id).await?;
                }
                // The task snapshots the stream carries keep at most
                // historyLength messages, as the blocking answer does (the
                // handler trims only that one).
                let history_length = req.configuration.as_ref().and_then(|c| c.history_length);
                as_caller(
                    caller.clone(),
                    self.inner.send_streaming_message(&traced(params), req),
                )
                .await
                .map(|events| self.resuming(caller, params, None, events))
                .map(|events| -> EventStream {
                    match history_length {
                        None => events,
                        Some(_) => Box::pin(events.map(move |ev| match ev {
                            Ok(StreamResponse::Task(mut t)) => {
                                trim_history(&mut t, history_length);
                                Ok(StreamResponse::Task(t))
                            }
                            other => other,
                        })),
                    }
                })
            }
            .await,
        )
    }

    async fn get_task(
        &self,
        params: &ServiceParams,
        req: GetTaskRequest,
    ) -> Result<Task, A2AError> {
        let obs = Observed::start("GetTask");
        obs.unary(
            async {
                let caller = self.caller(params)?;
                self.check_owner(&caller, &req.id).await?;
                as_caller(caller, self.inner.get_task(params, req)).await
            }
            .await,
        )
    }

    async fn list_tasks(
        &self,
        params: &ServiceParams,
        req: ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError> {
        let obs = Observed::start("ListTasks");
        obs.unary(
            async {
                let caller = self.caller(params)?;
                as_caller(caller, self.inner.list_tasks(params, req)).await
            }
            .await,
        )
    }

    async fn cancel_task(
        &self,
        params: &ServiceParams,
        req: CancelTaskRequest,
    ) -> Result<Task, A2AError> {
        let obs = Observed::start("CancelTask");
        obs.unary(
            async {
                let caller = self.caller(params)?;
                self.check_owner(&caller, &req.id).await?;
                as_caller(caller, self.inner.cancel_task(params, req)).await
            }
            .await,
        )
    }

    async fn subscribe_to_task(
        &self,
        params: &ServiceParams,
        req: SubscribeToTaskRequest,
    ) -> Result<EventStream, A2AError> {
        let obs = Observed::start("SubscribeToTask");
        obs.stream(
            async {
                let caller = self.caller(params)?;
                let id = req.id.clone();
                self.check_owner(&caller, &id).await?;
                match as_caller(caller.clone(), self.inner.subscribe_to_task(params, req)).await {
                    Err(e) if e.code == error_code::TASK_NOT_FOUND => {
                        Self::follow_remote(&self.turns, &self.tasks, &caller, &id).await
                    }
                    Ok(events) => Ok(self.resuming(caller, params, Some(id), events)),
                    Err(e) => Err(e),
                }
            }
            .await,
        )
    }

    async fn create_push_config(
        &self,
        params: &ServiceParams,
        req: TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        let obs = Observed::start("CreateTaskPushNotificationConfig");
        obs.unary(self.inner.create_push_config(params, req).await)
    }

    async fn get_push_config(
        &self,
        params: &ServiceParams,
        req: GetTaskPushNotificationConfigRequest,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        let obs = Observed::start("GetTaskPushNotificationConfig");
        obs.unary(self.inner.get_push_config(params, req).await)
    }

    async fn list_push_configs(
        &self,
        params: &ServiceParams,
        req: ListTaskPushNotificationConfigsRequest,
    ) -> Result<ListTaskPushNotificationConfigsResponse, A2AError> {
        let obs = Observed::start("ListTaskPushNotificationConfigs");
        obs.unary(self.inner.list_push_configs(params, req).await)
    }

    async fn delete_push_config(
        &self,
        params: &ServiceParams,
        req: DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), A2AError> {
        let obs = Observed::start("DeleteTaskPushNotificationConfig");
        obs.unary(self.inner.delete_push_config(params, req).await)
    }

    async fn get_extended_agent_card(
        &self,
        params: &ServiceParams,
        req: GetExtendedAgentCardRequest,
    ) -> Result<AgentCard, A2AError> {
        let obs = Observed::start("GetExtendedAgentCard");
        obs.unary(self.inner.get_extended_agent_card(params, req).await)
    }
}
