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
//!   `incomplete` rather than silently truncated.
//! - Past the deadline, or when recovery gives up, the remote task is
//!   cancelled (CancelTask) and the state it reached is logged.
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
    /// The most artifact content (text, data, file bytes) a call buffers;
    /// past it the call ends with [`CallError::TooLarge`] and the remote task
    /// is cancelled.
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

/// The size of `parts`' content: text and file bytes, a file's URL, data
/// as JSON.
fn parts_size(parts: &[Part]) -> usize {
    parts
        .iter()
        .map(|p| match &p.content {
            PartContent::Text(t) | PartContent::Url(t) => t.len(),
            PartContent::Raw(b) => b.len(),
            PartContent::Data(v) => serde_json::to_vec(v).map_or(0, |j| j.len()),
        })
        .sum()
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
    /// The size of the buffered artifacts' content, kept as they change.
    artifact_bytes: usize,
    /// A gap in the stream that no snapshot has covered yet.
    gap: bool,
    /// The remote's task snapshots were seen to leave out artifacts the
    /// task has: they cannot restore what a gap lost.
    bare_snapshots: bool,
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
            gap: false,
            bare_snapshots: false,
        }
    }

    fn ids(&mut self, task_id: &str, context_id: &str) {
        if self.task_id.is_none() && !task_id.is_empty() {
            self.task_id = Some(task_id.to_owned());
        }
        if self.context_id.is_none() && !context_id.is_empty() {
            self.context_id = Some(context_id.to_owned());
        }
    }

    /// Applies a task snapshot: its state, and its artifacts, which are
    /// authoritative and replace the buffer. A snapshot without artifacts
    /// leaves the buffer alone: if artifacts were seen already, the remote
    /// leaves them out of its snapshots, and a gap it was to cover stays
    /// uncovered (the result is incomplete); if none were, the task has
    /// none yet and the gap lost nothing.
    fn apply_task(&mut self, task: &Task) {
        self.ids(&task.id, &task.context_id);
        self.last_state = Some(task.status.state.clone());
        if task.status.message.is_some() {
            self.status_message = task.status.message.clone();
        }
        if let Some(artifacts) = task.artifacts.as_ref().filter(|a| !a.is_empty()) {
            self.artifacts = artifacts
                .iter()
                .map(|a| BufferedArtifact {
                    artifact: a.clone(),
                    ready: true,
                })
                .collect();
            self.artifact_bytes = self
                .artifacts
                .iter()
                .map(|b| parts_size(&b.artifact.parts))
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
                if u.status.message.is_some() {
                    self.status_message = u.status.message.clone();
                }
            }
            StreamResponse::ArtifactUpdate(u) => {
                self.ids(&u.task_id, &u.context_id);
                let ready = u.last_chunk.unwrap_or(false);
                let existing = self
                    .artifacts
                    .iter_mut()
                    .find(|b| b.artifact.artifact_id == u.artifact.artifact_id);
                let added = parts_size(&u.artifact.parts);
                match (existing, u.append.unwrap_or(false)) {
                    (Some(b), true) => {
                        b.artifact.parts.extend(u.artifact.parts.iter().cloned());
                        b.ready = ready;
                        self.artifact_bytes += added;
                    }
                    (Some(b), false) => {
                        self.artifact_bytes = self
                            .artifact_bytes
                            .saturating_sub(parts_size(&b.artifact.parts))
                            + added;
                        *b = BufferedArtifact {
                            artifact: u.artifact.clone(),
                            ready,
                        }
                    }
                    (None, append) => {
                        self.artifact_bytes += added;
                        // An append to an artifact we never saw: its start
                        // was lost.
                        if append {
                            self.incomplete = true;
                        }
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
    /// The task completed. Every artifact it produced is here.
    Completed {
        task_id: String,
        context_id: String,
        artifacts: Vec<Artifact>,
        incomplete: bool,
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
    /// The deadline passed; the remote task was cancelled.
    #[error(
        "the deadline passed; the remote task was cancelled (last state: {})",
        state_name(last_state)
    )]
    Deadline {
        task_id: Option<String>,
        last_state: Option<TaskState>,
        artifacts: Vec<Artifact>,
    },
    /// The stream was lost before the task had an id; not resent, since
    /// that would start a second task.
    #[error("the stream was lost before the task had an id; not resent: {cause}")]
    LostBeforeTask { cause: String },
    /// Recovery gave up (the agent stayed silent or unreachable, or lost the
    /// stream again at once, `max_recoveries` times in a row); the remote
    /// task was cancelled.
    #[error(
        "the task could not be recovered after {recoveries} attempts ({cause}); it was cancelled (last state: {})",
        state_name(last_state)
    )]
    Unrecoverable {
        task_id: String,
        last_state: Option<TaskState>,
        recoveries: u32,
        cause: String,
        artifacts: Vec<Artifact>,
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
    /// The remote task's artifacts outgrew `max_artifact_bytes`; it was
    /// cancelled.
    #[error("the remote task's artifacts are larger than {limit} bytes; it was cancelled")]
    TooLarge {
        task_id: Option<String>,
        limit: usize,
    },
    /// The remote agent refused the request.
    #[error("the remote agent refused the call: {0}")]
    Refused(A2AError),
}

fn state_name(s: &Option<TaskState>) -> String {
    s.as_ref()
        .map_or_else(|| "none".to_owned(), |s| format!("{s:?}"))
}

/// A client of one remote A2A agent; clones share the connection.
#[derive(Clone)]
pub struct A2aClient {
    inner: Arc<A2AClient<Box<dyn Transport>>>,
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
    /// without the token: A2A cards are public.
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
        let base_url = base_url
            .trim_end_matches('/')
            .trim_end_matches(a2a_server::agent_card::WELL_KNOWN_AGENT_CARD_PATH);
        let http = crate::agent::openai::client::http_client_trusting(ca_pem)?;
        let card = a2a_client::agent_card::AgentCardResolver::new(Some(http.clone()))
            .resolve(base_url)
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot read the agent card at {base_url}: {}", e.message)
            })?;
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
            factory = factory.register(Arc::new(
                a2a_client::jsonrpc::JsonRpcTransportFactory::new(Some(http)),
            ));
        }
        if grpc {
            factory = factory.register(Arc::new(a2a_grpc::GrpcTransportFactory::new()));
        }
        for i in interceptors(token) {
            factory = factory.with_interceptor(i);
        }
        let factory = factory.build();
        let client = factory.create_from_card(&card).await.map_err(|e| {
            anyhow::anyhow!("cannot connect to the agent at {base_url}: {}", e.message)
        })?;
        Ok(Self {
            inner: Arc::new(client),
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
        let transport: Box<dyn Transport> = Box::new(a2a_client::jsonrpc::JsonRpcTransport::new(
            http,
            url.to_owned(),
        ));
        let client = A2AClient::new(transport).with_interceptors(interceptors(token));
        Ok(Self {
            inner: Arc::new(client),
        })
    }

    /// A client over an existing transport (e.g. gRPC on an in-process channel).
    pub fn from_transport(transport: Box<dyn Transport>) -> Self {
        Self {
            inner: Arc::new(A2AClient::new(transport).with_interceptors(interceptors(None))),
        }
    }

    /// The underlying SDK client, for calls this wrapper does not cover.
    pub fn raw(&self) -> &A2AClient<Box<dyn Transport>> {
        &self.inner
    }

    pub async fn get_task(&self, task_id: &str) -> Result<Task, A2AError> {
        self.inner
            .get_task(&GetTaskRequest {
                id: task_id.to_owned(),
                history_length: Some(0),
                tenant: None,
            })
            .await
    }

    pub async fn cancel(&self, task_id: &str) -> Result<Task, A2AError> {
        self.inner
            .cancel_task(&CancelTaskRequest {
                id: task_id.to_owned(),
                metadata: None,
                tenant: None,
            })
            .await
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

    /// Sends `message` and follows the task to its end.
    pub async fn send(
        &self,
        message: Message,
        opts: &CallOptions,
        mut listener: Option<&mut dyn Listener>,
    ) -> Result<Outcome, CallError> {
        let deadline = Instant::now() + opts.deadline;
        let mut st = CallState::new();
        let req = SendMessageRequest {
            message,
            configuration: None,
            metadata: None,
            tenant: None,
        };
        let mut stream = match tokio::time::timeout_at(
            deadline,
            self.inner.send_streaming_message(&req),
        )
        .await
        {
            Ok(Ok(s)) => Some(s),
            Ok(Err(e)) => return Err(CallError::Refused(e)),
            Err(_) => {
                return Err(CallError::Deadline {
                    task_id: None,
                    last_state: None,
                    artifacts: vec![],
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
                    match self.follow(s, &mut st, opts, deadline, &mut listener).await {
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
                if let Ok(Ok(task)) =
                    tokio::time::timeout_at(deadline, self.get_task(&task_id)).await
                {
                    st.apply_task(&task);
                    if let Some(end) = end_of(&st, None) {
                        return end;
                    }
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
                Ok(Err(e)) if e.code == a2a::error_code::TASK_NOT_FOUND => {
                    tracing::warn!(task = %task_id, error = %e.message, "a2a: the remote agent no longer knows the task");
                    return Err(CallError::TaskLost {
                        task_id,
                        last_state: st.last_state.clone(),
                        artifacts: st.artifacts(),
                    });
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
                }
            }
            let sub = SubscribeToTaskRequest {
                id: task_id.clone(),
                tenant: None,
            };
            match tokio::time::timeout_at(deadline, self.inner.subscribe_to_task(&sub)).await {
                Err(_) => return Err(self.abandon_at_deadline(&st).await),
                Ok(Ok(s)) => stream = Some(s),
                Ok(Err(e)) => {
                    tracing::warn!(task = %task_id, error = %e.message, "a2a: SubscribeToTask failed");
                    recovery_failed = Some(format!("SubscribeToTask failed: {}", e.message));
                }
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
                Ok(Some(Err(e))) => return Step::Dropped(format!("stream error: {}", e.message)),
                Ok(Some(Ok(ev))) => ev,
            };
            st.apply(&next);
            if let Some(e) = self.too_large(st, opts).await {
                return Step::Done(Box::new(Err(e)));
            }
            if let Some(l) = listener.as_deref_mut() {
                match l.on_event(&next, st) {
                    Control::Continue => {}
                    Control::StopWithResponse(text) => {
                        return Step::Done(Box::new(Ok(stopped(st, Some(text)))));
                    }
                    Control::StopWithArtifacts => {
                        return Step::Done(Box::new(Ok(stopped(st, None))));
                    }
                }
            }
            if let Some(end) = end_of(st, Some(&next)) {
                return Step::Done(Box::new(end));
            }
        }
    }

    /// Past `max_artifact_bytes`: the remote task is cancelled, and the
    /// error to end the call with.
    async fn too_large(&self, st: &CallState, opts: &CallOptions) -> Option<CallError> {
        if st.artifact_bytes <= opts.max_artifact_bytes {
            return None;
        }
        if let Some(id) = &st.task_id {
            self.cancel_logged(id, st, "its artifacts outgrew the limit")
                .await;
        }
        Some(CallError::TooLarge {
            task_id: st.task_id.clone(),
            limit: opts.max_artifact_bytes,
        })
    }

    async fn abandon_at_deadline(&self, st: &CallState) -> CallError {
        if let Some(id) = &st.task_id {
            self.cancel_logged(id, st, "deadline").await;
        }
        CallError::Deadline {
            task_id: st.task_id.clone(),
            last_state: st.last_state.clone(),
            artifacts: st.artifacts(),
        }
    }

    async fn give_up(
        &self,
        st: &CallState,
        task_id: String,
        cause: String,
        recoveries: u32,
    ) -> CallError {
        self.cancel_logged(&task_id, st, "recovery gave up").await;
        CallError::Unrecoverable {
            task_id,
            last_state: st.last_state.clone(),
            recoveries,
            cause,
            artifacts: st.artifacts(),
        }
    }

    async fn cancel_logged(&self, task_id: &str, st: &CallState, why: &str) {
        let result = tokio::time::timeout(Duration::from_secs(10), self.cancel(task_id)).await;
        let outcome = match &result {
            Ok(Ok(t)) => format!("{:?}", t.status.state),
            Ok(Err(e)) => format!("cancel failed: {}", e.message),
            Err(_) => "cancel timed out".into(),
        };
        tracing::warn!(task = %task_id, reached = ?st.last_state, artifacts = st.artifacts.len(), %outcome, "a2a: cancelled the remote task ({why})");
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

    fn chunk(id: &str, text: &str, append: bool, last: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            artifact: Artifact {
                artifact_id: id.into(),
                name: None,
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
        task.artifacts = Some(vec![Artifact {
            parts: vec![Part::text("1"), Part::text("2")],
            ..match chunk("a", "", false, false) {
                StreamResponse::ArtifactUpdate(u) => u.artifact,
                _ => unreachable!(),
            }
        }]);
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
        let mut st = CallState::new();
        st.apply(&chunk("a", "12345", false, false));
        st.apply(&chunk("a", "678", true, false));
        st.apply(&chunk("b", "xy", false, true));
        assert_eq!(st.artifact_bytes, 10);
        st.apply(&chunk("a", "1", false, true));
        assert_eq!(st.artifact_bytes, 3, "a replacement drops what it replaces");
        let StreamResponse::ArtifactUpdate(u) = chunk("c", "abcd", false, true) else {
            unreachable!()
        };
        st.apply_task(&snapshot(TaskState::Working, Some(vec![u.artifact])));
        assert_eq!(st.artifact_bytes, 4, "a snapshot replaces the buffer");
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
