//! Flow control: a client that stops reading either back-pressures the agent
//! (`wait`) or is ended with RESOURCE_EXHAUSTED (`fail`); the server's memory
//! for the call stays bounded either way.

mod common;

use std::time::Duration;

use agentd::store::{Store, TurnState};
use agentd::turn::{SlowConsumer, TurnConfig};
use common::*;
use tonic::Code;

const EVENTS: u64 = 200_000;
const SIZE: usize = 1024;
const CAPACITY: usize = 8;
/// What HTTP/2 may hold for one stream on the way: hyper's per-stream send
/// buffer on the server plus the client's receive window (a few MiB), in
/// events of SIZE bytes, with room to spare.
const IN_FLIGHT_BOUND: u64 = (8 << 20) / SIZE as u64;

fn opts(policy: SlowConsumer) -> Options {
    let mut o = Options::default();
    o.turn = TurnConfig {
        channel_capacity: CAPACITY,
        slow_consumer: policy,
        stall_timeout: Duration::from_millis(200),
        ..o.turn
    };
    o
}

/// An Attach to alice's turn r1 of session `session`, from its first event.
async fn attach_r1(server: &TestServer, session: &str) -> tonic::Streaming<agentd::pb::AgentEvent> {
    let attach = agentd::pb::AttachRequest {
        user_id: "alice".into(),
        session_id: session.to_owned(),
        request_id: "r1".into(),
        after_seq: None,
    };
    server
        .client
        .raw()
        .attach(attach)
        .await
        .unwrap()
        .into_inner()
}

async fn stored_events(server: &TestServer, session: &str, rid: &str) -> u64 {
    let key = agentd::domain::TurnKey {
        session_id: agentd::domain::SessionId::parse(session).unwrap(),
        request_id: agentd::domain::RequestId::parse(rid).unwrap(),
    };
    server
        .store
        .events_after(&key, None, usize::MAX)
        .await
        .unwrap()
        .len() as u64
}

#[tokio::test]
async fn a_reader_that_stalls_under_fail_gets_resource_exhausted_and_the_buffer_stays_bounded() {
    let mut server = TestServer::tcp(opts(SlowConsumer::Fail)).await;
    let s = server.session("alice").await;
    let req = with_agent(
        run_request("alice", &s, "r1", &format!("n={EVENTS} size={SIZE}")),
        "stream",
    );
    let mut call = server.client.run(req, DEADLINE).await.unwrap();
    call.events.message().await.unwrap().unwrap();

    // Stop reading: the server must give up on us by itself.
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::Failed);
    assert_eq!(
        t.outcome.as_ref().unwrap().code,
        Code::ResourceExhausted as i32
    );
    let produced = stored_events(&server, &s, "r1").await;
    assert!(
        produced < IN_FLIGHT_BOUND,
        "the agent was stopped after {produced} events, not run to {EVENTS}"
    );

    // Reading again: what was in flight, then the status.
    let mut received = 1u64;
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("the stream ended with OK after {received} events"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(received <= produced, "received {received} of {produced}");
    server.stop().await;
}

#[tokio::test]
async fn a_reader_that_stalls_under_wait_back_pressures_the_agent_and_then_gets_everything() {
    let mut server = TestServer::tcp(opts(SlowConsumer::Wait)).await;
    let s = server.session("alice").await;
    let n = 20_000u64; // 20 MiB: far more than the channel and the windows hold.
    let req = with_agent(
        run_request("alice", &s, "r1", &format!("n={n} size={SIZE}")),
        "stream",
    );
    let mut call = server.client.run(req, DEADLINE).await.unwrap();
    call.events.message().await.unwrap().unwrap();

    // While we do not read, production stops at a bound and stays there.
    let mut last = 0;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = stored_events(&server, &s, "r1").await;
        if now == last && now > 0 {
            break;
        }
        last = now;
    }
    let paused_at = stored_events(&server, &s, "r1").await;
    assert!(
        paused_at < IN_FLIGHT_BOUND && paused_at < n,
        "production paused at {paused_at}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await; // longer than any stall timeout
    assert!(
        server.turn(&s, "r1").await.unwrap().state == TurnState::Running,
        "wait never gives up on a reader"
    );

    let mut received = 1u64;
    while let Some(e) = call.events.message().await.unwrap() {
        assert_eq!(e.seq, received);
        received += 1;
    }
    assert_eq!(received, n + 1);
    server.stop().await;
}

/// A follower's reader (here an Attach replaying a turn that ended) that
/// stops reading is ended under `fail` too, after the stall timeout: it
/// held a `--max-followers` permit until its deadline. The turn itself is
/// not touched: its outcome stays OK.
#[tokio::test]
async fn an_attached_reader_that_stalls_under_fail_gets_resource_exhausted() {
    let mut server = TestServer::tcp(opts(SlowConsumer::Fail)).await;
    let s = server.session("alice").await;
    let n = 20_000u64; // 20 MiB: far more than the channel and the windows hold.
    let req = with_agent(
        run_request("alice", &s, "r1", &format!("n={n} size={SIZE}")),
        "stream",
    );
    let mut call = server.client.run(req, DEADLINE).await.unwrap();
    while call.events.message().await.unwrap().is_some() {}

    let mut attached = attach_r1(&server, &s).await;
    attached.message().await.unwrap().unwrap();
    // Stop reading for longer than the stall timeout.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut received = 1u64;
    let status = loop {
        match attached.message().await {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("the attach ended with OK after {received} events"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("goes on"), "{status:?}");
    assert!(received < n, "received {received} of {n}");
    let t = server.turn(&s, "r1").await.unwrap();
    assert_eq!(t.outcome.unwrap().code, Code::Ok as i32);
    server.stop().await;
}

/// A run with on_disconnect CONTINUE whose client stays connected but stops
/// reading (a laptop asleep, a frozen process) goes on without it, as it
/// would had the client gone away: the turn completes with every event
/// stored, and the stalled call ends RESOURCE_EXHAUSTED, not recorded.
#[tokio::test]
async fn a_continue_run_whose_reader_stalls_goes_on_and_attach_replays_every_event() {
    let mut server = TestServer::tcp(opts(SlowConsumer::Fail)).await;
    let s = server.session("alice").await;
    let n = 20_000u64; // 20 MiB: far more than the channel and the windows hold.
    let mut req = with_agent(
        run_request("alice", &s, "r1", &format!("n={n} size={SIZE}")),
        "stream",
    );
    req.on_disconnect = agentd::pb::OnDisconnect::Continue as i32;
    let mut call = server.client.run(req, DEADLINE).await.unwrap();
    call.events.message().await.unwrap().unwrap();

    // Stop reading: the run must not be cancelled for it.
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::Completed, "{:?}", t.outcome);
    assert_eq!(stored_events(&server, &s, "r1").await, n + 1);

    // Reading again: what was in flight, then the status, which says the
    // turn went on.
    let mut received = 1u64;
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => received += 1,
            Ok(None) => panic!("the stream ended with OK after {received} events"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("goes on"), "{status:?}");
    assert!(
        status
            .metadata()
            .get(agentd::grpc::status::TURN_OUTCOME_HEADER)
            .is_none(),
        "{status:?}"
    );
    assert!(received < n, "received {received} of {n}");

    let mut attached = attach_r1(&server, &s).await;
    let mut replayed = 0u64;
    while let Some(e) = attached.message().await.unwrap() {
        assert_eq!(e.seq, replayed);
        replayed += 1;
    }
    assert_eq!(replayed, n + 1);
    server.stop().await;
}
