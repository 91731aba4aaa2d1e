//! A Run streams the agent's events in seq order, with kinds a caller can
//! tell apart without parsing text.

mod common;

use agentd::pb::EventKind;
use common::*;

async fn worked_trace(mut server: TestServer) {
    let s = server.session("alice").await;
    let (events, end) = server
        .client
        .run_to_end(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind()).collect();
    assert_eq!(
        kinds,
        [
            EventKind::ToolCall,
            EventKind::ToolResult,
            EventKind::FinalAnswer
        ]
    );
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(
        events.iter().map(|e| e.is_final).collect::<Vec<_>>(),
        [false, false, true]
    );

    assert_eq!(events[0].tool_name, "lookup_order");
    let args: serde_json::Value = serde_json::from_str(&events[0].payload_json).unwrap();
    assert_eq!(args["order_id"], "1187");
    assert_eq!(events[1].tool_call_id, events[0].tool_call_id);
    let result: serde_json::Value = serde_json::from_str(&events[1].payload_json).unwrap();
    assert_eq!(result["status"], "shipped");
    assert!(
        events[2].text.contains("1187") && events[2].text.contains("shipped"),
        "{}",
        events[2].text
    );
    assert_eq!(events[2].author, "order_helper");
    assert_eq!(server.tool.completed(), 1);
    server.stop().await;
}

#[tokio::test]
async fn the_worked_trace_arrives_in_seq_order_in_process() {
    worked_trace(TestServer::in_process(Options::default()).await).await;
}

#[tokio::test]
async fn the_worked_trace_arrives_in_seq_order_over_tcp() {
    worked_trace(TestServer::tcp(Options::default()).await).await;
}

#[tokio::test]
async fn unknown_orders_missing_numbers_and_chit_chat_get_deterministic_answers() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let ask = |text: &'static str, rid: &'static str| run_request("alice", &s, rid, text);

    let (ev, end) = server
        .client
        .run_to_end(ask("Where is order 9999?", "a"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(ev.len(), 3);
    assert!(
        ev[2].text.contains("could not find order 9999"),
        "{}",
        ev[2].text
    );

    let (ev, end) = server
        .client
        .run_to_end(ask("hello!", "b"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(ev.len(), 1, "chit-chat needs no tool");
    assert!(ev[0].is_final && ev[0].text.starts_with("Hello"));

    // The session remembers order 9999 from turn "a".
    let (ev, end) = server
        .client
        .run_to_end(ask("and when will it arrive?", "c"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&ev[0].payload_json).unwrap()["order_id"],
        "9999"
    );

    let s2 = server.session("bob").await;
    let (ev, end) = server
        .client
        .run_to_end(run_request("bob", &s2, "d", "where is my order?"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert!(ev[0].text.contains("order number"), "{}", ev[0].text);
    server.stop().await;
}

#[tokio::test]
async fn many_events_arrive_in_order_without_gaps() {
    let mut server = TestServer::tcp(Options::default()).await;
    let s = server.session("alice").await;
    let req = with_agent(
        run_request("alice", &s, "many", "n=5000 size=100"),
        "stream",
    );
    let (events, end) = server.client.run_to_end(req, DEADLINE).await.unwrap();
    end.unwrap();
    assert_eq!(events.len(), 5001);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as u64);
    }
    assert!(
        events[..5000]
            .iter()
            .all(|e| e.kind() == EventKind::PartialText && e.text.len() == 100)
    );
    assert!(events[5000].is_final);
    server.stop().await;
}

#[tokio::test]
async fn an_unknown_agent_is_not_found_and_bad_agent_input_is_invalid_argument() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let err = server
        .client
        .run(
            with_agent(run_request("alice", &s, "x", "hi"), "nope"),
            DEADLINE,
        )
        .await
        .err()
        .expect("unknown agent refused");
    assert_eq!(err.code(), tonic::Code::NotFound);
    assert!(
        err.message().contains("order_helper"),
        "lists what is served: {}",
        err.message()
    );

    let (events, end) = server
        .client
        .run_to_end(
            with_agent(run_request("alice", &s, "y", "bogus=1"), "stream"),
            DEADLINE,
        )
        .await
        .unwrap();
    assert!(events.is_empty());
    assert_eq!(end.unwrap_err().code(), tonic::Code::InvalidArgument);
    server.stop().await;
}

#[tokio::test]
async fn an_empty_request_id_is_generated_by_the_server_and_returned_in_a_header() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    // The generated client, as a caller other than AgentClient (which fills
    // in a request_id of its own) sends it.
    let resp = server
        .client
        .raw()
        .run(run_request("alice", &s, "", "hi"))
        .await
        .unwrap();
    let header = |name: &str| {
        resp.metadata()
            .get(name)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        header("agentd-request-id").starts_with("gen-"),
        "{}",
        header("agentd-request-id")
    );
    assert_eq!(header("agentd-turn-mode"), "new");
    drop(resp);
    server.stop().await;
}

#[tokio::test]
async fn the_client_gives_a_run_without_request_id_one_of_its_own() {
    let mut server = TestServer::in_process(Options::default()).await;
    let s = server.session("alice").await;
    let mut call = server
        .client
        .run(run_request("alice", &s, "", "hi"), DEADLINE)
        .await
        .unwrap();
    assert!(
        !call.request_id.is_empty() && !call.request_id.starts_with("gen-"),
        "{}",
        call.request_id
    );
    assert_eq!(call.mode, "new");
    while call.events.message().await.unwrap().is_some() {}
    // The turn is stored under that id, so sending it again replays it.
    server.ended_turn(&s, &call.request_id).await;
    let again = server
        .client
        .run(run_request("alice", &s, &call.request_id, "hi"), DEADLINE)
        .await
        .unwrap();
    assert_eq!(again.mode, "replay");
    drop(again);
    server.stop().await;
}
