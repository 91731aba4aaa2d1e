//! The request_id side table: a repeated turn is replayed or attached to,
//! and the agent's tools never run twice.

mod common;

use std::time::Duration;

use common::*;
use tonic::Code;

fn same_events(a: &[agentd::pb::AgentEvent], b: &[agentd::pb::AgentEvent]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(
            (x.seq, &x.text, x.kind, &x.payload_json, x.is_final),
            (y.seq, &y.text, y.kind, &y.payload_json, y.is_final)
        );
    }
}

#[tokio::test]
async fn a_duplicate_request_id_replays_the_stored_turn_without_running_the_tool() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "r1", "Where is order 1187?");
    let (first, end) = server
        .client
        .run_to_end(req.clone(), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    let call = server.client.run(req.clone(), DEADLINE).await.unwrap();
    assert_eq!(call.mode, "replay");
    drop(call);
    let (second, end) = server.client.run_to_end(req, DEADLINE).await.unwrap();
    end.unwrap();
    same_events(&first, &second);
    assert_eq!(
        server.tool.started(),
        1,
        "the tool ran once for three calls"
    );
    server.stop().await;
}

#[tokio::test]
async fn two_racing_calls_with_one_request_id_run_the_tool_once() {
    let mut server =
        TestServer::tcp(Options::default().tool_delay(Duration::from_millis(200))).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "race", "Where is order 1187?");
    let (mut c1, mut c2) = (server.client.clone(), server.client.clone());
    let (a, b) = tokio::join!(
        c1.run_to_end(req.clone(), DEADLINE),
        c2.run_to_end(req, DEADLINE)
    );
    let (a, ea) = a.unwrap();
    let (b, eb) = b.unwrap();
    ea.unwrap();
    eb.unwrap();
    same_events(&a, &b);
    assert_eq!(a.len(), 3);
    assert_eq!(server.tool.started(), 1);
    server.stop().await;
}

#[tokio::test]
async fn a_repeat_while_the_turn_runs_attaches_to_it_live() {
    let mut server = TestServer::tcp(Options::default().tool_delay(Duration::from_secs(2))).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "r1", "Where is order 1187?");
    let mut first = server.client.run(req.clone(), DEADLINE).await.unwrap();
    let e0 = first.events.message().await.unwrap().unwrap();
    assert_eq!(e0.seq, 0);

    let mut second = server.client.clone();
    let mut attached = second.run(req, DEADLINE).await.unwrap();
    assert_eq!(attached.mode, "attach");
    let mut seen = Vec::new();
    while let Some(e) = attached.events.message().await.unwrap() {
        seen.push(e);
    }
    assert_eq!(
        seen.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [0, 1, 2],
        "events so far, then live"
    );
    assert_eq!(seen[0].payload_json, e0.payload_json);
    while first.events.message().await.unwrap().is_some() {}
    assert_eq!(server.tool.started(), 1);
    server.stop().await;
}

#[tokio::test]
async fn a_failed_turn_replays_its_failure_status() {
    let mut server =
        TestServer::in_process(Options::default().tool_delay(Duration::from_secs(30))).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "r1", "Where is order 1187?");
    let first = match server
        .client
        .run_to_end(req.clone(), Duration::from_secs(2))
        .await
    {
        Ok((_, end)) => end.unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(first.code(), Code::DeadlineExceeded);
    server.ended_turn(&s, "r1").await;
    let (events, end) = server.client.run_to_end(req, DEADLINE).await.unwrap();
    let status = end.unwrap_err();
    assert_eq!(
        status.code(),
        Code::DeadlineExceeded,
        "the stored status, not a new run"
    );
    assert!(events.len() <= 1);
    assert_eq!(server.tool.started(), 1);
    server.stop().await;
}

#[tokio::test]
async fn a_request_id_reused_for_a_different_message_is_refused() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let (_, end) = server
        .client
        .run_to_end(run_request("alice", &s, "r1", "hello"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    let err = server
        .client
        .run(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(server.tool.started(), 0);
    server.stop().await;
}

#[tokio::test]
async fn the_same_request_id_in_another_session_is_another_turn() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s1 = server.session("alice").await;
    let s2 = server.session("alice").await;
    for s in [&s1, &s2] {
        let (_, end) = server
            .client
            .run_to_end(
                run_request("alice", s, "r1", "Where is order 1042?"),
                DEADLINE,
            )
            .await
            .unwrap();
        end.unwrap();
    }
    assert_eq!(server.tool.started(), 2);
    server.stop().await;
}

#[tokio::test]
async fn every_replay_of_a_failed_turn_ends_with_its_status_never_with_ok() {
    let mut server = TestServer::tcp(Options::default().tool_delay(Duration::from_secs(30))).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "r1", "Where is order 1187?");
    // The deadline may pass before or after the response headers.
    let first = match server
        .client
        .run_to_end(req.clone(), Duration::from_secs(2))
        .await
    {
        Ok((_, end)) => end.unwrap_err(),
        Err(status) => status,
    };
    assert_eq!(first.code(), Code::DeadlineExceeded);
    server.ended_turn(&s, "r1").await;
    // The end of a replay is decided by the follower before its channel
    // closes; a race there would end some replays with OK.
    for i in 0..100 {
        let (_, end) = server
            .client
            .run_to_end(req.clone(), DEADLINE)
            .await
            .unwrap();
        assert_eq!(
            end.err().map(|s| s.code()),
            Some(Code::DeadlineExceeded),
            "replay {i}"
        );
    }
    server.stop().await;
}

/// Followers (repeats of a running turn, Attach) past `max_followers` are
/// refused with RESOURCE_EXHAUSTED; a place is free again once one ends.
#[tokio::test]
async fn followers_past_the_cap_are_resource_exhausted() {
    let mut opts = Options::default().tool_delay(Duration::from_secs(3));
    opts.turn.max_followers = 1;
    let mut server = TestServer::tcp(opts).await;
    let s = server.session("alice").await;
    let req = run_request("alice", &s, "r1", "Where is order 1187?");
    let mut first = server.client.run(req.clone(), DEADLINE).await.unwrap();
    first.events.message().await.unwrap().unwrap();

    let mut c = server.client.clone();
    let mut follower = c.run(req.clone(), DEADLINE).await.unwrap();
    assert_eq!(follower.mode, "attach");
    let refused = c.run(req.clone(), DEADLINE).await.err().expect("refused");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("following"), "{refused:?}");

    while follower.events.message().await.unwrap().is_some() {}
    // The follower ended: a replay has its place.
    let (events, end) = c.run_to_end(req, DEADLINE).await.unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(server.tool.started(), 1);
    server.stop().await;
}

/// The history an agent gets holds at most `history_bytes` of earlier
/// questions and answers: past it the oldest turns are left out.
#[tokio::test]
async fn turns_past_the_history_byte_budget_are_left_out_of_the_memory() {
    let mut opts = Options::default();
    opts.turn.history_bytes = 10;
    let mut server = TestServer::in_process(opts).await;
    let s = server.session("alice").await;
    let (_, end) = server
        .client
        .run_to_end(
            run_request("alice", &s, "r1", "Where is order 2301?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    let (events, end) = server
        .client
        .run_to_end(
            run_request("alice", &s, "r2", "and when will it arrive?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    let answer = &events.last().unwrap().text;
    assert!(
        !answer.contains("2301"),
        "the first turn was left out: {answer}"
    );
    server.stop().await;
}
