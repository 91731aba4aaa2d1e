//! Prometheus metrics scraped over HTTP from the admin port after real calls
//! over TLS: per method and final status (a stream's status is the one in
//! its trailers), durations to the end of the stream, and the run metrics.
//! The A2A request metrics, after real calls over both A2A bindings, are
//! read from the process's recorder (what the admin port serves).

mod a2a_support;
mod common;
mod secured;
mod support;

use std::time::Duration;

use agentd::turn::{SlowConsumer, TurnConfig};
use common::{run_request, with_agent};
use secured::{Ca, Metrics, Secure, SecureServer, rpc};
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(30);
const HANDLED: &str = "grpc_server_handled_total";

fn slow_tool(delay: Duration) -> Secure {
    Secure {
        tool_delay: delay,
        ..Secure::default()
    }
}

fn delta(after: &Metrics, before: &Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    after.count(name, labels) - before.count(name, labels)
}

#[tokio::test]
async fn calls_are_counted_by_method_and_final_status_and_a_stream_by_its_trailer() {
    let server = SecureServer::start(Ca::new("ca"), slow_tool(Duration::from_secs(2))).await;
    let before = server.metrics().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let (_, end) = c
        .run_to_end(
            run_request("alice", &session, "ok", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();

    // The headers go out OK at once; the deadline ends the stream later.
    let short = Duration::from_secs(1);
    let mut call = c
        .run(
            run_request("alice", &session, "late", "Where is order 1042?"),
            short,
        )
        .await
        .unwrap();
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the slow run finished inside its deadline"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::DeadlineExceeded);

    let m = server
        .metrics_until("the deadline-exceeded Run", |m| {
            delta(m, &before, HANDLED, &rpc("Run", "DEADLINE_EXCEEDED")) == 1.0
        })
        .await;
    assert_eq!(
        delta(&m, &before, HANDLED, &rpc("Run", "OK")),
        1.0,
        "{}",
        m.0
    );
    assert_eq!(
        delta(&m, &before, HANDLED, &rpc("CreateSession", "OK")),
        1.0
    );
    assert_eq!(delta(&m, &before, HANDLED, &rpc("Run", "CANCELLED")), 0.0);
    // Measured to the end of the stream, not to the headers.
    let late = rpc("Run", "DEADLINE_EXCEEDED");
    assert_eq!(
        delta(&m, &before, "grpc_server_handling_seconds_count", &late),
        1.0
    );
    let secs = delta(&m, &before, "grpc_server_handling_seconds_sum", &late);
    assert!(
        secs >= short.as_secs_f64(),
        "the late Run was timed at {secs}s"
    );
    let ok_secs = delta(
        &m,
        &before,
        "grpc_server_handling_seconds_sum",
        &rpc("Run", "OK"),
    );
    assert!(
        ok_secs >= 0.4,
        "the OK Run (a 400 ms tool) was timed at {ok_secs}s"
    );

    let m = server
        .metrics_until("the cancelled run's metrics", |m| {
            delta(
                m,
                &before,
                "agentd_run_cancellations_total",
                &[("cause", "deadline")],
            ) == 1.0
        })
        .await;
    // Three events for the worked trace, the tool call for the late one.
    assert_eq!(
        delta(&m, &before, "agentd_run_events_count", &[("mode", "new")]),
        2.0
    );
    assert_eq!(
        delta(&m, &before, "agentd_run_events_sum", &[("mode", "new")]),
        4.0
    );
    assert_eq!(
        delta(
            &m,
            &before,
            "agentd_run_cancellations_total",
            &[("cause", "client")]
        ),
        0.0
    );
    server
        .metrics_until("no run in flight", |m| {
            m.count("agentd_runs_in_flight", &[]) == 0.0
        })
        .await;
    server.stop().await;
}

#[tokio::test]
async fn a_client_that_drops_the_stream_is_counted_as_a_client_cancellation() {
    let server = SecureServer::start(Ca::new("ca"), slow_tool(Duration::from_secs(20))).await;
    let before = server.metrics().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let mut call = c
        .run(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();
    let m = server
        .metrics_until("one run in flight", |m| {
            m.count("agentd_runs_in_flight", &[]) == 1.0
        })
        .await;
    // A call still streaming is started, not yet handled.
    let run = [
        ("grpc_service", "agents.v1.AgentService"),
        ("grpc_method", "Run"),
    ];
    assert_eq!(
        delta(&m, &before, "grpc_server_started_total", &run),
        1.0,
        "{}",
        m.0
    );
    assert_eq!(delta(&m, &before, HANDLED, &run), 0.0, "{}", m.0);
    drop(call);

    let m = server
        .metrics_until("the client's cancellation", |m| {
            delta(
                m,
                &before,
                "agentd_run_cancellations_total",
                &[("cause", "client")],
            ) == 1.0
                && delta(m, &before, HANDLED, &rpc("Run", "CANCELLED")) == 1.0
        })
        .await;
    assert_eq!(delta(&m, &before, HANDLED, &rpc("Run", "OK")), 0.0);
    server
        .metrics_until("no run in flight", |m| {
            m.count("agentd_runs_in_flight", &[]) == 0.0
        })
        .await;
    server.stop().await;
}

#[tokio::test]
async fn repeated_request_ids_are_counted_as_replays_and_attaches() {
    let server = SecureServer::start(Ca::new("ca"), slow_tool(Duration::from_secs(2))).await;
    let before = server.metrics().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let req = run_request("alice", &session, "r1", "Where is order 1187?");
    let (first, end) = c.run_to_end(req.clone(), DEADLINE).await.unwrap();
    end.unwrap();
    let again = c.run(req, DEADLINE).await.unwrap();
    assert_eq!(again.mode, "replay");
    drop(again);

    // A second call while the first still runs attaches to it.
    let req = run_request("alice", &session, "r2", "Where is order 1042?");
    let mut live = c.run(req.clone(), DEADLINE).await.unwrap();
    live.events.message().await.unwrap().unwrap();
    let (attached, end) = {
        let mut c2 = c.clone();
        let call = c2.run(req, DEADLINE).await.unwrap();
        assert_eq!(call.mode, "attach");
        let mut events = call.events;
        let mut n = Vec::new();
        let end = loop {
            match events.message().await {
                Ok(Some(e)) => n.push(e),
                Ok(None) => break Ok(()),
                Err(s) => break Err(s),
            }
        };
        (n, end)
    };
    end.unwrap();
    assert_eq!(attached.len(), first.len());
    drop(live);

    let m = server
        .metrics_until("the replay and the attach", |m| {
            delta(m, &before, "agentd_dedup_total", &[("mode", "replay")]) == 1.0
                && delta(m, &before, "agentd_dedup_total", &[("mode", "attach")]) == 1.0
        })
        .await;
    assert_eq!(
        server.tool.started(),
        2,
        "two turns ran; the repeats ran nothing"
    );
    // An Attach names its turn: it is no repeated request id.
    let attach = agentd::pb::AttachRequest {
        user_id: "alice".into(),
        session_id: session.clone(),
        request_id: "r1".into(),
        after_seq: None,
    };
    let mut attached = c.raw().attach(attach).await.unwrap().into_inner();
    while attached.message().await.unwrap().is_some() {}
    let after_attach = server.metrics().await;
    assert_eq!(
        delta(
            &after_attach,
            &m,
            "agentd_dedup_total",
            &[("mode", "replay")]
        ),
        0.0,
        "an Attach is not counted as a repeat"
    );
    assert!(
        delta(
            &m,
            &before,
            "agentd_run_events_count",
            &[("mode", "attach")]
        ) <= 1.0
    );
    server.stop().await;
}

/// A server that cuts a reader that stops reading (`--slow-consumer fail`)
/// after 200 ms, with little buffered for it.
async fn slow_readers_cut_soon() -> SecureServer {
    let turn = TurnConfig {
        channel_capacity: 8,
        slow_consumer: SlowConsumer::Fail,
        stall_timeout: Duration::from_millis(200),
        ..TurnConfig::default()
    };
    SecureServer::start(
        Ca::new("ca"),
        Secure {
            turn,
            ..Secure::default()
        },
    )
    .await
}

#[tokio::test]
async fn a_reader_that_stalls_is_counted_as_a_slow_consumer_termination() {
    let server = slow_readers_cut_soon().await;
    let before = server.metrics().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let req = with_agent(
        run_request("alice", &session, "r1", "n=200000 size=1024"),
        "stream",
    );
    let mut call = c.run(req, DEADLINE).await.unwrap();
    call.events.message().await.unwrap().unwrap();
    // Stop reading until the server gives up on us.
    server
        .metrics_until("the slow-consumer termination", |m| {
            delta(m, &before, "agentd_slow_consumer_terminations_total", &[]) == 1.0
        })
        .await;
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stream ended OK"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted);
    server
        .metrics_until("the RESOURCE_EXHAUSTED Run", |m| {
            delta(m, &before, HANDLED, &rpc("Run", "RESOURCE_EXHAUSTED")) == 1.0
        })
        .await;
    server.stop().await;
}

/// A follower (here a replay of a long turn) whose reader stalls is cut
/// as a Run's own reader is, and counted the same way.
#[tokio::test]
async fn a_follower_whose_reader_stalls_is_counted_as_a_slow_consumer_termination() {
    let server = slow_readers_cut_soon().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let req = with_agent(
        run_request("alice", &session, "r1", "n=8000 size=1024"),
        "stream",
    );
    let mut call = c.run(req.clone(), DEADLINE).await.unwrap();
    while call.events.message().await.unwrap().is_some() {}
    let before = server.metrics().await;
    let mut replay = c.run(req, DEADLINE).await.unwrap();
    replay.events.message().await.unwrap().unwrap();
    // Stop reading until the server gives up on us.
    server
        .metrics_until("the follower's slow-consumer termination", |m| {
            delta(m, &before, "agentd_slow_consumer_terminations_total", &[]) == 1.0
        })
        .await;
    let status = loop {
        match replay.events.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the replay ended OK"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    server.stop().await;
}

#[tokio::test]
async fn a_run_cut_at_shutdown_is_counted_and_readyz_turns_unavailable() {
    let secure = Secure {
        tool_delay: Duration::from_secs(30),
        shutdown_grace: Some(Duration::from_millis(300)),
        ..Secure::default()
    };
    let mut server = SecureServer::start(Ca::new("ca"), secure).await;
    assert_eq!(server.admin_get("/readyz").await.0, 200);
    assert_eq!(server.admin_get("/healthz").await.0, 200);
    let before = server.metrics().await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let mut call = c
        .run(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    call.events.message().await.unwrap().unwrap();

    server.begin_shutdown();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while server.admin_get("/readyz").await.0 != 503 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz still ready during shutdown"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = call.events.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    server
        .metrics_until("the cut run", |m| {
            delta(
                m,
                &before,
                "agentd_run_cancellations_total",
                &[("cause", "shutdown")],
            ) == 1.0
                && delta(m, &before, HANDLED, &rpc("Run", "UNAVAILABLE")) == 1.0
        })
        .await;
    server.stop().await;
}

#[tokio::test]
async fn refusals_before_any_message_are_counted_with_their_status() {
    let tokens =
        r#"{"tokens": [{"token": "tok-0123456789abcdef", "caller": "x", "user_ids": ["*"]}]}"#;
    let server = SecureServer::start(
        Ca::new("ca"),
        Secure {
            tokens_json: Some(tokens.into()),
            ..Secure::default()
        },
    )
    .await;
    let before = server.metrics().await;
    let mut anonymous = server.client(None, None).await.unwrap();
    assert_eq!(
        anonymous.create_session("alice").await.unwrap_err().code(),
        Code::Unauthenticated
    );
    let mut c = server
        .client(None, Some("tok-0123456789abcdef"))
        .await
        .unwrap();
    let err = c
        .run(run_request("alice", "not-a-session", "r1", "hi"), DEADLINE)
        .await
        .err()
        .expect("a bad session id is refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    // A method this server does not serve (reflection v1alpha; only v1 is
    // served) is counted, but not under a name the caller chose.
    let channel = tonic::transport::Endpoint::from_shared(server.url())
        .unwrap()
        .tls_config(agentd::client::ClientSecurity::tls_from_pem(
            server.ca.pem.as_bytes(),
            None,
        ))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut alpha =
        tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient::new(
            channel,
        );
    let req = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: None,
    };
    let err = match alpha.server_reflection_info(tokio_stream::once(req)).await {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(
        err.code(),
        Code::Unauthenticated,
        "authentication comes before routing: {err:?}"
    );

    let m = server.metrics().await;
    let unknown = [
        ("grpc_service", "unknown"),
        ("grpc_method", "unknown"),
        ("grpc_code", "UNAUTHENTICATED"),
    ];
    assert_eq!(delta(&m, &before, HANDLED, &unknown), 1.0, "{}", m.0);
    assert!(!m.0.contains("v1alpha"), "{}", m.0);
    assert_eq!(
        delta(
            &m,
            &before,
            HANDLED,
            &rpc("CreateSession", "UNAUTHENTICATED")
        ),
        1.0,
        "{}",
        m.0
    );
    assert_eq!(
        delta(&m, &before, HANDLED, &rpc("Run", "INVALID_ARGUMENT")),
        1.0,
        "{}",
        m.0
    );
    server.stop().await;
}

/// `agentd_store_up` of a real `agentd serve` on PostgreSQL behind a proxy:
/// 1 from the start, 0 while the database cannot be reached, 1 again once
/// it answers; both for a database that refuses connections and for one
/// that stops answering. In the second no store error is counted (each
/// health check gives up before the pool's connection attempt fails, and
/// Runs are refused without calling the store), so only this gauge shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentd_store_up_is_0_while_the_database_is_unreachable_and_1_again_once_it_answers() {
    let Some(db) = support::TestDb::fresh(support::Backend::Postgres).await else {
        return;
    };
    let proxy = support::Proxy::start(db.pg_addr()).await;
    let served = support::Child::serve(&["--store", &db.url_via(proxy.port)]).await;
    let admin = served.admin.expect("the admin port's address in the log");
    let store_up = |want: f64| move |m: &Metrics| m.get("agentd_store_up", &[]) == Some(want);
    scrape_until(admin, "agentd_store_up 1 at start", store_up(1.0)).await;

    for (outage, cut) in [
        ("refused", support::Proxy::down as fn(&support::Proxy)),
        ("unanswered", support::Proxy::hang),
    ] {
        cut(&proxy);
        scrape_until(
            admin,
            &format!("0 with connections {outage}"),
            store_up(0.0),
        )
        .await;
        proxy.up();
        scrape_until(
            admin,
            &format!("1 after connections {outage}"),
            store_up(1.0),
        )
        .await;
    }
    served.kill9().await;
}

/// Scrapes `admin`'s /metrics until `cond` holds (at most 20 s).
async fn scrape_until(
    admin: std::net::SocketAddr,
    what: &str,
    cond: impl Fn(&Metrics) -> bool,
) -> Metrics {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = secured::http_get(admin, "/metrics").await;
        assert_eq!(status, 200, "{body}");
        let m = Metrics(body);
        if cond(&m) {
            return m;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; metrics:\n{}",
            m.0
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The process's metrics (an A2A server in this test's process records into
/// the same recorder the admin port serves).
fn local_metrics() -> Metrics {
    Metrics(agentd::telemetry::metrics::render())
}

/// The process's metrics once `cond` holds (a request is counted when its
/// stream ends on the server, which can be just after the client saw its
/// last event); waits at most 10 s, then returns what it has.
async fn local_metrics_until(cond: impl Fn(&Metrics) -> bool) -> Metrics {
    let mut m = local_metrics();
    for _ in 0..200 {
        if cond(&m) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        m = local_metrics();
    }
    m
}

/// How many more A2A requests of `method` ended with `outcome` in `after`.
fn a2a_delta(
    after: &Metrics,
    before: &Metrics,
    method: &'static str,
    outcome: &'static str,
) -> f64 {
    delta(
        after,
        before,
        "agentd_a2a_requests_total",
        &a2a(method, outcome),
    )
}

/// Asks the demo agent about order 1187 and returns the completed task's id.
async fn completed_order_task(client: &agentd::client::a2a::A2aClient) -> String {
    use agentd::client::a2a::{CallOptions, Outcome};
    let opts = CallOptions {
        idle_timeout: Duration::from_secs(10),
        deadline: DEADLINE,
        ..Default::default()
    };
    match client
        .send_text("Where is order 1187?", None, &opts, None)
        .await
        .unwrap()
    {
        Outcome::Completed { task_id, .. } => task_id,
        out => panic!("{out:?}"),
    }
}

fn a2a(method: &'static str, outcome: &'static str) -> [(&'static str, &'static str); 2] {
    [("method", method), ("outcome", outcome)]
}

#[tokio::test]
async fn a2a_requests_over_json_rpc_are_counted_by_method_and_outcome_and_a_stream_to_its_end() {
    use a2a::{Message, Part, Role, SendMessageRequest, StreamResponse};
    use agentd::client::a2a::A2aClient;
    use futures::StreamExt;

    let tool = Duration::from_millis(300);
    let server = a2a_support::A2aServer::start(tool).await;
    let client = A2aClient::jsonrpc(&format!("{}/", server.base_url()), None).unwrap();
    let before = local_metrics();

    let task_id = completed_order_task(&client).await;
    client.get_task(&task_id).await.unwrap();
    let missing = client.get_task("no-such-task").await.unwrap_err();
    assert_eq!(missing.code, a2a::error_code::TASK_NOT_FOUND);

    // A paced stream (20 s of events) whose reader goes away after the first.
    let agent = [("agent".to_owned(), serde_json::json!("stream"))];
    let req = SendMessageRequest {
        message: Message {
            metadata: Some(agent.into_iter().collect()),
            ..Message::new(Role::User, vec![Part::text("n=1000 size=8 rate=50")])
        },
        configuration: None,
        metadata: None,
        tenant: None,
    };
    let mut events = client.raw().send_streaming_message(&req).await.unwrap();
    let first = tokio::time::timeout(DEADLINE, events.next())
        .await
        .unwrap()
        .expect("the stream ended at once")
        .unwrap();
    let paced_task = match &first {
        StreamResponse::Task(t) => t.id.clone(),
        StreamResponse::StatusUpdate(u) => u.task_id.clone(),
        other => panic!("first event {other:?}"),
    };
    drop(events);
    let m =
        local_metrics_until(|m| a2a_delta(m, &before, "SendStreamingMessage", "CANCELLED") == 1.0)
            .await;
    client.cancel(&paced_task).await.unwrap();
    let m2 = local_metrics();

    assert_eq!(
        a2a_delta(&m, &before, "SendStreamingMessage", "CANCELLED"),
        1.0,
        "the dropped stream: {}",
        m.0
    );
    assert_eq!(
        a2a_delta(&m, &before, "SendStreamingMessage", "OK"),
        1.0,
        "{}",
        m.0
    );
    assert_eq!(a2a_delta(&m, &before, "GetTask", "OK"), 1.0);
    assert_eq!(a2a_delta(&m, &before, "GetTask", "TASK_NOT_FOUND"), 1.0);
    assert_eq!(a2a_delta(&m2, &before, "CancelTask", "OK"), 1.0);
    // Timed to the end of the stream: the worked trace waits on a 300 ms tool.
    let ok = a2a("SendStreamingMessage", "OK");
    let secs = delta(&m, &before, "agentd_a2a_request_seconds_sum", &ok);
    assert!(
        secs >= tool.as_secs_f64(),
        "the streamed task was timed at {secs}s"
    );
    assert!(server.idle(Duration::from_secs(10)).await);
    server.stop().await;
}

/// JSON-RPC requests refused before they reach a method (a body that is not
/// JSON, an unknown method, params that do not fit, an A2A version not
/// served) count as method
/// `unknown` with their error's reason; one that reaches its method counts
/// under that method alone.
#[tokio::test]
async fn a2a_json_rpc_requests_refused_before_a_method_are_counted_by_their_error() {
    let server = a2a_support::A2aServer::start(Duration::ZERO).await;
    let url = format!("{}/", server.base_url());
    agentd::auth::tls::install_crypto_provider();
    let http = reqwest::Client::new();
    let before = local_metrics();
    let cases = [
        ("{not json", "1.0", a2a::error_code::PARSE_ERROR),
        (
            r#"{"jsonrpc":"2.0","id":1,"method":"NoSuchMethod","params":{}}"#,
            "1.0",
            a2a::error_code::METHOD_NOT_FOUND,
        ),
        (
            r#"{"jsonrpc":"2.0","id":2,"method":"GetTask","params":"nonsense"}"#,
            "1.0",
            a2a::error_code::INVALID_PARAMS,
        ),
        (
            r#"{"jsonrpc":"2.0","id":3,"method":"GetTask","params":{"id":"no-such-task"}}"#,
            "1.0",
            a2a::error_code::TASK_NOT_FOUND,
        ),
        (
            r#"{"jsonrpc":"2.0","id":4,"method":"GetTask","params":{"id":"no-such-task"}}"#,
            "0.3",
            a2a::error_code::VERSION_NOT_SUPPORTED,
        ),
    ];
    for (body, version, want) in cases {
        let resp = http
            .post(&url)
            .header("content-type", "application/json")
            .header("a2a-version", version)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{body}");
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], want, "{body}: {v}");
    }
    let card = http
        .get(format!("{}/.well-known/agent-card.json", server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(card.status(), 200);

    let m =
        local_metrics_until(|m| a2a_delta(m, &before, "GetTask", "TASK_NOT_FOUND") == 1.0).await;
    for (outcome, n) in [
        ("PARSE_ERROR", 1.0),
        ("METHOD_NOT_FOUND", 1.0),
        ("INVALID_PARAMS", 1.0),
        ("VERSION_NOT_SUPPORTED", 1.0),
        ("TASK_NOT_FOUND", 0.0),
        ("INVALID_REQUEST", 0.0),
    ] {
        assert_eq!(
            a2a_delta(&m, &before, "unknown", outcome),
            n,
            "{outcome}: {}",
            m.0
        );
    }
    assert_eq!(a2a_delta(&m, &before, "GetTask", "TASK_NOT_FOUND"), 1.0);
    assert_eq!(a2a_delta(&m, &before, "GetTask", "INVALID_PARAMS"), 0.0);
    server.stop().await;
}

#[tokio::test]
async fn a2a_requests_over_grpc_are_counted_by_the_same_metrics() {
    let (client, _tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    let before = local_metrics();
    completed_order_task(&client).await;
    let err = client.cancel("no-such-task").await.unwrap_err();
    assert_eq!(err.code, a2a::error_code::TASK_NOT_FOUND);

    let m =
        local_metrics_until(|m| a2a_delta(m, &before, "SendStreamingMessage", "OK") == 1.0).await;
    assert_eq!(
        a2a_delta(&m, &before, "SendStreamingMessage", "OK"),
        1.0,
        "{}",
        m.0
    );
    assert_eq!(a2a_delta(&m, &before, "CancelTask", "TASK_NOT_FOUND"), 1.0);
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}
