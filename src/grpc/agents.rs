//! `agents.v1.AgentService`: validates requests into domain types and hands
//! them to the turn engine.

use std::sync::Arc;

use futures::StreamExt;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

use super::{deadline, status};
use crate::domain::{
    InvalidInput, OnDisconnect, RequestId, RunInput, SessionId, TurnKey, UserId, UserText,
};
use crate::pb;
use crate::store::{
    PageCursor, Session, TurnCursor, TurnRecord, TurnState, TurnWithText, to_micros,
};
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
        if req.agent.len() > 64
            || !req
                .agent
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(InvalidInput::Malformed {
                field: "agent",
                rule: "1-64 characters of [A-Za-z0-9_-]",
            });
        }
        Some(req.agent)
    };
    let on_disconnect = match pb::OnDisconnect::try_from(req.on_disconnect) {
        Ok(pb::OnDisconnect::Unspecified | pb::OnDisconnect::Cancel) => OnDisconnect::Cancel,
        Ok(pb::OnDisconnect::Continue) => OnDisconnect::Continue,
        Err(_) => {
            return Err(InvalidInput::Malformed {
                field: "on_disconnect",
                rule: "CANCEL or CONTINUE",
            });
        }
    };
    Ok(RunInput {
        user_id,
        key: TurnKey {
            session_id,
            request_id,
        },
        generated_request_id: generated,
        text,
        agent,
        on_disconnect,
    })
}

/// Default and largest `ListSessionsRequest.page_size`.
pub const DEFAULT_PAGE_SIZE: usize = 50;
pub const MAX_PAGE_SIZE: usize = 1000;
/// GetSession's turns per page: its default and its most.
pub const MAX_TURN_PAGE_SIZE: usize = 1000;
/// GetSession's turns per page with their text (`include_text`): its
/// default and its most.
pub const MAX_TEXT_TURN_PAGE_SIZE: usize = 50;
/// The text a GetSession page with `include_text` carries before it ends:
/// it ends after the turn that takes it past this (each page holds one turn
/// at least, whatever its size).
pub const TURN_PAGE_TEXT_BYTES: usize = 1 << 20;

fn state_to_wire(s: TurnState) -> pb::TurnState {
    match s {
        TurnState::Running => pb::TurnState::Running,
        TurnState::Completed => pb::TurnState::Completed,
        TurnState::Failed => pb::TurnState::Failed,
        TurnState::Cancelled => pb::TurnState::Cancelled,
        TurnState::DeadlineExceeded => pb::TurnState::DeadlineExceeded,
    }
}

/// The turn a request names, checked in the order every turn RPC checks:
/// the user id, the caller's right to act for it, then the ids.
fn turn_of(
    caller: Option<crate::auth::Caller>,
    user_id: String,
    session_id: &str,
    request_id: String,
) -> Result<(UserId, TurnKey), Status> {
    let user_id = UserId::parse(user_id).map_err(status::invalid)?;
    crate::auth::authorize(caller.as_ref(), &user_id).map_err(status::permission_denied)?;
    let key = TurnKey {
        session_id: SessionId::parse(session_id).map_err(status::invalid)?,
        request_id: RequestId::parse(request_id).map_err(status::invalid)?,
    };
    Ok((user_id, key))
}

fn turn_to_wire(t: &TurnRecord) -> pb::TurnInfo {
    pb::TurnInfo {
        request_id: t.key.request_id.to_string(),
        state: state_to_wire(t.state) as i32,
        status_code: t.outcome.as_ref().map(|o| o.code),
        status_message: t
            .outcome
            .as_ref()
            .map(|o| o.message.clone())
            .unwrap_or_default(),
        agent: t.agent.clone(),
        owner: t.owner.clone(),
        created_unix_micros: to_micros(t.created_at),
        updated_unix_micros: to_micros(t.updated_at),
        user_text: String::new(),
        answer: String::new(),
        answer_payload_json: String::new(),
    }
}

fn turn_with_text_to_wire(t: TurnWithText) -> pb::TurnInfo {
    pb::TurnInfo {
        user_text: t.record.user_text.clone(),
        answer: t.answer,
        answer_payload_json: t.answer_payload,
        ..turn_to_wire(&t.record)
    }
}

/// The token of the page after one that ends with `last`: empty when no
/// turn follows it.
fn next_page_token(last: Option<&TurnRecord>, more: bool) -> String {
    match last {
        Some(last) if more => TurnCursor::after(last).encode(),
        _ => String::new(),
    }
}

/// A session with no turns (a listing's), or `turns` and the token of the
/// page after them (GetSession's).
fn session_to_wire(s: &Session, turns: Vec<pb::TurnInfo>, next: String) -> pb::SessionInfo {
    pb::SessionInfo {
        user_id: s.user_id.to_string(),
        session_id: s.id.to_string(),
        created_unix_micros: to_micros(s.created_at),
        updated_unix_micros: to_micros(s.updated_at),
        turns,
        next_turn_page_token: next,
    }
}

type EventResult = Result<pb::AgentEvent, Status>;

#[tonic::async_trait]
impl pb::agent_service_server::AgentService for AgentsService {
    async fn create_session(
        &self,
        req: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::SessionRef>, Status> {
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let user_id = UserId::parse(req.user_id).map_err(status::invalid)?;
        let key = match req.request_id.as_str() {
            "" => None,
            _ => Some(RequestId::parse(req.request_id).map_err(status::invalid)?),
        };
        crate::auth::authorize(caller.as_ref(), &user_id).map_err(status::permission_denied)?;
        let store = self.turns.store();
        let session = match &key {
            Some(key) => {
                let keyed = store
                    .create_session_keyed(&user_id, key)
                    .await
                    .map_err(status::store)?;
                if keyed.created {
                    tracing::info!(method = "CreateSession", session = %keyed.session.id, request_id = %key, "session created");
                } else {
                    tracing::info!(method = "CreateSession", session = %keyed.session.id, request_id = %key, "a repeated request id: the session it made is answered again");
                }
                keyed.session
            }
            None => {
                let session = store
                    .create_session(&user_id)
                    .await
                    .map_err(status::store)?;
                tracing::info!(method = "CreateSession", session = %session.id, "session created");
                session
            }
        };
        Ok(Response::new(pb::SessionRef {
            user_id: user_id.to_string(),
            session_id: session.id.to_string(),
        }))
    }

    type RunStream =
        futures::stream::Map<turn::RunStream, fn(Result<pb::AgentEvent, Failure>) -> EventResult>;
    type AttachStream = Self::RunStream;

    async fn get_session(
        &self,
        req: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let user_id = UserId::parse(req.user_id).map_err(status::invalid)?;
        crate::auth::authorize(caller.as_ref(), &user_id).map_err(status::permission_denied)?;
        let id = SessionId::parse(&req.session_id).map_err(status::invalid)?;
        let most = if req.include_text {
            MAX_TEXT_TURN_PAGE_SIZE
        } else {
            MAX_TURN_PAGE_SIZE
        };
        let limit = match req.turn_page_size as usize {
            0 => most,
            n => n.min(most),
        };
        let after = match req.turn_page_token.as_str() {
            "" => None,
            t => Some(TurnCursor::decode(t).ok_or_else(status::bad_turn_page_token)?),
        };
        let run_error = |e| status::run_error(e, self.turns.agents());
        let session = self
            .turns
            .owned_session(id, &user_id)
            .await
            .map_err(run_error)?;
        let store = self.turns.store();
        let (turns, next) = if req.include_text {
            let page = store
                .list_turn_texts(id, after.as_ref(), limit, TURN_PAGE_TEXT_BYTES)
                .await
                .map_err(status::store)?;
            let next = next_page_token(page.turns.last().map(|t| &t.record), page.more);
            (
                page.turns.into_iter().map(turn_with_text_to_wire).collect(),
                next,
            )
        } else {
            // One more than the page: whether there is a next one.
            let mut turns = store
                .list_turns(id, after.as_ref(), limit + 1)
                .await
                .map_err(status::store)?;
            let more = turns.len() > limit;
            turns.truncate(limit);
            let next = next_page_token(turns.last(), more);
            (turns.iter().map(turn_to_wire).collect(), next)
        };
        Ok(Response::new(session_to_wire(&session, turns, next)))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let user_id = UserId::parse(req.user_id).map_err(status::invalid)?;
        crate::auth::authorize(caller.as_ref(), &user_id).map_err(status::permission_denied)?;
        let limit = match req.page_size as usize {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        };
        let after = match req.page_token.as_str() {
            "" => None,
            t => Some(PageCursor::decode(t).ok_or_else(status::bad_page_token)?),
        };
        let page = self
            .turns
            .store()
            .list_sessions(&user_id, limit, after.as_ref())
            .await
            .map_err(status::store)?;
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: page
                .sessions
                .iter()
                .map(|s| session_to_wire(s, Vec::new(), String::new()))
                .collect(),
            next_page_token: page.next.map(|c| c.encode()).unwrap_or_default(),
        }))
    }

    async fn delete_session(
        &self,
        req: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let user_id = UserId::parse(req.user_id).map_err(status::invalid)?;
        crate::auth::authorize(caller.as_ref(), &user_id).map_err(status::permission_denied)?;
        let id = SessionId::parse(&req.session_id).map_err(status::invalid)?;
        self.turns
            .delete_session(id, &user_id)
            .await
            .map_err(|e| status::run_error(e, self.turns.agents()))?;
        tracing::info!(method = "DeleteSession", session = %id, "session deleted");
        Ok(Response::new(pb::DeleteSessionResponse {}))
    }

    async fn attach(
        &self,
        req: Request<pb::AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let timeout = deadline::from_metadata(req.metadata()).map_err(Status::invalid_argument)?;
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let (user_id, key) = turn_of(caller, req.user_id, &req.session_id, req.request_id)?;
        // Stores number events with signed 64-bit integers.
        if req.after_seq.is_some_and(|a| a > i64::MAX as u64) {
            return Err(Status::invalid_argument(format!(
                "after_seq must be at most {}",
                i64::MAX
            )));
        }
        let started = self.turns.attach(&user_id, key, req.after_seq, timeout).await.map_err(|e| {
            let s = status::run_error(e, self.turns.agents());
            // The store known to be down: logged once, by its health check.
            if status::is_store_down(&s) {
                tracing::debug!(method = "Attach", code = ?s.code(), reason = s.message(), "attach refused");
            } else {
                tracing::info!(method = "Attach", code = ?s.code(), reason = s.message(), "attach refused");
            }
            s
        })?;
        Ok(stream_response(started, false))
    }

    async fn cancel_turn(
        &self,
        req: Request<pb::CancelTurnRequest>,
    ) -> Result<Response<pb::CancelTurnResponse>, Status> {
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let req = req.into_inner();
        let (user_id, key) = turn_of(caller, req.user_id, &req.session_id, req.request_id)?;
        let (turn, cancelled_now) = self
            .turns
            .cancel_turn(&user_id, &key)
            .await
            .map_err(|e| status::run_error(e, self.turns.agents()))?;
        tracing::info!(method = "CancelTurn", session = %key.session_id, request_id = %key.request_id,
            state = turn.state.as_str(), cancelled_now, "cancel answered");
        Ok(Response::new(pb::CancelTurnResponse {
            turn: Some(turn_to_wire(&turn)),
            cancelled_now,
        }))
    }

    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<Self::RunStream>, Status> {
        // Who asked, for the refusal's log line (bounded: not yet checked).
        let r = req.get_ref();
        let ids = [&r.user_id, &r.session_id, &r.request_id].map(|v| logged(v));
        let result = self.start(req).await;
        if let Err(s) = &result {
            let [user, session, request_id] = &ids;
            // The store known to be down: logged once, by its health check,
            // not once per Run an outage refuses.
            if status::is_store_down(s) {
                tracing::debug!(method = "Run", code = ?s.code(), reason = s.message(), %user, %session, %request_id, "run refused");
            } else {
                tracing::info!(method = "Run", code = ?s.code(), reason = s.message(), %user, %session, %request_id, "run refused");
            }
        }
        result
    }
}

impl AgentsService {
    async fn start(
        &self,
        req: Request<pb::RunRequest>,
    ) -> Result<Response<<Self as pb::agent_service_server::AgentService>::RunStream>, Status> {
        let timeout = deadline::from_metadata(req.metadata()).map_err(Status::invalid_argument)?;
        let caller = req.extensions().get::<crate::auth::Caller>().cloned();
        let input = parse_run(req.into_inner(), &self.limits).map_err(status::invalid)?;
        crate::auth::authorize(caller.as_ref(), &input.user_id)
            .map_err(status::permission_denied)?;
        let generated = input.generated_request_id;
        let started = self
            .turns
            .start(input, timeout)
            .await
            .map_err(|e| status::run_error(e, self.turns.agents()))?;
        Ok(stream_response(started, generated))
    }
}

/// A started turn as a response: its events, with the request id and the
/// mode in the headers.
/// `generated`: the server made the request id up (the caller sent none),
/// so sending the same request again is a new turn.
fn stream_response(
    started: turn::Started,
    generated: bool,
) -> Response<<AgentsService as pb::agent_service_server::AgentService>::RunStream> {
    let to_status: fn(Result<pb::AgentEvent, Failure>) -> EventResult = if generated {
        |r| r.map_err(|f| status::failure(f, true))
    } else {
        |r| r.map_err(|f| status::failure(f, false))
    };
    let mut resp = Response::new(started.stream.map(to_status));
    if let Ok(v) = MetadataValue::try_from(started.request_id.as_str()) {
        resp.metadata_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp.metadata_mut().insert(
        TURN_MODE_HEADER,
        MetadataValue::from_static(started.mode.as_str()),
    );
    resp
}

/// A caller's id as a log field: at most 128 characters, the rest marked.
fn logged(v: &str) -> String {
    match v.char_indices().nth(128) {
        Some((cut, _)) => format!("{}…", &v[..cut]),
        None => v.to_owned(),
    }
}
