//! agentd's A2A streaming client against a Python A2A agent written with the
//! official SDK (tests/a2a_test_agent.py): chunked and multiple artifacts,
//! a connection dropped mid-stream, a silent stall, a deadline; and against
//! our own server in-process.

mod a2a_support;

use std::time::Duration;

use a2a::{StreamResponse, TaskState};
use a2a_support::{PyAgent, python};
use agentd::client::a2a::{
    A2aClient, CallError, CallOptions, CallState, Cancellation, Control, Outcome, parts_text,
};

fn opts() -> CallOptions {
    CallOptions {
        idle_timeout: Duration::from_secs(10),
        deadline: Duration::from_secs(30),
        initial_backoff: Duration::from_millis(20),
        ..CallOptions::default()
    }
}

fn texts(artifacts: &[a2a::Artifact]) -> Vec<(String, String)> {
    artifacts
        .iter()
        .map(|a| (a.artifact_id.clone(), parts_text(&a.parts)))
        .collect()
}

/// The artifacts of a completed call, and whether they are incomplete.
fn completed(out: Outcome) -> (Vec<a2a::Artifact>, bool) {
    match out {
        Outcome::Completed {
            artifacts,
            incomplete,
            ..
        } => (artifacts, incomplete),
        other => panic!("not completed: {other:?}"),
    }
}

/// Waits (bounded) until the remote task reaches `state`.
async fn remote_state(client: &A2aClient, task_id: &str, state: TaskState) -> TaskState {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = client.get_task(task_id).await.unwrap().status.state;
        if now == state || tokio::time::Instant::now() > until {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn every_chunk_of_every_artifact_arrives_in_the_result() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let mut chunks = 0;
    let mut count = |ev: &StreamResponse, _: &CallState| {
        if matches!(ev, StreamResponse::ArtifactUpdate(_)) {
            chunks += 1;
        }
        Control::Continue
    };
    let out = client
        .send_text("chunks=5 second=1 delay=0", None, &opts(), Some(&mut count))
        .await
        .unwrap();
    let (artifacts, incomplete) = completed(out);
    assert_eq!(
        texts(&artifacts),
        [
            ("a1".into(), "c0 c1 c2 c3 c4 ".into()),
            ("a2".into(), "second artifact".into())
        ]
    );
    assert!(!incomplete);
    assert_eq!(chunks, 6);
}

#[tokio::test]
async fn a_stream_dropped_mid_artifact_is_recovered_complete_from_the_snapshot() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let mut recoveries = 0;
    let mut watch = |_: &StreamResponse, st: &CallState| {
        recoveries = st.recoveries;
        Control::Continue
    };
    let out = client
        .send_text(
            "chunks=8 drop=2 delay=0.05 second=1",
            None,
            &opts(),
            Some(&mut watch),
        )
        .await
        .unwrap();
    let (artifacts, incomplete) = completed(out);
    assert!(recoveries >= 1, "the drop was not noticed");
    assert_eq!(
        texts(&artifacts),
        [
            ("a1".into(), "c0 c1 c2 c3 c4 c5 c6 c7 ".into()),
            ("a2".into(), "second artifact".into())
        ]
    );
    assert!(!incomplete);
}

#[tokio::test]
async fn chunks_lost_in_a_drop_that_no_snapshot_restores_are_flagged_incomplete() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, true).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let out = client
        .send_text("chunks=8 drop=2 delay=0.05", None, &opts(), None)
        .await
        .unwrap();
    let (artifacts, incomplete) = completed(out);
    assert!(incomplete, "a truncated result must say so: {artifacts:?}");
    // c2 went out while the connection was cut and no snapshot has it.
    let text = parts_text(&artifacts[0].parts);
    assert!(
        text.starts_with("c0 c1 ") && !text.contains("c2 "),
        "{text}"
    );
}

#[tokio::test]
async fn a_stream_cut_again_after_each_recovery_that_made_progress_still_completes() {
    let Some(py) = python() else { return };
    // Every stream (the first and each resubscription) is cut after two
    // chunks: more cuts than max_recoveries, each after progress.
    let agent = PyAgent::start_flags(&py, &["--drop-every", "2"]).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let o = CallOptions {
        max_recoveries: 2,
        ..opts()
    };
    let out = client
        .send_text("chunks=12 delay=0.05", None, &o, None)
        .await
        .unwrap();
    let (artifacts, incomplete) = completed(out);
    assert!(!incomplete);
    let all: String = (0..12).map(|i| format!("c{i} ")).collect();
    assert_eq!(texts(&artifacts), [("a1".into(), all)]);
}

#[tokio::test]
async fn a_task_the_remote_no_longer_knows_after_a_drop_ends_the_call_at_once() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start_flags(&py, &["--forget-tasks"]).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let err = client
        .send_text("chunks=8 drop=2 delay=0.05", None, &opts(), None)
        .await
        .unwrap_err();
    let CallError::TaskLost { artifacts, .. } = &err else {
        panic!("TaskNotFound is not retried: {err:?}")
    };
    assert_eq!(texts(artifacts), [("a1".into(), "c0 c1 ".into())]);
}

#[tokio::test]
async fn artifacts_past_the_size_limit_end_the_call_and_cancel_the_task() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let o = CallOptions {
        max_artifact_bytes: 40,
        ..opts()
    };
    let err = client
        .send_text("chunks=200 delay=0.02", None, &o, None)
        .await
        .unwrap_err();
    let CallError::TooLarge {
        task_id: Some(task_id),
        limit: 40,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(
        remote_state(&client, task_id, TaskState::Canceled).await,
        TaskState::Canceled
    );
}

#[tokio::test]
async fn the_idle_watchdog_catches_a_silent_stall_and_cancels_the_task() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let o = CallOptions {
        idle_timeout: Duration::from_secs(1),
        max_recoveries: 2,
        ..opts()
    };
    let started = tokio::time::Instant::now();
    let err = client
        .send_text("chunks=5 stall=2", None, &o, None)
        .await
        .unwrap_err();
    let CallError::Unrecoverable {
        task_id,
        recoveries,
        cause,
        artifacts,
        cancel,
        ..
    } = err
    else {
        panic!("{err:?}")
    };
    assert!(
        matches!(cancel, Cancellation::Acknowledged(_)),
        "{cancel:?}"
    );
    assert_eq!(recoveries, 2);
    assert!(cause.contains("idle"), "{cause}");
    assert_eq!(texts(&artifacts), [("a1".into(), "c0 c1 ".into())]);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the stall was not caught promptly"
    );
    assert_eq!(
        remote_state(&client, &task_id, TaskState::Canceled).await,
        TaskState::Canceled
    );
}

#[tokio::test]
async fn a_deadline_cancels_the_remote_task() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let o = CallOptions {
        deadline: Duration::from_secs(3),
        ..opts()
    };
    let err = client
        .send_text("chunks=5 stall=1", None, &o, None)
        .await
        .unwrap_err();
    let CallError::Deadline {
        task_id: Some(task_id),
        last_state,
        cancel,
        ..
    } = err
    else {
        panic!("{err:?}")
    };
    assert_eq!(last_state, Some(TaskState::Working));
    assert!(
        matches!(cancel, Cancellation::Acknowledged(_)),
        "{cancel:?}"
    );
    assert_eq!(
        remote_state(&client, &task_id, TaskState::Canceled).await,
        TaskState::Canceled
    );
}

#[tokio::test]
async fn failed_and_rejected_tasks_are_errors_a_message_is_an_answer_and_input_required_waits() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let err = client
        .send_text("fail=1", None, &opts(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CallError::Task { state: TaskState::Failed, message, .. } if message == "boom"),
        "{err:?}"
    );
    let err = client
        .send_text("reject=1", None, &opts(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            CallError::Task {
                state: TaskState::Rejected,
                ..
            }
        ),
        "{err:?}"
    );
    let out = client
        .send_text("message=1", None, &opts(), None)
        .await
        .unwrap();
    assert!(
        matches!(&out, Outcome::Message(m) if parts_text(&m.parts) == "direct reply"),
        "{out:?}"
    );
    let out = client
        .send_text("input=1", None, &opts(), None)
        .await
        .unwrap();
    let Outcome::Waiting {
        state,
        task_id,
        context_id,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(state, TaskState::InputRequired);
    assert!(!task_id.is_empty() && !context_id.is_empty());
}

#[tokio::test]
async fn a_listener_can_stop_the_call_without_cancelling_the_remote_task() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let client = A2aClient::connect(&agent.base_url, None).await.unwrap();
    let mut stop = |ev: &StreamResponse, st: &CallState| match ev {
        StreamResponse::ArtifactUpdate(_)
            if st
                .artifacts
                .first()
                .is_some_and(|a| a.artifact.parts.len() == 2) =>
        {
            Control::StopWithArtifacts
        }
        _ => Control::Continue,
    };
    let out = client
        .send_text("chunks=6 delay=0.05", None, &opts(), Some(&mut stop))
        .await
        .unwrap();
    let Outcome::Stopped {
        task_id: Some(task_id),
        artifacts,
        response: None,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(texts(&artifacts), [("a1".into(), "c0 c1 ".into())]);
    assert_eq!(
        remote_state(&client, &task_id, TaskState::Completed).await,
        TaskState::Completed
    );

    let mut answer = |_: &StreamResponse, _: &CallState| Control::StopWithResponse("enough".into());
    let out = client
        .send_text("chunks=3", None, &opts(), Some(&mut answer))
        .await
        .unwrap();
    assert!(matches!(out, Outcome::Stopped { response: Some(r), .. } if r == "enough"));
}

/// The agent card of `server`, with its interfaces replaced by
/// `interfaces` (binding, URL), served on 127.0.0.1 by itself: its base URL.
async fn card_listing(server: &a2a_support::A2aServer, interfaces: &[(&str, String)]) -> String {
    agentd::auth::tls::install_crypto_provider();
    let mut card: a2a::AgentCard =
        reqwest::get(format!("{}/.well-known/agent-card.json", server.base_url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    card.supported_interfaces = interfaces
        .iter()
        .map(|(binding, url)| a2a::AgentInterface::new(url.clone(), *binding))
        .collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = a2a_server::agent_card::agent_card_router(std::sync::Arc::new(
        a2a_server::StaticAgentCard::new(card),
    ));
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

#[tokio::test]
async fn the_client_takes_the_first_interface_of_the_card_it_speaks_unless_told_which() {
    use a2a::{TRANSPORT_PROTOCOL_GRPC as GRPC, TRANSPORT_PROTOCOL_JSONRPC as JSONRPC};
    let server = a2a_support::A2aServer::start(Duration::ZERO).await;
    let echo = || {
        Some(
            [("agent".to_owned(), serde_json::json!("echo"))]
                .into_iter()
                .collect(),
        )
    };
    let (_held, port) = a2a_support::refusing_port();
    let (grpc, jsonrpc, dead) = (
        server.grpc.to_string(),
        format!("{}/", server.base_url()),
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
    );
    // Each card's second interface leads nowhere: a call succeeds only
    // over the one chosen.
    let cases = [
        // gRPC first: gRPC, though JSON-RPC is listed too.
        (
            vec![(GRPC, grpc.clone()), (JSONRPC, format!("http://{dead}/"))],
            None,
        ),
        // JSON-RPC first: JSON-RPC.
        (
            vec![(JSONRPC, jsonrpc.clone()), (GRPC, dead.to_string())],
            None,
        ),
        // An interface this client does not speak is passed over.
        (
            vec![
                ("HTTP+JSON", format!("http://{dead}/")),
                (GRPC, grpc.clone()),
                (JSONRPC, format!("http://{dead}/")),
            ],
            None,
        ),
        // Told which: that one, wherever the card lists it.
        (
            vec![(GRPC, dead.to_string()), (JSONRPC, jsonrpc.clone())],
            Some(agentd::client::a2a::Binding::Jsonrpc),
        ),
    ];
    for (interfaces, binding) in cases {
        let url = card_listing(&server, &interfaces).await;
        let client = A2aClient::connect(&url, binding).await.unwrap();
        let out = client
            .send_text("hello", echo(), &opts(), None)
            .await
            .unwrap_or_else(|e| panic!("{interfaces:?} {binding:?}: {e:?}"));
        let Outcome::Completed { artifacts, .. } = out else {
            panic!("{interfaces:?}: {out:?}")
        };
        assert_eq!(parts_text(&artifacts[0].parts), "hello");
    }
    server.stop().await;
}

/// Over gRPC, a message larger than the binding's client receives (4 MiB:
/// the a2a-grpc client keeps tonic's default) would come again on every
/// retry: the call ends at once with an error that says so, and the task,
/// which was not failing, is left running rather than cancelled. Here the
/// remote's answer grows by 1 MiB chunks slower than the idle timeout, so
/// that each gap is recovered from a GetTask, until that snapshot passes
/// 4 MiB.
#[tokio::test]
async fn a_message_larger_than_grpc_receives_ends_the_call_without_cancelling_the_task() {
    let server = a2a_support::A2aServer::start(Duration::ZERO).await;
    let client = server.grpc_client().await;
    let stream = Some(
        [("agent".to_owned(), serde_json::json!("stream"))]
            .into_iter()
            .collect(),
    );
    let o = CallOptions {
        idle_timeout: Duration::from_millis(150),
        max_backoff: Duration::from_millis(50),
        ..opts()
    };
    let err = client
        .send_text("n=12 size=1048576 rate=4", stream, &o, None)
        .await
        .unwrap_err();
    let CallError::MessageTooLarge {
        task_id: Some(task_id),
        last_state: Some(TaskState::Working),
        ..
    } = &err
    else {
        // Not Debug: the artifacts are megabytes.
        panic!("{err}")
    };
    assert!(err.to_string().contains("left running"), "{err}");
    // The task goes on to its end (read over JSON-RPC, which has no such
    // limit).
    let jsonrpc = A2aClient::connect(&server.base_url(), None).await.unwrap();
    assert_eq!(
        remote_state(&jsonrpc, task_id, TaskState::Completed).await,
        TaskState::Completed
    );
    server.stop().await;
}
