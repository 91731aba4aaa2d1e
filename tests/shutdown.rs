//! Health and graceful shutdown: NOT_SERVING first, then stop accepting, let
//! in-flight runs finish within the grace, cut what outlives it.

mod common;

use std::time::Duration;

use agentd::store::TurnState;
use agentd::turn::TurnConfig;
use common::*;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

#[tokio::test]
async fn health_reports_serving_then_not_serving_during_the_drain_delay() {
    let mut opts = Options::default();
    opts.server.drain_delay = Duration::from_secs(2);
    let mut server = TestServer::tcp(opts).await;
    assert_eq!(
        server.client.health("").await.unwrap(),
        ServingStatus::Serving
    );
    assert_eq!(
        server
            .client
            .health("agents.v1.AgentService")
            .await
            .unwrap(),
        ServingStatus::Serving
    );
    let unknown = server.client.health("no.such.Service").await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    server.begin_shutdown();
    let mut status = ServingStatus::Serving;
    for _ in 0..200 {
        status = server.client.health("").await.unwrap();
        if status == ServingStatus::NotServing {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(status, ServingStatus::NotServing);
    assert_eq!(
        server
            .client
            .health("agents.v1.AgentService")
            .await
            .unwrap(),
        ServingStatus::NotServing
    );
    // Still serving calls while endpoints catch up.
    let s = server.session("alice").await;
    let (_, end) = server
        .client
        .run_to_end(run_request("alice", &s, "r", "hi"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    server.join(Duration::from_secs(10)).await.unwrap();
}

#[tokio::test]
async fn a_run_in_flight_at_shutdown_completes_within_the_grace() {
    let mut server =
        TestServer::tcp(Options::default().tool_delay(Duration::from_millis(500))).await;
    let s = server.session("alice").await;
    let mut call = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    server.begin_shutdown();
    let mut rest = Vec::new();
    while let Some(e) = call.events.message().await.unwrap() {
        rest.push(e);
    }
    assert_eq!(rest.len(), 2);
    assert!(rest[1].is_final);
    assert_eq!(server.tool.completed(), 1);
    server.join(Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        server.turn(&s, "r1").await.unwrap().state,
        TurnState::Completed
    );
}

#[tokio::test]
async fn a_run_that_outlives_the_grace_ends_with_unavailable_and_is_recorded() {
    let mut opts = Options::default().tool_delay(Duration::from_secs(30));
    opts.server.shutdown_grace = Duration::from_millis(300);
    let mut server = TestServer::tcp(opts).await;
    let s = server.session("alice").await;
    let mut call = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    server.begin_shutdown();
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("ended with OK"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(server.tool.cancelled(), 1);
    server.join(Duration::from_secs(10)).await.unwrap();
    let t = server.turn(&s, "r1").await.unwrap();
    assert_eq!(t.state, TurnState::Failed);
    assert_eq!(t.outcome.unwrap().code, Code::Unavailable as i32);
}

#[tokio::test]
async fn a_new_call_after_shutdown_starts_is_refused() {
    let mut server = TestServer::tcp(Options::default().tool_delay(Duration::from_secs(2))).await;
    let addr = server.addr.unwrap();
    let s = server.session("alice").await;
    // A run in flight keeps the server in its grace period.
    let mut call = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    server.begin_shutdown();

    // New connections are refused once the listener is closed.
    let mut refused = false;
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(refused, "the listener still accepts");
    // And a new Run on the existing channel is refused too: the connection
    // got GOAWAY, so the client's transport fails it (UNAVAILABLE or, when
    // the request raced the GOAWAY, CANCELLED), and the server never runs it.
    let err = server
        .client
        .run(run_request("alice", &s, "r2", "hi"), DEADLINE)
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(err.code(), Code::Unavailable | Code::Cancelled),
        "{err:?}"
    );

    while call.events.message().await.unwrap().is_some() {}
    server.join(Duration::from_secs(10)).await.unwrap();
    assert!(
        server.turn(&s, "r2").await.is_none(),
        "the refused call stored nothing"
    );
}

/// A Run of the order question by `user`, as it starts or is refused.
async fn order_run(
    server: &mut TestServer,
    user: &str,
    session: &str,
    rid: &str,
) -> Result<agentd::client::RunCall, tonic::Status> {
    server
        .client
        .run(
            run_request(user, session, rid, "Where is order 1187?"),
            DEADLINE,
        )
        .await
}

/// [`order_run`], once its first event came.
async fn running(
    server: &mut TestServer,
    user: &str,
    session: &str,
    rid: &str,
) -> agentd::client::RunCall {
    let mut call = order_run(server, user, session, rid).await.unwrap();
    call.events.message().await.unwrap().unwrap();
    call
}

#[tokio::test]
async fn a_user_past_its_share_of_runs_is_resource_exhausted_while_others_are_served() {
    let mut opts = Options::default().tool_delay(Duration::from_secs(30));
    opts.turn = TurnConfig {
        max_runs_per_user: Some(1),
        ..opts.turn
    };
    let mut server = TestServer::in_process(opts).await;
    let alice = server.session("alice").await;
    let bob = server.session("bob").await;
    let held = running(&mut server, "alice", &alice, "a").await;

    let err = order_run(&mut server, "alice", &alice, "b")
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(err.message().contains("this user"), "{err:?}");
    assert!(server.turn(&alice, "b").await.is_none(), "nothing stored");
    // Another user is served meanwhile, and so is a repeat of the user's
    // running turn.
    let other = running(&mut server, "bob", &bob, "a").await;
    let attach = order_run(&mut server, "alice", &alice, "a").await.unwrap();
    assert_eq!(attach.mode, "attach");

    // The user's share frees when its run ends.
    drop(held);
    let tool = server.tool.clone();
    eventually("alice's run is cancelled", || tool.cancelled() == 1).await;
    server.ended_turn(&alice, "a").await;
    drop(running(&mut server, "alice", &alice, "b").await);
    drop(other);
    server.stop().await;
}

#[tokio::test]
async fn runs_past_the_concurrency_cap_are_resource_exhausted() {
    let mut opts = Options::default().tool_delay(Duration::from_secs(30));
    opts.turn = TurnConfig {
        max_concurrent_runs: 2,
        ..opts.turn
    };
    let mut server = TestServer::in_process(opts).await;
    let s = server.session("alice").await;
    let mut held = Vec::new();
    for rid in ["a", "b"] {
        held.push(running(&mut server, "alice", &s, rid).await);
    }
    let err = order_run(&mut server, "alice", &s, "c")
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(server.turn(&s, "c").await.is_none());
    // A replay of a running turn needs no new run: it is still served.
    let attach = order_run(&mut server, "alice", &s, "a").await.unwrap();
    assert_eq!(attach.mode, "attach");
    drop(attach);
    // A slot frees when a run ends.
    drop(held.pop());
    let tool = server.tool.clone();
    eventually("run b is cancelled", || tool.cancelled() == 1).await;
    server.ended_turn(&s, "b").await;
    drop(running(&mut server, "alice", &s, "c").await);
    drop(held);
    server.stop().await;
}

/// A gRPC server whose connections stop coming (the incoming stream ended)
/// stops by itself: `serve` says so, and nothing it started runs on. The
/// store's upkeep and the health mirror, each holding the turn engine,
/// used to outlive it.
#[tokio::test]
async fn a_server_that_stops_by_itself_says_so_and_leaves_nothing_running() {
    use std::sync::Arc;

    let registry = agentd::agent::AgentRegistry::new(
        vec![Arc::new(agentd::agent::synthetic::Echo) as Arc<dyn agentd::agent::Agent>],
        "echo",
    )
    .unwrap();
    let turns = agentd::turn::Turns::new(
        Arc::new(agentd::store::memory::MemoryStore::new()),
        registry,
        TurnConfig::default(),
    );
    let held = Arc::strong_count(&turns);
    let incoming = futures::stream::empty::<Result<tokio::io::DuplexStream, std::io::Error>>();
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        agentd::server::serve(
            incoming,
            turns.clone(),
            Options::default().server,
            std::future::pending(),
        ),
    )
    .await
    .expect("serve returns once its connections stop coming")
    .expect_err("a server that stopped by itself is an error");
    assert!(
        err.to_string()
            .contains("the gRPC server stopped by itself"),
        "{err:#}"
    );
    eventually("the server's tasks let go of the turn engine", || {
        Arc::strong_count(&turns) == held
    })
    .await;
}
