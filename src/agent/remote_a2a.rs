//! An agent that delegates each turn to a remote A2A agent (`kind =
//! "remote_a2a"` in the agents file), through the A2A streaming client
//! ([`crate::client::a2a`]): one client per remote agent, made on first use
//! and reused.
//!
//! ```text
//! Run ─▶ SendStreamingMessage (the session's remote contextId, metadata "agent";
//!        taskId: the task the session's last turn left waiting for input)
//!        WORKING status with a toolCall / toolResult data part ─▶ TOOL_CALL / TOOL_RESULT
//!        other status messages                               ─▶ not forwarded (debug log)
//!        artifact chunks (text)                              ─▶ PARTIAL_TEXT: the text not
//!                                                              forwarded yet (see `unsent`)
//!        COMPLETED: the artifacts' text (else its final
//!        status's message), or a direct Message              ─▶ FINAL_ANSWER (at most 2 MiB)
//!        INPUT_REQUIRED                                      ─▶ FINAL_ANSWER "The remote agent needs
//!                                                              more input: …"; the session's next
//!                                                              turn is sent as the reply
//!        FAILED / REJECTED / CANCELED / AUTH_REQUIRED        ─▶ agent error, sanitised message
//! stream dropped (client cancel, deadline), answer past 2 MiB, AUTH_REQUIRED,
//! or the call ended on a refusal while the task runs          ─▶ CancelTask on the remote task
//! ```
//!
//! The remote conversation (its contextId, and the task waiting for input)
//! is kept with the session, in the store, so that any replica and any
//! restart continues it: every final answer carries it as its payload,
//! `{"a2a": {"context_id": …, "task_id": …, "state": …}}` ([`RemoteTurn`]),
//! which later turns read back from their history's notes
//! ([`Conversation::of`], [`RunContext::notes`]).
//! Nothing of it is held in this process.
//!
//! The remote's own texts (status messages of a failure, errors) go to the
//! log, never into a status message: they may echo the prompt. The bearer
//! token is never logged.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use a2a::{Message, Part, PartContent, Role, StreamResponse, TaskState};
use tokio::sync::{Notify, OnceCell};
use tracing::Instrument;

use super::{Agent, AgentError, Event, EventKind, EventStream, PriorTurn, RunContext};
use crate::client::a2a::{
    A2aClient, Binding, BufferedArtifact, CallError, CallOptions, CallState, Control, Outcome,
    parts_text,
};

/// Default: no event from the remote for this long counts as a lost stream.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default bound of one delegated turn.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the CancelTask sent for a dropped run may take.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the remote agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remote {
    /// Read the agent card there (a base URL, or the card's own URL) and use
    /// `binding`, or else the first of the card's interfaces the client speaks
    /// (JSON-RPC, gRPC), in the card's order.
    Card {
        url: String,
        binding: Option<Binding>,
    },
    /// Call this JSON-RPC endpoint directly.
    JsonRpc { url: String },
}

/// A bearer token; `Debug` never shows it.
#[derive(Clone)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

/// Everything one remote A2A agent is.
#[derive(Debug, Clone)]
pub struct RemoteA2aConfig {
    pub name: String,
    pub description: String,
    pub remote: Remote,
    /// Sent as message metadata `"agent"` (an agentd remote picks its agent by it).
    pub remote_agent: Option<String>,
    pub token: Option<Token>,
    /// PEM certificates trusted besides the system's roots (https remotes).
    pub ca_pem: Option<Vec<u8>>,
    /// No event for this long counts as a lost stream (the client recovers).
    pub idle_timeout: Duration,
    /// Bound of each delegated turn; past it the remote task is cancelled.
    pub call_timeout: Duration,
}

/// Where a turn left the session's conversation with the remote: the
/// payload of its final answer, `{"a2a": {...}}`, kept by the store beside
/// the turn (within [`super::MAX_ANSWER_PAYLOAD_BYTES`]) and given back in
/// later turns' history, and seen by agents.v1 clients on the FINAL_ANSWER
/// event. A field the remote did not give is left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct RemoteTurn {
    /// The remote contextId: the session's conversation there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context_id: Option<String>,
    /// The remote task that answered; none for a direct Message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    task_id: Option<String>,
    /// That task's state: [`COMPLETED`], or [`INPUT_REQUIRED`] (the next
    /// turn replies to the task); none for a direct Message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state: Option<String>,
}

/// [`RemoteTurn::state`] of a task that completed.
const COMPLETED: &str = "completed";
/// [`RemoteTurn::state`] of a task that waits for input.
const INPUT_REQUIRED: &str = "input_required";

impl RemoteTurn {
    /// The final answer payload that records this turn.
    fn payload(&self) -> String {
        serde_json::json!({ "a2a": self }).to_string()
    }

    /// The turn `payload` records, if it records one.
    fn parse(payload: &str) -> Option<Self> {
        #[derive(serde::Deserialize)]
        struct Payload {
            a2a: RemoteTurn,
        }
        serde_json::from_str::<Payload>(payload).ok().map(|p| p.a2a)
    }
}

/// The session's conversation with the remote, as this agent's earlier
/// turns left it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Conversation {
    context_id: Option<String>,
    /// The remote task waits for input (INPUT_REQUIRED): this turn replies to it.
    waiting_task: Option<String>,
}

impl Conversation {
    /// From `history` (oldest first), the turns agent `agent` ran: the
    /// remote context of the newest that recorded one, and the task it
    /// waits on only if the newest of them all left it waiting for input.
    /// A turn of this agent that ended without an answer (failed,
    /// cancelled) records nothing: the conversation goes on in the context
    /// before it, with no task waiting.
    fn of(agent: &str, history: &[PriorTurn]) -> Self {
        let mut c = Conversation::default();
        for (i, t) in history
            .iter()
            .rev()
            .filter(|t| t.agent == agent)
            .enumerate()
        {
            let Some(turn) = RemoteTurn::parse(&t.answer_payload) else {
                continue;
            };
            if i == 0 && turn.state.as_deref() == Some(INPUT_REQUIRED) {
                c.waiting_task = turn.task_id;
            }
            if let Some(context) = turn.context_id.filter(|c| !c.is_empty()) {
                c.context_id = Some(context);
                break;
            }
        }
        c
    }
}

/// An agents.v1 agent whose turns a remote A2A agent answers.
pub struct RemoteA2aAgent {
    shared: Arc<Shared>,
}

struct Shared {
    cfg: RemoteA2aConfig,
    client: OnceCell<A2aClient>,
}

impl RemoteA2aAgent {
    /// A JSON-RPC remote's client is made here; a card is read on the first
    /// run (and again on the next run if that fails), so the remote need
    /// not be up when agentd starts.
    pub fn new(cfg: RemoteA2aConfig) -> anyhow::Result<Self> {
        let client = OnceCell::new();
        if let Remote::JsonRpc { url } = &cfg.remote {
            let c = A2aClient::jsonrpc_trusting(
                url,
                cfg.token.as_ref().map(|t| t.0.as_str()),
                cfg.ca_pem.as_deref(),
            )?;
            let _ = client.set(c);
        }
        Ok(Self {
            shared: Arc::new(Shared { cfg, client }),
        })
    }
}

impl Shared {
    /// The client, connecting (reading the card) first if no run has yet.
    /// The wait is bounded by `by`, the run's turn deadline, which covers
    /// the wait behind another run's connect as well as its own: a remote
    /// that takes connections and never answers would otherwise hold every
    /// run until its Run deadline. A connect that fails or times out is not
    /// kept: the next run tries again.
    async fn client(&self, by: tokio::time::Instant) -> Result<&A2aClient, AgentError> {
        let connect = self.client.get_or_try_init(|| async {
            let Remote::Card { url, binding } = &self.cfg.remote else {
                unreachable!("a JSON-RPC remote's client is made at start-up")
            };
            // The client masks the URL's credentials in its errors.
            A2aClient::connect_trusting(url, *binding, self.cfg.token.as_ref().map(|t| t.0.as_str()), self.cfg.ca_pem.as_deref())
                .await
                .map_err(|e| {
                    tracing::warn!(agent = %self.cfg.name, error = %format!("{e:#}"), "remote_a2a: cannot connect to the remote agent");
                    unavailable("the remote A2A agent cannot be reached")
                })
        });
        match tokio::time::timeout_at(by, connect).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(agent = %self.cfg.name, "remote_a2a: the remote agent did not answer its card or connection within call_timeout");
                Err(unavailable("the remote A2A agent cannot be reached"))
            }
        }
    }
}

fn unavailable(message: &str) -> AgentError {
    AgentError::Unavailable {
        message: message.to_owned(),
        retry_after: None,
    }
}

/// What the listener hands the run's stream.
#[derive(Default)]
struct Relay {
    events: VecDeque<Event>,
    task_id: Option<String>,
    /// The length of the latest status message's text (an answer some
    /// agents give there): counted against [`MAX_ANSWER_BYTES`] as it
    /// comes. The answer itself is the outcome's: a status seen only in a
    /// recovery's snapshot, or one without a message, is not seen here.
    status_bytes: usize,
    /// The answer's text as the artifacts now hold it (see [`Answer`]).
    answer: Answer,
    /// What was forwarded so far.
    forwarded: Forwarded,
    /// The answer outgrew [`MAX_ANSWER_BYTES`]: the call was stopped.
    too_large: bool,
}

impl Relay {
    /// The most answer text the call holds or has forwarded, in bytes: a
    /// rewrite that is not forwarded (see [`unsent`]) counts as well as
    /// text that was.
    fn answer_bytes(&self) -> usize {
        self.forwarded
            .bytes
            .max(self.answer.bytes)
            .max(self.status_bytes)
    }
}

/// The length of the artifacts' text, as the client buffers them, kept
/// per update (an update changes one artifact; only a snapshot, which may
/// change them all, is measured whole).
#[derive(Default)]
struct Answer {
    /// Per artifact id, its text's length.
    by_id: HashMap<String, usize>,
    bytes: usize,
}

impl Answer {
    /// Follows `ev`; `st`: the call's state with it applied.
    fn update(&mut self, ev: &StreamResponse, st: &CallState) {
        match ev {
            StreamResponse::ArtifactUpdate(u) => {
                let added = text_bytes(&u.artifact.parts);
                let len = self
                    .by_id
                    .entry(u.artifact.artifact_id.clone())
                    .or_default();
                self.bytes -= *len;
                // As the client does: an append extends the artifact of its
                // id, anything else replaces it.
                *len = if u.append == Some(true) {
                    *len + added
                } else {
                    added
                };
                self.bytes += *len;
            }
            StreamResponse::Task(_) => {
                self.by_id = st
                    .artifacts
                    .iter()
                    .map(|b| {
                        (
                            b.artifact.artifact_id.clone(),
                            text_bytes(&b.artifact.parts),
                        )
                    })
                    .collect();
                self.bytes = self.by_id.values().sum();
            }
            StreamResponse::StatusUpdate(_) | StreamResponse::Message(_) => {}
        }
    }
}

/// The length of `parts`' text, without joining it.
fn text_bytes(parts: &[Part]) -> usize {
    parts
        .iter()
        .map(|p| match &p.content {
            PartContent::Text(t) => t.len(),
            _ => 0,
        })
        .sum()
}

/// What one call forwarded so far, so that an update seen again (a
/// resubscription served by another replica replays the task from its
/// start) is not forwarded twice.
#[derive(Default)]
struct Forwarded {
    /// Per artifact id, the text forwarded as PARTIAL_TEXT.
    text: HashMap<String, SentText>,
    /// The answer text forwarded, in bytes: `text`'s lengths, kept as they
    /// change rather than summed again per update.
    bytes: usize,
    /// The tool calls and results forwarded, by kind and call id.
    tools: std::collections::HashSet<(EventKind, String)>,
}

impl Forwarded {
    /// What of `b`'s text was not forwarded yet, given `ev`, the update
    /// that changed it (see [`unsent`]); it counts as forwarded from here.
    fn unsent(&mut self, agent: &str, b: &BufferedArtifact, ev: &StreamResponse) -> Option<String> {
        let id = &b.artifact.artifact_id;
        let sent = self.text.entry(id.clone()).or_default();
        let before = sent.text.len();
        let parts = &b.artifact.parts;
        // A chunk appended right after what was forwarded.
        let rest = if let StreamResponse::ArtifactUpdate(u) = ev
            && u.append == Some(true)
            && parts.len() >= u.artifact.parts.len()
            && sent.parts == Some(parts.len() - u.artifact.parts.len())
        {
            let new = parts_text(&u.artifact.parts);
            sent.text.push_str(&new);
            sent.parts = Some(parts.len());
            (!new.is_empty()).then_some(new)
        } else {
            let current = parts_text(parts);
            let rest = unsent(agent, id, &mut sent.text, &current);
            sent.parts = (sent.text == current).then_some(parts.len());
            rest
        };
        self.bytes = self.bytes - before + sent.text.len();
        rest
    }
}

/// The text forwarded of one artifact.
struct SentText {
    text: String,
    /// `text` is exactly the artifact's first this many parts' text: a
    /// chunk appended after them is forwarded as it is, without reading
    /// the artifact's whole text again (which, chunk after chunk, would
    /// take time growing with the square of the answer).
    parts: Option<usize>,
}

impl Default for SentText {
    fn default() -> Self {
        Self {
            text: String::new(),
            parts: Some(0),
        }
    }
}

/// The most answer text a remote agent may send, as a model may
/// ([`crate::agent::openai::accumulate::MAX_TEXT_BYTES`]): an answer is stored and sent
/// back as every later turn's history.
const MAX_ANSWER_BYTES: usize = crate::agent::openai::accumulate::MAX_TEXT_BYTES;

/// Cancels the remote task if the run's stream is dropped while the call
/// is still going (client cancel, deadline, shutdown).
struct CancelOnDrop {
    client: A2aClient,
    relay: Arc<Mutex<Relay>>,
    agent: String,
    /// The call's span: the CancelTask request carries its traceparent.
    span: tracing::Span,
    /// The call's read bounds, which the CancelTask's answer (the task,
    /// artifacts and all) is read within too.
    limits: crate::client::a2a::jsonrpc::Limits,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let task = self
            .relay
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .task_id
            .clone();
        let Some(task) = task else {
            tracing::info!(agent = %self.agent, "remote_a2a: run dropped before the remote task had an id; nothing to cancel");
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (client, agent) = (self.client.clone(), self.agent.clone());
        rt.spawn(
            self.limits
                .scope(async move {
                    let outcome = match tokio::time::timeout(CANCEL_TIMEOUT, client.cancel(&task)).await {
                        Ok(Ok(t)) => format!("{:?}", t.status.state),
                        Ok(Err(e)) => format!("cancel failed: {}", e.message),
                        Err(_) => "cancel timed out".into(),
                    };
                    tracing::info!(%agent, task = %task, %outcome, "remote_a2a: run dropped; cancelled the remote task");
                })
                .instrument(self.span.clone()),
        );
    }
}

/// What of an artifact's whole text so far (`current`, as the client
/// buffers it: a chunk with `append` extends the artifact of its id, one
/// without replaces it) was not forwarded yet, given `sent`, what was; `sent`
/// then becomes `current`.
///
/// - A chunk that appends, or a replacement that extends what was sent (a
///   remote sending the whole text so far each time): the new suffix.
/// - A replacement that is a prefix of what was sent: nothing. This is a
///   replay (a peer that, on resubscription, sends the turn again from its
///   first chunk, as an agentd replica following the task's turn does) or a
///   repeated chunk; once the replay passes what was sent, its new suffix is
///   forwarded.
/// - A replacement that rewrites text already forwarded: nothing, now or
///   later for that artifact unless its text comes back to extend what was
///   sent. PARTIAL_TEXT cannot take text back, so forwarding the rewrite
///   would show the caller both versions run together; the FINAL_ANSWER
///   carries the artifact's final text whatever was streamed.
fn unsent(agent: &str, artifact_id: &str, sent: &mut String, current: &str) -> Option<String> {
    match current.strip_prefix(sent.as_str()) {
        Some("") => None,
        Some(rest) => {
            let rest = rest.to_owned();
            current.clone_into(sent);
            Some(rest)
        }
        None => {
            if !sent.starts_with(current) {
                tracing::debug!(%agent, artifact = %artifact_id, "remote_a2a: an artifact rewrote text already streamed; not forwarded");
            }
            None
        }
    }
}

/// The agents.v1 events of one remote update; `st`: the call's state with
/// the update applied; `forwarded`: what was forwarded so far. A tool call
/// or result whose id was forwarded already is not forwarded again.
fn map_update(
    agent: &str,
    ev: &StreamResponse,
    st: &CallState,
    forwarded: &mut Forwarded,
) -> Vec<Event> {
    match ev {
        StreamResponse::StatusUpdate(u) => {
            let Some(m) = &u.status.message else {
                return vec![];
            };
            let text = parts_text(&m.parts);
            let mut out = vec![];
            for p in &m.parts {
                let PartContent::Data(d) = &p.content else {
                    continue;
                };
                if let Some(c) = d.get("toolCall") {
                    out.push(Event::tool_call(
                        agent,
                        c.get("name").and_then(|v| v.as_str()).unwrap_or("tool"),
                        c.get("id").and_then(|v| v.as_str()).unwrap_or_default(),
                        c.get("arguments").unwrap_or(&serde_json::Value::Null),
                    ));
                } else if let Some(r) = d.get("toolResult") {
                    out.push(Event::tool_result(
                        r.get("name").and_then(|v| v.as_str()).unwrap_or("tool"),
                        r.get("id").and_then(|v| v.as_str()).unwrap_or_default(),
                        text.clone(),
                        r.get("result").unwrap_or(&serde_json::Value::Null),
                    ));
                }
            }
            if out.is_empty() && !text.is_empty() {
                tracing::debug!(%agent, state = ?u.status.state, "remote_a2a: status message not forwarded");
            }
            out.retain(|e| {
                e.tool_call_id.is_empty()
                    || forwarded.tools.insert((e.kind, e.tool_call_id.clone()))
            });
            out
        }
        // A chunk changes its artifact (found by id: a remote may send a
        // great many); a snapshot (after a recovery) may bring text whose
        // chunks were lost, in any of them.
        StreamResponse::ArtifactUpdate(u) => st
            .artifact(&u.artifact.artifact_id)
            .and_then(|b| forwarded.unsent(agent, b, ev))
            .map(|text| Event::partial(agent, text))
            .into_iter()
            .collect(),
        StreamResponse::Task(_) => st
            .artifacts
            .iter()
            .filter_map(|b| forwarded.unsent(agent, b, ev))
            .map(|text| Event::partial(agent, text))
            .collect(),
        StreamResponse::Message(_) => vec![],
    }
}

/// The answer text of a completed task: its artifacts' text, one artifact a
/// line; else the text of its final status's message (`message`, the
/// outcome's: the last status's own, which a progress note of an earlier
/// status is not, and which a completion seen only in a recovery's
/// snapshot has too).
fn answer_text(artifacts: &[a2a::Artifact], message: Option<&Message>) -> String {
    let texts: Vec<String> = artifacts
        .iter()
        .map(|a| parts_text(&a.parts))
        .filter(|t| !t.is_empty())
        .collect();
    if texts.is_empty() {
        message.map(|m| parts_text(&m.parts)).unwrap_or_default()
    } else {
        texts.join("\n")
    }
}

/// The sanitised agent error for a failed call; the remote's text is logged.
fn call_error(agent: &str, e: CallError) -> AgentError {
    match e {
        CallError::Task {
            state,
            task_id,
            message,
            ..
        } => {
            tracing::warn!(%agent, task = %task_id, ?state, remote_message = %message, "remote_a2a: the remote task did not complete");
            match state {
                TaskState::Rejected => {
                    AgentError::FailedPrecondition("the remote A2A agent rejected the task".into())
                }
                TaskState::Canceled => unavailable("the remote A2A agent cancelled the task"),
                _ => unavailable("the remote A2A agent failed the task"),
            }
        }
        CallError::Deadline { task_id, .. } => {
            tracing::warn!(%agent, task = ?task_id, "remote_a2a: call_timeout passed; the remote task was cancelled");
            unavailable(
                "the remote A2A agent did not finish within call_timeout; its task was cancelled",
            )
        }
        CallError::LostBeforeTask { cause } => {
            tracing::warn!(%agent, %cause, "remote_a2a: stream lost before the task had an id");
            unavailable("the connection to the remote A2A agent was lost")
        }
        CallError::Unrecoverable { task_id, cause, .. } => {
            tracing::warn!(%agent, task = %task_id, %cause, "remote_a2a: the remote task could not be recovered");
            unavailable("the remote A2A agent stopped answering; its task was cancelled")
        }
        CallError::TooLarge {
            task_id,
            limit,
            cancel,
        } => {
            tracing::warn!(%agent, task = ?task_id, limit, %cancel, "remote_a2a: the remote task's artifacts outgrew the limit");
            AgentError::FailedPrecondition(format!(
                "the remote A2A agent's answer is larger than {} MiB",
                limit >> 20
            ))
        }
        CallError::TaskLost { task_id, .. } => {
            tracing::warn!(%agent, task = %task_id, "remote_a2a: the stream was lost and the remote agent no longer knows the task");
            unavailable(
                "the connection to the remote A2A agent was lost and it no longer knows the task",
            )
        }
        CallError::MessageTooLarge { task_id, cause, .. } => {
            tracing::warn!(%agent, task = ?task_id, %cause, "remote_a2a: a message from the remote agent is larger than its binding carries; cancelling its task");
            AgentError::FailedPrecondition(
                "a message from the remote A2A agent is larger than its binding lets this server receive".into(),
            )
        }
        CallError::Refused(e) => {
            tracing::warn!(%agent, code = e.code, error = %e.message, "remote_a2a: the remote agent refused the call");
            if e.code == a2a::error_code::INTERNAL_ERROR {
                unavailable("the remote A2A agent cannot be reached")
            } else if e.code == crate::a2a::auth::UNAUTHENTICATED_CODE {
                AgentError::FailedPrecondition(
                    "the remote A2A agent refused this server's credentials".into(),
                )
            } else {
                AgentError::FailedPrecondition("the remote A2A agent refused the request".into())
            }
        }
    }
}

impl Agent for RemoteA2aAgent {
    fn name(&self) -> &str {
        &self.shared.cfg.name
    }

    fn description(&self) -> &str {
        &self.shared.cfg.description
    }

    fn run(&self, ctx: RunContext, input: String) -> EventStream {
        let shared = self.shared.clone();
        Box::pin(async_stream::try_stream! {
            let agent = shared.cfg.name.clone();
            // The turn's deadline: call_timeout, within the run's own. The
            // connect (on a first run) counts against it too.
            let left = ctx.deadline.saturating_duration_since(tokio::time::Instant::now());
            let turn_deadline = tokio::time::Instant::now() + shared.cfg.call_timeout.min(left);
            let client = shared.client(turn_deadline).await?.clone();
            // From the notes, not the history: a large answer that pushed
            // the turns before it out of the history's byte budget does not
            // end the conversation.
            let conversation = Conversation::of(&agent, &ctx.notes);
            let metadata = shared.cfg.remote_agent.as_ref().map(|a| {
                [(crate::a2a::executor::AGENT_METADATA_KEY.to_owned(), serde_json::Value::String(a.clone()))]
                    .into_iter()
                    .collect()
            });
            let message = Message {
                context_id: conversation.context_id.clone(),
                task_id: conversation.waiting_task.clone(),
                metadata,
                ..Message::new(Role::User, vec![Part::text(input)])
            };
            let opts = CallOptions {
                idle_timeout: shared.cfg.idle_timeout,
                deadline: turn_deadline.saturating_duration_since(tokio::time::Instant::now()),
                // Text past MAX_ANSWER_BYTES stops the call already; this
                // bounds what else (data, files) the client buffers.
                max_artifact_bytes: 4 * MAX_ANSWER_BYTES,
                ..CallOptions::default()
            };
            let relay = Arc::new(Mutex::new(Relay::default()));
            let ready = Arc::new(Notify::new());
            // Its traceparent goes with every request of the call.
            let span = crate::telemetry::trace::invoke_agent_span(&agent);
            let mut guard = CancelOnDrop {
                client: client.clone(),
                relay: relay.clone(),
                agent: agent.clone(),
                span: span.clone(),
                limits: crate::client::a2a::jsonrpc::Limits::for_artifacts(opts.max_artifact_bytes),
                armed: true,
            };
            let mut listener = {
                let (relay, ready, agent, span) = (relay.clone(), ready.clone(), agent.clone(), span.clone());
                move |ev: &StreamResponse, st: &CallState| {
                    let mut r = relay.lock().unwrap_or_else(|e| e.into_inner());
                    if r.task_id.is_none() {
                        r.task_id = st.task_id.clone();
                        if let Some(task) = &r.task_id {
                            span.record("a2a.task.id", task.as_str());
                        }
                    }
                    if let StreamResponse::StatusUpdate(_) | StreamResponse::Task(_) = ev {
                        r.status_bytes = st.status_message.as_ref().map_or(0, |m| text_bytes(&m.parts));
                    }
                    r.answer.update(ev, st);
                    let events = map_update(&agent, ev, st, &mut r.forwarded);
                    if !events.is_empty() {
                        r.events.extend(events);
                        ready.notify_one();
                    }
                    if r.answer_bytes() > MAX_ANSWER_BYTES {
                        r.too_large = true;
                        return Control::StopWithArtifacts;
                    }
                    Control::Continue
                }
            };
            let result = {
                let call = client.send(message, &opts, Some(&mut listener)).instrument(span.clone());
                tokio::pin!(call);
                // Poll the call only while nothing waits to be sent: a slow
                // reader back-pressures the remote stream instead of
                // filling a buffer.
                loop {
                    let pending: Vec<Event> = relay.lock().unwrap_or_else(|e| e.into_inner()).events.drain(..).collect();
                    for e in pending {
                        yield e;
                    }
                    tokio::select! {
                        r = &mut call => break r,
                        _ = ready.notified() => {}
                    }
                }
            };
            let too_large = relay.lock().unwrap_or_else(|e| e.into_inner()).too_large;
            if too_large {
                // Still armed: dropped, the guard cancels the remote task.
                tracing::warn!(%agent, "remote_a2a: the remote answer outgrew the answer limit; cancelling its task");
                Err(answer_too_large())?;
            }
            // The call is over. The client cancelled the task itself where
            // it had to (deadline, recovery given up, artifacts past its
            // limit); the guard stays armed where the task was left running
            // with no one to follow it (see `abandoned`).
            guard.armed = abandoned(&result);
            if !guard.armed {
                guard.span = tracing::Span::none();
            }
            if result.is_err() {
                span.record("otel.status_code", "error");
            }
            drop(span);
            let pending: Vec<Event> = relay.lock().unwrap_or_else(|e| e.into_inner()).events.drain(..).collect();
            for e in pending {
                yield e;
            }
            // What the final answer records for the session's next turn
            // ([`RemoteTurn`]): the context it continues (this turn's, else
            // the one it was sent in), and the task if it waits for input.
            // A turn that ends in an error records nothing.
            let recorded = |context_id: Option<String>, task_id: Option<String>, state: Option<&str>| {
                RemoteTurn {
                    context_id: context_id.filter(|c| !c.is_empty()).or_else(|| conversation.context_id.clone()),
                    task_id,
                    state: state.map(str::to_owned),
                }
                .payload()
            };
            match result {
                Ok(Outcome::Completed { context_id, artifacts, incomplete, task_id, message }) => {
                    if incomplete {
                        tracing::warn!(%agent, task = %task_id, "remote_a2a: the remote answer lost chunks in transit");
                        Err(unavailable("the remote A2A agent's answer was cut in transit"))?;
                    }
                    // The task has ended: nothing to cancel if the answer
                    // is too large.
                    let answer = within_limit(&agent, answer_text(&artifacts, message.as_ref()))?;
                    yield Event {
                        payload_json: recorded(Some(context_id), Some(task_id), Some(COMPLETED)),
                        ..Event::final_answer(&agent, answer)
                    };
                }
                Ok(Outcome::Message(m)) => {
                    let answer = within_limit(&agent, parts_text(&m.parts))?;
                    yield Event {
                        payload_json: recorded(m.context_id, None, None),
                        ..Event::final_answer(&agent, answer)
                    };
                }
                Ok(Outcome::Waiting { state, task_id, context_id, message, .. }) => {
                    if state == TaskState::AuthRequired {
                        tracing::warn!(%agent, task = %task_id, "remote_a2a: the remote agent asks for authorization");
                        Err(AgentError::FailedPrecondition("the remote A2A agent asks for an authorization this server cannot give".into()))?;
                    }
                    let question = message.map(|m| parts_text(&m.parts)).unwrap_or_default();
                    let text = if question.is_empty() {
                        "The remote agent needs more input.".to_owned()
                    } else {
                        format!("The remote agent needs more input: {question}")
                    };
                    // A question too large to answer: the task would wait
                    // for ever; the guard cancels it.
                    guard.armed = true;
                    let text = within_limit(&agent, text)?;
                    guard.armed = false;
                    yield Event {
                        payload_json: recorded(Some(context_id), Some(task_id), Some(INPUT_REQUIRED)),
                        ..Event::final_answer(&agent, text)
                    };
                }
                Ok(Outcome::Stopped { .. }) => {
                    Err(AgentError::Unexpected(anyhow::anyhow!("the call stopped without a listener asking")))?;
                }
                Err(e) => {
                    Err(call_error(&agent, e))?;
                }
            }
        })
    }
}

/// Whether the remote task may still run with no one to follow it once
/// the call has ended with `result`, so that the run's guard cancels it: a
/// refusal (recovering, the remote refused GetTask) or a message too large
/// to receive leaves it running, and a task that waits for an authorization
/// this server cannot give would wait for ever. Every other end has the
/// task over, waiting on purpose (INPUT_REQUIRED: the session's next turn
/// replies to it), or cancelled by the client already.
fn abandoned(result: &Result<Outcome, CallError>) -> bool {
    matches!(
        result,
        Err(CallError::Refused(_) | CallError::MessageTooLarge { .. })
            | Ok(Outcome::Waiting {
                state: TaskState::AuthRequired,
                ..
            })
    )
}

fn answer_too_large() -> AgentError {
    AgentError::FailedPrecondition(format!(
        "the remote A2A agent's answer is larger than {} MiB",
        MAX_ANSWER_BYTES >> 20
    ))
}

/// `answer`, if it is within [`MAX_ANSWER_BYTES`]. Checked whole, before
/// it is yielded: the listener counts only what it sees, and an answer may
/// come from what it does not (a completion, or a rewrite, seen only in a
/// recovery's snapshot; the final status's message).
fn within_limit(agent: &str, answer: String) -> Result<String, AgentError> {
    if answer.len() > MAX_ANSWER_BYTES {
        tracing::warn!(%agent, bytes = answer.len(), "remote_a2a: the remote answer is larger than the answer limit");
        return Err(answer_too_large());
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    use a2a::{Artifact, TaskArtifactUpdateEvent, TaskStatus, TaskStatusUpdateEvent};

    /// One update mapped on its own (no earlier update).
    fn map_one(agent: &str, ev: &StreamResponse) -> Vec<Event> {
        let mut st = CallState::new();
        st.apply(ev);
        map_update(agent, ev, &st, &mut Forwarded::default())
    }

    fn status(parts: Vec<Part>) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: TaskStatus {
                state: TaskState::Working,
                message: Some(Message::new(Role::Agent, parts)),
                timestamp: None,
            },
            metadata: None,
        })
    }

    #[test]
    fn tool_data_parts_become_tool_events_and_plain_status_text_is_not_forwarded() {
        let call = status(vec![
            Part::text("calling lookup_order"),
            Part::data(
                serde_json::json!({"toolCall": {"name": "lookup_order", "id": "c1", "arguments": {"order_id": "1187"}}}),
            ),
        ]);
        let e = map_one("orders", &call);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].kind, super::super::EventKind::ToolCall);
        assert_eq!(
            (e[0].tool_name.as_str(), e[0].tool_call_id.as_str()),
            ("lookup_order", "c1")
        );
        assert_eq!(e[0].payload_json, r#"{"order_id":"1187"}"#);
        let result = status(vec![
            Part::text("order 1187 is shipped"),
            Part::data(
                serde_json::json!({"toolResult": {"name": "lookup_order", "id": "c1", "result": {"found": true}}}),
            ),
        ]);
        let e = map_one("orders", &result);
        assert_eq!(e[0].kind, super::super::EventKind::ToolResult);
        assert_eq!(e[0].text, "order 1187 is shipped");
        assert!(map_one("orders", &status(vec![Part::text("thinking")])).is_empty());
    }

    #[test]
    fn tool_events_seen_again_in_a_replay_are_not_forwarded_twice() {
        // A resubscription served by another replica replays the task from
        // its start.
        let call = status(vec![Part::data(
            serde_json::json!({"toolCall": {"name": "lookup_order", "id": "c1", "arguments": {}}}),
        )]);
        let result = status(vec![
            Part::text("shipped"),
            Part::data(
                serde_json::json!({"toolResult": {"name": "lookup_order", "id": "c1", "result": {}}}),
            ),
        ]);
        let second = status(vec![Part::data(
            serde_json::json!({"toolCall": {"name": "lookup_order", "id": "c2", "arguments": {}}}),
        )]);
        let (mut st, mut forwarded) = (CallState::new(), Forwarded::default());
        let mut seen = Vec::new();
        for u in [&call, &result, &call, &result, &second] {
            st.apply(u);
            seen.extend(
                map_update("x", u, &st, &mut forwarded)
                    .into_iter()
                    .map(|e| (e.kind, e.tool_call_id)),
            );
        }
        assert_eq!(
            seen,
            [
                (EventKind::ToolCall, "c1".to_owned()),
                (EventKind::ToolResult, "c1".to_owned()),
                (EventKind::ToolCall, "c2".to_owned()),
            ]
        );
    }

    #[test]
    fn artifact_chunks_are_partial_text_and_the_answer_joins_artifacts() {
        let chunk = chunk("a", "Hel", false);
        let e = map_one("x", &chunk);
        assert_eq!(
            (e[0].kind, e[0].text.as_str()),
            (super::super::EventKind::PartialText, "Hel")
        );
        let StreamResponse::ArtifactUpdate(u) = chunk else {
            unreachable!()
        };
        let mut b = u.artifact.clone();
        b.parts = vec![Part::text("two")];
        let said = Message::new(Role::Agent, vec![Part::text("from status")]);
        assert_eq!(answer_text(&[u.artifact, b], Some(&said)), "Hel\ntwo");
        assert_eq!(answer_text(&[], Some(&said)), "from status");
        assert_eq!(answer_text(&[], None), "");
    }

    /// Artifact `id`, holding `text`.
    fn artifact(id: &str, text: &str) -> Artifact {
        Artifact {
            artifact_id: id.into(),
            name: None,
            description: None,
            parts: vec![Part::text(text)],
            metadata: None,
            extensions: None,
        }
    }

    fn chunk(id: &str, text: &str, append: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            artifact: artifact(id, text),
            append: Some(append),
            last_chunk: Some(false),
            metadata: None,
        })
    }

    /// A snapshot of task t, working, with `artifacts`.
    fn working(artifacts: Vec<Artifact>) -> a2a::Task {
        a2a::Task {
            id: "t".into(),
            context_id: "c".into(),
            status: TaskStatus {
                state: TaskState::Working,
                message: None,
                timestamp: None,
            },
            artifacts: Some(artifacts),
            history: None,
            metadata: None,
        }
    }

    /// The partial texts of `updates`, mapped in order on one call.
    fn partials(updates: &[StreamResponse]) -> Vec<String> {
        let (mut st, mut forwarded) = (CallState::new(), Forwarded::default());
        updates
            .iter()
            .flat_map(|u| {
                st.apply(u);
                map_update("x", u, &st, &mut forwarded)
            })
            .map(|e| e.text)
            .collect()
    }

    #[test]
    fn only_text_not_forwarded_yet_is_partial_text_per_artifact() {
        // Replacements that extend: their new suffix; appends: themselves;
        // per artifact id.
        assert_eq!(
            partials(&[
                chunk("a", "Hel", false),
                chunk("b", "x", false),
                chunk("a", "Hello", false),
                chunk("b", "y", true),
                chunk("a", "!", true),
            ]),
            ["Hel", "x", "lo", "y", "!"]
        );
        // A replay from the first chunk: nothing until it passes what was
        // sent, then the rest; a repeated chunk: nothing.
        assert_eq!(
            partials(&[
                chunk("a", "Hel", false),
                chunk("a", "lo", true),
                chunk("a", "Hel", false),
                chunk("a", "lo", true),
                chunk("a", "lo", false),
                chunk("a", "Hello", false),
                chunk("a", " world", true),
            ]),
            ["Hel", "lo", " world"]
        );
        // A rewrite of text already sent: not forwarded, nor what extends
        // it, until the text extends what was sent again.
        assert_eq!(
            partials(&[
                chunk("a", "Hello wrld", false),
                chunk("a", "Hello world", false),
                chunk("a", "!", true),
                chunk("a", "Hello wrld, bye", false),
            ]),
            ["Hello wrld", ", bye"]
        );
    }

    /// The running totals (text forwarded, text the artifacts hold) are
    /// what summing again would give, after appends, replacements,
    /// rewrites, new ids and snapshots.
    #[test]
    fn the_answers_running_totals_match_what_they_count() {
        let snapshot = working(vec![artifact("a", "Hello there"), artifact("b", "xyz")]);
        let (mut st, mut forwarded, mut answer) =
            (CallState::new(), Forwarded::default(), Answer::default());
        let mut partials = Vec::new();
        for u in [
            chunk("a", "Hel", false),
            chunk("a", "lo", true),
            chunk("b", "x", false),
            chunk("a", "Help", false),
            chunk("a", "!", true),
            chunk("c", "new", true),
            StreamResponse::Task(snapshot),
            chunk("a", " you", true),
            chunk("b", "", false),
        ] {
            st.apply(&u);
            answer.update(&u, &st);
            partials.extend(
                map_update("x", &u, &st, &mut forwarded)
                    .into_iter()
                    .map(|e| e.text),
            );
            let sent: usize = forwarded.text.values().map(|s| s.text.len()).sum();
            assert_eq!(forwarded.bytes, sent, "after {u:?}");
            let held: usize = st.artifacts.iter().map(|b| b.text().len()).sum();
            assert_eq!(answer.bytes, held, "after {u:?}");
        }
        assert_eq!(partials, ["Hel", "lo", "x", "new", " there", "yz", " you"]);
        assert_eq!(st.artifact("a").unwrap().text(), "Hello there you");
    }

    #[test]
    fn a_snapshot_after_a_gap_forwards_the_text_whose_chunks_were_lost() {
        let snapshot = working(vec![artifact("a", "Hello wor")]);
        assert_eq!(
            partials(&[
                chunk("a", "Hel", false),
                StreamResponse::Task(snapshot),
                chunk("a", "ld", true),
            ]),
            ["Hel", "lo wor", "ld"]
        );
    }

    #[test]
    fn remote_failures_are_sanitised() {
        let e = call_error(
            "x",
            CallError::Task {
                state: TaskState::Failed,
                task_id: "t".into(),
                message: "secret prompt echo".into(),
                artifacts: vec![],
            },
        );
        assert!(matches!(&e, AgentError::Unavailable { .. }), "{e:?}");
        assert!(!e.to_string().contains("secret"), "{e}");
        let e = call_error(
            "x",
            CallError::Task {
                state: TaskState::Rejected,
                task_id: "t".into(),
                message: "no".into(),
                artifacts: vec![],
            },
        );
        assert!(matches!(e, AgentError::FailedPrecondition(_)));
    }

    /// A prior turn of `agent` whose final answer carried `payload`.
    fn prior(agent: &str, payload: &str) -> PriorTurn {
        PriorTurn {
            agent: agent.into(),
            answer_payload: payload.into(),
            ..PriorTurn::default()
        }
    }

    fn recorded(context: &str, task: Option<&str>, state: Option<&str>) -> String {
        RemoteTurn {
            context_id: Some(context.into()),
            task_id: task.map(Into::into),
            state: state.map(Into::into),
        }
        .payload()
    }

    #[test]
    fn a_turns_record_is_its_final_answers_payload_and_reads_back() {
        let waiting = recorded("c1", Some("t1"), Some(INPUT_REQUIRED));
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&waiting).unwrap(),
            serde_json::json!({"a2a": {"context_id": "c1", "task_id": "t1", "state": "input_required"}})
        );
        assert_eq!(
            RemoteTurn::parse(&recorded("c1", None, None)),
            Some(RemoteTurn {
                context_id: Some("c1".into()),
                ..RemoteTurn::default()
            })
        );
        assert_eq!(
            RemoteTurn::parse(&recorded("c1", None, None))
                .unwrap()
                .payload(),
            r#"{"a2a":{"context_id":"c1"}}"#
        );
        for other in ["", "{}", "not json", r#"{"order":"1187"}"#] {
            assert_eq!(RemoteTurn::parse(other), None, "{other}");
        }
    }

    #[test]
    fn the_conversation_is_read_from_this_agents_latest_turns() {
        let me = "orders";
        assert_eq!(Conversation::of(me, &[]), Conversation::default());
        let waiting = prior(me, &recorded("c1", Some("t1"), Some(INPUT_REQUIRED)));
        let conversation = |history: &[PriorTurn]| {
            let c = Conversation::of(me, history);
            (c.context_id, c.waiting_task)
        };
        let c1 = || Some("c1".to_owned());
        // The newest turn waits: this one replies to its task.
        assert_eq!(
            conversation(std::slice::from_ref(&waiting)),
            (c1(), Some("t1".into()))
        );
        // Other agents' turns in between change nothing, even one whose
        // payload looks like a record.
        let theirs = [
            prior("other", &recorded("c9", Some("t9"), Some(INPUT_REQUIRED))),
            prior("demo", ""),
        ];
        let mut history = vec![waiting.clone()];
        history.extend(theirs.iter().cloned());
        assert_eq!(conversation(&history), (c1(), Some("t1".into())));
        // A later turn of this agent that failed (no payload): the context
        // goes on, the task no longer waits for this session.
        history.push(prior(me, ""));
        assert_eq!(conversation(&history), (c1(), None));
        // Nor once a later turn answered.
        let answered = [
            waiting.clone(),
            prior(me, &recorded("c1", Some("t1"), Some(COMPLETED))),
        ];
        assert_eq!(conversation(&answered), (c1(), None));
        // The newest context wins; a Message answer records one too.
        let moved = [
            prior(me, &recorded("c0", Some("t0"), Some(COMPLETED))),
            prior(me, &recorded("c2", None, None)),
        ];
        assert_eq!(conversation(&moved), (Some("c2".into()), None));
        // Only other agents' turns: a new conversation.
        assert_eq!(conversation(&theirs), (None, None));
    }

    #[test]
    fn a_token_is_never_shown() {
        assert_eq!(
            format!("{:?}", Token("tok-0123456789abcdef".into())),
            "Token(..)"
        );
    }
}
