//! The agent runner contract: an [`Agent`] turns a user's message, with its
//! [`RunContext`], into a stream of [`Event`]s. Dropping the stream cancels
//! the run (the model call and its tools); the context's cancellation token
//! fires at the same moment so tools running elsewhere can observe it.

pub mod demo;
pub mod file;
pub mod openai;
pub mod remote_a2a;
pub mod synthetic;
pub mod tools;

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::Stream;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

use crate::domain::{RequestId, SessionId, UserId};

/// What an event is; mirrors `agents.v1.EventKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    ToolCall,
    ToolResult,
    PartialText,
    FinalAnswer,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::ToolCall => "tool_call",
            EventKind::ToolResult => "tool_result",
            EventKind::PartialText => "partial_text",
            EventKind::FinalAnswer => "final_answer",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "tool_call" => EventKind::ToolCall,
            "tool_result" => EventKind::ToolResult,
            "partial_text" => EventKind::PartialText,
            "final_answer" => EventKind::FinalAnswer,
            _ => return None,
        })
    }
}

/// The most bytes of a final answer's payload kept beside its turn, and so
/// given back in later turns' [`PriorTurn::answer_payload`]: an agent's
/// state for its next turn (a remote A2A agent's conversation, say), not
/// data. A larger one still reaches the client and the event log.
pub const MAX_ANSWER_PAYLOAD_BYTES: usize = 4096;

/// One step of a run, as the agent produced it. The turn assigns `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// The agent's name, or the tool's for a tool result.
    pub author: String,
    pub text: String,
    pub tool_name: String,
    pub tool_call_id: String,
    /// Tool arguments or result as a JSON document; on a final answer,
    /// what the agent keeps of the turn for its later turns (at most
    /// [`MAX_ANSWER_PAYLOAD_BYTES`] is kept); empty otherwise.
    pub payload_json: String,
    /// When the producer created it, Unix epoch nanoseconds.
    pub created_unix_nanos: i64,
}

/// Nanoseconds since the Unix epoch, for event timestamps.
pub fn now_unix_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

impl Event {
    fn new(kind: EventKind, author: &str, text: String) -> Self {
        Event {
            kind,
            author: author.to_owned(),
            text,
            tool_name: String::new(),
            tool_call_id: String::new(),
            payload_json: String::new(),
            created_unix_nanos: now_unix_nanos(),
        }
    }

    pub fn tool_call(author: &str, tool: &str, call_id: &str, args: &serde_json::Value) -> Self {
        Event {
            tool_name: tool.to_owned(),
            tool_call_id: call_id.to_owned(),
            payload_json: args.to_string(),
            ..Event::new(EventKind::ToolCall, author, format!("calling {tool}"))
        }
    }

    pub fn tool_result(
        tool: &str,
        call_id: &str,
        summary: String,
        result: &serde_json::Value,
    ) -> Self {
        Event {
            tool_name: tool.to_owned(),
            tool_call_id: call_id.to_owned(),
            payload_json: result.to_string(),
            ..Event::new(EventKind::ToolResult, tool, summary)
        }
    }

    pub fn partial(author: &str, text: String) -> Self {
        Event::new(EventKind::PartialText, author, text)
    }

    pub fn final_answer(author: &str, text: String) -> Self {
        Event::new(EventKind::FinalAnswer, author, text)
    }

    pub fn is_final(&self) -> bool {
        self.kind == EventKind::FinalAnswer
    }
}

/// An earlier turn of the same session: the agent's conversation memory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PriorTurn {
    pub request_id: String,
    /// The agent that ran it: a session's turns may name different agents,
    /// and an agent finds its own turns' [`PriorTurn::answer_payload`] by it.
    pub agent: String,
    pub user_text: String,
    /// The final answer; empty when that turn did not complete.
    pub answer: String,
    /// The final answer event's `payload_json`, when it had one of at most
    /// [`MAX_ANSWER_PAYLOAD_BYTES`]; empty otherwise (no final answer, none
    /// given, or a larger one, which is not kept).
    pub answer_payload: String,
}

impl PriorTurn {
    /// What the turn weighs in the history's byte budget: its question,
    /// its answer and its payload.
    pub fn bytes(&self) -> usize {
        self.user_text.len() + self.answer.len() + self.answer_payload.len()
    }
}

/// Everything a run may know besides the message itself.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub user_id: UserId,
    pub session_id: SessionId,
    pub request_id: RequestId,
    /// Fires when the run is abandoned (client gone, deadline, shutdown).
    pub cancel: CancellationToken,
    /// The run must be over by then; the turn enforces it, agents may use it
    /// to bound their own calls.
    pub deadline: tokio::time::Instant,
    /// Completed turns of this session, oldest first.
    pub history: Vec<PriorTurn>,
    /// Every turn the history was read from (`--history-turns`), oldest
    /// first, with its agent and answer payload only (texts empty): what
    /// agents left for their later turns, whatever `--history-bytes` kept
    /// of the texts in `history` (a large answer drops the turns before it
    /// from `history`, not from here).
    pub notes: Vec<PriorTurn>,
}

/// How an agent run fails. Messages must already be safe to show a caller:
/// agents put model or tool error bodies in the log, not here.
#[derive(Debug, Error)]
pub enum AgentError {
    /// A dependency (model server, tool) is down or overloaded; retry later.
    #[error("{message}")]
    Unavailable {
        message: String,
        retry_after: Option<Duration>,
    },
    /// The request cannot be served as configured (e.g. the model rejected it).
    #[error("{0}")]
    FailedPrecondition(String),
    /// The caller's input was rejected by the agent.
    #[error("{0}")]
    InvalidInput(String),
    /// Anything else; the caller sees a generic message, the log the cause.
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

pub type EventStream = Pin<Box<dyn Stream<Item = Result<Event, AgentError>> + Send + 'static>>;

/// An agent served by agentd.
pub trait Agent: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn description(&self) -> &str;
    /// Starts a run. The stream ends after the final-answer event or an error;
    /// dropping it early must cancel whatever the run was doing.
    fn run(&self, ctx: RunContext, input: String) -> EventStream;
    /// True when nothing the run does before its first event reaches
    /// outside agentd but a model call (no tool, no other agent): the turn
    /// engine may then start the run while its turn is still being claimed,
    /// polling it only up to that first event, which is held until the claim
    /// is won. A lost claim (a repeated request id) drops the run, and with
    /// it the model call. The first token then waits for the slower of the
    /// claim and the model, not for both one after the other.
    fn starts_before_claim(&self) -> bool {
        false
    }
}

/// The agents one process serves, by name, with a default.
#[derive(Clone)]
pub struct AgentRegistry {
    agents: BTreeMap<String, Arc<dyn Agent>>,
    default: String,
}

impl AgentRegistry {
    /// `default` must be the name of one of `agents`.
    pub fn new(agents: Vec<Arc<dyn Agent>>, default: &str) -> anyhow::Result<Self> {
        let mut map = BTreeMap::new();
        for a in agents {
            let name = a.name().to_owned();
            if map.insert(name.clone(), a).is_some() {
                anyhow::bail!("two agents are named {name:?}");
            }
        }
        if !map.contains_key(default) {
            anyhow::bail!(
                "default agent {default:?} is not one of the served agents ({})",
                map.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
        Ok(Self {
            agents: map,
            default: default.to_owned(),
        })
    }

    /// The agent for `name`, or the default for `None`.
    pub fn get(&self, name: Option<&str>) -> Option<&Arc<dyn Agent>> {
        self.agents.get(name.unwrap_or(&self.default))
    }

    pub fn default_name(&self) -> &str {
        &self.default
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.agents.keys().map(String::as_str)
    }
}
