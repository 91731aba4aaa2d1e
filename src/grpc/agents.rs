//! `agents.v1.AgentService`: validates requests into domain types and hands
//! them to the turn engine.

use std::sync::Arc;

use futures::StreamExt;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use super::{deadline, status};
use crate::domain::{InvalidInput, RequestId, RunInput, SessionId, TurnKey, UserId, UserText};
use crate::pb;
use crate::turn::{self, Failure, Turns};

pub use pb::agent_service_server::AgentServiceServer;

/// Header carrying the turn's request id (useful when the server generated it).
pub const REQUEST_ID_HEADER: &str = "agentd-request-id";
/// Header saying whether the Run started the turn, replays or attaches.
pub const TURN_MODE_HEADER: &str = "agentd-turn-mode";

/// Limits on what one request may carry.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest accepted `RunRequest.text`, in bytes.
    pub max_input_bytes: usize,
}

pub struct AgentsService {
    turns: Arc<Turns>,
    limits: Limits,
}

impl AgentsService {
    pub fn new(turns: Arc<Turns>, limits: Limits) -> Self {
        Self { turns, limits }
    }
}

/// Turns a wire request into a validated [`RunInput`].
pub fn parse_run(req: pb::RunRequest, limits: &Limits) -> Result<RunInput, InvalidInput> {
    let user_id = UserId::parse(req.user_id)?;
    let session_id = SessionId::parse(&req.session_id)?;
    let (request_id, generated) = if req.request_id.is_empty() {
        (RequestId::generate(), true)
    } else {
        (RequestId::parse(req.request_id)?, false)
    };
    let text = UserText::parse(req.text, limits.max_input_bytes)?;
    let agent = if req.agent.is_empty() {
        None
    } else {
        if req.agent.len() > 64 || !req.agent.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(InvalidInput::Malformed { field: "agent", rule: "1-64 characters of [A-Za-z0-9_-]" });
        }
        Some(req.agent)
    };
    Ok(RunInput { user_id, key: TurnKey { session_id, request_id }, generated_request_id: generated, text, agent })
}

type EventResult = Result<pb::AgentEvent, Status>;

#[tonic::async_trait]
impl pb::agent_service_server::AgentService for AgentsService {
    async fn create_session(&self, req: Request<pb::CreateSessionRequest>) -> Result<Response<pb::SessionRef>, Status> {
        let user_id = UserId::parse(req.into_inner().user_id).map_err(status::invalid)?;
        let session = self.turns.store().create_session(&user_id).await.map_err(status::store)?;
        tracing::info!(method = "CreateSession", session = %session.id, "session created");
        Ok(Response::new(pb::SessionRef { user_id: user_id.to_string(), session_id: session.id.to_string() }))
    }

    type RunStream = futures::stream::Map<turn::RunStream, fn(Result<pb::AgentEvent, Failure>) -> EventResult>;

    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<Self::RunStream>, Status> {
        let result = self.start(req).await;
        if let Err(s) = &result {
            tracing::info!(method = "Run", code = ?s.code(), reason = s.message(), "run refused");
        }
        result
    }
}

impl AgentsService {
    async fn start(&self, req: Request<pb::RunRequest>) -> Result<Response<<Self as pb::agent_service_server::AgentService>::RunStream>, Status> {
        let timeout = deadline::from_metadata(req.metadata()).map_err(Status::invalid_argument)?;
        let input = parse_run(req.into_inner(), &self.limits).map_err(status::invalid)?;
        let started = self
            .turns
            .start(input, timeout)
            .await
            .map_err(|e| status::run_error(e, self.turns.agents()))?;
        let to_status: fn(Result<pb::AgentEvent, Failure>) -> EventResult = |r| r.map_err(status::failure);
        let mut resp = Response::new(started.stream.map(to_status));
        if let Ok(v) = MetadataValue::try_from(started.request_id.as_str()) {
            resp.metadata_mut().insert(REQUEST_ID_HEADER, v);
        }
        resp.metadata_mut().insert(TURN_MODE_HEADER, MetadataValue::from_static(started.mode.as_str()));
        Ok(resp)
    }
}
