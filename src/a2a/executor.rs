//! The A2A face of our agents: an [`AgentExecutor`] that runs a task as one
//! turn of the turn engine and maps the turn's events to A2A updates.
//!
//! ```text
//! A2A task ─▶ Turns::start (session per contextId, request id from the task id)
//!           ─▶ RunStream ─▶ map: tool call/result → WORKING status messages (text + data part)
//!                               partial text      → artifact chunks (append, last_chunk)
//!                               final answer      → the last chunk, then COMPLETED
//!                               failure           → FAILED with the sanitised message
//! CancelTask ─▶ token ─▶ the RunStream is dropped (the agents.v1 drop path) ─▶ CANCELED
//! CancelTask on another replica ─▶ the task reads CANCELED in the store (read
//!   back every second while the run lives) ─▶ token ─▶ as above
//! ```
//!
//! Going through the turn engine, not `Agent::run` directly, gives A2A
//! tasks what every run has: the concurrency cap, the server's maximum run
//! duration, the drain and cut of shutdown, and a turn record in the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use a2a::{
    A2AError, Artifact, Message, Part, PartContent, Role, StreamResponse, Task,
    TaskArtifactUpdateEvent, TaskState, TaskStatus, TaskStatusUpdateEvent,
};
use a2a_server::{AgentExecutor, ExecutorContext};
use futures::stream::BoxStream;
use futures::{FutureExt as _, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::domain::{OnDisconnect, RequestId, RunInput, SessionId, TurnKey, UserId, UserText};
use crate::grpc::status;
use crate::pb;
use crate::store::TurnState;
use crate::store::a2a_tasks::{A2aTasks, context_session};
use crate::turn::{Failure, RunError, Turns};

/// The id of the artifact that carries an agent's answer.
pub const ANSWER_ARTIFACT_ID: &str = "answer";
/// Message or request metadata key naming the agent to run.
pub const AGENT_METADATA_KEY: &str = "agent";
/// The user an A2A task runs as when authentication is off (with it on, a
/// task runs as its caller).
pub const ANONYMOUS_USER: &str = crate::store::a2a_tasks::A2A_USER;

/// Runs A2A tasks on the turn engine.
#[derive(Clone)]
pub struct TurnExecutor {
    shared: Arc<Shared>,
}

struct Shared {
    turns: Arc<Turns>,
    /// Authentication is on: a task runs as its caller (the
    /// `CALLER_HEADER` service parameter the authentication layers set).
    authenticated: bool,
    /// Longest accepted message text, as for agents.v1.
    max_input_bytes: usize,
    /// Cancellation of each task running here, fired by CancelTask.
    running: Arc<Mutex<HashMap<String, CancellationToken>>>,
}

impl TurnExecutor {
    /// `authenticated`: authentication is on, so every task has a caller.
    pub fn new(turns: Arc<Turns>, max_input_bytes: usize, authenticated: bool) -> Self {
        let shared = Shared {
            turns,
            authenticated,
            max_input_bytes,
            running: Arc::default(),
        };
        Self {
            shared: Arc::new(shared),
        }
    }
}

/// Everything one execution needs, taken from the executor context.
pub(crate) struct Job {
    task_id: String,
    context_id: String,
    message: Message,
    user: UserId,
    agent: Option<String>,
    /// Distinguishes the turns of one task (a task may take several messages).
    turn_index: usize,
    /// For a reply to a waiting task (INPUT_REQUIRED): the task as the
    /// reply continues it ([`continued_task`]), which its stream begins
    /// with; `None` for a task that starts with this message.
    continued: Option<Task>,
    /// The trace context the message's call carried.
    trace_parent: opentelemetry::Context,
    /// The job follows a turn run elsewhere ([`Job::follower`]): see
    /// [`updates`] for how its end differs.
    following: bool,
}

/// The user a call is made by: with authentication on, the caller the
/// authentication layers name (the `CALLER_HEADER` service parameter, which
/// they remove from what a client sends); without, [`ANONYMOUS_USER`].
pub(crate) fn caller(
    params: &a2a_server::ServiceParams,
    authenticated: bool,
) -> Result<UserId, A2AError> {
    if !authenticated {
        return Ok(UserId::parse(ANONYMOUS_USER).expect("a valid id"));
    }
    let caller = params
        .get(crate::auth::CALLER_HEADER)
        .and_then(|v| v.first())
        .ok_or_else(|| A2AError::invalid_request("this call has no authenticated caller"))?;
    UserId::parse(caller.clone()).map_err(|_| {
        A2AError::invalid_request(
            "the caller's name is not a valid user id (A2A tasks run as their caller)",
        )
    })
}

impl Job {
    fn from_ctx(ctx: ExecutorContext, authenticated: bool) -> Result<Self, A2AError> {
        let message = ctx
            .message
            .ok_or_else(|| A2AError::invalid_params("a message is required"))?;
        let agent = agent_name(&message).or_else(|| {
            ctx.metadata
                .as_ref()
                .and_then(|m| m.get(AGENT_METADATA_KEY))
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        });
        let user = caller(&ctx.service_params, authenticated)?;
        let turn_index = ctx
            .stored_task
            .as_ref()
            .and_then(|t| t.history.as_ref())
            .map_or(0, Vec::len);
        let is_new = ctx
            .stored_task
            .as_ref()
            .is_none_or(|t| t.status.state == TaskState::Submitted);
        let continued = ctx
            .stored_task
            .as_ref()
            .filter(|_| !is_new)
            .map(|t| continued_task(t, &message));
        Ok(Job {
            continued,
            trace_parent: crate::telemetry::trace::extract_params(&ctx.service_params),
            task_id: ctx.task_id,
            context_id: ctx.context_id,
            message,
            user,
            agent,
            turn_index,
            following: false,
        })
    }

    /// The job of following a task's turn that runs elsewhere: only its ids
    /// matter for mapping events.
    pub(crate) fn follower(task_id: String, context_id: String) -> Self {
        Job {
            task_id,
            context_id,
            message: Message::new(Role::User, vec![]),
            user: UserId::parse(ANONYMOUS_USER).expect("a valid id"),
            agent: None,
            turn_index: 0,
            continued: None,
            trace_parent: opentelemetry::Context::new(),
            following: true,
        }
    }

    fn status(&self, state: TaskState, message: Option<Message>) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            status: TaskStatus {
                state,
                message,
                timestamp: Some(chrono::Utc::now()),
            },
            metadata: None,
        })
    }

    fn agent_message(&self, parts: Vec<Part>) -> Message {
        Message {
            context_id: Some(self.context_id.clone()),
            task_id: Some(self.task_id.clone()),
            ..Message::new(Role::Agent, parts)
        }
    }

    fn chunk(&self, text: String, append: bool, last: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            artifact: Artifact {
                artifact_id: ANSWER_ARTIFACT_ID.into(),
                name: Some("answer".into()),
                description: None,
                parts: vec![Part::text(text)],
                metadata: None,
                extensions: None,
            },
            append: Some(append),
            last_chunk: Some(last),
            metadata: None,
        })
    }

    /// The task as it is when its run starts, which its stream begins
    /// with (spec: a stream begins with the Task): SUBMITTED with its first
    /// message, or, for a reply to a waiting task, WORKING with the
    /// history it has (the handler stores the snapshot as the task).
    fn submitted(&self, session: Option<SessionId>) -> StreamResponse {
        let mut task = self.continued.clone().unwrap_or_else(|| Task {
            id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            status: TaskStatus {
                state: TaskState::Submitted,
                message: None,
                timestamp: Some(chrono::Utc::now()),
            },
            artifacts: None,
            history: Some(vec![self.message.clone()]),
            metadata: None,
        });
        if let Some(s) = session {
            task.metadata.get_or_insert_with(HashMap::new).insert(
                crate::store::a2a_tasks::SESSION_METADATA_KEY.to_owned(),
                serde_json::Value::String(s.to_string()),
            );
        }
        StreamResponse::Task(task)
    }

    /// The task ends without running: REJECTED for a request we will not
    /// serve, FAILED for one we cannot serve now.
    fn refused(&self, state: TaskState, why: &str) -> Vec<StreamResponse> {
        vec![
            self.submitted(None),
            self.status(state, Some(self.agent_message(vec![Part::text(why)]))),
        ]
    }
}

/// A waiting task (INPUT_REQUIRED) as `message`, the reply to it,
/// continues it: WORKING, with the reply last in its history (the handler
/// hands the task to a blocking call with the reply already there, to a
/// streaming one without).
pub(crate) fn continued_task(stored: &Task, message: &Message) -> Task {
    let mut task = stored.clone();
    let history = task.history.get_or_insert_with(Vec::new);
    if history
        .last()
        .is_none_or(|m| m.message_id != message.message_id)
    {
        history.push(message.clone());
    }
    task.status = TaskStatus {
        state: TaskState::Working,
        message: None,
        timestamp: Some(chrono::Utc::now()),
    };
    task
}

fn agent_name(message: &Message) -> Option<String> {
    message
        .metadata
        .as_ref()?
        .get(AGENT_METADATA_KEY)?
        .as_str()
        .map(str::to_owned)
}

/// The message's text: its text parts (and bytes declared `text/plain`),
/// joined by newlines. `None` when it has none (the handler refuses other
/// parts before a task is made).
fn message_text(message: &Message) -> Option<String> {
    let texts: Vec<&str> = message
        .parts
        .iter()
        .filter_map(|p| match &p.content {
            PartContent::Text(t) => Some(t.as_str()),
            PartContent::Raw(_) => raw_text(p),
            _ => None,
        })
        .collect();
    (!texts.is_empty()).then(|| texts.join("\n"))
}

/// The text of a part of bytes declared `text/plain` (a charset parameter
/// allowed) that are UTF-8.
pub(crate) fn raw_text(p: &Part) -> Option<&str> {
    let PartContent::Raw(bytes) = &p.content else {
        return None;
    };
    if !is_text_plain(p.media_type.as_deref()?) {
        return None;
    }
    std::str::from_utf8(bytes).ok()
}

/// Whether a declared media type is `text/plain`: its essence (before
/// any parameter, such as a charset), in any case.
pub(crate) fn is_text_plain(media_type: &str) -> bool {
    let essence = media_type.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("text/plain")
}

/// Maps the turn's events to A2A updates, one agents.v1 event at a time.
struct Mapper {
    /// Text already sent as chunks of the answer artifact.
    streamed: String,
    /// An answer chunk was sent, so the next one appends.
    started: bool,
    /// The final answer went out as the last chunk.
    answered: bool,
}

impl Mapper {
    fn new() -> Self {
        Self {
            streamed: String::new(),
            started: false,
            answered: false,
        }
    }

    fn map(&mut self, job: &Job, e: pb::AgentEvent) -> Vec<StreamResponse> {
        match e.kind() {
            pb::EventKind::ToolCall | pb::EventKind::ToolResult => {
                let key = if e.kind() == pb::EventKind::ToolCall {
                    "toolCall"
                } else {
                    "toolResult"
                };
                let payload: serde_json::Value =
                    serde_json::from_str(&e.payload_json).unwrap_or(serde_json::Value::Null);
                let field = if e.kind() == pb::EventKind::ToolCall {
                    "arguments"
                } else {
                    "result"
                };
                let data = serde_json::json!({ key: { "name": e.tool_name, "id": e.tool_call_id, field: payload } });
                let mut parts = vec![];
                if !e.text.is_empty() {
                    parts.push(Part::text(e.text));
                }
                parts.push(Part::data(data).with_media_type("application/json"));
                vec![job.status(TaskState::Working, Some(job.agent_message(parts)))]
            }
            pb::EventKind::PartialText => {
                let append = std::mem::replace(&mut self.started, true);
                self.streamed.push_str(&e.text);
                vec![job.chunk(e.text, append, false)]
            }
            pb::EventKind::FinalAnswer | pb::EventKind::Unspecified => {
                self.answered = true;
                if !self.started {
                    return vec![job.chunk(e.text, false, true)];
                }
                // A final answer that repeats the streamed text only adds its
                // rest; one that does not replaces it: the answer artifact
                // is the final answer, never the streamed text with the
                // answer after it.
                match e.text.strip_prefix(self.streamed.as_str()) {
                    Some(rest) => vec![job.chunk(rest.to_owned(), true, true)],
                    None => vec![job.chunk(e.text, false, true)],
                }
            }
        }
    }
}

/// Removes a task's token when its run ends, however it ends.
struct Running {
    tasks: Arc<Mutex<HashMap<String, CancellationToken>>>,
    task_id: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.task_id);
    }
}

impl Shared {
    /// The run of one task, as the stream of its updates.
    ///
    /// The handler drives the stream on a task of its own, storing each
    /// update before it takes the next, and drops the stream only once it
    /// has stored the last. The stream holds the turn engine ([`Turns::hold`])
    /// for as long as it lives, so that shutdown waits for the task's end to
    /// be stored, not only for the turn's.
    fn run(self: Arc<Self>, job: Job) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        let hold = self.turns.hold();
        Box::pin(async_stream::stream! {
            let _hold = hold;
            // The turn's key is derived, not stored: armed before anything
            // can fail, `settle` ends the task even when the store refused
            // both the run and the update that would have ended it. A task
            // that ended (refused here, say) is left as it is.
            let key = RequestId::parse(format!("{}.{}", job.task_id, job.turn_index)).map(|request_id| TurnKey {
                session_id: context_session(&job.user, &job.context_id),
                request_id,
            });
            let mut settle = key.as_ref().ok().map(|key| {
                super::settle::Settle::new(self.turns.clone(), job.task_id.clone(), job.context_id.clone(), key.clone())
            });
            let Some(text) = message_text(&job.message) else {
                for e in job.refused(TaskState::Rejected, "the message has no text part; this agent reads text only") {
                    yield Ok(e);
                }
                return;
            };
            let text = match UserText::parse(text, self.max_input_bytes) {
                Ok(t) => t,
                Err(e) => {
                    for e in job.refused(TaskState::Rejected, &e.to_string()) {
                        yield Ok(e);
                    }
                    return;
                }
            };
            let (Ok(key), Some(agent)) = (key, valid_agent(job.agent.clone())) else {
                for e in job.refused(TaskState::Rejected, "the task id or the agent name is malformed") {
                    yield Ok(e);
                }
                return;
            };
            // The session of (user, context), created on first use: derived
            // from the pair, so every replica and every restart finds it.
            let session_id = key.session_id;
            if let Err(e) = self.turns.store().a2a_tasks().ensure_session(session_id, &job.user).await {
                for e in job.refused(TaskState::Failed, refusal(e.into(), &self.turns).1.as_str()) {
                    yield Ok(e);
                }
                return;
            }
            let input = RunInput {
                user_id: job.user.clone(),
                key,
                generated_request_id: false,
                text,
                agent,
                // CancelTask drops the stream: that must cancel the run.
                on_disconnect: OnDisconnect::Cancel,
            };
            let cancel = CancellationToken::new();
            self.running.lock().unwrap_or_else(|e| e.into_inner()).insert(job.task_id.clone(), cancel.clone());
            let _running = Running { tasks: self.running.clone(), task_id: job.task_id.clone() };
            // The run's span is a child of this one in the trace (its
            // OpenTelemetry parent; in tracing it stands alone, so neither
            // holds the other open), which continues the caller's trace;
            // this one ends with the task's stream.
            let span = crate::telemetry::trace::a2a_task_span(&job.task_id, &job.context_id, job.trace_parent.clone());
            let events = match self.turns.start(input, None).instrument(span.clone()).await {
                Ok(started) => started.stream,
                Err(e) => {
                    let (state, why) = refusal(e, &self.turns);
                    for e in job.refused(state, &why) {
                        yield Ok(e);
                    }
                    return;
                }
            };
            yield Ok(job.submitted(Some(session_id)));
            if job.continued.is_none() {
                yield Ok(job.status(TaskState::Working, None));
            }
            let task_id = job.task_id.clone();
            let mut updates = Box::pin(updates(job, events));
            // A CancelTask served by another replica marks the task CANCELED
            // in the store and cannot reach `cancel`: the stored task is read
            // back every WATCH_EVERY while the run lives, and a task found
            // ended fires `cancel` as a CancelTask served here would. The
            // reads run beside the stream, never in the way of its updates.
            let ended_elsewhere = Arc::new(std::sync::Mutex::new(None));
            let watching = CancellationToken::new();
            let _stop_watching = watching.clone().drop_guard();
            tokio::spawn(watch_stored_end(
                self.turns.store().a2a_tasks(),
                task_id.clone(),
                cancel.clone(),
                watching,
                ended_elsewhere.clone(),
            ));
            loop {
                let next = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => {
                        // Dropping the stream is the agents.v1 cancel path: the
                        // pump sees the channel close and cancels the agent.
                        // CancelTask reports CANCELED itself; one served
                        // elsewhere stored it, and the task's streams here end
                        // with that stored status.
                        tracing::info!(task = %task_id, "a2a: task cancelled; run dropped");
                        if let Some(settle) = settle.as_mut() {
                            settle.disarm();
                        }
                        drop(updates);
                        let end = ended_elsewhere.lock().unwrap_or_else(|e| e.into_inner()).take();
                        if let Some(end) = end {
                            yield Ok(end);
                        }
                        return;
                    }
                    next = updates.next() => next,
                };
                match next {
                    Some(update) => yield update,
                    None => return,
                }
            }
        })
    }
}

/// How often the task of a run live here is read back from the store, to
/// notice a CancelTask served by another replica: one read per live task
/// per interval.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads task `task_id` back every [`WATCH_EVERY`] until `watching` is
/// cancelled (the run's stream ended) or `cancel` fires; once it reads the
/// task ended (a CancelTask served by another replica), leaves its status
/// in `ended` and fires `cancel`.
async fn watch_stored_end(
    tasks: Arc<dyn A2aTasks>,
    task_id: String,
    cancel: CancellationToken,
    watching: CancellationToken,
    ended: Arc<std::sync::Mutex<Option<StreamResponse>>>,
) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + WATCH_EVERY, WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = watching.cancelled() => return,
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let found = tokio::select! {
            _ = watching.cancelled() => return,
            found = ended_in_store(&*tasks, &task_id) => found,
        };
        if let Some(t) = found {
            tracing::info!(task = %task_id, state = ?t.status.state, "a2a: the task ended elsewhere; stopping its run");
            *ended.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                    task_id: t.id,
                    context_id: t.context_id,
                    status: t.status,
                    metadata: None,
                }));
            cancel.cancel();
            return;
        }
    }
}

/// The task, when the store has it ended (CANCELED by a CancelTask served
/// elsewhere); `None` while it is not, or when the store does not answer
/// within [`WATCH_EVERY`] (the next read looks again).
async fn ended_in_store(tasks: &dyn A2aTasks, task_id: &str) -> Option<Task> {
    match tokio::time::timeout(WATCH_EVERY, tasks.get(task_id)).await {
        Ok(Ok(Some(t))) if t.status.state.is_terminal() => Some(t),
        _ => None,
    }
}

/// The most answer text joined into one update.
const CHUNK_JOIN_MAX_BYTES: usize = 64 * 1024;

/// The A2A updates of one turn's events, to the task's terminal status:
/// what the executor streams for the run it started, and what a follower of
/// a turn run elsewhere streams (see `follow`).
///
/// Chunks of answer text that are already waiting when one is taken go out
/// as one update: the task is stored again with every update, so a reader
/// (or a store) slower than the model gets fewer, larger updates instead of
/// falling further behind. Nothing waits for more to come.
///
/// A follower ([`Job::follower`]) tells only what the turn's stored end
/// says of the task, as `settle` stores it ([`super::settle::task_end`]):
/// a follower also stops for reasons of its own (this server shutting down,
/// a reader too slow, the store unreadable here, the turn removed), which
/// say nothing of the task, still running where it runs. Those end the
/// stream with an error, never a terminal status: the caller subscribes
/// again or looks with GetTask. The executor's own run never ends with an
/// error.
pub(crate) fn updates(
    job: Job,
    mut events: impl futures::Stream<Item = Result<pb::AgentEvent, Failure>> + Unpin,
) -> impl futures::Stream<Item = Result<StreamResponse, A2AError>> {
    async_stream::stream! {
        let mut mapper = Mapper::new();
        // An event taken while joining chunks that was not one of them;
        // `Some(None)`: the stream ended then.
        let mut held: Option<Option<Result<pb::AgentEvent, Failure>>> = None;
        loop {
            let next = match held.take() {
                Some(next) => next,
                None => events.next().await,
            };
            match next {
                Some(Ok(mut e)) => {
                    if e.kind() == pb::EventKind::PartialText {
                        while e.text.len() < CHUNK_JOIN_MAX_BYTES {
                            match events.next().now_or_never() {
                                None => break,
                                Some(Some(Ok(more))) if more.kind() == pb::EventKind::PartialText => {
                                    e.text.push_str(&more.text);
                                }
                                Some(other) => {
                                    held = Some(other);
                                    break;
                                }
                            }
                        }
                    }
                    for update in mapper.map(&job, e) {
                        yield Ok(update);
                    }
                }
                Some(Err(Failure::Stored(o))) if job.following => {
                    let (state, why) = super::settle::task_end(Some(&o));
                    let message = why.map(|w| job.agent_message(vec![Part::text(w)]));
                    yield Ok(job.status(state, message));
                    return;
                }
                Some(Err(f)) if job.following => {
                    yield Err(stopped_following(f));
                    return;
                }
                // The turn completed (its answer is stored) but this stream
                // could not take its final event: no end is written here.
                // The task's settle stores the end the turn recorded,
                // COMPLETED with the stored answer.
                Some(Err(Failure::Undelivered(_))) => return,
                Some(Err(f)) => {
                    let state = match &f {
                        Failure::ClientGone => TaskState::Canceled,
                        Failure::StoppedFollowing(f) if matches!(**f, Failure::ClientGone) => {
                            TaskState::Canceled
                        }
                        Failure::Stored(o) if o.state == TurnState::Cancelled => TaskState::Canceled,
                        Failure::CancelledByRequest => TaskState::Canceled,
                        _ => TaskState::Failed,
                    };
                    let why = status::failure(f, true).message().to_owned();
                    yield Ok(job.status(state, Some(job.agent_message(vec![Part::text(why)]))));
                    return;
                }
                None => break,
            }
        }
        if mapper.answered || job.following {
            // A follower's turn ended OK: its outcome is stored, and the
            // task ends COMPLETED (`settle` stores it so).
            yield Ok(job.status(TaskState::Completed, None));
        } else {
            let why = status::failure(Failure::NoFinalAnswer, true).message().to_owned();
            yield Ok(job.status(TaskState::Failed, Some(job.agent_message(vec![Part::text(why)]))));
        }
    }
}

/// The error a follower ends with when it stops for a reason of its own
/// (`f`), which is not the task's end.
fn stopped_following(f: Failure) -> A2AError {
    let why = match f {
        Failure::Store(e) => return crate::store::a2a_tasks::a2a_err(e),
        Failure::StoppedFollowing(f) => match *f {
            Failure::Shutdown => "this server is shutting down",
            Failure::SlowConsumer => "the stream was not read fast enough",
            Failure::Deadline { .. } => "following it took longer than this server allows",
            Failure::ClientGone => "the caller went away",
            _ => "this server stopped following it",
        },
        Failure::Removed => "its turn was removed meanwhile",
        _ => "this server stopped following it",
    };
    A2AError::internal(format!(
        "stopped following the task ({why}); it goes on where it runs: subscribe again or use GetTask"
    ))
}

/// The longest task or context id a message may name: ids are made by
/// servers (UUIDs) or by clients for their conversations; longer ones are
/// refused rather than stored, logged and echoed.
pub(crate) const MAX_ID_BYTES: usize = 256;

/// The most a message may hold outside its text: its JSON encoding with
/// the text of its parts left out (ids, metadata, extensions,
/// referenceTaskIds, the parts' own metadata). The message is stored in its
/// task's history, which is written again with every update of the task
/// and read back by every GetTask and ListTasks: only the text, which the
/// agent reads, is bounded otherwise (`--max-input-bytes`).
pub(crate) const MAX_MESSAGE_OUTSIDE_TEXT_BYTES: usize = 64 * 1024;

/// The size of `m`'s JSON encoding without the text of its parts (text,
/// and bytes read as text, count as empty).
fn size_outside_text(m: &Message) -> usize {
    let parts = m
        .parts
        .iter()
        .map(|p| Part {
            content: match &p.content {
                PartContent::Text(_) => PartContent::Text(String::new()),
                PartContent::Raw(_) if raw_text(p).is_some() => PartContent::Raw(Vec::new()),
                other => other.clone(),
            },
            filename: p.filename.clone(),
            media_type: p.media_type.clone(),
            metadata: p.metadata.clone(),
        })
        .collect();
    let outside = Message {
        message_id: m.message_id.clone(),
        context_id: m.context_id.clone(),
        task_id: m.task_id.clone(),
        role: m.role.clone(),
        parts,
        metadata: m.metadata.clone(),
        extensions: m.extensions.clone(),
        reference_task_ids: m.reference_task_ids.clone(),
    };
    serde_json::to_vec(&outside).map_or(usize::MAX, |v| v.len())
}

/// Refuses a message no agent could run, before the handler stores a task
/// for it (its refusal would otherwise be a stored REJECTED task, holding
/// whatever the message held): no message id, not the user's, ids past
/// [`MAX_ID_BYTES`], more than [`MAX_MESSAGE_OUTSIDE_TEXT_BYTES`] outside
/// its text, no text or text past `max_input_bytes`, an agent name that
/// is malformed or not served.
pub(crate) fn check_request(
    req: &a2a::SendMessageRequest,
    max_input_bytes: usize,
    agents: &crate::agent::AgentRegistry,
) -> Result<(), A2AError> {
    let m = &req.message;
    if m.message_id.is_empty() {
        return Err(A2AError::invalid_params("the message has no messageId"));
    }
    if m.role != a2a::Role::User {
        return Err(A2AError::invalid_params(
            "the message's role must be ROLE_USER",
        ));
    }
    for (name, id) in [("taskId", &m.task_id), ("contextId", &m.context_id)] {
        if id.as_ref().is_some_and(|id| id.len() > MAX_ID_BYTES) {
            return Err(A2AError::invalid_params(format!(
                "the message's {name} is longer than {MAX_ID_BYTES} bytes"
            )));
        }
    }
    let outside = size_outside_text(m);
    if outside > MAX_MESSAGE_OUTSIDE_TEXT_BYTES {
        return Err(A2AError::invalid_params(format!(
            "the message holds more than {MAX_MESSAGE_OUTSIDE_TEXT_BYTES} bytes outside its text \
             (its ids, metadata, extensions, referenceTaskIds and the parts' metadata, as JSON)"
        )));
    }
    let Some(text) = message_text(m) else {
        return Err(A2AError::invalid_params(
            "the message has no text part; the agents read text only",
        ));
    };
    UserText::parse(text, max_input_bytes).map_err(|e| A2AError::invalid_params(e.to_string()))?;
    let agent = agent_name(m).or_else(|| {
        req.metadata
            .as_ref()
            .and_then(|md| md.get(AGENT_METADATA_KEY))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    });
    match valid_agent(agent) {
        None => Err(A2AError::invalid_params(
            "the agent name is malformed (1 to 64 of A-Z a-z 0-9 _ -)",
        )),
        Some(name) if agents.get(name.as_deref()).is_none() => {
            Err(A2AError::invalid_params(format!(
                "no such agent; this server serves: {}",
                agents.names().collect::<Vec<_>>().join(", ")
            )))
        }
        Some(_) => Ok(()),
    }
}

/// Agent names follow the agents.v1 rule; `None` inside means the default.
fn valid_agent(agent: Option<String>) -> Option<Option<String>> {
    match agent {
        None => Some(None),
        Some(a)
            if !a.is_empty()
                && a.len() <= 64
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
        {
            Some(Some(a))
        }
        Some(_) => None,
    }
}

/// How a refused run ends the task, with the agents.v1 table's message.
fn refusal(e: RunError, turns: &Turns) -> (TaskState, String) {
    let state = match e {
        RunError::UnknownAgent
        | RunError::RequestIdReused
        | RunError::SessionNotFound
        | RunError::TurnNotFound => TaskState::Rejected,
        RunError::Busy { .. }
        | RunError::UserBusy { .. }
        | RunError::TooManyFollowers { .. }
        | RunError::ShuttingDown
        | RunError::SessionBusy
        | RunError::Store(_) => TaskState::Failed,
    };
    (
        state,
        status::run_error(e, turns.agents()).message().to_owned(),
    )
}

impl AgentExecutor for TurnExecutor {
    fn execute(
        &self,
        ctx: ExecutorContext,
    ) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        match Job::from_ctx(ctx, self.shared.authenticated) {
            Ok(job) => self.shared.clone().run(job),
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        }
    }

    fn cancel(&self, ctx: ExecutorContext) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        if let Some(token) = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ctx.task_id)
        {
            token.cancel();
        }
        let update = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: ctx.task_id,
            context_id: ctx.context_id,
            status: TaskStatus {
                state: TaskState::Canceled,
                message: None,
                timestamp: Some(chrono::Utc::now()),
            },
            metadata: None,
        });
        Box::pin(futures::stream::once(async move { Ok(update) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            task_id: "t".into(),
            context_id: "c".into(),
            message: Message::new(Role::User, vec![Part::text("hi")]),
            user: UserId::parse("u").unwrap(),
            agent: None,
            turn_index: 0,
            continued: None,
            trace_parent: opentelemetry::Context::new(),
            following: false,
        }
    }

    fn event(kind: pb::EventKind, text: &str) -> pb::AgentEvent {
        pb::AgentEvent {
            kind: kind as i32,
            text: text.into(),
            ..Default::default()
        }
    }

    fn chunk(u: &StreamResponse) -> (String, bool, bool) {
        match u {
            StreamResponse::ArtifactUpdate(a) => (
                a.artifact.parts[0].as_text().unwrap().to_owned(),
                a.append.unwrap(),
                a.last_chunk.unwrap(),
            ),
            other => panic!("not a chunk: {other:?}"),
        }
    }

    /// Chunks waiting together go out as one update (the task is stored
    /// once for them); a chunk alone goes out at once, and the events after
    /// the joined ones keep their order.
    #[tokio::test]
    async fn chunks_waiting_together_become_one_update() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut out = std::pin::pin!(updates(job(), rx).map(Result::unwrap));
        tx.unbounded_send(Ok(event(pb::EventKind::PartialText, "a")))
            .unwrap();
        assert_eq!(
            chunk(&out.next().await.unwrap()),
            ("a".into(), false, false)
        );
        for t in ["b", "c", "d"] {
            tx.unbounded_send(Ok(event(pb::EventKind::PartialText, t)))
                .unwrap();
        }
        let mut call = event(pb::EventKind::ToolCall, "");
        call.tool_name = "lookup".into();
        tx.unbounded_send(Ok(call)).unwrap();
        tx.unbounded_send(Ok(event(pb::EventKind::PartialText, "e")))
            .unwrap();
        tx.unbounded_send(Ok(event(pb::EventKind::FinalAnswer, "abcde")))
            .unwrap();
        drop(tx);
        let rest: Vec<StreamResponse> = out.collect().await;
        assert_eq!(rest.len(), 5, "{rest:?}");
        assert_eq!(chunk(&rest[0]), ("bcd".into(), true, false));
        assert!(
            matches!(&rest[1], StreamResponse::StatusUpdate(u) if u.status.state == TaskState::Working)
        );
        assert_eq!(chunk(&rest[2]), ("e".into(), true, false));
        assert_eq!(chunk(&rest[3]), ("".into(), true, true));
        assert!(
            matches!(&rest[4], StreamResponse::StatusUpdate(u) if u.status.state == TaskState::Completed)
        );
    }

    /// A run whose turn completed but whose stream could not take the
    /// final event writes no end (least of all FAILED, which would
    /// contradict the stored turn): the task's settle stores COMPLETED.
    #[tokio::test]
    async fn an_undelivered_final_event_ends_the_updates_without_a_status() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        tx.unbounded_send(Ok(event(pb::EventKind::PartialText, "a")))
            .unwrap();
        tx.unbounded_send(Err(Failure::Undelivered(Box::new(Failure::SlowConsumer))))
            .unwrap();
        drop(tx);
        let out: Vec<StreamResponse> = updates(job(), rx).map(Result::unwrap).collect().await;
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(chunk(&out[0]), ("a".into(), false, false));
    }

    fn follower() -> Job {
        Job::follower("t".into(), "c".into())
    }

    fn state(u: &StreamResponse) -> Option<TaskState> {
        match u {
            StreamResponse::StatusUpdate(s) => Some(s.status.state.clone()),
            _ => None,
        }
    }

    /// A follower stopped for a reason of its own (here the following
    /// server shutting down) ends with an error, never a terminal status:
    /// the task goes on where it runs.
    #[tokio::test]
    async fn a_follower_stopping_on_its_own_ends_with_an_error_not_a_status() {
        for own in [
            Failure::StoppedFollowing(Box::new(Failure::Shutdown)),
            Failure::StoppedFollowing(Box::new(Failure::SlowConsumer)),
            Failure::StoppedFollowing(Box::new(Failure::ClientGone)),
            Failure::Removed,
            Failure::Store(crate::store::StoreError::Unavailable(anyhow::anyhow!(
                "down"
            ))),
        ] {
            let what = format!("{own:?}");
            let events =
                futures::stream::iter([Ok(event(pb::EventKind::PartialText, "a")), Err(own)]);
            let out: Vec<_> = updates(follower(), events).collect().await;
            assert_eq!(out.len(), 2, "{what}: {out:?}");
            assert_eq!(chunk(out[0].as_ref().unwrap()), ("a".into(), false, false));
            assert!(out[1].is_err(), "{what}: {out:?}");
            assert!(
                out.iter().flatten().all(|u| state(u).is_none()),
                "{what}: {out:?}"
            );
        }
    }

    /// A follower ends with the end the store's settle gives the turn's
    /// stored outcome: a turn cancelled because its task's updates could
    /// not be stored is FAILED, as the task is stored, not CANCELED.
    #[tokio::test]
    async fn a_follower_ends_as_the_store_settles_the_turns_outcome() {
        let not_stored = status::outcome(&Err(Failure::ClientGone));
        assert_eq!(not_stored.state, TurnState::Cancelled);
        for (outcome, want) in [
            (not_stored, TaskState::Failed),
            (status::cancelled_by_request(), TaskState::Canceled),
            (status::replica_stopped(), TaskState::Failed),
        ] {
            assert_eq!(super::super::settle::task_end(Some(&outcome)).0, want);
            let events = futures::stream::iter([Err(Failure::Stored(outcome))]);
            let out: Vec<_> = updates(follower(), events).collect().await;
            assert_eq!(out.len(), 1, "{out:?}");
            assert_eq!(state(out[0].as_ref().unwrap()), Some(want));
        }
    }

    #[test]
    fn partial_text_becomes_appended_chunks_and_the_final_answer_the_last_one() {
        let (j, mut m) = (job(), Mapper::new());
        let a = m.map(&j, event(pb::EventKind::PartialText, "Hel"));
        let b = m.map(&j, event(pb::EventKind::PartialText, "lo"));
        let c = m.map(&j, event(pb::EventKind::FinalAnswer, "Hello world"));
        assert_eq!(chunk(&a[0]), ("Hel".into(), false, false));
        assert_eq!(chunk(&b[0]), ("lo".into(), true, false));
        assert_eq!(chunk(&c[0]), (" world".into(), true, true));
    }

    #[test]
    fn a_final_answer_that_is_not_the_streamed_text_replaces_it() {
        let (j, mut m) = (job(), Mapper::new());
        m.map(&j, event(pb::EventKind::PartialText, "Let me check. "));
        m.map(&j, event(pb::EventKind::ToolCall, ""));
        m.map(&j, event(pb::EventKind::PartialText, "Shipped."));
        let c = m.map(&j, event(pb::EventKind::FinalAnswer, "Shipped."));
        assert_eq!(chunk(&c[0]), ("Shipped.".into(), false, true));
    }

    #[test]
    fn a_final_answer_alone_is_one_complete_chunk() {
        let (j, mut m) = (job(), Mapper::new());
        assert_eq!(
            chunk(&m.map(&j, event(pb::EventKind::FinalAnswer, "done"))[0]),
            ("done".into(), false, true)
        );
    }

    #[test]
    fn tool_calls_are_working_status_messages_with_a_data_part() {
        let (j, mut m) = (job(), Mapper::new());
        let mut e = event(pb::EventKind::ToolCall, "calling lookup_order");
        e.tool_name = "lookup_order".into();
        e.payload_json = r#"{"order_id":"1187"}"#.into();
        let StreamResponse::StatusUpdate(s) = &m.map(&j, e)[0] else {
            panic!("not a status")
        };
        assert_eq!(s.status.state, TaskState::Working);
        let parts = &s.status.message.as_ref().unwrap().parts;
        assert_eq!(parts[0].as_text(), Some("calling lookup_order"));
        let PartContent::Data(d) = &parts[1].content else {
            panic!("not data")
        };
        assert_eq!(d["toolCall"]["name"], "lookup_order");
        assert_eq!(d["toolCall"]["arguments"]["order_id"], "1187");
    }
}
