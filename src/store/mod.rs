//! Storage behind one trait: sessions, the turn side table keyed by
//! (session_id, request_id), and the event log of every turn.
//!
//! Claiming a turn is the dedup point: [`Store::claim_turn`] is atomic, so two
//! callers racing on one request id cannot both be told [`Claim::New`].

pub mod memory;

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use thiserror::Error;

use crate::agent::{Event, PriorTurn};
use crate::domain::{SessionId, TurnKey, UserId};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: SessionId,
    pub user_id: UserId,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

/// Where a turn is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnState {
    Running,
    Completed,
    Failed,
    Cancelled,
    DeadlineExceeded,
}

impl TurnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Running => "running",
            TurnState::Completed => "completed",
            TurnState::Failed => "failed",
            TurnState::Cancelled => "cancelled",
            TurnState::DeadlineExceeded => "deadline_exceeded",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => TurnState::Running,
            "completed" => TurnState::Completed,
            "failed" => TurnState::Failed,
            "cancelled" => TurnState::Cancelled,
            "deadline_exceeded" => TurnState::DeadlineExceeded,
            _ => return None,
        })
    }

    pub fn is_terminal(self) -> bool {
        self != TurnState::Running
    }
}

/// How a turn ended: its state and the gRPC status a replay reproduces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnOutcome {
    pub state: TurnState,
    /// A `tonic::Code` as its number.
    pub code: i32,
    /// Already sanitised: safe to send to any caller.
    pub message: String,
}

/// One event of a turn's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqEvent {
    pub seq: u64,
    pub event: Event,
}

/// A row of the turn side table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    pub key: TurnKey,
    pub user_text: String,
    pub agent: String,
    pub state: TurnState,
    /// Set once the turn is terminal.
    pub outcome: Option<TurnOutcome>,
    /// The replica running it (meaningful while running).
    pub owner: String,
    pub lease_expires_at: SystemTime,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct NewTurn {
    pub key: TurnKey,
    pub user_text: String,
    pub agent: String,
    pub owner: String,
    pub lease: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller owns the turn now and must run it.
    New,
    /// Someone claimed it before; here is its row.
    Existing(TurnRecord),
}

#[derive(Debug, Error)]
pub enum StoreError {
    /// The backend cannot be reached right now; the caller may retry.
    #[error("the session store is unavailable")]
    Unavailable(#[source] anyhow::Error),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

pub type StoreResult<T> = Result<T, StoreError>;

#[async_trait]
pub trait Store: Send + Sync + 'static {
    async fn create_session(&self, user_id: &UserId) -> StoreResult<Session>;
    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>>;

    /// Atomically claims `turn.key`: [`Claim::New`] for exactly one caller.
    async fn claim_turn(&self, turn: &NewTurn) -> StoreResult<Claim>;
    async fn get_turn(&self, key: &TurnKey) -> StoreResult<Option<TurnRecord>>;
    /// Appends events in seq order (a batch; the turn calls it per group).
    async fn append_events(&self, key: &TurnKey, events: Vec<SeqEvent>) -> StoreResult<()>;
    /// Records the outcome of a running turn.
    async fn finish_turn(&self, key: &TurnKey, outcome: &TurnOutcome) -> StoreResult<()>;
    /// Events with seq greater than `after` (all with `None`), at most `limit`.
    async fn events_after(&self, key: &TurnKey, after: Option<u64>, limit: usize) -> StoreResult<Vec<SeqEvent>>;
    /// The session's terminal turns, oldest first, at most the last `limit`.
    async fn history(&self, session: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>>;
}
