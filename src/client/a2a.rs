//! A2A 1.0 streaming client that survives drops: one [`A2aClient`] per
//! remote agent (reused across calls), one [`CallState`] per call.
//!
//! The recipe:
//! - The task and context ids are captured from the first event that has
//!   them. Artifacts are buffered by `artifactId`: `append` extends, anything
//!   else replaces; `lastChunk` marks one ready. One source only: a task
//!   snapshot's artifacts *replace* the buffer, they are never appended to it.
//! - A call ends on a direct Message, a terminal state, or INPUT_REQUIRED /
//!   AUTH_REQUIRED (the agent waits; the outcome has the ids to reply with).
//!   FAILED, REJECTED and CANCELED are errors, never an empty success.
//! - A dropped stream (an error, an end without a final state, or no event
//!   for longer than the idle timeout) is recovered: with no task id yet the
//!   call fails (resending would start a second task); otherwise GetTask
//!   gives the authoritative snapshot and, if the task is still running,
//!   SubscribeToTask resumes it, with bounded exponential backoff (the
//!   budget counts recoveries in a row that brought no update). A task the
//!   remote no longer knows ends the call at once. When chunks may have
//!   been lost and the snapshot cannot restore them (a remote whose
//!   snapshots leave out artifacts already seen), the result is flagged
//!   `incomplete` rather than silently truncated. What the task sends
//!   between the snapshot and the resubscription is covered by the Task a
//!   subscription begins with (A2A 1.0 requires it); after one that does
//!   not begin so, the result is flagged `incomplete` too.
//!   A GetTask error that retrying cannot fix (the remote refuses our
//!   credentials or the request) ends the call at once, and the task is
//!   left running. A remote that refuses SubscribeToTask so while GetTask
//!   shows the task running (it does not offer streaming to us) has the
//!   task followed by GetTask alone, with backoff, to its end or the
//!   deadline.
//! - A message larger than the binding receives (gRPC: 4 MiB, which its
//!   client cannot raise; JSON-RPC: one event or answer past twice
//!   `max_artifact_bytes` plus 1 MiB, see [`jsonrpc::Limits`]) ends the
//!   call at once, the task left running: every retry would bring it again.
//! - In a reply turn (a message into a task that waited), the artifacts the
//!   task had before it (the Task its stream begins with; else a GetTask
//!   before sending) are remembered, so that a snapshot brings back only
//!   what this turn made, as its stream would have.
//! - Errors never show the credentials an endpoint's URL carries (its
//!   password, its query's values): the SDK's transport errors quote the
//!   URL.
//! - Past the deadline, or when recovery gives up, the remote task is
//!   cancelled (CancelTask) and the state it reached is logged; the error
//!   says whether the cancel was sent and acknowledged.
//! - A [`Listener`] sees every update and may stop the call early, with a
//!   response of its own or the artifacts so far. Stopping only ends *our*
//!   stream: the remote task goes on (cancel it with [`A2aClient::cancel`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use a2a::{
    A2AError, Artifact, CancelTaskRequest, GetTaskRequest, Message, Part, PartContent, Role,
    SendMessageRequest, StreamResponse, SubscribeToTaskRequest, Task, TaskState,
};
use a2a_client::middleware::CallInterceptor;
use a2a_client::{A2AClient, A2AClientFactory, Transport};
use futures::StreamExt;
use futures::stream::BoxStream;
use thiserror::Error;
use tokio::time::Instant;

pub mod jsonrpc;

type Stream = BoxStream<'static, Result<StreamResponse, A2AError>>;

/// What every call sends besides its request: the current span's trace
/// context, and `authorization: Bearer <token>` when a token is given.
fn interceptors(token: Option<&str>) -> Vec<Arc<dyn CallInterceptor>> {
    let mut v: Vec<Arc<dyn CallInterceptor>> = vec![Arc::new(TraceContext)];
    if let Some(t) = token {
        v.push(Arc::new(a2a_client::auth::AuthInterceptor::bearer(t)));
    }
    v
}

/// Sends the current span's `traceparent`, so a call made inside a span
/// (a remote agent's turn: [`crate::telemetry::trace::invoke_agent_span`])
/// continues the trace on the remote.
struct TraceContext;

#[async_trait::async_trait]
impl CallInterceptor for TraceContext {
    async fn before(
        &self,
        _method: &str,
        params: &mut a2a_client::transport::ServiceParams,
    ) -> Result<(), A2AError> {
        crate::telemetry::trace::inject_params(params);
        Ok(())
    }
}

/// Which A2A binding to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Binding {
    Jsonrpc,
    Grpc,
}

impl Binding {
    fn protocol(self) -> &'static str {
        match self {
            Binding::Jsonrpc => a2a::TRANSPORT_PROTOCOL_JSONRPC,
            Binding::Grpc => a2a::TRANSPORT_PROTOCOL_GRPC,
        }
    }
}

/// Per-call limits.
#[derive(Debug, Clone)]
pub struct CallOptions {
    /// No event for this long counts as a drop.
    pub idle_timeout: Duration,
    /// The whole call, recoveries included; past it the task is cancelled.
    pub deadline: Duration,
    /// Recoveries (snapshot + resubscribe) in a row that bring no update
    /// before giving up; a resubscribed stream that brings updates starts
    /// the count again.
    pub max_recoveries: u32,
    /// First backoff before a recovery; doubles each time up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// The most a call buffers of artifacts: their content (text, data,
    /// file bytes) and everything kept with it (ids, names, metadata, and
    /// each part's and artifact's own size); past it the call ends with
    /// [`CallError::TooLarge`] and the remote task is cancelled. Over
    /// JSON-RPC it bounds what one event or answer may be too, with room to
    /// spare ([`jsonrpc::Limits::for_artifacts`]).
    pub max_artifact_bytes: usize,
}

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(120),
            max_recoveries: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_artifact_bytes: 64 << 20,
        }
    }
}

/// One artifact as buffered so far.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferedArtifact {
    pub artifact: Artifact,
    /// Its last chunk arrived (or it came whole, from a task snapshot).
    pub ready: bool,
}

impl BufferedArtifact {
    /// The artifact's text parts, concatenated.
    pub fn text(&self) -> String {
        parts_text(&self.artifact.parts)
    }
}

/// What a part costs the buffer: its content (text and file bytes, a
/// file's URL, data as JSON), its metadata, filename and media type, and the
/// part itself. Everything kept counts: a server must not grow the buffer
/// for free with parts that carry no content (an empty text with metadata,
/// appended forever).
fn part_size(p: &Part) -> usize {
    let content = match &p.content {
        PartContent::Text(t) | PartContent::Url(t) => t.len(),
        PartContent::Raw(b) => b.len(),
        PartContent::Data(v) => json_size(v),
    };
    size_of::<Part>()
        + content
        + p.filename.as_ref().map_or(0, String::len)
        + p.media_type.as_ref().map_or(0, String::len)
        + p.metadata.as_ref().map_or(0, json_size)
}

/// What an artifact costs the buffer: its parts ([`part_size`]), its id,
/// name, description, metadata and extensions, and its own slot (so that
/// new ids without parts are not free either).
fn artifact_size(a: &Artifact) -> usize {
    size_of::<BufferedArtifact>()
        + a.artifact_id.len()
        + a.name.as_ref().map_or(0, String::len)
        + a.description.as_ref().map_or(0, String::len)
        + a.metadata.as_ref().map_or(0, json_size)
        + a.extensions
            .iter()
            .flatten()
            .map(|e| size_of::<String>() + e.len())
            .sum::<usize>()
        + a.parts.iter().map(part_size).sum::<usize>()
}

/// The length of `v` as JSON, counted as it is written rather than built.
fn json_size(v: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing to a counter cannot fail; a value that cannot be written
    // counts what was written of it.
    let _ = serde_json::to_writer(&mut n, v);
    n.0
}

/// The text parts of `parts`, concatenated.
pub fn parts_text(parts: &[Part]) -> String {
    parts
        .iter()
        .filter_map(|p| match &p.content {
            PartContent::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// What one call knows about its task.
#[derive(Debug, Clone)]
pub struct CallState {
    pub task_id: Option<String>,
    pub context_id: Option<String>,
    /// Artifacts by id, in the order they first appeared.
    pub artifacts: Vec<BufferedArtifact>,
    pub last_state: Option<TaskState>,
    /// The latest status message (e.g. why a task failed).
    pub status_message: Option<Message>,
    pub last_event_at: Instant,
    /// Chunks may have been lost and no snapshot restored them.
    pub incomplete: bool,
    /// Recoveries so far.
    pub recoveries: u32,
    /// Status, artifact and message events applied so far (snapshots not
    /// counted).
    updates: u64,
    /// What the buffered artifacts cost ([`artifact_size`]), kept as they
    /// change.
    artifact_bytes: usize,
    /// Where each artifact id is in `artifacts`: an update finds its
    /// artifact without a scan (a server may send a great many ids).
    index: HashMap<String, usize>,
    /// In a reply turn (a message into a task that waited), the artifacts
    /// the task had before the turn, by id: a snapshot holds them too, and
    /// those still as they were, and not streamed in this turn, are not
    /// this turn's.
    before_turn: HashMap<String, Artifact>,
    /// A gap in the stream that no snapshot has covered yet.
    gap: bool,
    /// The remote's task snapshots were seen to leave out artifacts the
    /// task has: they cannot restore what a gap lost.
    bare_snapshots: bool,
    /// What the next event is, if it is the first of a stream that
    /// matters.
    lead: Lead,
}

/// The first event of a stream, where a Task means more than a snapshot.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lead {
    Any,
    /// A reply turn's stream: a Task is the task as the turn began, whose
    /// artifacts are earlier turns'.
    Reply,
    /// A resubscription after a recovery's snapshot: a Task covers the gap
    /// since that snapshot; anything else leaves it uncovered.
    Resubscribed,
}

impl CallState {
    pub(crate) fn new() -> Self {
        Self {
            task_id: None,
            context_id: None,
            artifacts: Vec::new(),
            last_state: None,
            status_message: None,
            last_event_at: Instant::now(),
            incomplete: false,
            recoveries: 0,
            updates: 0,
            artifact_bytes: 0,
            index: HashMap::new(),
            before_turn: HashMap::new(),
            gap: false,
            bare_snapshots: false,
            lead: Lead::Any,
        }
    }

    /// The buffered artifact of id `id`, found without a scan.
    pub fn artifact(&self, id: &str) -> Option<&BufferedArtifact> {
        self.index.get(id).map(|&i| &self.artifacts[i])
    }

    fn ids(&mut self, task_id: &str, context_id: &str) {
        if self.task_id.is_none() && !task_id.is_empty() {
            self.task_id = Some(task_id.to_owned());
        }
        if self.context_id.is_none() && !context_id.is_empty() {
            self.context_id = Some(context_id.to_owned());
        }
    }

    /// Remembers the artifacts a task had before this turn (a reply into
    /// it). More than a call may buffer is not remembered: holding it would
    /// double what the limit bounds.
    fn remember_earlier_turns(&mut self, artifacts: Vec<Artifact>, limit: usize) {
        if artifacts.iter().map(artifact_size).sum::<usize>() <= limit {
            self.before_turn = artifacts
                .into_iter()
                .map(|a| (a.artifact_id.clone(), a))
                .collect();
        }
    }

    /// Whether a snapshot's artifact is an earlier turn's: the task had it
    /// before this turn, as it is now, and this turn did not stream it.
    fn earlier_turns(&self, a: &Artifact) -> bool {
        !self.index.contains_key(&a.artifact_id) && self.before_turn.get(&a.artifact_id) == Some(a)
    }

    /// Applies a task snapshot: its state, and its artifacts, which are
    /// authoritative and replace the buffer (less earlier turns', in a reply
    /// turn: the outcome is this turn's, as its stream would have made it).
    /// A snapshot without artifacts leaves the buffer alone: if artifacts
    /// were seen already, the remote leaves them out of its snapshots, and a
    /// gap it was to cover stays uncovered (the result is incomplete); if
    /// none were, the task has none yet and the gap lost nothing.
    fn apply_task(&mut self, task: &Task) {
        self.ids(&task.id, &task.context_id);
        self.last_state = Some(task.status.state.clone());
        // The status's own message: an earlier status's is not this one's.
        self.status_message = task.status.message.clone();
        if let Some(artifacts) = task.artifacts.as_ref().filter(|a| !a.is_empty()) {
            let kept: Vec<BufferedArtifact> = artifacts
                .iter()
                .filter(|a| !self.earlier_turns(a))
                .map(|a| BufferedArtifact {
                    artifact: a.clone(),
                    ready: true,
                })
                .collect();
            self.artifacts = kept;
            self.index = self
                .artifacts
                .iter()
                .enumerate()
                .map(|(i, b)| (b.artifact.artifact_id.clone(), i))
                .collect();
            self.artifact_bytes = self
                .artifacts
                .iter()
                .map(|b| artifact_size(&b.artifact))
                .sum();
            self.incomplete = false;
            self.gap = false;
        } else if !self.artifacts.is_empty() {
            self.bare_snapshots = true;
            if self.gap {
                self.incomplete = true;
            }
        } else if self.bare_snapshots {
            if self.gap {
                self.incomplete = true;
            }
        } else {
            self.gap = false;
        }
    }

    pub(crate) fn apply(&mut self, event: &StreamResponse) {
        self.last_event_at = Instant::now();
        if !matches!(event, StreamResponse::Task(_)) {
            self.updates += 1;
        }
        match event {
            StreamResponse::Task(task) => self.apply_task(task),
            StreamResponse::StatusUpdate(u) => {
                self.ids(&u.task_id, &u.context_id);
                self.last_state = Some(u.status.state.clone());
                self.status_message = u.status.message.clone();
            }
            StreamResponse::ArtifactUpdate(u) => {
                self.ids(&u.task_id, &u.context_id);
                let ready = u.last_chunk.unwrap_or(false);
                let existing = self.index.get(&u.artifact.artifact_id).copied();
                match (existing, u.append.unwrap_or(false)) {
                    (Some(i), true) => {
                        // Only the parts are kept of an append.
                        let b = &mut self.artifacts[i];
                        b.artifact.parts.extend(u.artifact.parts.iter().cloned());
                        b.ready = ready;
                        self.artifact_bytes +=
                            u.artifact.parts.iter().map(part_size).sum::<usize>();
                    }
                    (Some(i), false) => {
                        let b = &mut self.artifacts[i];
                        self.artifact_bytes = self
                            .artifact_bytes
                            .saturating_sub(artifact_size(&b.artifact))
                            + artifact_size(&u.artifact);
                        *b = BufferedArtifact {
                            artifact: u.artifact.clone(),
                            ready,
                        }
                    }
                    (None, append) => {
                        self.artifact_bytes += artifact_size(&u.artifact);
                        // An append to an artifact we never saw: its start
                        // was lost.
                        if append {
                            self.incomplete = true;
                        }
                        self.index
                            .insert(u.artifact.artifact_id.clone(), self.artifacts.len());
                        self.artifacts.push(BufferedArtifact {
                            artifact: u.artifact.clone(),
                            ready,
                        });
                    }
                }
            }
            StreamResponse::Message(m) => {
                let (t, c) = (
                    m.task_id.clone().unwrap_or_default(),
                    m.context_id.clone().unwrap_or_default(),
                );
                self.ids(&t, &c);
            }
        }
    }

    /// After a gap in the stream: artifacts still being streamed may have
    /// lost chunks, and whole artifacts may have been sent and lost, unless
    /// a snapshot restores them.
    fn mark_gap(&mut self) {
        self.gap = true;
        if self.bare_snapshots || self.artifacts.iter().any(|a| !a.ready) {
            self.incomplete = true;
        }
    }

    fn artifacts(&self) -> Vec<Artifact> {
        self.artifacts.iter().map(|b| b.artifact.clone()).collect()
    }
}

/// What a listener wants after an update.
#[derive(Debug, Clone, PartialEq)]
pub enum Control {
    Continue,
    /// End the call now with this response text.
    StopWithResponse(String),
    /// End the call now with the artifacts buffered so far.
    StopWithArtifacts,
}

/// Sees every update of a call, after it is applied to the state.
pub trait Listener: Send {
    fn on_event(&mut self, event: &StreamResponse, state: &CallState) -> Control;
}

impl<F: FnMut(&StreamResponse, &CallState) -> Control + Send> Listener for F {
    fn on_event(&mut self, event: &StreamResponse, state: &CallState) -> Control {
        self(event, state)
    }
}

/// How a call ended well (or at least on purpose).
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The task completed. Every artifact it produced is here, and the
    /// message of its last status, if it had one (an agent may answer
    /// there instead of in an artifact).
    Completed {
        task_id: String,
        context_id: String,
        artifacts: Vec<Artifact>,
        incomplete: bool,
        message: Option<Message>,
    },
    /// The agent answered with a message instead of a task.
    Message(Message),
    /// The agent waits for the caller (INPUT_REQUIRED or AUTH_REQUIRED):
    /// reply with a message carrying these ids.
    Waiting {
        state: TaskState,
        task_id: String,
        context_id: String,
        message: Option<Message>,
        artifacts: Vec<Artifact>,
    },
    /// A listener stopped the call; the remote task was left running.
    Stopped {
        task_id: Option<String>,
        response: Option<String>,
        artifacts: Vec<Artifact>,
        incomplete: bool,
    },
}

/// How a call failed.
#[derive(Debug, Error)]
pub enum CallError {
    /// The task ended FAILED or REJECTED (or was CANCELED remotely).
    #[error("the remote task ended {state:?}: {message}")]
    Task {
        state: TaskState,
        task_id: String,
        message: String,
        artifacts: Vec<Artifact>,
    },
    /// The deadline passed; the remote task was cancelled if its id was
    /// known (`cancel` says how that went).
    #[error(
        "the deadline passed; {cancel} (last state: {})",
        state_name(last_state)
    )]
    Deadline {
        task_id: Option<String>,
        last_state: Option<TaskState>,
        artifacts: Vec<Artifact>,
        cancel: Cancellation,
    },
    /// The stream was lost before the task had an id; not resent, since
    /// that would start a second task.
    #[error("the stream was lost before the task had an id; not resent: {cause}")]
    LostBeforeTask { cause: String },
    /// Recovery gave up (the agent stayed silent or unreachable, or lost the
    /// stream again at once, `max_recoveries` times in a row); the remote
    /// task was cancelled (`cancel` says how that went).
    #[error(
        "the task could not be recovered after {recoveries} attempts ({cause}); {cancel} (last state: {})",
        state_name(last_state)
    )]
    Unrecoverable {
        task_id: String,
        last_state: Option<TaskState>,
        recoveries: u32,
        cause: String,
        artifacts: Vec<Artifact>,
        cancel: Cancellation,
    },
    /// After a drop, the remote agent no longer knew the task (it restarted
    /// without keeping its tasks, say): nothing to resume or cancel.
    #[error(
        "the stream was lost and the remote agent no longer knows the task (last state: {})",
        state_name(last_state)
    )]
    TaskLost {
        task_id: String,
        last_state: Option<TaskState>,
        artifacts: Vec<Artifact>,
    },
    /// The remote task's artifacts outgrew `max_artifact_bytes`; the task
    /// was cancelled if its id was known and it was still running (`cancel`
    /// says how that went).
    #[error("the remote task's artifacts are larger than {limit} bytes; {cancel}")]
    TooLarge {
        task_id: Option<String>,
        limit: usize,
        cancel: Cancellation,
    },
    /// The remote agent refused the request; or, recovering a dropped
    /// stream, failed GetTask with an error that retrying cannot fix (the
    /// message names the request and the cause; the task was left running).
    #[error("the remote agent refused the call: {0}")]
    Refused(A2AError),
    /// A message from the remote agent (an update, or the task as a
    /// snapshot brings it) is larger than the transport receives (the gRPC
    /// binding: 4 MiB a message; JSON-RPC: an event or an answer past
    /// [`jsonrpc::Limits`]). Retrying would bring it again, so the call
    /// ends at once; the task was left running (cancel it with
    /// [`A2aClient::cancel`]).
    #[error(
        "a message from the remote agent is larger than this client can receive over its binding ({cause}); the remote task was left running (last state: {})",
        state_name(last_state)
    )]
    MessageTooLarge {
        task_id: Option<String>,
        last_state: Option<TaskState>,
        artifacts: Vec<Artifact>,
        cause: String,
    },
}

/// What became of the CancelTask a call sends when it abandons its task.
#[derive(Debug, Clone, PartialEq)]
pub enum Cancellation {
    /// None was sent: the task's id was never known.
    NotSent,
    /// None was needed: the task had already ended.
    Ended,
    /// The remote answered it; the task's state in its answer.
    Acknowledged(TaskState),
    /// It failed or went unanswered: the task may still be running.
    Failed(String),
}

impl std::fmt::Display for Cancellation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cancellation::NotSent => {
                f.write_str("no cancel was sent: the remote task's id was never known")
            }
            Cancellation::Ended => {
                f.write_str("no cancel was sent: the remote task had already ended")
            }
            Cancellation::Acknowledged(TaskState::Canceled) => {
                f.write_str("the remote task was cancelled")
            }
            Cancellation::Acknowledged(state) => {
                write!(
                    f,
                    "CancelTask was acknowledged (the remote task is {state:?})"
                )
            }
            Cancellation::Failed(why) => write!(
                f,
                "CancelTask failed ({why}): the remote task may still be running"
            ),
        }
    }
}

fn state_name(s: &Option<TaskState>) -> String {
    s.as_ref()
        .map_or_else(|| "none".to_owned(), |s| format!("{s:?}"))
}

/// Whether retrying a request that failed with `e` cannot help: the remote
/// does not offer the method or operation, refuses our credentials (the
/// codes of agentd's own A2A face: A2A leaves authentication to HTTP), or
/// finds the request itself wrong, or the task unknown. Anything else (a
/// connection refused or reset, a timeout, an internal error) may pass and
/// is retried. The gRPC binding reports UNAUTHENTICATED, PERMISSION_DENIED
/// and UNAVAILABLE alike as INTERNAL_ERROR (the SDK keeps no other code for
/// them), so over gRPC those are retried, within `max_recoveries`.
fn permanent(e: &A2AError) -> bool {
    use a2a::error_code as c;
    matches!(
        e.code,
        c::METHOD_NOT_FOUND
            | c::UNSUPPORTED_OPERATION
            | c::INVALID_PARAMS
            | c::INVALID_REQUEST
            | c::PARSE_ERROR
            | c::TASK_NOT_FOUND
            | c::TASK_NOT_CANCELABLE
            | c::CONTENT_TYPE_NOT_SUPPORTED
            | c::VERSION_NOT_SUPPORTED
            | c::EXTENSION_SUPPORT_REQUIRED
            | c::PUSH_NOTIFICATION_NOT_SUPPORTED
            | c::EXTENDED_CARD_NOT_CONFIGURED
            | crate::a2a::auth::UNAUTHENTICATED_CODE
            | crate::a2a::auth::PERMISSION_DENIED_CODE
    )
}

/// The name of `e`'s code, for a message.
fn reason(e: &A2AError) -> &'static str {
    match e.code {
        crate::a2a::auth::UNAUTHENTICATED_CODE => "UNAUTHENTICATED",
        crate::a2a::auth::PERMISSION_DENIED_CODE => "PERMISSION_DENIED",
        code => a2a::error_reason(code),
    }
}

/// Whether an interface at `interface_url`, listed by the agent card read
/// from `card_url`, is a downgrade from TLS to plaintext: the card came over
/// https and the interface is anything but https (a gRPC interface without a
/// scheme, `host:port`, is plaintext). A client with a bearer token uses no
/// such interface. Another host than the card's is allowed (agentd's own
/// card may name the pod rather than the Service it was read through), with
/// the same or a stronger scheme.
fn downgrades(card_url: &str, interface_url: &str) -> bool {
    let scheme = |u: &str| {
        u.split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase())
    };
    scheme(card_url).as_deref() == Some("https")
        && scheme(interface_url).as_deref() != Some("https")
}

/// The credentials an endpoint's URL may carry: its userinfo (a password,
/// or a token given as the username, `https://TOKEN@host/`), and its query
/// (where an API key often goes). Errors quote the URL a request failed on:
/// the SDK's transport errors (reqwest's "error sending request for url
/// (…)", query and all) and this client's own (the card's URL as given,
/// userinfo and all). Those errors reach logs, the CLI's `--json` output
/// and, in the causes of failed recoveries, every caller: each error an
/// [`A2aClient`] returns has them masked (`***`). Masked, of each URL:
/// - its username and password where the URL shows them (`//***:***@`);
/// - on its own wherever a message quotes it (as written and decoded), the
///   password, and the username of a URL without one (the username is then
///   the credential; beside a password it is a name, and masking it
///   everywhere would garble a host or a word that holds it);
/// - its whole query where the URL or its query string shows it;
/// - on its own wherever a message quotes it (as written and decoded), the
///   value of each query parameter whose name says it is a credential
///   ([`credential_key`]). Other values are masked only within the query:
///   `json` of `?format=json` masked everywhere would make
///   "application/json" "application/***".
///
/// A value shorter than 4 bytes is masked only where the URL shows it: no
/// credential is that short, and masking every "1" would garble the
/// message.
#[derive(Debug, Default)]
struct Secrets(Vec<(String, String)>);

/// Whether a query parameter named `key` (decoded) carries a credential:
/// its name, in any case, contains one of the words API keys, tokens,
/// passwords, signatures, OAuth codes and session ids go by (or is `sid`).
fn credential_key(key: &str) -> bool {
    const WORDS: [&str; 14] = [
        "key",
        "token",
        "secret",
        "sig",
        "password",
        "passwd",
        "pass",
        "pwd",
        "auth",
        "credential",
        "session",
        "jwt",
        "bearer",
        "code",
    ];
    let key = key.to_ascii_lowercase();
    key == "sid" || WORDS.iter().any(|w| key.contains(w))
}

impl Secrets {
    const MASK: &'static str = "***";

    fn of(url: &str) -> Self {
        let mut s = Self::default();
        s.add(url);
        s
    }

    /// Adds what of `url` is masked, as written and as reqwest shows it.
    fn add(&mut self, url: &str) {
        // As a form value (`+` a space), which a query value is.
        let decoded = |v: &str| {
            form_urlencoded::parse(format!("={v}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default()
        };
        let parsed = reqwest::Url::parse(url).ok();
        let written = url
            .split_once('?')
            .map(|(_, q)| q.split_once('#').map_or(q, |(q, _)| q));
        let shown = parsed.as_ref().and_then(|u| u.query());
        let alone = |s: &mut Self, v: &str| {
            if v.len() >= 4 {
                s.push(v.to_owned(), Self::MASK.to_owned());
                s.push(decoded(v), Self::MASK.to_owned());
            }
        };
        for query in [written, shown].into_iter().flatten() {
            self.push(format!("?{query}"), format!("?{}", Self::MASK));
            for (key, value) in query.split('&').filter_map(|p| p.split_once('=')) {
                if credential_key(&decoded(key)) {
                    alone(self, value);
                }
            }
        }
        // The username as written (the userinfo before the host, up to a
        // `:`), and as the parsed URL shows it (percent-encoded; `TOKEN:@`
        // shown as `TOKEN@`, its empty password dropped).
        let written_user = url.split_once("://").and_then(|(_, rest)| {
            let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
            let (userinfo, _) = authority.rsplit_once('@')?;
            Some(userinfo.split_once(':').map_or(userinfo, |(u, _)| u))
        });
        let shown_user = parsed.as_ref().map(|u| u.username());
        let password = parsed
            .as_ref()
            .and_then(|u| u.password())
            .filter(|p| !p.is_empty());
        for user in [written_user, shown_user].into_iter().flatten() {
            if user.is_empty() {
                continue;
            }
            for end in ['@', ':'] {
                self.push(format!("//{user}{end}"), format!("//{}{end}", Self::MASK));
            }
            if password.is_none() {
                alone(self, user);
            }
        }
        if let Some(password) = password {
            self.push(format!(":{password}@"), format!(":{}@", Self::MASK));
            alone(self, password);
        }
        // Longest first: a whole query goes before the values in it.
        self.0.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
    }

    fn push(&mut self, secret: String, mask: String) {
        if secret.len() > 1 && !self.0.iter().any(|(s, _)| *s == secret) {
            self.0.push((secret, mask));
        }
    }

    fn mask(&self, message: &str) -> String {
        let mut message = message.to_owned();
        for (secret, mask) in &self.0 {
            if message.contains(secret.as_str()) {
                message = message.replace(secret.as_str(), mask);
            }
        }
        message
    }

    fn error(&self, mut e: A2AError) -> A2AError {
        if !self.0.is_empty() {
            e.message = self.mask(&e.message);
        }
        e
    }

    /// `stream` with every error item masked.
    fn stream(self: &Arc<Self>, stream: Stream) -> Stream {
        if self.0.is_empty() {
            return stream;
        }
        let secrets = self.clone();
        Box::pin(stream.map(move |item| item.map_err(|e| secrets.error(e))))
    }
}

/// The largest agent card this client reads. A card names the agent, its
/// interfaces and its skills: a few KiB, rarely more than a few hundred
/// (hundreds of skills with their examples); a peer that sends more, or a
/// body that never ends, is refused here rather than buffered.
pub const MAX_CARD_BYTES: usize = 1 << 20;

/// The agent card at `base_url` (its `/.well-known/agent-card.json`), read
/// within [`MAX_CARD_BYTES`]. The SDK's resolver read the body whole, however
/// large.
async fn fetch_card(http: &reqwest::Client, base_url: &str) -> Result<a2a::AgentCard, String> {
    let url = format!(
        "{}{}",
        base_url.trim_end_matches('/'),
        a2a_server::agent_card::WELL_KNOWN_AGENT_CARD_PATH
    );
    let too_large =
        || format!("the card is larger than this client's limit of {MAX_CARD_BYTES} bytes");
    let mut resp = http
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("failed to fetch agent card: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("agent card fetch returned HTTP {}", resp.status()));
    }
    if resp
        .content_length()
        .is_some_and(|n| n > MAX_CARD_BYTES as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| format!("failed to fetch agent card: {e}"))?
    {
        if body.len() + chunk.len() > MAX_CARD_BYTES {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| format!("failed to parse agent card: {e}"))
}

/// How long one GetTask or CancelTask of [`A2aClient`] waits for its
/// answer unless [`A2aClient::with_request_timeout`] says otherwise.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A client of one remote A2A agent; clones share the connection.
#[derive(Clone)]
pub struct A2aClient {
    inner: Arc<A2AClient<Box<dyn Transport>>>,
    /// Masked in every error this client returns.
    secrets: Arc<Secrets>,
    /// The bound of one GetTask or CancelTask ([`REQUEST_TIMEOUT`]).
    request_timeout: Duration,
}

impl A2aClient {
    /// Resolves the agent card at `base_url` and connects over `binding`,
    /// or else over the first of the card's interfaces this client speaks
    /// (JSON-RPC, gRPC), in the card's order.
    pub async fn connect(base_url: &str, binding: Option<Binding>) -> anyhow::Result<Self> {
        Self::connect_with(base_url, binding, None).await
    }

    /// [`Self::connect`], sending `authorization: Bearer <token>` on every
    /// call when a token is given. `base_url` may also be the card's own URL
    /// (ending in `/.well-known/agent-card.json`). The card itself is read
    /// without the token: A2A cards are public. With a token, a card read
    /// over https is used only through its https interfaces: a plaintext
    /// one is left out, and an error if none is left.
    pub async fn connect_with(
        base_url: &str,
        binding: Option<Binding>,
        token: Option<&str>,
    ) -> anyhow::Result<Self> {
        Self::connect_trusting(base_url, binding, token, None).await
    }

    /// [`Self::connect_with`], trusting the certificates of the PEM bundle
    /// `ca_pem` besides the system's roots for an `https://` agent (a
    /// private CA). An `https://` agent is called over JSON-RPC; the gRPC
    /// binding is plaintext only.
    pub async fn connect_trusting(
        base_url: &str,
        binding: Option<Binding>,
        token: Option<&str>,
        ca_pem: Option<&[u8]>,
    ) -> anyhow::Result<Self> {
        // The card's URL and every interface it lists: the errors below, and
        // the transport's, may quote any of them.
        let mut secrets = Secrets::of(base_url);
        match Self::connect_inner(base_url, binding, token, ca_pem, &mut secrets).await {
            Ok(inner) => Ok(Self {
                inner: Arc::new(inner),
                secrets: Arc::new(secrets),
                request_timeout: REQUEST_TIMEOUT,
            }),
            Err(e) => Err(anyhow::anyhow!(secrets.mask(&format!("{e:#}")))),
        }
    }

    async fn connect_inner(
        base_url: &str,
        binding: Option<Binding>,
        token: Option<&str>,
        ca_pem: Option<&[u8]>,
        secrets: &mut Secrets,
    ) -> anyhow::Result<A2AClient<Box<dyn Transport>>> {
        let base_url = base_url
            .trim_end_matches('/')
            .trim_end_matches(a2a_server::agent_card::WELL_KNOWN_AGENT_CARD_PATH);
        let http = crate::agent::openai::client::http_client_trusting(ca_pem)?;
        let card = fetch_card(&http, base_url)
            .await
            .map_err(|e| anyhow::anyhow!("cannot read the agent card at {base_url}: {e}"))?;
        // The bindings this client may use here: the one asked for, else
        // JSON-RPC and gRPC; gRPC is plaintext only, so an https:// agent
        // is not called over it unless asked.
        let speaks: Vec<&str> = match binding {
            Some(b) => vec![b.protocol()],
            None if base_url.starts_with("https://") => vec![a2a::TRANSPORT_PROTOCOL_JSONRPC],
            None => vec![
                a2a::TRANSPORT_PROTOCOL_JSONRPC,
                a2a::TRANSPORT_PROTOCOL_GRPC,
            ],
        };
        for i in &card.supported_interfaces {
            secrets.add(&i.url);
        }
        // With a token, no interface that would carry it in plaintext where
        // the card came over TLS (see `downgrades`).
        let mut card = card;
        let mut plaintext: Vec<String> = Vec::new();
        if token.is_some() {
            card.supported_interfaces.retain(|i| {
                let spoken = speaks
                    .iter()
                    .any(|p| i.protocol_binding.eq_ignore_ascii_case(p));
                if spoken && downgrades(base_url, &i.url) {
                    plaintext.push(format!("{} at {}", i.protocol_binding, i.url));
                    return false;
                }
                true
            });
            if !plaintext.is_empty() {
                // The card's host only: its URL may carry credentials.
                let host = reqwest::Url::parse(base_url)
                    .ok()
                    .and_then(|u| u.host_str().map(str::to_owned))
                    .unwrap_or_default();
                tracing::warn!(
                    card_host = %host,
                    interfaces = %plaintext.join(", "),
                    "the agent card, read over https, lists plaintext interfaces: they are not used, so that the bearer token is not sent in cleartext"
                );
            }
        }
        // A2A §8.3.2: the first interface of the card's (ordered) list that
        // the client supports. The factory ranks candidates by this list's
        // order, so it is the card's, with what this client does not speak
        // left out (and no default factories registered for it).
        let mut preferred: Vec<String> = Vec::new();
        let mut jsonrpc = false;
        let mut grpc = false;
        for i in &card.supported_interfaces {
            let Some(p) = speaks
                .iter()
                .find(|p| i.protocol_binding.eq_ignore_ascii_case(p))
            else {
                continue;
            };
            jsonrpc |= *p == a2a::TRANSPORT_PROTOCOL_JSONRPC;
            grpc |= *p == a2a::TRANSPORT_PROTOCOL_GRPC;
            if !preferred.contains(&i.protocol_binding) {
                preferred.push(i.protocol_binding.clone());
            }
        }
        if preferred.is_empty() && !plaintext.is_empty() {
            anyhow::bail!(
                "the agent card at {base_url} was read over https but offers {} only over plaintext ({}): the bearer token is not sent in cleartext; the card must list an https:// interface",
                binding.map_or("an interface this client speaks", |b| b.protocol()),
                plaintext.join(", ")
            );
        }
        if preferred.is_empty() {
            match binding {
                Some(b) => anyhow::bail!(
                    "the agent card at {base_url} offers no {} interface",
                    b.protocol()
                ),
                None => anyhow::bail!(
                    "the agent card at {base_url} offers no interface this client speaks ({})",
                    speaks.join(", ")
                ),
            }
        }
        let mut factory = A2AClientFactory::builder()
            .no_defaults()
            .preferred_bindings(preferred);
        if jsonrpc {
            factory = factory.register(Arc::new(jsonrpc::JsonRpcTransportFactory::new(http)));
        }
        if grpc {
            factory = factory.register(Arc::new(a2a_grpc::GrpcTransportFactory::new()));
        }
        for i in interceptors(token) {
            factory = factory.with_interceptor(i);
        }
        let factory = factory.build();
        factory.create_from_card(&card).await.map_err(|e| {
            anyhow::anyhow!("cannot connect to the agent at {base_url}: {}", e.message)
        })
    }

    /// A client of the JSON-RPC endpoint at `url` (no card is read), sending
    /// `authorization: Bearer <token>` on every call when a token is given.
    pub fn jsonrpc(url: &str, token: Option<&str>) -> anyhow::Result<Self> {
        Self::jsonrpc_trusting(url, token, None)
    }

    /// [`Self::jsonrpc`], trusting the PEM bundle `ca_pem` besides the
    /// system's roots for an `https://` endpoint.
    pub fn jsonrpc_trusting(
        url: &str,
        token: Option<&str>,
        ca_pem: Option<&[u8]>,
    ) -> anyhow::Result<Self> {
        let http = crate::agent::openai::client::http_client_trusting(ca_pem)?;
        let transport: Box<dyn Transport> =
            Box::new(jsonrpc::JsonRpcTransport::new(http, url.to_owned()));
        let client = A2AClient::new(transport).with_interceptors(interceptors(token));
        Ok(Self {
            inner: Arc::new(client),
            secrets: Arc::new(Secrets::of(url)),
            request_timeout: REQUEST_TIMEOUT,
        })
    }

    /// A client over an existing transport (e.g. gRPC on an in-process channel).
    pub fn from_transport(transport: Box<dyn Transport>) -> Self {
        Self {
            inner: Arc::new(A2AClient::new(transport).with_interceptors(interceptors(None))),
            secrets: Arc::default(),
            request_timeout: REQUEST_TIMEOUT,
        }
    }

    /// The same client, each GetTask and CancelTask of it waiting at most
    /// `timeout` for its answer (default [`REQUEST_TIMEOUT`]).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// `call`, within the client's request timeout; its errors masked.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, A2AError>>,
    ) -> Result<T, A2AError> {
        match tokio::time::timeout(self.request_timeout, call).await {
            Ok(r) => r.map_err(|e| self.secrets.error(e)),
            Err(_) => Err(A2AError::internal(format!(
                "{what}: no answer within {:?}",
                self.request_timeout
            ))),
        }
    }

    /// The underlying SDK client, for calls this wrapper does not cover.
    /// Its errors are the SDK's, which may quote the endpoint's URL: show
    /// them through [`Self::mask_secrets`].
    pub fn raw(&self) -> &A2AClient<Box<dyn Transport>> {
        &self.inner
    }

    /// `message` with the credentials the endpoint's URLs carry masked, as
    /// in every error this client returns (see [`Secrets`]).
    pub fn mask_secrets(&self, message: &str) -> String {
        self.secrets.mask(message)
    }

    /// GetTask, without history, its errors masked; an answer that does
    /// not come within the request timeout ([`Self::with_request_timeout`])
    /// is an internal error.
    pub async fn get_task(&self, task_id: &str) -> Result<Task, A2AError> {
        let req = GetTaskRequest {
            id: task_id.to_owned(),
            history_length: Some(0),
            tenant: None,
        };
        self.bounded("GetTask", self.inner.get_task(&req)).await
    }

    /// CancelTask, its errors masked; the task as the server has it after
    /// the request. Bounded as [`Self::get_task`] is.
    pub async fn cancel(&self, task_id: &str) -> Result<Task, A2AError> {
        let req = CancelTaskRequest {
            id: task_id.to_owned(),
            metadata: None,
            tenant: None,
        };
        self.bounded("CancelTask", self.inner.cancel_task(&req))
            .await
    }

    /// SendStreamingMessage, its errors masked.
    async fn send_streaming(&self, req: &SendMessageRequest) -> Result<Stream, A2AError> {
        match self.inner.send_streaming_message(req).await {
            Ok(s) => Ok(self.secrets.stream(s)),
            Err(e) => Err(self.secrets.error(e)),
        }
    }

    /// SubscribeToTask, its errors masked.
    async fn subscribe(&self, task_id: &str) -> Result<Stream, A2AError> {
        let req = SubscribeToTaskRequest {
            id: task_id.to_owned(),
            tenant: None,
        };
        match self.inner.subscribe_to_task(&req).await {
            Ok(s) => Ok(self.secrets.stream(s)),
            Err(e) => Err(self.secrets.error(e)),
        }
    }

    /// Sends `text` (with optional message metadata) and follows the task to
    /// its end. See the module docs for the rules.
    pub async fn send_text(
        &self,
        text: &str,
        metadata: Option<HashMap<String, serde_json::Value>>,
        opts: &CallOptions,
        listener: Option<&mut dyn Listener>,
    ) -> Result<Outcome, CallError> {
        let message = Message {
            metadata,
            ..Message::new(Role::User, vec![Part::text(text)])
        };
        self.send(message, opts, listener).await
    }

    /// Sends `message` and follows the task to its end. Over JSON-RPC, its
    /// requests read at most [`jsonrpc::Limits::for_artifacts`] of
    /// `opts.max_artifact_bytes`.
    pub async fn send(
        &self,
        message: Message,
        opts: &CallOptions,
        listener: Option<&mut dyn Listener>,
    ) -> Result<Outcome, CallError> {
        jsonrpc::Limits::for_artifacts(opts.max_artifact_bytes)
            .scope(self.send_within_limits(message, opts, listener))
            .await
    }

    async fn send_within_limits(
        &self,
        message: Message,
        opts: &CallOptions,
        mut listener: Option<&mut dyn Listener>,
    ) -> Result<Outcome, CallError> {
        let deadline = Instant::now() + opts.deadline;
        let mut st = CallState::new();
        // A reply into a task that waited: its snapshots hold what its
        // earlier turns made too, which this turn's stream does not bring.
        // The Task its stream begins with (A2A: a stream begins with the
        // Task) says what those are; this look is for a remote whose reply
        // streams do not begin so (an a2a-python executor that enqueues the
        // Task of a new task only, as tests/a2a_test_agent.py does), and
        // cannot be left out: only a look taken before the turn tells an
        // earlier turn's artifact from one of this turn's that a gap lost.
        // Without either (the look failed too), a recovery may bring
        // earlier turns' artifacts back.
        // The look waits an idle period at most, so that a remote slow to
        // answer it does not keep the reply from being sent.
        if let Some(id) = &message.task_id {
            st.lead = Lead::Reply;
            let until = look_until(deadline, opts);
            if let Ok(Ok(task)) = tokio::time::timeout_at(until, self.get_task(id)).await {
                st.remember_earlier_turns(
                    task.artifacts.unwrap_or_default(),
                    opts.max_artifact_bytes,
                );
            }
        }
        let req = SendMessageRequest {
            message,
            configuration: None,
            metadata: None,
            tenant: None,
        };
        let mut stream = match tokio::time::timeout_at(deadline, self.send_streaming(&req)).await {
            Ok(Ok(s)) => Some(s),
            Ok(Err(e)) if unreceivable(&e) => return Err(too_large_to_receive(&st, e)),
            Ok(Err(e)) => return Err(CallError::Refused(e)),
            // A reply names its task: that one is cancelled, as at any
            // deadline; a new task's id was never known.
            Err(_) => {
                let (task_id, cancel) = match req.message.task_id.clone() {
                    Some(id) => {
                        let cancel = self.cancel_logged(&id, &st, "the deadline passed").await;
                        (Some(id), cancel)
                    }
                    None => (None, Cancellation::NotSent),
                };
                return Err(CallError::Deadline {
                    task_id,
                    last_state: None,
                    artifacts: vec![],
                    cancel,
                });
            }
        };
        let mut backoff = opts.initial_backoff;
        // Recoveries in a row that brought no update; a stream that
        // delivers updates after one (a snapshot alone does not count)
        // starts the count again.
        let mut failed_in_a_row = 0u32;
        // Why the last recovery failed, if it did before a stream was had.
        let mut recovery_failed: Option<String> = None;
        loop {
            let cause = match stream.as_mut() {
                Some(s) => {
                    let (seen, since) = (st.updates, Instant::now());
                    let step = self.follow(s, &mut st, opts, deadline, &mut listener).await;
                    // Only a stream's first event is its lead.
                    st.lead = Lead::Any;
                    match step {
                        Step::Done(r) => return *r,
                        Step::Deadline => return Err(self.abandon_at_deadline(&st).await),
                        Step::Dropped(cause) => {
                            if st.updates > seen {
                                failed_in_a_row = 0;
                                // Only a stream that lasted resets the
                                // backoff: one that drops right after an
                                // update each time is not retried hot.
                                if since.elapsed() >= opts.max_backoff {
                                    backoff = opts.initial_backoff;
                                }
                            }
                            cause
                        }
                    }
                }
                None => recovery_failed
                    .take()
                    .unwrap_or_else(|| "resubscribe failed".to_owned()),
            };
            stream = None;
            let Some(task_id) = st.task_id.clone() else {
                return Err(CallError::LostBeforeTask { cause });
            };
            st.mark_gap();
            if failed_in_a_row >= opts.max_recoveries {
                // One last look: a task that ended meanwhile is answered,
                // not cancelled.
                match tokio::time::timeout_at(deadline, self.get_task(&task_id)).await {
                    Ok(Ok(task)) => {
                        st.apply_task(&task);
                        if let Some(end) = end_of(&st, None) {
                            return end;
                        }
                    }
                    Ok(Err(e)) if unreceivable(&e) => return Err(too_large_to_receive(&st, e)),
                    Ok(Err(e)) if permanent(&e) => {
                        return Err(lost_or_refused(&st, task_id, "GetTask", e));
                    }
                    _ => {}
                }
                return Err(self.give_up(&st, task_id, cause, failed_in_a_row).await);
            }
            failed_in_a_row += 1;
            st.recoveries += 1;
            tracing::warn!(task = %task_id, attempt = failed_in_a_row, %cause, "a2a: stream lost; recovering from a snapshot");
            if tokio::time::timeout_at(deadline, tokio::time::sleep(backoff))
                .await
                .is_err()
            {
                return Err(self.abandon_at_deadline(&st).await);
            }
            backoff = (backoff * 2).min(opts.max_backoff);
            match tokio::time::timeout_at(deadline, self.get_task(&task_id)).await {
                Err(_) => return Err(self.abandon_at_deadline(&st).await),
                Ok(Err(e)) if unreceivable(&e) => return Err(too_large_to_receive(&st, e)),
                Ok(Err(e)) if permanent(&e) => {
                    return Err(lost_or_refused(&st, task_id, "GetTask", e));
                }
                Ok(Err(e)) => {
                    tracing::warn!(task = %task_id, error = %e.message, "a2a: GetTask failed during recovery");
                    recovery_failed = Some(format!("GetTask failed: {}", e.message));
                    continue;
                }
                Ok(Ok(task)) => {
                    st.apply_task(&task);
                    if let Some(e) = self.too_large(&st, opts).await {
                        return Err(e);
                    }
                    if let Some(end) = end_of(&st, None) {
                        return end;
                    }
                    // The task runs on: what it sends between this snapshot
                    // and the subscription is covered only if the
                    // subscription begins with the task as it then is.
                    st.mark_gap();
                }
            }
            match tokio::time::timeout_at(deadline, self.subscribe(&task_id)).await {
                Err(_) => return Err(self.abandon_at_deadline(&st).await),
                Ok(Ok(s)) => {
                    stream = Some(s);
                    st.lead = Lead::Resubscribed;
                }
                Ok(Err(e)) if unreceivable(&e) => return Err(too_large_to_receive(&st, e)),
                Ok(Err(e)) if permanent(&e) => {
                    // One more look decides. The task may have ended or come
                    // to wait for input since the snapshot (A2A refuses to
                    // subscribe to an ended task; agentd's face answers
                    // TaskNotFound for one waiting). And a refusal may pass:
                    // agentd's face refuses (UnsupportedOperation) to follow
                    // a task another replica has not started yet, or
                    // cannot follow for a moment.
                    let passing = matches!(
                        e.code,
                        a2a::error_code::UNSUPPORTED_OPERATION | a2a::error_code::TASK_NOT_FOUND
                    );
                    match tokio::time::timeout_at(deadline, self.get_task(&task_id)).await {
                        Err(_) => return Err(self.abandon_at_deadline(&st).await),
                        Ok(Ok(task)) => {
                            st.apply_task(&task);
                            if let Some(e) = self.too_large(&st, opts).await {
                                return Err(e);
                            }
                            if let Some(end) = end_of(&st, None) {
                                return end;
                            }
                            st.mark_gap();
                        }
                        Ok(Err(g)) if unreceivable(&g) => {
                            return Err(too_large_to_receive(&st, g));
                        }
                        Ok(Err(g)) if permanent(&g) => {
                            return Err(lost_or_refused(&st, task_id, "GetTask", g));
                        }
                        Ok(Err(_)) => {}
                    }
                    if !passing {
                        // The remote will not let us subscribe (it does not
                        // offer the method, or refuses it to us) but shows
                        // the task: follow it by GetTask alone. Ending the
                        // call here would leave the task running with no
                        // one to follow or cancel it.
                        tracing::warn!(task = %task_id, code = e.code, error = %e.message, "a2a: SubscribeToTask refused; following the task by GetTask");
                        return self
                            .poll(&mut st, task_id, opts, deadline, backoff, &mut listener)
                            .await;
                    }
                    tracing::warn!(task = %task_id, error = %e.message, "a2a: SubscribeToTask refused while the task runs; trying again");
                    recovery_failed = Some(format!("SubscribeToTask refused: {}", e.message));
                }
                Ok(Err(e)) => {
                    tracing::warn!(task = %task_id, error = %e.message, "a2a: SubscribeToTask failed");
                    recovery_failed = Some(format!("SubscribeToTask failed: {}", e.message));
                }
            }
        }
    }

    /// Follows a task by GetTask alone, for a remote that refuses
    /// SubscribeToTask while its GetTask shows the task running: every
    /// `backoff` (doubling up to `max_backoff`) a snapshot, which is
    /// authoritative and goes to the listener as an update, until the task
    /// ends or waits; past the deadline, or after `max_recoveries` failed
    /// looks in a row, the task is cancelled.
    async fn poll(
        &self,
        st: &mut CallState,
        task_id: String,
        opts: &CallOptions,
        deadline: Instant,
        mut backoff: Duration,
        listener: &mut Option<&mut dyn Listener>,
    ) -> Result<Outcome, CallError> {
        let mut failed_in_a_row = 0u32;
        loop {
            if tokio::time::timeout_at(deadline, tokio::time::sleep(backoff))
                .await
                .is_err()
            {
                return Err(self.abandon_at_deadline(st).await);
            }
            backoff = (backoff * 2).min(opts.max_backoff);
            // A look answered slowly is still one answered (a large
            // snapshot takes its time to arrive): only the deadline bounds
            // it, as it bounds the call.
            let task = match tokio::time::timeout_at(deadline, self.get_task(&task_id)).await {
                Err(_) => return Err(self.abandon_at_deadline(st).await),
                Ok(Err(e)) if unreceivable(&e) => return Err(too_large_to_receive(st, e)),
                Ok(Err(e)) if permanent(&e) => {
                    return Err(lost_or_refused(st, task_id, "GetTask", e));
                }
                Ok(Err(e)) => {
                    failed_in_a_row += 1;
                    tracing::warn!(task = %task_id, attempt = failed_in_a_row, error = %e.message, "a2a: GetTask failed while following the task by GetTask");
                    if failed_in_a_row >= opts.max_recoveries.max(1) {
                        let cause = format!("GetTask failed: {}", e.message);
                        return Err(self.give_up(st, task_id, cause, failed_in_a_row).await);
                    }
                    continue;
                }
                Ok(Ok(task)) => task,
            };
            failed_in_a_row = 0;
            let event = StreamResponse::Task(task);
            st.apply(&event);
            if let Some(e) = self.too_large(st, opts).await {
                return Err(e);
            }
            if let Some(done) = listen(st, &event, listener) {
                return done;
            }
            if let Some(end) = end_of(st, None) {
                return end;
            }
        }
    }

    /// Reads `stream` until the call ends, the deadline passes or the stream
    /// is lost.
    async fn follow(
        &self,
        stream: &mut Stream,
        st: &mut CallState,
        opts: &CallOptions,
        deadline: Instant,
        listener: &mut Option<&mut dyn Listener>,
    ) -> Step {
        loop {
            // The timer below fires only while the stream has no event
            // ready: one that always has one would never let it.
            if Instant::now() >= deadline {
                return Step::Deadline;
            }
            let idle_at = (Instant::now() + opts.idle_timeout).min(deadline);
            let next = match tokio::time::timeout_at(idle_at, stream.next()).await {
                Err(_) if Instant::now() >= deadline => return Step::Deadline,
                Err(_) => {
                    return Step::Dropped(format!(
                        "no event for {:?} (idle timeout)",
                        opts.idle_timeout
                    ));
                }
                Ok(None) => return Step::Dropped("the stream ended before the task did".into()),
                Ok(Some(Err(e))) if unreceivable(&e) => {
                    return Step::Done(Box::new(Err(too_large_to_receive(st, e))));
                }
                Ok(Some(Err(e))) => return Step::Dropped(format!("stream error: {}", e.message)),
                Ok(Some(Ok(ev))) => ev,
            };
            match std::mem::replace(&mut st.lead, Lead::Any) {
                // The task as this turn began: its artifacts are earlier
                // turns'.
                Lead::Reply => {
                    if let StreamResponse::Task(t) = &next {
                        st.remember_earlier_turns(
                            t.artifacts.clone().unwrap_or_default(),
                            opts.max_artifact_bytes,
                        );
                    }
                }
                // A subscription that does not begin with the task as it
                // is (a peer older than A2A 1.0, which requires it) leaves
                // the gap since the recovery's snapshot uncovered: what the
                // task sent in it may be lost, unless a last GetTask once
                // the task completed restores it (see `settle_gap`).
                Lead::Resubscribed => {
                    if !matches!(next, StreamResponse::Task(_)) && st.gap {
                        st.incomplete = true;
                    }
                }
                Lead::Any => {}
            }
            st.apply(&next);
            if let Some(e) = self.too_large(st, opts).await {
                return Step::Done(Box::new(Err(e)));
            }
            if let Some(done) = listen(st, &next, listener) {
                return Step::Done(Box::new(done));
            }
            if let Some(end) = end_of(st, Some(&next)) {
                let end = self.settle_gap(st, opts, deadline, end).await;
                return Step::Done(Box::new(end));
            }
        }
    }

    /// A completed task whose stream left a gap uncovered (a resubscription
    /// after a recovery's snapshot that did not begin with the Task) is
    /// flagged incomplete, though the gap may have lost nothing: one
    /// GetTask settles it. A completed task's artifacts are final, so its
    /// snapshot is authoritative: applied, it restores whatever the gap
    /// lost, and the result is whole unless the snapshot leaves out
    /// artifacts the stream brought (see [`CallState::apply_task`]). If
    /// the read fails (or shows anything but the completed task), the
    /// result stays flagged: the call ends either way.
    async fn settle_gap(
        &self,
        st: &mut CallState,
        opts: &CallOptions,
        deadline: Instant,
        end: Result<Outcome, CallError>,
    ) -> Result<Outcome, CallError> {
        if !st.gap || !matches!(end, Ok(Outcome::Completed { .. })) {
            return end;
        }
        let Some(task_id) = st.task_id.clone() else {
            return end;
        };
        // The task is over: a remote that does not answer holds the call
        // no longer than one idle period, not to its deadline.
        let task = match tokio::time::timeout_at(
            look_until(deadline, opts),
            self.get_task(&task_id),
        )
        .await
        {
            Ok(Ok(task)) if task.status.state == TaskState::Completed => task,
            Ok(Ok(task)) => {
                tracing::warn!(task = %task_id, state = ?task.status.state, "a2a: GetTask after the task completed shows another state; its result stays flagged incomplete");
                return end;
            }
            Ok(Err(e)) => {
                tracing::warn!(task = %task_id, error = %e.message, "a2a: GetTask after the task completed failed; its result stays flagged incomplete");
                return end;
            }
            Err(_) => {
                tracing::warn!(task = %task_id, "a2a: GetTask after the task completed went unanswered for an idle period; its result stays flagged incomplete");
                return end;
            }
        };
        st.apply_task(&task);
        // Covered: the snapshot's artifacts replaced the buffer, or the
        // task has none and none were streamed: nothing was lost.
        if !st.gap {
            st.incomplete = false;
        }
        // Over the limit: the call ends TooLarge, with no cancel for a
        // task that has completed.
        if st.artifact_bytes > opts.max_artifact_bytes {
            return Err(CallError::TooLarge {
                task_id: st.task_id.clone(),
                limit: opts.max_artifact_bytes,
                cancel: Cancellation::Ended,
            });
        }
        end_of(st, None).unwrap_or(end)
    }

    /// Past `max_artifact_bytes`: the remote task is cancelled (unless it
    /// was seen ended), and the error to end the call with.
    async fn too_large(&self, st: &CallState, opts: &CallOptions) -> Option<CallError> {
        if st.artifact_bytes <= opts.max_artifact_bytes {
            return None;
        }
        let ended = st.last_state.as_ref().is_some_and(|s| s.is_terminal());
        let cancel = match &st.task_id {
            Some(_) if ended => Cancellation::Ended,
            Some(id) => {
                self.cancel_logged(id, st, "its artifacts outgrew the limit")
                    .await
            }
            None => Cancellation::NotSent,
        };
        Some(CallError::TooLarge {
            task_id: st.task_id.clone(),
            limit: opts.max_artifact_bytes,
            cancel,
        })
    }

    async fn abandon_at_deadline(&self, st: &CallState) -> CallError {
        let cancel = match &st.task_id {
            Some(id) => self.cancel_logged(id, st, "deadline").await,
            None => Cancellation::NotSent,
        };
        CallError::Deadline {
            task_id: st.task_id.clone(),
            last_state: st.last_state.clone(),
            artifacts: st.artifacts(),
            cancel,
        }
    }

    async fn give_up(
        &self,
        st: &CallState,
        task_id: String,
        cause: String,
        recoveries: u32,
    ) -> CallError {
        let cancel = self.cancel_logged(&task_id, st, "recovery gave up").await;
        CallError::Unrecoverable {
            task_id,
            last_state: st.last_state.clone(),
            recoveries,
            cause,
            artifacts: st.artifacts(),
            cancel,
        }
    }

    /// Sends CancelTask for the task a call abandons, and logs how it went.
    async fn cancel_logged(&self, task_id: &str, st: &CallState, why: &str) -> Cancellation {
        const WAIT: Duration = Duration::from_secs(10);
        let cancel = match tokio::time::timeout(WAIT, self.cancel(task_id)).await {
            Ok(Ok(t)) => Cancellation::Acknowledged(t.status.state),
            Ok(Err(e)) => Cancellation::Failed(e.message),
            Err(_) => Cancellation::Failed(format!("no answer within {WAIT:?}")),
        };
        tracing::warn!(task = %task_id, reached = ?st.last_state, artifacts = st.artifacts.len(), %cancel, "a2a: abandoned the remote task ({why})");
        cancel
    }
}

/// How long a look at a task whose fate does not hang on it (the settling
/// look at a completed task, the look before a reply) may take: an idle
/// period, never past the deadline; past it the call goes on without it.
/// Looks at a running task take up to the deadline: a large snapshot is
/// slow to arrive, and giving up on it would cancel a healthy task.
fn look_until(deadline: Instant, opts: &CallOptions) -> Instant {
    deadline.min(Instant::now() + opts.idle_timeout)
}

/// The end of a call whose recovery met an error that retrying cannot fix:
/// a task the remote no longer knows is lost; anything else is a refusal,
/// named with the request it answered. Either way the task is not
/// cancelled: it was not failing, our requests were.
fn lost_or_refused(st: &CallState, task_id: String, request: &str, e: A2AError) -> CallError {
    if e.code == a2a::error_code::TASK_NOT_FOUND {
        tracing::warn!(task = %task_id, error = %e.message, "a2a: the remote agent no longer knows the task");
        return CallError::TaskLost {
            task_id,
            last_state: st.last_state.clone(),
            artifacts: st.artifacts(),
        };
    }
    tracing::warn!(task = %task_id, request, code = e.code, error = %e.message, "a2a: recovery refused; not retried");
    CallError::Refused(A2AError {
        code: e.code,
        message: format!(
            "{request} failed while recovering task {task_id} from a dropped stream, with {} ({}); not retried, since retrying cannot fix it, and the task was not cancelled",
            reason(&e),
            e.message
        ),
        details: e.details,
    })
}

/// What `listener` makes of `event`: the end of the call if it stops it.
fn listen(
    st: &CallState,
    event: &StreamResponse,
    listener: &mut Option<&mut dyn Listener>,
) -> Option<Result<Outcome, CallError>> {
    match listener.as_deref_mut()?.on_event(event, st) {
        Control::Continue => None,
        Control::StopWithResponse(text) => Some(Ok(stopped(st, Some(text)))),
        Control::StopWithArtifacts => Some(Ok(stopped(st, None))),
    }
}

/// Whether `e` says a message from the remote was larger than the
/// transport receives: tonic's decode limit (4 MiB a message, which the
/// gRPC binding's client keeps: it offers no way to raise it), reported as
/// INTERNAL_ERROR with tonic's own message; or an event or answer past the
/// JSON-RPC transport's [`jsonrpc::Limits`]. The same update, or the task
/// holding it, would come again on every retry.
fn unreceivable(e: &A2AError) -> bool {
    e.message.contains("decoded message length too large") || jsonrpc::is_too_large(e)
}

/// The end of a call that met a message larger than the transport
/// receives (see [`unreceivable`]). The task is left running: it was not
/// failing, this client cannot take what it sends.
fn too_large_to_receive(st: &CallState, e: A2AError) -> CallError {
    tracing::warn!(task = ?st.task_id, error = %e.message, "a2a: a message from the remote agent is larger than this client receives; not retried");
    CallError::MessageTooLarge {
        task_id: st.task_id.clone(),
        last_state: st.last_state.clone(),
        artifacts: st.artifacts(),
        cause: e.message,
    }
}

enum Step {
    Done(Box<Result<Outcome, CallError>>),
    Deadline,
    Dropped(String),
}

fn stopped(st: &CallState, response: Option<String>) -> Outcome {
    Outcome::Stopped {
        task_id: st.task_id.clone(),
        response,
        artifacts: st.artifacts(),
        incomplete: st.incomplete,
    }
}

/// Whether the call ends here, and how. `event` is the update just applied
/// (`None` after a snapshot).
fn end_of(st: &CallState, event: Option<&StreamResponse>) -> Option<Result<Outcome, CallError>> {
    if let Some(StreamResponse::Message(m)) = event {
        return Some(Ok(Outcome::Message(m.clone())));
    }
    let state = st.last_state.clone()?;
    let ids = || {
        (
            st.task_id.clone().unwrap_or_default(),
            st.context_id.clone().unwrap_or_default(),
        )
    };
    match state {
        TaskState::Completed => {
            let (task_id, context_id) = ids();
            Some(Ok(Outcome::Completed {
                task_id,
                context_id,
                artifacts: st.artifacts(),
                incomplete: st.incomplete,
                message: st.status_message.clone(),
            }))
        }
        TaskState::Failed | TaskState::Rejected | TaskState::Canceled => {
            let message = st
                .status_message
                .as_ref()
                .map(|m| parts_text(&m.parts))
                .unwrap_or_default();
            Some(Err(CallError::Task {
                state,
                task_id: ids().0,
                message,
                artifacts: st.artifacts(),
            }))
        }
        TaskState::InputRequired | TaskState::AuthRequired => {
            let (task_id, context_id) = ids();
            Some(Ok(Outcome::Waiting {
                state,
                task_id,
                context_id,
                message: st.status_message.clone(),
                artifacts: st.artifacts(),
            }))
        }
        TaskState::Submitted | TaskState::Working | TaskState::Unspecified => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use a2a::TaskArtifactUpdateEvent;

    #[test]
    fn an_interface_downgrades_when_it_leaves_tls_for_plaintext() {
        let card = "https://partner.example/";
        for plain in [
            "http://other-host/",
            "http://partner.example/",
            "HTTP://partner.example/",
            "partner.example:50051",
            "grpc://partner.example:50051",
            "",
        ] {
            assert!(downgrades(card, plain), "{plain:?}");
            assert!(downgrades("HTTPS://partner.example", plain), "{plain:?}");
        }
        for kept in [
            "https://partner.example/rpc",
            "HTTPS://pod-7.partner.svc:8443/",
        ] {
            assert!(!downgrades(card, kept), "{kept:?}");
        }
        // A card read over plaintext has nothing to lose.
        for any in ["http://other-host/", "host:50051", "https://x/"] {
            assert!(!downgrades("http://partner.example", any), "{any:?}");
        }
    }

    fn chunk(id: &str, text: &str, append: bool, last: bool) -> StreamResponse {
        update(id, vec![Part::text(text)], append, last)
    }

    fn update(id: &str, parts: Vec<Part>, append: bool, last: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            artifact: Artifact {
                artifact_id: id.into(),
                name: None,
                description: None,
                parts,
                metadata: None,
                extensions: None,
            },
            append: Some(append),
            last_chunk: Some(last),
            metadata: None,
        })
    }

    /// Artifact `id` whole, with a text part for each of `texts`.
    fn art(id: &str, texts: &[&str]) -> Artifact {
        let StreamResponse::ArtifactUpdate(u) = update(
            id,
            texts.iter().map(|t| Part::text(*t)).collect(),
            false,
            false,
        ) else {
            unreachable!()
        };
        u.artifact
    }

    /// A reply turn's message: more input to task t.
    fn reply() -> Message {
        Message {
            task_id: Some("t".into()),
            context_id: Some("c".into()),
            ..Message::new(Role::User, vec![Part::text("more")])
        }
    }

    /// Task t's artifacts before a reply turn: notes and an answer.
    fn before_the_turn() -> Vec<Artifact> {
        vec![art("notes", &["earlier"]), art("answer", &["old answer"])]
    }

    /// The same mid-turn: the turn rewrote the answer (same id) and began
    /// a2 with "x ".
    fn during_the_turn() -> Vec<Artifact> {
        vec![
            art("notes", &["earlier"]),
            art("answer", &["new answer"]),
            art("a2", &["x "]),
        ]
    }

    /// A subscription to task t mid-turn: it begins with the task as
    /// [`during_the_turn`] shows it, then a2 ends with "y" and the task
    /// completes.
    fn resubscribed() -> Reply<Stream> {
        Box::new(|_| {
            Ok(stream(vec![
                StreamResponse::Task(snapshot(TaskState::Working, Some(during_the_turn()))),
                chunk("a2", "y", true, true),
                status(TaskState::Completed),
            ]))
        })
    }

    #[test]
    fn appends_extend_and_a_non_append_replaces_per_artifact_id() {
        let mut st = CallState::new();
        for e in [
            chunk("a", "1", false, false),
            chunk("b", "x", false, true),
            chunk("a", "2", true, true),
        ] {
            st.apply(&e);
        }
        assert_eq!(st.task_id.as_deref(), Some("t"));
        assert_eq!(
            st.artifacts
                .iter()
                .map(|b| (b.text(), b.ready))
                .collect::<Vec<_>>(),
            [("12".into(), true), ("x".into(), true)]
        );
        st.apply(&chunk("a", "new", false, true));
        assert_eq!(st.artifacts[0].text(), "new");
        assert!(!st.incomplete);
    }

    #[test]
    fn an_append_without_its_start_and_a_gap_mid_artifact_mark_the_result_incomplete() {
        let mut st = CallState::new();
        st.apply(&chunk("a", "2", true, false));
        assert!(st.incomplete);
        let mut st = CallState::new();
        st.apply(&chunk("a", "1", false, false));
        st.mark_gap();
        assert!(
            st.incomplete,
            "a gap while an artifact streams may lose chunks"
        );
        let mut task = Task {
            id: "t".into(),
            context_id: "c".into(),
            status: a2a::TaskStatus {
                state: TaskState::Working,
                message: None,
                timestamp: None,
            },
            artifacts: None,
            history: None,
            metadata: None,
        };
        st.apply_task(&task);
        assert!(
            st.incomplete,
            "a snapshot without artifacts restores nothing"
        );
        task.artifacts = Some(vec![art("a", &["1", "2"])]);
        st.apply_task(&task);
        assert!(!st.incomplete, "the snapshot's artifacts are authoritative");
        assert_eq!(st.artifacts[0].text(), "12");
    }

    fn snapshot(state: TaskState, artifacts: Option<Vec<Artifact>>) -> Task {
        Task {
            id: "t".into(),
            context_id: "c".into(),
            status: a2a::TaskStatus {
                state,
                message: None,
                timestamp: None,
            },
            artifacts,
            history: None,
            metadata: None,
        }
    }

    #[test]
    fn a_whole_artifact_lost_in_a_gap_that_snapshots_cannot_restore_marks_the_result_incomplete() {
        // Every artifact seen had ended when the stream dropped; the remote's
        // snapshot leaves them out: whatever came meanwhile is unknown.
        let mut st = CallState::new();
        st.apply(&chunk("a1", "whole", false, true));
        st.mark_gap();
        assert!(!st.incomplete, "nothing known lost yet");
        st.apply_task(&snapshot(TaskState::Completed, None));
        assert!(
            st.incomplete,
            "a snapshot without the artifacts already seen cannot restore the gap"
        );
        // Once the remote is known to leave artifacts out, any gap counts.
        let mut st = CallState::new();
        st.apply(&chunk("a1", "whole", false, true));
        st.apply_task(&snapshot(TaskState::Working, None));
        assert!(!st.incomplete);
        st.mark_gap();
        assert!(st.incomplete);
    }

    #[test]
    fn a_gap_before_any_artifact_is_covered_by_a_snapshot_that_has_none() {
        // A snapshot carries the task's artifacts (A2A's Task does): one with
        // none, before any was seen, says the gap lost nothing.
        let mut st = CallState::new();
        st.apply_task(&snapshot(TaskState::Working, None));
        st.mark_gap();
        st.apply_task(&snapshot(TaskState::Working, None));
        st.apply(&chunk("a1", "1", false, false));
        st.apply(&chunk("a1", "2", true, true));
        assert!(!st.incomplete);
        assert_eq!(st.artifacts[0].text(), "12");
    }

    #[test]
    fn the_buffered_size_follows_appends_replacements_and_snapshots() {
        // What the buffer holds, measured afresh.
        let held = |st: &CallState| {
            st.artifacts
                .iter()
                .map(|b| artifact_size(&b.artifact))
                .sum::<usize>()
        };
        let mut st = CallState::new();
        st.apply(&chunk("a", "12345", false, false));
        st.apply(&chunk("a", "678", true, false));
        st.apply(&chunk("b", "xy", false, true));
        assert_eq!(st.artifact_bytes, held(&st));
        let before = st.artifact_bytes;
        st.apply(&chunk("a", "1", false, true));
        assert_eq!(st.artifact_bytes, held(&st));
        assert!(
            st.artifact_bytes < before,
            "a replacement drops what it replaces"
        );
        let StreamResponse::ArtifactUpdate(u) = chunk("c", "abcd", false, true) else {
            unreachable!()
        };
        let c = artifact_size(&u.artifact);
        st.apply_task(&snapshot(TaskState::Working, Some(vec![u.artifact])));
        assert_eq!(st.artifact_bytes, c, "a snapshot replaces the buffer");
    }

    #[test]
    fn parts_without_content_and_artifacts_without_parts_are_counted() {
        // An empty text with 1 KiB of metadata, appended again and again.
        let meta = HashMap::from([("k".to_owned(), serde_json::json!("x".repeat(1024)))]);
        let mut st = CallState::new();
        for _ in 0..100 {
            st.apply(&update("a", vec![empty_with(&meta)], true, false));
        }
        assert!(st.artifact_bytes >= 100 * 1024, "{}", st.artifact_bytes);
        // A new id each time, without parts.
        let mut st = CallState::new();
        for i in 0..100 {
            st.apply(&update(&format!("a{i}"), vec![], false, true));
        }
        assert!(
            st.artifact_bytes >= 100 * size_of::<BufferedArtifact>(),
            "{}",
            st.artifact_bytes
        );
        assert_eq!(st.artifacts.len(), 100);
        assert_eq!(st.index.len(), 100);
    }

    #[tokio::test]
    async fn stream_growing_the_buffer_without_content_ends_too_large_and_cancels() {
        let meta = HashMap::from([("k".to_owned(), serde_json::json!("x".repeat(1024)))]);
        // Endless appends of empty parts with metadata, or new ids without
        // parts; each stream completes after enough of them to pass the
        // limit many times over.
        let floods: [Vec<StreamResponse>; 2] = [
            (0..1000)
                .map(|_| update("a", vec![empty_with(&meta)], true, false))
                .collect(),
            (0..1000)
                .map(|i| update(&format!("a{i}"), vec![], false, true))
                .collect(),
        ];
        for flood in floods {
            let events: Vec<StreamResponse> = [status(TaskState::Working)]
                .into_iter()
                .chain(flood)
                .chain([status(TaskState::Completed)])
                .collect();
            let remote = Arc::new(Remote {
                send: Box::new(move |_| Ok(stream(events.clone()))),
                ..Remote::new()
            });
            let o = CallOptions {
                max_artifact_bytes: 16 << 10,
                ..opts()
            };
            let err = go_with(&remote, &o).await.unwrap_err();
            assert!(
                matches!(&err, CallError::TooLarge { task_id: Some(t), limit, cancel: Cancellation::Acknowledged(TaskState::Canceled) } if t == "t" && *limit == 16 << 10),
                "{err:?}"
            );
            assert_eq!(remote.count(&remote.cancelled), 1);
        }
        // Legitimate use: the same stream of content, under the default
        // limit, completes.
        let remote = Arc::new(Remote {
            send: Box::new(|_| {
                Ok(stream(vec![
                    status(TaskState::Working),
                    chunk("a", "1", false, false),
                    chunk("a", "2", true, true),
                    status(TaskState::Completed),
                ]))
            }),
            ..Remote::new()
        });
        let out = go(&remote).await.unwrap();
        assert!(
            matches!(&out, Outcome::Completed { artifacts, .. } if parts_text(&artifacts[0].parts) == "12"),
            "{out:?}"
        );
    }

    #[test]
    fn stream_that_always_has_an_event_ready_still_meets_the_deadline_and_cancels() {
        let remote = Arc::new(Remote {
            send: Box::new(|_| {
                Ok(Box::pin(futures::stream::repeat_with(|| {
                    Ok(status(TaskState::Working))
                })))
            }),
            ..Remote::new()
        });
        let client = client_of(&remote);
        let (tx, rx) = std::sync::mpsc::channel();
        // On a thread and a runtime of its own: a call that never yields
        // cannot be stopped by a timer on its runtime, and the test must end
        // either way.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let o = CallOptions {
                deadline: Duration::from_millis(200),
                ..opts()
            };
            let _ = tx.send(rt.block_on(client.send_text("go", None, &o, None)));
        });
        let out = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the deadline never ended the call");
        assert!(
            matches!(
                &out,
                Err(CallError::Deadline {
                    task_id: Some(_),
                    last_state: Some(TaskState::Working),
                    cancel: Cancellation::Acknowledged(TaskState::Canceled),
                    ..
                })
            ),
            "{out:?}"
        );
        assert_eq!(remote.count(&remote.cancelled), 1);
    }

    /// A remote whose first stream is lost after the task started, and whose
    /// GetTask shows it still working.
    fn dropping(subscribe: Reply<Stream>) -> Arc<Remote> {
        Arc::new(dropped(subscribe))
    }

    /// [`dropping`]'s remote, for a test to script further.
    fn dropped(subscribe: Reply<Stream>) -> Remote {
        Remote {
            send: Box::new(|_| Ok(stream(vec![status(TaskState::Working)]))),
            get: Box::new(|_| Ok(snapshot(TaskState::Working, None))),
            subscribe,
            ..Remote::new()
        }
    }

    /// A completed task's message is its last status's own: a progress
    /// note of an earlier status is not the answer.
    #[test]
    fn the_outcomes_message_is_the_last_statuss_own() {
        let said = |state: TaskState, text: Option<&str>| {
            let StreamResponse::StatusUpdate(mut u) = status(state) else {
                unreachable!()
            };
            u.status.message = text.map(|t| Message::new(Role::Agent, vec![Part::text(t)]));
            StreamResponse::StatusUpdate(u)
        };
        let mut st = CallState::new();
        st.apply(&said(TaskState::Working, Some("Looking up the order")));
        st.apply(&said(TaskState::Completed, None));
        let Some(Ok(Outcome::Completed { message, .. })) = end_of(&st, None) else {
            panic!("not completed")
        };
        assert!(message.is_none(), "{message:?}");
        st.apply(&said(TaskState::Completed, Some("all done")));
        let Some(Ok(Outcome::Completed { message, .. })) = end_of(&st, None) else {
            panic!("not completed")
        };
        assert_eq!(parts_text(&message.unwrap().parts), "all done");
    }

    #[tokio::test]
    async fn recovery_errors_retrying_cannot_fix_end_the_call_at_once_without_a_cancel() {
        use crate::a2a::auth::{PERMISSION_DENIED_CODE, UNAUTHENTICATED_CODE};
        use a2a::error_code as c;
        // GetTask refused so: the task cannot be followed; it is left
        // running, and the error names the request and why.
        for (code, name) in [
            (c::METHOD_NOT_FOUND, "METHOD_NOT_FOUND"),
            (c::INVALID_PARAMS, "INVALID_PARAMS"),
            (c::VERSION_NOT_SUPPORTED, "VERSION_NOT_SUPPORTED"),
            (UNAUTHENTICATED_CODE, "UNAUTHENTICATED"),
            (PERMISSION_DENIED_CODE, "PERMISSION_DENIED"),
        ] {
            let remote = Arc::new(Remote {
                get: Box::new(move |_| Err(A2AError::new(code, "no"))),
                ..dropped(Box::new(|_| unreachable!()))
            });
            let err = go(&remote).await.unwrap_err();
            let CallError::Refused(e) = &err else {
                panic!("{name}: {err:?}")
            };
            assert_eq!(e.code, code);
            assert!(
                e.message.contains("GetTask") && e.message.contains(name),
                "{e:?}"
            );
            assert_eq!(remote.count(&remote.got), 1, "{name} was retried");
            assert_eq!(remote.count(&remote.cancelled), 0, "{name}: cancelled");
        }
        // A refusal to subscribe that may pass while GetTask still shows the
        // task working (agentd's face: a task another replica has not
        // started, or waits for input): retried as any failed recovery.
        for refusal in [
            A2AError::task_not_found("t"),
            A2AError::unsupported_operation("cannot be followed now"),
        ] {
            let remote = dropping(Box::new(move |_| Err(refusal.clone())));
            let err = go(&remote).await.unwrap_err();
            assert!(matches!(err, CallError::Unrecoverable { .. }), "{err:?}");
            assert!(remote.count(&remote.subscribed) > 1);
        }
        // A task the remote no longer knows at all: lost at once.
        let remote = Arc::new(Remote {
            get: Box::new(|n| {
                if n == 0 {
                    Ok(snapshot(TaskState::Working, None))
                } else {
                    Err(A2AError::task_not_found("t"))
                }
            }),
            ..dropped(Box::new(|_| Err(A2AError::task_not_found("t"))))
        });
        let err = go(&remote).await.unwrap_err();
        assert!(matches!(err, CallError::TaskLost { .. }), "{err:?}");
        assert_eq!(remote.count(&remote.subscribed), 1);
        assert_eq!(remote.count(&remote.cancelled), 0);
        // The same from GetTask: nothing subscribed, nothing cancelled.
        let remote = Arc::new(Remote {
            get: Box::new(|_| Err(A2AError::new(UNAUTHENTICATED_CODE, "bad token"))),
            ..dropped(Box::new(|_| unreachable!()))
        });
        let err = go(&remote).await.unwrap_err();
        assert!(
            matches!(&err, CallError::Refused(e) if e.message.contains("GetTask")),
            "{err:?}"
        );
        assert_eq!(remote.count(&remote.got), 1);
        assert_eq!(remote.count(&remote.cancelled), 0);
        // The task ended between the snapshot and the subscription: an
        // answer, not a refusal.
        let remote = Arc::new(Remote {
            get: Box::new(|n| {
                Ok(snapshot(
                    if n == 0 {
                        TaskState::Working
                    } else {
                        TaskState::Completed
                    },
                    None,
                ))
            }),
            ..dropped(Box::new(|_| {
                Err(A2AError::unsupported_operation("the task ended"))
            }))
        });
        let out = go(&remote).await.unwrap();
        assert!(matches!(out, Outcome::Completed { .. }), "{out:?}");
        assert_eq!(remote.count(&remote.cancelled), 0);
    }

    #[tokio::test]
    async fn transient_recovery_errors_are_retried_then_the_task_is_cancelled() {
        let remote = dropping(Box::new(|_| {
            Err(A2AError::internal(
                "HTTP request failed: connection refused",
            ))
        }));
        let o = CallOptions {
            max_recoveries: 3,
            ..opts()
        };
        let err = go_with(&remote, &o).await.unwrap_err();
        let CallError::Unrecoverable {
            recoveries, cancel, ..
        } = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!(*recoveries, 3);
        assert_eq!(*cancel, Cancellation::Acknowledged(TaskState::Canceled));
        assert_eq!(remote.count(&remote.subscribed), 3);
        assert_eq!(remote.count(&remote.cancelled), 1);
    }

    #[tokio::test]
    async fn errors_say_whether_the_cancel_was_sent_and_how_it_went() {
        let o = CallOptions {
            deadline: Duration::from_millis(100),
            ..opts()
        };
        let stalls = |events: Vec<StreamResponse>| -> Reply<Stream> {
            Box::new(move |_| {
                Ok(Box::pin(
                    futures::stream::iter(events.clone().into_iter().map(Ok))
                        .chain(futures::stream::pending()),
                ))
            })
        };
        // The cancel fails: the task may still run, and the error says so.
        let remote = Arc::new(Remote {
            send: stalls(vec![status(TaskState::Working)]),
            cancel: Box::new(|_| Err(A2AError::task_not_cancelable("t"))),
            ..Remote::new()
        });
        let err = go_with(&remote, &o).await.unwrap_err();
        assert!(
            matches!(
                &err,
                CallError::Deadline {
                    cancel: Cancellation::Failed(_),
                    ..
                }
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("CancelTask failed") && !text.contains("was cancelled"),
            "{text}"
        );
        assert_eq!(remote.count(&remote.cancelled), 1);
        // The cancel is acknowledged.
        let remote = Arc::new(Remote {
            send: stalls(vec![status(TaskState::Working)]),
            ..Remote::new()
        });
        let err = go_with(&remote, &o).await.unwrap_err();
        assert!(
            err.to_string().contains("the remote task was cancelled"),
            "{err}"
        );
        // No task id: no cancel, and no claim of one.
        let remote = Arc::new(Remote {
            send: stalls(vec![]),
            ..Remote::new()
        });
        let err = go_with(&remote, &o).await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("no cancel was sent") && !text.contains("was cancelled"),
            "{text}"
        );
        assert_eq!(remote.count(&remote.cancelled), 0);
        let too_large = CallError::TooLarge {
            task_id: None,
            limit: 1,
            cancel: Cancellation::NotSent,
        }
        .to_string();
        assert!(
            too_large.contains("no cancel was sent") && !too_large.contains("was cancelled"),
            "{too_large}"
        );
    }

    #[tokio::test]
    async fn recovery_in_a_reply_turn_brings_back_only_this_turns_artifacts() {
        let with = |state, artifacts| Ok(snapshot(state, Some(artifacts)));
        let texts = |out: Outcome| match out {
            Outcome::Completed {
                artifacts,
                incomplete: false,
                ..
            } => artifacts
                .iter()
                .map(|a| (a.artifact_id.clone(), parts_text(&a.parts)))
                .collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        // Without a drop.
        let remote = Arc::new(Remote {
            get: Box::new(move |_| with(TaskState::InputRequired, before_the_turn())),
            send: Box::new(|_| {
                Ok(stream(vec![
                    status(TaskState::Working),
                    chunk("answer", "new answer", false, true),
                    chunk("a2", "x ", false, false),
                    chunk("a2", "y", true, true),
                    status(TaskState::Completed),
                ]))
            }),
            ..Remote::new()
        });
        let whole = texts(
            client_of(&remote)
                .send(reply(), &opts(), None)
                .await
                .unwrap(),
        );
        assert_eq!(
            whole,
            [
                ("answer".to_owned(), "new answer".to_owned()),
                ("a2".to_owned(), "x y".to_owned())
            ]
        );
        // The stream drops after a2's first chunk; the answer went out in
        // the gap. The snapshots hold the notes too.
        let remote = Arc::new(Remote {
            get: Box::new(move |n| {
                if n == 0 {
                    with(TaskState::InputRequired, before_the_turn())
                } else {
                    with(TaskState::Working, during_the_turn())
                }
            }),
            send: Box::new(|_| {
                Ok(stream(vec![
                    status(TaskState::Working),
                    chunk("a2", "x ", false, false),
                ]))
            }),
            subscribe: resubscribed(),
            ..Remote::new()
        });
        let recovered = texts(
            client_of(&remote)
                .send(reply(), &opts(), None)
                .await
                .unwrap(),
        );
        assert_eq!(remote.count(&remote.subscribed), 1, "no drop was recovered");
        assert_eq!(recovered, whole);
    }

    /// A remote that refuses SubscribeToTask for good (it does not offer
    /// it, or not to us) while GetTask shows the task running: the task is
    /// followed by GetTask to its end, or cancelled at the deadline; never
    /// left running with no one following it.
    #[tokio::test]
    async fn a_subscription_refused_for_good_has_the_task_followed_by_get_task() {
        use crate::a2a::auth::{PERMISSION_DENIED_CODE, UNAUTHENTICATED_CODE};
        use a2a::error_code as c;
        let done = |n: usize| {
            let StreamResponse::ArtifactUpdate(u) = chunk("a", &format!("{n} "), false, true)
            else {
                unreachable!()
            };
            Ok(snapshot(
                if n < 4 {
                    TaskState::Working
                } else {
                    TaskState::Completed
                },
                Some(vec![u.artifact]),
            ))
        };
        for code in [
            c::METHOD_NOT_FOUND,
            c::INVALID_PARAMS,
            c::VERSION_NOT_SUPPORTED,
            UNAUTHENTICATED_CODE,
            PERMISSION_DENIED_CODE,
        ] {
            let remote = Arc::new(Remote {
                get: Box::new(done),
                ..dropped(Box::new(move |_| Err(A2AError::new(code, "no"))))
            });
            let mut seen = Vec::new();
            let mut watch = |ev: &StreamResponse, st: &CallState| {
                if matches!(ev, StreamResponse::Task(_)) {
                    seen.push(st.artifacts[0].text());
                }
                Control::Continue
            };
            let out = client_of(&remote)
                .send_text("go", None, &opts(), Some(&mut watch))
                .await
                .unwrap_or_else(|e| panic!("{code}: {e:?}"));
            let Outcome::Completed {
                artifacts,
                incomplete: false,
                ..
            } = out
            else {
                panic!("{code}: {out:?}")
            };
            assert_eq!(parts_text(&artifacts[0].parts), "4 ");
            assert_eq!(remote.count(&remote.subscribed), 1, "{code}: resubscribed");
            assert_eq!(remote.count(&remote.got), 5, "{code}");
            assert_eq!(remote.count(&remote.cancelled), 0, "{code}: cancelled");
            // Each look went to the listener, as an update would have.
            assert_eq!(seen, ["2 ", "3 ", "4 "], "{code}");
        }
        // A task that never ends: cancelled at the deadline.
        let remote = dropping(Box::new(|_| Err(A2AError::new(c::METHOD_NOT_FOUND, "no"))));
        let o = CallOptions {
            deadline: Duration::from_millis(300),
            ..opts()
        };
        let err = go_with(&remote, &o).await.unwrap_err();
        assert!(
            matches!(
                &err,
                CallError::Deadline {
                    cancel: Cancellation::Acknowledged(TaskState::Canceled),
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(remote.count(&remote.subscribed), 1);
        assert!(remote.count(&remote.got) > 2);
        assert_eq!(remote.count(&remote.cancelled), 1);
    }

    /// What the task sends between a recovery's snapshot and the
    /// subscription is covered by a subscription that begins with the
    /// Task, or else, once the task completed, by one last GetTask (a
    /// completed task's artifacts are final); with neither, the hole stays,
    /// and the result says so.
    #[tokio::test]
    async fn chunks_lost_between_the_snapshot_and_a_subscription_without_a_task_are_flagged() {
        // The stream sends "1" of artifact a, its last chunk if `a_ends`,
        // and drops; the recovery's GetTask shows "1"; the one after the
        // end, `last`.
        let got = |a_ends: bool, subscription: Vec<StreamResponse>, last: Reply<Task>| {
            Arc::new(Remote {
                send: Box::new(move |_| {
                    Ok(stream(vec![
                        status(TaskState::Working),
                        chunk("a", "1", false, a_ends),
                    ]))
                }),
                get: Box::new(move |n| match n {
                    0 => Ok(snapshot(TaskState::Working, Some(vec![art("a", &["1"])]))),
                    n => last(n),
                }),
                subscribe: Box::new(move |_| Ok(stream(subscription.clone()))),
                ..Remote::new()
            })
        };
        let result = |out: Outcome| match out {
            Outcome::Completed {
                artifacts,
                incomplete,
                ..
            } => (parts_text(&artifacts[0].parts), incomplete),
            other => panic!("{other:?}"),
        };
        // "2" went out between the snapshot and the subscription: the
        // completed task's snapshot restores it.
        let without_the_task = || vec![chunk("a", "3", true, true), status(TaskState::Completed)];
        let remote = got(
            false,
            without_the_task(),
            Box::new(move |_| {
                Ok(snapshot(
                    TaskState::Completed,
                    Some(vec![art("a", &["1", "2", "3"])]),
                ))
            }),
        );
        let out = go(&remote).await.unwrap();
        assert_eq!(remote.count(&remote.subscribed), 1);
        assert_eq!(remote.count(&remote.got), 2, "one GetTask after the end");
        assert_eq!(result(out), ("123".to_owned(), false));
        // That last GetTask failing, showing the task without its
        // artifacts, or not completed, leaves the hole flagged.
        let lasts: [Reply<Task>; 3] = [
            Box::new(|_| Err(A2AError::new(a2a::error_code::INTERNAL_ERROR, "busy"))),
            Box::new(|_| Ok(snapshot(TaskState::Completed, None))),
            Box::new(move |_| {
                Ok(snapshot(
                    TaskState::Working,
                    Some(vec![art("a", &["1", "2", "3"])]),
                ))
            }),
        ];
        for last in lasts {
            let remote = got(false, without_the_task(), last);
            let out = go(&remote).await.unwrap();
            assert_eq!(remote.count(&remote.got), 2);
            assert_eq!(result(out), ("13".to_owned(), true));
        }
        // No artifact was streaming, but a whole one ("b") may have gone
        // out: flagged, unless the last GetTask shows it.
        let whole = |last: Reply<Task>| {
            got(
                true,
                vec![chunk("c", "3", false, true), status(TaskState::Completed)],
                last,
            )
        };
        let remote = whole(Box::new(|_| {
            Err(A2AError::new(a2a::error_code::INTERNAL_ERROR, "busy"))
        }));
        let out = go(&remote).await.unwrap();
        assert!(
            matches!(&out, Outcome::Completed { artifacts, incomplete: true, .. } if artifacts.len() == 2),
            "{out:?}"
        );
        let remote = whole(Box::new(move |_| {
            Ok(snapshot(
                TaskState::Completed,
                Some(vec![art("a", &["1"]), art("b", &["2"]), art("c", &["3"])]),
            ))
        }));
        let out = go(&remote).await.unwrap();
        assert!(
            matches!(&out, Outcome::Completed { artifacts, incomplete: false, .. } if artifacts.len() == 3),
            "{out:?}"
        );
        // A subscription that begins with the task as it is restores it:
        // no GetTask after the end.
        let remote = got(
            false,
            vec![
                StreamResponse::Task(snapshot(
                    TaskState::Working,
                    Some(vec![art("a", &["1", "2"])]),
                )),
                chunk("a", "3", true, true),
                status(TaskState::Completed),
            ],
            Box::new(|_| panic!("no GetTask after the end")),
        );
        let out = go(&remote).await.unwrap();
        assert_eq!(remote.count(&remote.got), 1);
        assert_eq!(result(out), ("123".to_owned(), false));
    }

    /// A slow GetTask is waited for where the task's fate hangs on it
    /// (following a running task by GetTask alone: giving up would cancel a
    /// healthy task), and for one idle period at most where it does not:
    /// settling a completed task's gap (the result stays flagged) and the
    /// look before a reply turn (the reply goes out without it).
    #[tokio::test]
    async fn a_slow_get_task_is_waited_for_only_where_the_task_needs_it() {
        const NEVER: Duration = Duration::from_secs(3600);
        let quick = CallOptions {
            idle_timeout: Duration::from_millis(100),
            deadline: Duration::from_secs(30),
            ..opts()
        };
        async fn bounded<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .unwrap_or_else(|_| {
                    panic!("{what}: the call waited for a GetTask it needs no answer from")
                })
        }
        // Followed by GetTask alone (the remote does not offer
        // SubscribeToTask); its third look takes three idle periods.
        let remote = Arc::new(Remote {
            get: Box::new(|n| {
                Ok(snapshot(
                    if n < 4 {
                        TaskState::Working
                    } else {
                        TaskState::Completed
                    },
                    None,
                ))
            }),
            get_wait: |n| match n {
                2 => Duration::from_millis(300),
                _ => Duration::ZERO,
            },
            ..dropped(Box::new(|_| {
                Err(A2AError::new(a2a::error_code::METHOD_NOT_FOUND, "no"))
            }))
        });
        let out = bounded("a slow look", go_with(&remote, &quick)).await;
        assert!(matches!(out, Ok(Outcome::Completed { .. })), "{out:?}");
        assert_eq!(remote.count(&remote.got), 5);
        assert_eq!(remote.count(&remote.cancelled), 0);
        // A completed task whose gap the last GetTask would settle: the
        // result, flagged, comes back after one idle period.
        let remote = Arc::new(Remote {
            send: Box::new(|_| {
                Ok(stream(vec![
                    status(TaskState::Working),
                    chunk("a", "1", false, false),
                ]))
            }),
            get: Box::new(|_| Ok(snapshot(TaskState::Working, Some(vec![art("a", &["1"])])))),
            get_wait: |n| if n >= 1 { NEVER } else { Duration::ZERO },
            subscribe: Box::new(|_| {
                Ok(stream(vec![
                    chunk("a", "3", true, true),
                    status(TaskState::Completed),
                ]))
            }),
            ..Remote::new()
        });
        let out = bounded("the gap", go_with(&remote, &quick)).await.unwrap();
        assert!(
            matches!(
                &out,
                Outcome::Completed {
                    incomplete: true,
                    ..
                }
            ),
            "{out:?}"
        );
        // A reply into a waiting task whose look before sending goes
        // unanswered: the reply is sent all the same.
        let remote = Arc::new(Remote {
            send: Box::new(|_| Ok(stream(vec![status(TaskState::Completed)]))),
            get_wait: |_| NEVER,
            ..Remote::new()
        });
        let out = bounded("the reply", client_of(&remote).send(reply(), &quick, None)).await;
        assert!(matches!(out, Ok(Outcome::Completed { .. })), "{out:?}");
        assert_eq!(remote.count(&remote.sent), 1);
    }

    /// A reply whose sending outlasts the deadline names its task in the
    /// error and cancels it, as any call past its deadline does.
    #[tokio::test]
    async fn a_reply_past_its_deadline_cancels_the_task_it_names() {
        let remote = Arc::new(Remote {
            get: Box::new(|_| Ok(snapshot(TaskState::InputRequired, None))),
            send: Box::new(|_| Ok(stream(vec![status(TaskState::Completed)]))),
            send_wait: |_| Duration::from_secs(3600),
            ..Remote::new()
        });
        let o = CallOptions {
            deadline: Duration::from_millis(300),
            ..opts()
        };
        let err = client_of(&remote)
            .send(reply(), &o, None)
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                CallError::Deadline {
                    task_id: Some(t),
                    cancel: Cancellation::Acknowledged(TaskState::Canceled),
                    ..
                } if t == "t"
            ),
            "{err:?}"
        );
        assert_eq!(remote.count(&remote.cancelled), 1);
    }

    /// `err` ends the call TooLarge with no cancel sent, and says so.
    fn assert_too_large_without_a_cancel(err: &CallError, remote: &Remote) {
        assert!(
            matches!(
                err,
                CallError::TooLarge {
                    cancel: Cancellation::Ended,
                    ..
                }
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("had already ended") && !text.contains("CancelTask was sent"),
            "{text}"
        );
        assert_eq!(remote.count(&remote.cancelled), 0);
    }

    /// A task seen ended by a snapshot over the limit is not cancelled: the
    /// call ends TooLarge saying so.
    #[tokio::test]
    async fn an_ended_tasks_snapshot_over_the_limit_sends_no_cancel() {
        let remote = Arc::new(Remote {
            get: Box::new(|_| {
                Ok(snapshot(
                    TaskState::Completed,
                    Some(vec![art("a", &[&"x".repeat(32 << 10)])]),
                ))
            }),
            ..dropped(Box::new(|_| {
                Err(A2AError::new(a2a::error_code::METHOD_NOT_FOUND, "no"))
            }))
        });
        let o = CallOptions {
            max_artifact_bytes: 16 << 10,
            ..opts()
        };
        let err = go_with(&remote, &o).await.unwrap_err();
        assert_too_large_without_a_cancel(&err, &remote);
    }

    /// A completed task whose settling snapshot is over the limit ends the
    /// call TooLarge without a cancel, and its error says so.
    #[tokio::test]
    async fn a_completed_tasks_snapshot_over_the_limit_is_not_cancelled() {
        let remote = Arc::new(Remote {
            send: Box::new(|_| {
                Ok(stream(vec![
                    status(TaskState::Working),
                    chunk("a", "1", false, false),
                ]))
            }),
            get: Box::new(|n| match n {
                0 => Ok(snapshot(TaskState::Working, Some(vec![art("a", &["1"])]))),
                _ => Ok(snapshot(
                    TaskState::Completed,
                    Some(vec![art("a", &["1", &"x".repeat(32 << 10), "3"])]),
                )),
            }),
            subscribe: Box::new(|_| {
                Ok(stream(vec![
                    chunk("a", "3", true, true),
                    status(TaskState::Completed),
                ]))
            }),
            ..Remote::new()
        });
        let o = CallOptions {
            max_artifact_bytes: 16 << 10,
            ..opts()
        };
        let err = go_with(&remote, &o).await.unwrap_err();
        assert_too_large_without_a_cancel(&err, &remote);
    }

    /// A reply turn's stream begins with the task as the turn began (A2A;
    /// agentd's face does): its artifacts are earlier turns', whether or
    /// not the look before sending worked, and neither the stream nor a
    /// recovery brings them into this turn's result.
    #[tokio::test]
    async fn a_reply_streams_leading_task_tells_earlier_turns_artifacts() {
        let remote = Arc::new(Remote {
            // The look before sending fails; the recovery's works.
            get: Box::new(|n| {
                if n == 0 {
                    Err(A2AError::internal("connection reset"))
                } else {
                    Ok(snapshot(TaskState::Working, Some(during_the_turn())))
                }
            }),
            send: Box::new(|_| {
                Ok(stream(vec![
                    StreamResponse::Task(snapshot(TaskState::Working, Some(before_the_turn()))),
                    status(TaskState::Working),
                    chunk("a2", "x ", false, false),
                ]))
            }),
            subscribe: resubscribed(),
            ..Remote::new()
        });
        let mut streamed = Vec::new();
        let mut watch = |_: &StreamResponse, st: &CallState| {
            streamed.push(
                st.artifacts
                    .iter()
                    .map(|b| b.artifact.artifact_id.clone())
                    .collect::<Vec<_>>(),
            );
            Control::Continue
        };
        let out = client_of(&remote)
            .send(reply(), &opts(), Some(&mut watch))
            .await
            .unwrap();
        let Outcome::Completed {
            artifacts,
            incomplete: false,
            ..
        } = out
        else {
            panic!("{out:?}")
        };
        assert_eq!(remote.count(&remote.subscribed), 1, "no drop was recovered");
        assert_eq!(
            artifacts
                .iter()
                .map(|a| (a.artifact_id.as_str(), parts_text(&a.parts)))
                .collect::<Vec<_>>(),
            [
                ("answer", "new answer".to_owned()),
                ("a2", "x y".to_owned())
            ]
        );
        assert!(
            streamed.iter().flatten().all(|id| id != "notes"),
            "an earlier turn's artifact was this turn's: {streamed:?}"
        );
    }

    /// A message larger than the gRPC binding receives comes again on every
    /// retry: the call ends at once, and the task, which was not failing,
    /// is left running.
    #[tokio::test]
    async fn a_message_too_large_to_receive_ends_the_call_at_once_without_a_cancel() {
        // tonic's decode error, as the gRPC binding reports it.
        let too_large = || {
            A2AError::internal(
                "Error, decoded message length too large: found 5242941 bytes, the limit is: 4194304 bytes",
            )
        };
        // On the stream.
        let remote = Arc::new(Remote {
            send: Box::new(move |_| {
                Ok(Box::pin(futures::stream::iter([
                    Ok(status(TaskState::Working)),
                    Err(too_large()),
                ])))
            }),
            ..Remote::new()
        });
        let err = go(&remote).await.unwrap_err();
        assert!(
            matches!(&err, CallError::MessageTooLarge { task_id: Some(t), .. } if t == "t"),
            "{err:?}"
        );
        assert!(err.to_string().contains("left running"), "{err}");
        assert_eq!(remote.count(&remote.got), 0, "retried");
        assert_eq!(remote.count(&remote.cancelled), 0);
        // In a recovery's snapshot.
        let remote = Arc::new(Remote {
            get: Box::new(move |_| Err(too_large())),
            ..dropped(Box::new(|_| unreachable!()))
        });
        let err = go(&remote).await.unwrap_err();
        assert!(matches!(&err, CallError::MessageTooLarge { .. }), "{err:?}");
        assert_eq!(remote.count(&remote.got), 1, "retried");
        assert_eq!(remote.count(&remote.cancelled), 0);
    }

    /// Over JSON-RPC, an event or an answer past the transport's limits
    /// ends the call as a gRPC message too large does, wherever it comes: on
    /// the stream, in a recovery's GetTask, at SubscribeToTask, at the first
    /// request; not retried, the task not cancelled. It is told by the
    /// error's detail, not its text: masking the endpoint's credentials in
    /// the message does not hide it.
    #[tokio::test]
    async fn a_json_rpc_answer_past_its_limit_ends_the_call_at_once_without_a_cancel() {
        let over = || jsonrpc::too_large("an answer", 10);
        // The endpoint's password is a word of the error's message.
        let client = |remote: &Arc<Remote>| A2aClient {
            inner: Arc::new(A2AClient::new(
                Box::new(Scripted(remote.clone())) as Box<dyn Transport>
            )),
            secrets: Arc::new(Secrets::of("http://agent:limit@h/")),
            request_timeout: REQUEST_TIMEOUT,
        };
        let cases: Vec<(&str, Remote, bool)> = vec![
            (
                "on the stream",
                Remote {
                    send: Box::new(move |_| {
                        Ok(Box::pin(futures::stream::iter([
                            Ok(status(TaskState::Working)),
                            Err(over()),
                        ])))
                    }),
                    ..Remote::new()
                },
                true,
            ),
            (
                "in GetTask",
                Remote {
                    get: Box::new(move |_| Err(over())),
                    ..dropped(Box::new(|_| unreachable!()))
                },
                true,
            ),
            (
                "at SubscribeToTask",
                dropped(Box::new(move |_| Err(over()))),
                true,
            ),
            (
                "at SendStreamingMessage",
                Remote {
                    send: Box::new(move |_| Err(over())),
                    ..Remote::new()
                },
                false,
            ),
        ];
        for (case, remote, started) in cases {
            let remote = Arc::new(remote);
            let err = client(&remote)
                .send_text("go", None, &opts(), None)
                .await
                .unwrap_err();
            let CallError::MessageTooLarge { task_id, cause, .. } = &err else {
                panic!("{case}: {err:?}")
            };
            assert_eq!(task_id.is_some(), started, "{case}");
            assert!(!cause.contains("limit"), "{case}: not masked: {cause}");
            assert_eq!(remote.count(&remote.cancelled), 0, "{case}");
            assert!(
                remote.count(&remote.got) <= 1 && remote.count(&remote.subscribed) <= 1,
                "{case}: retried"
            );
        }
    }

    #[test]
    fn secrets_of_an_endpoints_url_are_masked() {
        let s = Secrets::of(
            "http://bot:s3cr%40t@agents.internal:9/a2a?key=k-123&api_key=a%2Bb%20c&v=1",
        );
        let e = "error sending request for url (http://bot:s3cr%40t@agents.internal:9/a2a?key=k-123&api_key=a%2Bb%20c&v=1)";
        let shown = s.mask(e);
        for secret in ["s3cr", "k-123", "a%2Bb"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("agents.internal:9/a2a"), "{shown}");
        // A value quoted alone, decoded, or the password decoded.
        let shown = s.mask("bad key k-123; bad key a+b c; password s3cr@t");
        for secret in ["k-123", "a+b c", "s3cr@t"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        // Short values are masked only where the URL shows them: not
        // every "1".
        assert_eq!(s.mask("HTTP 501"), "HTTP 501");
        let short = Secrets::of("http://bot:pw@h/a?k=1");
        assert_eq!(
            short.mask("failed: http://bot:pw@h/a?k=1 (pw 1)"),
            "failed: http://***:***@h/a?*** (pw 1)"
        );
        assert_eq!(Secrets::of("http://h/").mask("plain"), "plain");
    }

    /// A token given as the URL's username, with no password or an empty
    /// one, is a credential: masked where the URL shows it (as written, and
    /// as the parsed URL shows it, without the empty password's `:`) and
    /// on its own. Beside a password the username is masked in the URL
    /// only.
    #[test]
    fn a_token_given_as_the_urls_username_is_masked() {
        for url in [
            "https://tok-5678@agents.internal/a2a",
            "https://tok-5678:@agents.internal/a2a",
        ] {
            let s = Secrets::of(url);
            let parsed = reqwest::Url::parse(url).unwrap();
            for message in [
                format!("cannot read the agent card at {url}: refused"),
                format!("error sending request for url ({parsed})"),
                "bad token tok-5678".to_owned(),
            ] {
                let shown = s.mask(&message);
                assert!(!shown.contains("tok-5678"), "{url}: {shown}");
            }
            assert_eq!(
                s.mask(&format!("at {url}")),
                format!("at {}", url.replace("tok-5678", "***")),
            );
            assert_eq!(
                s.mask(&format!("at {parsed}")),
                "at https://***@agents.internal/a2a"
            );
        }
        let s = Secrets::of("https://agents:pw-456@agents.internal/a2a");
        assert_eq!(
            s.mask("https://agents:pw-456@agents.internal/a2a: agents down"),
            "https://***:***@agents.internal/a2a: agents down"
        );
    }

    /// This client's own errors quote the card's URL as given, userinfo
    /// and all (reqwest takes it out of what it quotes; this client does
    /// not): a token given as the username must not reach them.
    #[tokio::test]
    async fn connect_errors_do_not_show_a_token_given_as_the_username() {
        for url in [
            "http://tok-5678@127.0.0.1:1/",
            "http://tok-5678:@127.0.0.1:1/",
        ] {
            let err = A2aClient::connect(url, None).await.err().unwrap();
            let shown = format!("{err:#}");
            assert!(shown.contains("127.0.0.1:1"), "{shown}");
            assert!(!shown.contains("tok-5678"), "{shown}");
        }
    }

    /// Only a credential's query value is masked on its own: `json` of
    /// `?format=json` is masked within the query, not in
    /// "application/json"; `api_key`'s value everywhere.
    #[test]
    fn only_credential_query_values_are_masked_outside_the_url() {
        let url = "https://agents.internal/a2a?format=json&api_key=abcd1234";
        let s = Secrets::of(url);
        assert_eq!(
            s.mask(&format!(
                "error sending request for url ({url}): expected application/json, got text/html; key abcd1234 refused"
            )),
            "error sending request for url (https://agents.internal/a2a?***): expected application/json, got text/html; key *** refused"
        );
        assert_eq!(
            s.mask("query format=json&api_key=abcd1234"),
            "query format=json&api_key=***",
        );
        for key in [
            "X-Amz-Signature",
            "access_TOKEN",
            "sessionid",
            "Auth",
            "client_secret",
            "pwd",
            "pass",
            "jwt",
            "bearer",
            "code",
        ] {
            let s = Secrets::of(&format!("https://h/a?{key}=v-9876&{key}2=w%2B9876"));
            assert_eq!(s.mask("v-9876 w+9876 w%2B9876"), "*** *** ***", "{key}");
        }
        let s = Secrets::of("https://h/a?SID=v-9876");
        assert_eq!(s.mask("v-9876"), "***");
        for key in ["format", "lang", "v", "side"] {
            let s = Secrets::of(&format!("https://h/a?{key}=v-9876"));
            assert_eq!(s.mask("v-9876"), "v-9876", "{key}");
        }
    }

    /// The SDK's transport errors quote the URL a request failed on: an
    /// API key in the endpoint's query must not reach the error.
    #[tokio::test]
    async fn errors_do_not_show_the_endpoints_credentials() {
        let client = A2aClient::jsonrpc("http://bot:pw-456@127.0.0.1:1/a?key=k-123", None).unwrap();
        let err = client
            .send_text("go", None, &opts(), None)
            .await
            .unwrap_err();
        let shown = format!("{err} {err:?}");
        assert!(shown.contains("127.0.0.1:1"), "{shown}");
        assert!(
            !shown.contains("k-123") && !shown.contains("pw-456"),
            "{shown}"
        );
        for e in [
            client.get_task("t").await.unwrap_err(),
            client.cancel("t").await.unwrap_err(),
        ] {
            assert!(
                !e.message.contains("k-123") && !e.message.contains("pw-456"),
                "{e:?}"
            );
        }
    }

    type Reply<T> = Box<dyn Fn(usize) -> Result<T, A2AError> + Send + Sync>;

    /// A remote agent scripted per request: each answer is made from how
    /// many of that request came before it; the requests are counted.
    struct Remote {
        send: Reply<Stream>,
        get: Reply<Task>,
        subscribe: Reply<Stream>,
        cancel: Reply<Task>,
        /// How long each GetTask (counted from 0) takes to be answered.
        get_wait: fn(usize) -> Duration,
        /// How long each SendStreamingMessage takes to be answered.
        send_wait: fn(usize) -> Duration,
        sent: std::sync::atomic::AtomicUsize,
        got: std::sync::atomic::AtomicUsize,
        subscribed: std::sync::atomic::AtomicUsize,
        cancelled: std::sync::atomic::AtomicUsize,
    }

    impl Remote {
        /// Refuses everything but CancelTask, which cancels.
        fn new() -> Self {
            fn no<T>() -> Reply<T> {
                Box::new(|_| Err(A2AError::unsupported_operation("not scripted")))
            }
            Self {
                send: no(),
                get: no(),
                subscribe: no(),
                cancel: Box::new(|_| Ok(snapshot(TaskState::Canceled, None))),
                get_wait: |_| Duration::ZERO,
                send_wait: |_| Duration::ZERO,
                sent: Default::default(),
                got: Default::default(),
                subscribed: Default::default(),
                cancelled: Default::default(),
            }
        }

        fn count(&self, n: &std::sync::atomic::AtomicUsize) -> usize {
            n.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// Answers with `reply`, given how many calls `n` counted before.
    fn next<T>(n: &std::sync::atomic::AtomicUsize, reply: &Reply<T>) -> Result<T, A2AError> {
        reply(n.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
    }

    struct Scripted(Arc<Remote>);

    fn client_of(remote: &Arc<Remote>) -> A2aClient {
        A2aClient::from_transport(Box::new(Scripted(remote.clone())))
    }

    #[async_trait::async_trait]
    impl Transport for Scripted {
        async fn send_message(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &SendMessageRequest,
        ) -> Result<a2a::SendMessageResponse, A2AError> {
            Err(A2AError::unsupported_operation("streaming only"))
        }
        async fn send_streaming_message(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &SendMessageRequest,
        ) -> Result<Stream, A2AError> {
            let n = self
                .0
                .sent
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep((self.0.send_wait)(n)).await;
            (self.0.send)(n)
        }
        async fn get_task(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &GetTaskRequest,
        ) -> Result<Task, A2AError> {
            let n = self.0.got.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep((self.0.get_wait)(n)).await;
            (self.0.get)(n)
        }
        async fn list_tasks(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::ListTasksRequest,
        ) -> Result<a2a::ListTasksResponse, A2AError> {
            Err(A2AError::unsupported_operation("not scripted"))
        }
        async fn cancel_task(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &CancelTaskRequest,
        ) -> Result<Task, A2AError> {
            next(&self.0.cancelled, &self.0.cancel)
        }
        async fn subscribe_to_task(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &SubscribeToTaskRequest,
        ) -> Result<Stream, A2AError> {
            next(&self.0.subscribed, &self.0.subscribe)
        }
        async fn create_push_config(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::TaskPushNotificationConfig,
        ) -> Result<a2a::TaskPushNotificationConfig, A2AError> {
            Err(A2AError::push_notification_not_supported())
        }
        async fn get_push_config(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::GetTaskPushNotificationConfigRequest,
        ) -> Result<a2a::TaskPushNotificationConfig, A2AError> {
            Err(A2AError::push_notification_not_supported())
        }
        async fn list_push_configs(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::ListTaskPushNotificationConfigsRequest,
        ) -> Result<a2a::ListTaskPushNotificationConfigsResponse, A2AError> {
            Err(A2AError::push_notification_not_supported())
        }
        async fn delete_push_config(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::DeleteTaskPushNotificationConfigRequest,
        ) -> Result<(), A2AError> {
            Err(A2AError::push_notification_not_supported())
        }
        async fn get_extended_agent_card(
            &self,
            _: &a2a_client::transport::ServiceParams,
            _: &a2a::GetExtendedAgentCardRequest,
        ) -> Result<a2a::AgentCard, A2AError> {
            Err(A2AError::extended_card_not_configured())
        }
        async fn destroy(&self) -> Result<(), A2AError> {
            Ok(())
        }
    }

    /// Sends "go" to `remote` with [`opts`].
    async fn go(remote: &Arc<Remote>) -> Result<Outcome, CallError> {
        go_with(remote, &opts()).await
    }

    /// Sends "go" to `remote` with `o`.
    async fn go_with(remote: &Arc<Remote>, o: &CallOptions) -> Result<Outcome, CallError> {
        client_of(remote).send_text("go", None, o, None).await
    }

    fn opts() -> CallOptions {
        CallOptions {
            idle_timeout: Duration::from_secs(5),
            deadline: Duration::from_secs(10),
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            ..CallOptions::default()
        }
    }

    fn stream(events: Vec<StreamResponse>) -> Stream {
        Box::pin(futures::stream::iter(events.into_iter().map(Ok)))
    }

    fn status(state: TaskState) -> StreamResponse {
        StreamResponse::StatusUpdate(a2a::TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: a2a::TaskStatus {
                state,
                message: None,
                timestamp: None,
            },
            metadata: None,
        })
    }

    /// An empty text part with `metadata`.
    fn empty_with(metadata: &HashMap<String, serde_json::Value>) -> Part {
        Part {
            metadata: Some(metadata.clone()),
            ..Part::text("")
        }
    }

    #[test]
    fn failed_and_rejected_are_errors_and_input_required_waits() {
        let mut st = CallState::new();
        st.task_id = Some("t".into());
        st.last_state = Some(TaskState::Rejected);
        assert!(matches!(
            end_of(&st, None),
            Some(Err(CallError::Task {
                state: TaskState::Rejected,
                ..
            }))
        ));
        st.last_state = Some(TaskState::Failed);
        assert!(matches!(
            end_of(&st, None),
            Some(Err(CallError::Task {
                state: TaskState::Failed,
                ..
            }))
        ));
        st.last_state = Some(TaskState::InputRequired);
        assert!(matches!(
            end_of(&st, None),
            Some(Ok(Outcome::Waiting { .. }))
        ));
        st.last_state = Some(TaskState::Working);
        assert!(end_of(&st, None).is_none());
    }
}
