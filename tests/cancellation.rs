//! Drop-on-cancel: a client that cancels, disconnects or passes its deadline
//! stops the agent and its tool, promptly, and the turn is recorded.

mod common;

use std::time::Duration;

use agentd::store::TurnState;
use agentd::turn::TurnConfig;
use common::*;
use tonic::Code;

fn slow_tool() -> Options {
    Options::default().tool_delay(Duration::from_secs(30))
}

#[tokio::test]
async fn a_short_client_deadline_ends_with_deadline_exceeded_and_cancels_the_tool() {
    let mut server = TestServer::tcp(slow_tool()).await;
    let s = server.session("alice").await;
    let started = tokio::time::Instant::now();
    let (events, end) = match server
        .client
        .run_to_end(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            Duration::from_secs(2),
        )
        .await
    {
        Ok(r) => r,
        // On a loaded machine the deadline may pass before the headers.
        Err(status) => (Vec::new(), Err(status)),
    };
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "ended by the deadline, not the tool"
    );
    assert!(
        events.len() <= 1,
        "at most the tool call arrived: {events:?}"
    );
    // The client stops at its deadline; the server's cancel lands moments
    // later.
    let tool = server.tool.clone();
    eventually("the slow tool observed the cancellation", || {
        tool.started() == 1 && tool.cancelled() == 1
    })
    .await;
    assert_eq!(server.tool.completed(), 0);
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::DeadlineExceeded);
    server.stop().await;
}

#[tokio::test]
async fn the_servers_max_run_duration_bounds_a_call_without_a_deadline() {
    let mut opts = slow_tool();
    opts.turn = TurnConfig {
        max_run_duration: Duration::from_millis(300),
        ..opts.turn
    };
    let mut server = TestServer::in_process(opts).await;
    let s = server.session("alice").await;
    // A client deadline far beyond the server's bound.
    let (_, end) = server
        .client
        .run_to_end(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(
        status.message().contains("maximum run duration"),
        "{}",
        status.message()
    );
    assert_eq!(server.tool.cancelled(), 1);
    server.stop().await;
}

#[tokio::test]
async fn a_client_that_drops_the_stream_mid_run_cancels_the_tool() {
    let mut server = TestServer::tcp(slow_tool()).await;
    let s = server.session("alice").await;
    let mut call = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    let first = call.events.message().await.unwrap().unwrap();
    assert_eq!(first.tool_name, "lookup_order");
    let dropped_at = tokio::time::Instant::now();
    drop(call);
    let tool = server.tool.clone();
    eventually("the tool is cancelled", || tool.cancelled() == 1).await;
    assert!(
        dropped_at.elapsed() < Duration::from_secs(5),
        "promptly, not when the tool would finish"
    );
    assert_eq!(server.tool.completed(), 0);
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::Cancelled);
    assert_eq!(t.outcome.unwrap().code, Code::Cancelled as i32);
    server.stop().await;
}

/// A client that resets its stream when its own deadline passes (as
/// gRPC clients do), a moment before the server's deadline for the call
/// (counted from its arrival; here 100 ms, as for a client that counted
/// from before it connected): the turn is recorded DEADLINE_EXCEEDED, not
/// CANCELLED.
#[tokio::test]
async fn a_client_that_goes_away_at_its_deadline_is_recorded_past_its_deadline() {
    let mut server = TestServer::tcp(slow_tool()).await;
    let s = server.session("alice").await;
    let deadline = Duration::from_millis(1500);
    let sent = tokio::time::Instant::now();
    let mut call = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            deadline,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    tokio::time::sleep_until(sent + deadline - Duration::from_millis(100)).await;
    drop(call);
    let tool = server.tool.clone();
    eventually("the tool is cancelled", || tool.cancelled() == 1).await;
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::DeadlineExceeded);
    assert_eq!(t.outcome.unwrap().code, Code::DeadlineExceeded as i32);
    server.stop().await;
}

#[tokio::test]
async fn a_client_whose_connection_breaks_cancels_the_tool() {
    let server = TestServer::tcp(slow_tool()).await;
    let proxy = Proxy::start(server.addr.unwrap()).await;
    let mut other = agentd::client::AgentClient::connect(&format!("http://{}", proxy.addr))
        .await
        .unwrap();
    let s = other.create_session("alice").await.unwrap().session_id;
    let mut call = other
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    // The call is still held: only the network goes away.
    proxy.cut();
    let tool = server.tool.clone();
    eventually("the tool is cancelled", || tool.cancelled() == 1).await;
    assert!(
        call.events.message().await.is_err(),
        "the client sees the broken call"
    );
    let t = server.ended_turn(&s, "r1").await;
    assert_eq!(t.state, TurnState::Cancelled);
    server.stop().await;
}
