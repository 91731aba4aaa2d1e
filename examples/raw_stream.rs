//! The benchmarks' "raw tonic" baseline: `agents.v1.AgentService` served by
//! a minimal tonic server that emits the `stream` agent's events straight
//! from an async stream, with no agent runtime, store, channel or pump. It is
//! the practical limit of tonic on this machine, measured with the same client.
//!
//! ```text
//! cargo run --release --example raw_stream -- 127.0.0.1:50062
//! ```
//!
//! Run texts are the `stream` agent's parameters (`n=10000 size=64 rate=0
//! yield=1 wait=0s`); CreateSession returns a fresh id and remembers nothing.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use tonic::{Request, Response, Status};

use agentd::agent::now_unix_nanos;
use agentd::agent::synthetic::StreamSpec;
use agentd::pb;
use agentd::pb::agent_service_server::{AgentService, AgentServiceServer};

struct Raw;

/// The baseline serves only what the benchmark calls: CreateSession and Run.
fn unimplemented() -> Status {
    Status::unimplemented("the benchmark baseline serves CreateSession and Run only")
}

fn event(seq: u64, text: String, kind: pb::EventKind) -> pb::AgentEvent {
    pb::AgentEvent {
        seq,
        text,
        is_final: kind == pb::EventKind::FinalAnswer,
        kind: kind as i32,
        author: "stream".into(),
        created_unix_nanos: now_unix_nanos(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl AgentService for Raw {
    async fn create_session(
        &self,
        req: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::SessionRef>, Status> {
        let user_id = req.into_inner().user_id;
        Ok(Response::new(pb::SessionRef {
            user_id,
            session_id: uuid::Uuid::new_v4().to_string(),
        }))
    }

    async fn get_session(
        &self,
        _: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        Err(unimplemented())
    }

    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        Err(unimplemented())
    }

    async fn delete_session(
        &self,
        _: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        Err(unimplemented())
    }

    async fn cancel_turn(
        &self,
        _: Request<pb::CancelTurnRequest>,
    ) -> Result<Response<pb::CancelTurnResponse>, Status> {
        Err(unimplemented())
    }

    type AttachStream = Self::RunStream;

    async fn attach(
        &self,
        _: Request<pb::AttachRequest>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        Err(unimplemented())
    }

    type RunStream = Pin<Box<dyn Stream<Item = Result<pb::AgentEvent, Status>> + Send + 'static>>;

    async fn run(&self, req: Request<pb::RunRequest>) -> Result<Response<Self::RunStream>, Status> {
        let spec = StreamSpec::parse(&req.into_inner().text).map_err(Status::invalid_argument)?;
        Ok(Response::new(Box::pin(async_stream::stream! {
            if !spec.wait.is_zero() {
                tokio::time::sleep(spec.wait).await;
            }
            let body = "x".repeat(spec.size);
            let mut ticker = (spec.rate > 0.0).then(|| {
                let mut t = tokio::time::interval(Duration::from_secs_f64(1.0 / spec.rate));
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                t
            });
            for seq in 0..spec.count {
                if let Some(t) = ticker.as_mut() {
                    t.tick().await;
                } else if spec.yield_each {
                    tokio::task::yield_now().await;
                }
                yield Ok(event(seq, body.clone(), pb::EventKind::PartialText));
            }
            yield Ok(event(spec.count, format!("sent {} events", spec.count), pb::EventKind::FinalAnswer));
        })))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .as_deref()
        .unwrap_or("127.0.0.1:50062")
        .parse()?;
    eprintln!("raw_stream: serving agents.v1.AgentService on {addr}");
    // The same transport settings agentd uses, so only the bridge differs.
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(1024))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(AgentServiceServer::new(Raw))
        .serve_with_shutdown(addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
