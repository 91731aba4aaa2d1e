//! agentd's A2A streaming client against a Python A2A agent written with the
//! official SDK (tests/a2a_test_agent.py): chunked and multiple artifacts,
//! a connection dropped mid-stream, a silent stall, a deadline; and against
//! our own server in-process.

mod a2a_support;
mod common;

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
        cancel: agentd::client::a2a::Cancellation::Acknowledged(_),
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
    // The task goes on to its end (read over JSON-RPC, whose limit is far
    // larger: 129 MiB outside a call).
    let jsonrpc = A2aClient::connect(&server.base_url(), None).await.unwrap();
    assert_eq!(
        remote_state(&jsonrpc, task_id, TaskState::Completed).await,
        TaskState::Completed
    );
    server.stop().await;
}

// ---------------------------------------------------------------------------
// The JSON-RPC transport against a peer scripted byte by byte: what it reads
// is bounded (an event that never ends, an answer too large), and it reads
// streams as the SDK's transport did.
// ---------------------------------------------------------------------------

mod raw_peer {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// How the peer answers one request.
    #[derive(Clone)]
    pub enum Body {
        /// This content type (none if `None`), then these chunks; the
        /// connection then closes (the end of the body).
        Chunks(Option<&'static str>, Vec<Vec<u8>>),
        /// An SSE body that never ends its last event: `start`, then `x`s,
        /// 16 KiB a write, until `cap` bytes were written or the client goes
        /// away.
        Endless { start: Vec<u8>, cap: usize },
        /// JSON, with its content-length.
        Json(String),
    }

    /// A JSON-RPC peer on 127.0.0.1: `script` answers each request, given
    /// its method; a GET is answered with an agent card that lists the peer
    /// itself as a JSON-RPC interface.
    pub struct RawPeer {
        pub url: String,
        methods: Arc<Mutex<Vec<String>>>,
        /// What an endless body wrote, and whether the client went away.
        pub written: Arc<AtomicUsize>,
        pub cut_off: Arc<AtomicBool>,
    }

    impl RawPeer {
        pub async fn start(script: impl Fn(&str) -> Body + Send + Sync + 'static) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}/", listener.local_addr().unwrap());
            let peer = Self {
                url: url.clone(),
                methods: Arc::default(),
                written: Arc::default(),
                cut_off: Arc::default(),
            };
            let (methods, written, cut_off) = (
                peer.methods.clone(),
                peer.written.clone(),
                peer.cut_off.clone(),
            );
            let script = Arc::new(script);
            tokio::spawn(async move {
                while let Ok((socket, _)) = listener.accept().await {
                    let (script, methods, written, cut_off, url) = (
                        script.clone(),
                        methods.clone(),
                        written.clone(),
                        cut_off.clone(),
                        url.clone(),
                    );
                    tokio::spawn(async move {
                        serve(socket, &*script, &methods, &written, &cut_off, &url).await
                    });
                }
            });
            peer
        }

        /// The methods called so far, in order.
        pub fn methods(&self) -> Vec<String> {
            self.methods.lock().unwrap().clone()
        }
    }

    async fn serve(
        mut socket: TcpStream,
        script: &(dyn Fn(&str) -> Body + Send + Sync),
        methods: &Mutex<Vec<String>>,
        written: &AtomicUsize,
        cut_off: &AtomicBool,
        url: &str,
    ) {
        let Some((head, body)) = read_request(&mut socket).await else {
            return;
        };
        if head.starts_with("GET ") {
            let card = serde_json::json!({
                "name": "raw", "description": "raw", "version": "1",
                "supportedInterfaces": [{"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}],
                "capabilities": {"streaming": true},
                "defaultInputModes": ["text"], "defaultOutputModes": ["text"], "skills": [],
            })
            .to_string();
            let response = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{card}",
                card.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
            return;
        }
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let method = request["method"].as_str().unwrap().to_owned();
        methods.lock().unwrap().push(method.clone());
        let (content_type, endless) = match script(&method) {
            Body::Chunks(ct, chunks) => (ct, Err(chunks)),
            Body::Endless { start, cap } => (Some("text/event-stream"), Ok((start, cap))),
            Body::Json(json) => {
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
                    json.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                return;
            }
        };
        let ct = content_type.map_or(String::new(), |c| format!("content-type: {c}\r\n"));
        let head = format!("HTTP/1.1 200 OK\r\n{ct}connection: close\r\n\r\n");
        if socket.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        match endless {
            Err(chunks) => {
                for c in chunks {
                    if socket.write_all(&c).await.is_err() {
                        return;
                    }
                }
                let _ = socket.shutdown().await;
            }
            Ok((start, cap)) => {
                let _ = socket.write_all(&start).await;
                let block = vec![b'x'; 16 * 1024];
                let mut n = start.len();
                while n < cap {
                    if socket.write_all(&block).await.is_err() {
                        cut_off.store(true, Ordering::SeqCst);
                        break;
                    }
                    n += block.len();
                    written.store(n, Ordering::SeqCst);
                    // Paced a little (16 MB/s at most), so that what is in
                    // flight when the client goes away stays small.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }

    /// An HTTP/1.1 request: its head, and its body (by content-length).
    async fn read_request(socket: &mut TcpStream) -> Option<(String, Vec<u8>)> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let header_end = loop {
            let n = socket.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
        };
        let head = String::from_utf8_lossy(&buf[..header_end]).into_owned();
        let length = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0);
        while buf.len() < header_end + length {
            let n = socket.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        Some((head, buf[header_end..header_end + length].to_vec()))
    }
}

use raw_peer::{Body, RawPeer};

/// `result` (a StreamResponse or a Task) in a JSON-RPC response, as JSON.
fn envelope<T: a2a_pb::protojson_conv::ProtoJsonPayload>(result: &T) -> String {
    serde_json::json!({
        "jsonrpc": "2.0",
        "id": "1",
        "result": a2a_pb::protojson_conv::to_value(result).unwrap(),
    })
    .to_string()
}

/// Task t in `state`, its status's message holding `text`.
fn task_t(state: TaskState, text: &str) -> a2a::Task {
    a2a::Task {
        id: "t".into(),
        context_id: "c".into(),
        status: a2a::TaskStatus {
            state,
            message: (!text.is_empty())
                .then(|| a2a::Message::new(a2a::Role::Agent, vec![a2a::Part::text(text)])),
            timestamp: None,
        },
        artifacts: None,
        history: None,
        metadata: None,
    }
}

/// An SSE event of task t as it is in `state`.
fn task_event(state: TaskState) -> Vec<u8> {
    format!(
        "data: {}\n\n",
        envelope(&StreamResponse::Task(task_t(state, "")))
    )
    .into_bytes()
}

/// A JSON-RPC error response (not an event), of `code`.
fn error_envelope(code: i32, data: serde_json::Value) -> String {
    serde_json::json!({
        "jsonrpc": "2.0",
        "id": "1",
        "error": {"code": code, "message": "no such task", "data": data},
    })
    .to_string()
}

/// Small limits: what a call that buffers 1 KiB of artifacts reads.
fn small() -> CallOptions {
    CallOptions {
        max_artifact_bytes: 1024,
        ..opts()
    }
}

/// A peer that never ends an event (it would send 24 MiB of one) has the
/// call end at the bound with an error that says so, as a gRPC message past
/// its limit: at once, not retried (no GetTask, no SubscribeToTask), and
/// the task left running (no CancelTask). The client stops reading there:
/// the peer finds the connection closed long before it has sent it all.
/// Both ways of connecting (a card, a JSON-RPC URL) use the bounded
/// transport.
#[tokio::test]
async fn an_event_that_never_ends_stops_the_call_at_the_bound() {
    const CAP: usize = 24 << 20;
    let limit = agentd::client::a2a::jsonrpc::Limits::for_artifacts(1024).max_event_bytes;
    for via_card in [false, true] {
        let peer = RawPeer::start(|method| match method {
            "SendStreamingMessage" => {
                let mut start = task_event(TaskState::Working);
                start.extend_from_slice(b"data: {\"jsonrpc\":\"2.0\",\"id\":\"1\",\"result\":\"");
                Body::Endless { start, cap: CAP }
            }
            _ => Body::Chunks(None, vec![]),
        })
        .await;
        let client = if via_card {
            A2aClient::connect(&peer.url, None).await.unwrap()
        } else {
            A2aClient::jsonrpc(&peer.url, None).unwrap()
        };
        let err = tokio::time::timeout(
            Duration::from_secs(20),
            client.send_text("go", None, &small(), None),
        )
        .await
        .expect("the call did not end")
        .unwrap_err();
        let CallError::MessageTooLarge {
            task_id: Some(task_id),
            last_state: Some(TaskState::Working),
            cause,
            ..
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(task_id, "t");
        assert!(
            cause.contains(&format!("limit of {limit} bytes")),
            "{cause}"
        );
        assert!(err.to_string().contains("left running"), "{err}");
        assert_eq!(peer.methods(), ["SendStreamingMessage"], "card: {via_card}");
        // The peer finds the connection closed (bounded: it would stop by
        // itself at CAP).
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !peer.cut_off.load(std::sync::atomic::Ordering::SeqCst)
            && tokio::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let written = peer.written.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            peer.cut_off.load(std::sync::atomic::Ordering::SeqCst),
            "the client read on: {written} bytes"
        );
        // The bound (1 MiB), and what the sockets' buffers took.
        assert!(
            written < CAP / 2,
            "{written} bytes were sent before the client stopped"
        );
    }
}

/// An event exactly as large as the bound arrives whole, in however many
/// chunks; one byte more ends the call at once with the limit's error.
#[tokio::test]
async fn an_event_at_the_bound_arrives_whole_and_one_byte_more_is_refused() {
    let limit = agentd::client::a2a::jsonrpc::Limits::for_artifacts(1024).max_event_bytes;
    // The line `data: <envelope>` whose status message holds `n` bytes.
    let line = |n: usize| {
        let event = StreamResponse::StatusUpdate(a2a::TaskStatusUpdateEvent {
            task_id: "t".into(),
            context_id: "c".into(),
            status: task_t(TaskState::Completed, &"a".repeat(n)).status,
            metadata: None,
        });
        format!("data: {}", envelope(&event))
    };
    let fits = limit - (line(1).len() - 1);
    assert_eq!(line(fits).len(), limit);
    for (n, whole) in [(fits, true), (fits + 1, false)] {
        let body: Vec<Vec<u8>> = format!("{}\n\n", line(n))
            .into_bytes()
            .chunks(8 * 1024)
            .map(<[u8]>::to_vec)
            .collect();
        let peer =
            RawPeer::start(move |_| Body::Chunks(Some("text/event-stream"), body.clone())).await;
        let client = A2aClient::jsonrpc(&peer.url, None).unwrap();
        let out = client.send_text("go", None, &small(), None).await;
        if whole {
            let Ok(Outcome::Completed {
                message: Some(m), ..
            }) = &out
            else {
                panic!("{:?}", out.map_err(|e| e.to_string()).map(|_| ()))
            };
            assert_eq!(parts_text(&m.parts).len(), n);
        } else {
            let Err(CallError::MessageTooLarge {
                task_id: None,
                cause,
                ..
            }) = &out
            else {
                panic!("{:?}", out.map_err(|e| e.to_string()).map(|_| ()))
            };
            assert!(
                cause.contains(&format!("limit of {limit} bytes")),
                "{cause}"
            );
        }
        assert_eq!(peer.methods(), ["SendStreamingMessage"]);
    }
}

/// A GetTask answer past the bound (recovering a dropped stream) ends the
/// call at once with the limit's error, the task left running (no
/// SubscribeToTask, no CancelTask): whether the answer says its length
/// first or not. Outside a call, GetTask reads with the default limits
/// (64 MiB of artifacts: 129 MiB), and the answer passes.
#[tokio::test]
async fn a_get_task_answer_past_the_bound_ends_the_call_without_a_cancel() {
    let limit = agentd::client::a2a::jsonrpc::Limits::for_artifacts(1024).max_body_bytes;
    let big = envelope(&task_t(TaskState::Working, &"b".repeat(limit)));
    for with_length in [true, false] {
        let big = big.clone();
        let peer = RawPeer::start(move |method| match method {
            // The stream ends before the task does: a drop.
            "SendStreamingMessage" => Body::Chunks(
                Some("text/event-stream"),
                vec![task_event(TaskState::Working)],
            ),
            "GetTask" if with_length => Body::Json(big.clone()),
            "GetTask" => Body::Chunks(
                Some("application/json"),
                big.as_bytes()
                    .chunks(16 * 1024)
                    .map(<[u8]>::to_vec)
                    .collect(),
            ),
            _ => Body::Chunks(None, vec![]),
        })
        .await;
        let client = A2aClient::jsonrpc(&peer.url, None).unwrap();
        let err = client
            .send_text("go", None, &small(), None)
            .await
            .unwrap_err();
        let CallError::MessageTooLarge {
            task_id: Some(task_id),
            cause,
            ..
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(task_id, "t");
        assert!(cause.contains("an answer"), "{cause}");
        assert!(
            cause.contains(&format!("limit of {limit} bytes")),
            "{cause}"
        );
        assert_eq!(
            peer.methods(),
            ["SendStreamingMessage", "GetTask"],
            "length: {with_length}"
        );
        let task = client.get_task("t").await.unwrap();
        assert_eq!(answer_text(&task).len(), limit);
    }
}

fn answer_text(task: &a2a::Task) -> String {
    task.status
        .message
        .as_ref()
        .map(|m| parts_text(&m.parts))
        .unwrap_or_default()
}

/// The transport reads a stream as the SDK's did: a JSON-RPC error in a
/// JSON body (with or without a content type, or with an event stream's),
/// or in an event, is that error (its code mapped as the SDK maps it); an
/// event cut off, or bytes that are no event, at the end are an error,
/// never a clean end; an event the stream ends inside is still read;
/// whitespace at the end is a clean end; events end at `\n\n`, `\r\r` or
/// `\r\n\r\n`, and `data` may take several lines.
#[tokio::test]
async fn the_json_rpc_transport_reads_streams_as_the_sdks_did() {
    use a2a::error_code::{INTERNAL_ERROR, TASK_NOT_FOUND};
    use futures::StreamExt;
    // INTERNAL_ERROR, with an ErrorInfo of the A2A domain that says
    // TASK_NOT_FOUND: TASK_NOT_FOUND.
    let not_found = error_envelope(
        INTERNAL_ERROR,
        serde_json::json!([{
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "TASK_NOT_FOUND",
            "domain": "a2a-protocol.org",
        }]),
    );
    let working = String::from_utf8(task_event(TaskState::Working)).unwrap();
    let completed = envelope(&StreamResponse::Task(task_t(TaskState::Completed, "")));
    // The same event, its data on two lines (JSON does not mind the line
    // end between them).
    let (a, b) = completed.split_at(completed.find(',').unwrap() + 1);
    let two_lines = format!("data: {a}\ndata: {b}\n\n");
    // What a call yields: each event's state or error code, or the error
    // code the call itself failed with.
    type Seen = Result<Vec<Result<TaskState, i32>>, i32>;
    let w = Ok(TaskState::Working);
    let c = Ok(TaskState::Completed);
    let cases: Vec<(&str, Option<&'static str>, String, Seen)> = vec![
        (
            "an error in a JSON body",
            Some("application/json"),
            not_found.clone(),
            Err(TASK_NOT_FOUND),
        ),
        (
            "an error in a body without a content type",
            None,
            not_found.clone(),
            Ok(vec![Err(TASK_NOT_FOUND)]),
        ),
        (
            "an error in an event stream's body, not in an event",
            Some("text/event-stream"),
            format!("{not_found}\n"),
            Ok(vec![Err(TASK_NOT_FOUND)]),
        ),
        (
            "an error in an event",
            Some("text/event-stream"),
            format!("{working}data: {not_found}\n\n"),
            Ok(vec![w.clone(), Err(TASK_NOT_FOUND)]),
        ),
        (
            "an event cut off",
            Some("text/event-stream"),
            format!("{working}data: {{\"jsonrpc\":\"2.0\",\"res"),
            Ok(vec![w.clone(), Err(INTERNAL_ERROR)]),
        ),
        (
            "bytes that are no event at the end",
            Some("text/event-stream"),
            format!("{working}id: 4\n"),
            Ok(vec![w.clone(), Err(INTERNAL_ERROR)]),
        ),
        (
            "an event the stream ends inside",
            Some("text/event-stream"),
            format!("{working}data: {completed}"),
            Ok(vec![w.clone(), c.clone()]),
        ),
        (
            "whitespace at the end",
            Some("text/event-stream"),
            format!("{working} \r\n\n\t "),
            Ok(vec![w.clone()]),
        ),
        (
            "\\r\\r, \\r\\n\\r\\n, and data on two lines",
            Some("text/event-stream"),
            format!("data: {completed}\r\rdata: {completed}\r\n\r\n{two_lines}"),
            Ok(vec![c.clone(), c.clone(), c.clone()]),
        ),
    ];
    for (case, content_type, body, want) in cases {
        // In small chunks, so that events and lines are split between them.
        let chunks: Vec<Vec<u8>> = body.as_bytes().chunks(7).map(<[u8]>::to_vec).collect();
        let peer = RawPeer::start(move |_| Body::Chunks(content_type, chunks.clone())).await;
        let client = A2aClient::jsonrpc(&peer.url, None).unwrap();
        let req = a2a::SendMessageRequest {
            message: a2a::Message::new(a2a::Role::User, vec![a2a::Part::text("go")]),
            configuration: None,
            metadata: None,
            tenant: None,
        };
        let seen: Seen = match client.raw().send_streaming_message(&req).await {
            Err(e) => Err(e.code),
            Ok(stream) => Ok(stream
                .map(|item| {
                    item.map(|ev| match ev {
                        StreamResponse::Task(t) => t.status.state,
                        other => panic!("{case}: {other:?}"),
                    })
                    .map_err(|e| e.code)
                })
                .collect()
                .await),
        };
        assert_eq!(seen, want, "{case}");
    }
}

/// A card larger than the client reads (a body that goes on, with no
/// length) fails the connect with the limit named; the client stops
/// reading there, long before the peer would stop by itself. A card with
/// a content-length past the limit is refused before its body is read.
#[tokio::test]
async fn a_card_past_the_limit_fails_the_connect_without_being_read_whole() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const CAP: usize = 16 << 20;
    let limit = agentd::client::a2a::MAX_CARD_BYTES;
    for with_length in [false, true] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let written = Arc::new(AtomicUsize::new(0));
        let w = written.clone();
        let peer = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 4096];
            let _ = socket.read(&mut head).await;
            let length = if with_length {
                format!("content-length: {CAP}\r\n")
            } else {
                String::new()
            };
            let start = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{length}connection: close\r\n\r\n{{\"name\":\""
            );
            if socket.write_all(start.as_bytes()).await.is_err() {
                return;
            }
            let block = vec![b'x'; 16 * 1024];
            let mut n = 0;
            while n < CAP {
                if socket.write_all(&block).await.is_err() {
                    return;
                }
                n += block.len();
                w.store(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        let err = tokio::time::timeout(Duration::from_secs(20), A2aClient::connect(&url, None))
            .await
            .expect("the connect did not end")
            .err()
            .expect("a card past the limit was read");
        let msg = format!("{err:#}");
        assert!(
            msg.contains("cannot read the agent card")
                && msg.contains(&format!("limit of {limit} bytes")),
            "{msg}"
        );
        // The client went away: the peer's writes fail well before CAP.
        tokio::time::timeout(Duration::from_secs(10), peer)
            .await
            .expect("the peer wrote on")
            .unwrap();
        let sent = written.load(Ordering::SeqCst);
        assert!(
            sent < CAP / 2,
            "{sent} bytes were sent before the client stopped"
        );
    }
}

/// A server that takes the request and never answers: GetTask and
/// CancelTask end with an error once the client's request timeout passes
/// (by default 30 s), instead of never.
#[tokio::test]
async fn get_task_and_cancel_of_a_server_that_never_answers_end_at_the_request_timeout() {
    let silent = common::Silent::start().await;
    let timeout = Duration::from_millis(300);
    let client = A2aClient::jsonrpc(&format!("http://{}/", silent.addr), None)
        .unwrap()
        .with_request_timeout(timeout);
    for cancel in [false, true] {
        let started = std::time::Instant::now();
        let call = async {
            if cancel {
                client.cancel("t1").await
            } else {
                client.get_task("t1").await
            }
        };
        let answer = tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .expect("bounded by the request timeout");
        let e = answer.expect_err("no answer came");
        assert!(e.message.contains("no answer within"), "{e:?}");
        assert!(started.elapsed() >= timeout);
    }
}
