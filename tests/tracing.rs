//! OpenTelemetry traces through an in-process exporter: a caller's W3C
//! `traceparent` continues inside agentd (RPC span, run span, tool span),
//! the client sends its own, log lines carry the trace id, and a model-backed
//! run's model calls and HTTP tool calls are spans whose traceparent the
//! model server and the tool receive, and a remote A2A agent's turn
//! continues the trace on the remote.

mod a2a_support;
mod common;
mod log_capture;
mod openai_support;
mod secured;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use agentd::config::LogFormat;
use common::run_request;
use log_capture::{Logs, line_with};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use secured::{Ca, Secure, SecureServer};
use tracing_opentelemetry::OpenTelemetrySpanExt;

const DEADLINE: Duration = Duration::from_secs(30);

/// The process's telemetry, as `agentd serve` sets it up, with spans kept
/// in memory and JSON logs in a buffer.
fn telemetry() -> &'static (InMemorySpanExporter, Logs) {
    static T: OnceLock<(InMemorySpanExporter, Logs)> = OnceLock::new();
    T.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        (exporter, Logs::install(LogFormat::Json, provider))
    })
}

/// The finished spans of trace `trace`, once `names` are all among them.
async fn spans_of(trace: TraceId, names: &[&str]) -> Vec<SpanData> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let spans: Vec<SpanData> = telemetry()
            .0
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|s| s.span_context.trace_id() == trace)
            .collect();
        if names.iter().all(|n| spans.iter().any(|s| s.name == *n)) {
            return spans;
        }
        let have: Vec<_> = spans.iter().map(|s| s.name.to_string()).collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "spans of {trace} so far: {have:?}, want {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no span {name}"))
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

const RPC: &str = "agents.v1.AgentService/Run";
const TOOL: &str = "execute_tool lookup_order";

#[tokio::test]
async fn a_run_carrying_a_traceparent_produces_spans_in_the_callers_trace() {
    telemetry();
    let server = SecureServer::start(Ca::new("ca"), Secure::default()).await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;

    let trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let caller_span = SpanId::from_hex("00f067aa0ba902b7").unwrap();
    let mut req = tonic::Request::new(run_request("alice", &session, "r1", "Where is order 1187?"));
    req.metadata_mut().insert(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    let events = events_of(c.raw().run(req).await.unwrap().into_inner()).await;
    assert_eq!(events.len(), 3);

    let spans = spans_of(trace, &[RPC, "run", TOOL]).await;
    let rpc = named(&spans, RPC);
    assert_eq!(
        rpc.parent_span_id, caller_span,
        "the RPC span continues the caller's span"
    );
    assert!(rpc.parent_span_is_remote);
    assert_eq!(attr(rpc, "rpc.grpc.status_code").as_deref(), Some("0"));
    assert_eq!(attr(rpc, "rpc.method").as_deref(), Some("Run"));
    let run = named(&spans, "run");
    assert_eq!(
        run.parent_span_id,
        rpc.span_context.span_id(),
        "the run is a child of the RPC"
    );
    let tool = named(&spans, TOOL);
    assert_eq!(
        tool.parent_span_id,
        run.span_context.span_id(),
        "the tool call is a child of the run"
    );
    assert_eq!(
        attr(tool, "gen_ai.tool.name").as_deref(),
        Some("lookup_order")
    );
    // No span carries the thread that opened it or its macro's source line:
    // a span lives as long as its run, and they cost every waiting run.
    for span in &spans {
        let extra: Vec<_> = span
            .attributes
            .iter()
            .map(|kv| kv.key.as_str())
            .filter(|k| k.starts_with("thread.") || k.starts_with("code."))
            .collect();
        assert!(extra.is_empty(), "{}: {extra:?}", span.name);
    }

    // The run's log line carries the trace id.
    let logs = telemetry().1.text();
    let line = line_with(&logs, &["run finished", "\"request_id\":\"r1\"", &session]);
    assert!(line.contains(&trace.to_string()), "{line}");
    server.stop().await;
}

#[tokio::test]
async fn the_client_sends_the_current_trace_to_the_server() {
    telemetry();
    let server = SecureServer::start(Ca::new("ca"), Secure::default()).await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;

    let trace = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap();
    let remote = SpanContext::new(
        trace,
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    );
    let span = tracing::info_span!("caller");
    span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
        .unwrap();
    let client_span_id = span.context().span().span_context().span_id();
    let (_, end) = tracing::Instrument::instrument(
        c.run_to_end(run_request("alice", &session, "r1", "hello"), DEADLINE),
        span.clone(),
    )
    .await
    .unwrap();
    end.unwrap();
    drop(span);

    let spans = spans_of(trace, &[RPC, "run"]).await;
    assert_eq!(
        named(&spans, RPC).parent_span_id,
        client_span_id,
        "the server's span is a child of the client's"
    );
    server.stop().await;
}

#[tokio::test]
async fn tokens_never_reach_the_logs() {
    telemetry();
    let good = "tok-good-0123456789abcdef";
    let bad = "tok-bad-0123456789abcdef";
    let tokens =
        format!(r#"{{"tokens": [{{"token": "{good}", "caller": "svc", "user_ids": ["alice"]}}]}}"#);
    let server = SecureServer::start(
        Ca::new("ca"),
        Secure {
            tokens_json: Some(tokens),
            ..Secure::default()
        },
    )
    .await;
    let mut ok = server.client(None, Some(good)).await.unwrap();
    let session = ok.create_session("alice").await.unwrap().session_id;
    ok.run_to_end(run_request("alice", &session, "r1", "hello"), DEADLINE)
        .await
        .unwrap()
        .1
        .unwrap();
    assert!(ok.create_session("bob").await.is_err());
    let mut wrong = server.client(None, Some(bad)).await.unwrap();
    assert!(wrong.create_session("alice").await.is_err());
    server.stop().await;

    let logs = telemetry().1.text();
    assert!(
        logs.contains("call refused"),
        "the refusals are logged:\n{logs}"
    );
    // The run's span is no child of the call's: it carries the caller
    // itself, for its log lines.
    let finished = line_with(&logs, &["run finished", &session]);
    assert!(
        finished.contains("\"caller\":\"svc\""),
        "the run's line names its caller: {finished}"
    );
    assert!(
        logs.contains("\"caller\":\"svc\""),
        "the caller's name is logged:\n{logs}"
    );
    assert!(
        !logs.contains(good) && !logs.contains(bad),
        "a token was logged:\n{logs}"
    );
}

#[tokio::test]
async fn a_streams_span_ends_with_the_status_of_its_trailers() {
    telemetry();
    let server = SecureServer::start(
        Ca::new("ca"),
        Secure {
            tool_delay: Duration::from_secs(20),
            ..Secure::default()
        },
    )
    .await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let mut req = tonic::Request::new(run_request("alice", &session, "r1", "Where is order 1187?"));
    let deadline = Duration::from_secs(1);
    req.set_timeout(deadline);
    req.metadata_mut().insert(
        "traceparent",
        "00-11111111111111111111111111111111-2222222222222222-01"
            .parse()
            .unwrap(),
    );
    let mut stream = c.raw().run(req).await.unwrap().into_inner();
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the slow run finished inside its deadline"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);

    let trace = TraceId::from_hex("11111111111111111111111111111111").unwrap();
    let spans = spans_of(trace, &[RPC, "run", TOOL]).await;
    let rpc = named(&spans, RPC);
    assert_eq!(attr(rpc, "rpc.grpc.status_code").as_deref(), Some("4"));
    assert!(
        matches!(rpc.status, opentelemetry::trace::Status::Error { .. }),
        "{:?}",
        rpc.status
    );
    let secs = rpc.end_time.duration_since(rpc.start_time).unwrap();
    assert!(
        secs >= deadline,
        "the span ended after {secs:?}, before the stream did"
    );
    server.stop().await;
}

/// A model server answering its first call with a call of the tool named
/// `tool` and its second with text, and the HTTP tool `stock`; both keep the
/// `traceparent` of every request.
async fn traced_model_calling(tool: &str) -> (String, String, Arc<Mutex<Vec<String>>>) {
    use axum::routing::post;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let keep = |seen: Arc<Mutex<Vec<String>>>, who: &'static str, h: &axum::http::HeaderMap| {
        let tp = h
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none");
        seen.lock().unwrap().push(format!("{who} {tp}"));
    };
    let (s1, s2) = (seen.clone(), seen.clone());
    let call = serde_json::json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t1","type":"function",
        "function":{"name":tool,"arguments":"{}"}}]},"finish_reason":"tool_calls"}]})
    .to_string();
    let app = axum::Router::new()
        .route(
            "/v1/chat/completions",
            post(move |h: axum::http::HeaderMap| {
                keep(s1.clone(), "model", &h);
                let first = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                let call = call.clone();
                async move {
                    let chunk = if first {
                        call
                    } else {
                        r#"{"choices":[{"index":0,"delta":{"content":"In stock."},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#.to_owned()
                    };
                    axum::response::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(axum::body::Body::from(format!("data: {chunk}\n\ndata: [DONE]\n\n")))
                        .unwrap()
                }
            }),
        )
        .route(
            "/stock",
            post(move |h: axum::http::HeaderMap| {
                keep(s2.clone(), "tool", &h);
                async { "{\"count\":3}" }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("{base}/v1"), base, seen)
}

/// An agentd serving agent `helper`, which has the HTTP tool `stock` and
/// whose model is [`traced_model_calling`]`(tool)`; and what that model
/// server and tool saw.
async fn helper_calling(tool: &str) -> (openai_support::Agentd, Arc<Mutex<Vec<String>>>) {
    let (model_url, tools_url, seen) = traced_model_calling(tool).await;
    let agents = format!(
        r#"
[agents.helper]
description = "test agent"
instruction = "You answer stock questions."
tools = ["stock"]
[agents.helper.model]
base_url = "{model_url}"
model = "test-model"
[tools.stock]
description = "Stock of a product."
url = "{tools_url}/stock"
parameters = {{ type = "object" }}
"#
    );
    (openai_support::Agentd::start(&agents).await, seen)
}

/// The events of a Run's stream, to its end.
async fn events_of(
    mut stream: tonic::Streaming<agentd::pb::AgentEvent>,
) -> Vec<agentd::pb::AgentEvent> {
    let mut events = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        events.push(e);
    }
    events
}

/// Alice's Run `r1` of `agent` in `session`, sent with `traceparent`.
fn traced_run(
    session: String,
    agent: &str,
    text: &str,
    traceparent: &str,
) -> tonic::Request<agentd::pb::RunRequest> {
    let mut req = tonic::Request::new(agentd::pb::RunRequest {
        user_id: "alice".into(),
        session_id: session,
        text: text.into(),
        request_id: "r1".into(),
        agent: agent.into(),
        ..Default::default()
    });
    req.metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    req
}

#[tokio::test]
async fn a_model_backed_runs_model_and_tool_calls_are_spans_whose_traceparent_reaches_the_servers()
{
    telemetry();
    let (mut d, seen) = helper_calling("stock").await;
    let session = d.session("alice").await;
    let trace = TraceId::from_hex("1af7651916cd43dd8448eb211c80319c").unwrap();
    let req = traced_run(
        session,
        "helper",
        "Any cups?",
        "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    events_of(d.client.raw().run(req).await.unwrap().into_inner()).await;

    let model = "chat test-model";
    let tool = "execute_tool stock";
    let spans = spans_of(trace, &["run", model, tool]).await;
    let run = named(&spans, "run");
    let calls: Vec<&SpanData> = spans.iter().filter(|s| s.name == model).collect();
    assert_eq!(calls.len(), 2, "one span per model call");
    for c in &calls {
        assert_eq!(
            c.parent_span_id,
            run.span_context.span_id(),
            "a model call is a child of the run"
        );
        assert_eq!(
            attr(c, "gen_ai.request.model").as_deref(),
            Some("test-model")
        );
    }
    assert!(
        calls
            .iter()
            .any(|c| attr(c, "gen_ai.usage.output_tokens").as_deref() == Some("3")),
        "the answer's token counts are on its span"
    );
    let tool_span = named(&spans, tool);
    assert_eq!(tool_span.parent_span_id, run.span_context.span_id());

    // Each server got the traceparent of the span its call ran in.
    let seen = seen.lock().unwrap().clone();
    let want: Vec<String> = [
        ("model", calls[0]),
        ("tool", tool_span),
        ("model", calls[1]),
    ]
    .iter()
    .map(|(who, s)| format!("{who} 00-{trace}-{}-01", s.span_context.span_id()))
    .collect();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    let mut got_sorted = seen.clone();
    got_sorted.sort();
    assert_eq!(got_sorted, want_sorted, "in order of arrival: {seen:?}");
    d.stop().await;
}

/// A turn delegated to a remote A2A agent continues the caller's trace on
/// the remote, over either binding: the delegating run's `invoke_agent` span
/// carries the remote task's id, the remote's A2A task span is its child,
/// and the remote's run and tool call follow under it.
#[tokio::test]
async fn a_remote_a2a_agents_turn_continues_the_trace_on_the_remote() {
    telemetry();
    let remote = a2a_support::A2aServer::start(Duration::ZERO).await;
    let agents = format!(
        r#"
[agents.orders]
kind = "remote_a2a"
description = "Order questions, answered by another agentd (JSON-RPC)."
[agents.orders.a2a]
jsonrpc_url = "{url}/"
agent = "order_helper"

[agents.orders_grpc]
kind = "remote_a2a"
description = "The same, over A2A's gRPC binding."
[agents.orders_grpc.a2a]
card_url = "{url}/.well-known/agent-card.json"
binding = "grpc"
agent = "order_helper"
"#,
        url = remote.base_url()
    );
    let mut d = openai_support::Agentd::start(&agents).await;
    for (agent, trace_hex) in [
        ("orders", "5bf92f3577b34da6a3ce929d0e0e4736"),
        ("orders_grpc", "6bf92f3577b34da6a3ce929d0e0e4736"),
    ] {
        let session = d.session("alice").await;
        let req = traced_run(
            session,
            agent,
            "Where is order 1187?",
            &format!("00-{trace_hex}-00f067aa0ba902b7-01"),
        );
        let events = events_of(d.client.raw().run(req).await.unwrap().into_inner()).await;
        let last = events.last().expect("events");
        assert!(last.is_final && last.text.contains("1187"), "{last:?}");

        let trace = TraceId::from_hex(trace_hex).unwrap();
        let invoke_name = format!("invoke_agent {agent}");
        let spans = spans_of(trace, &[RPC, &invoke_name, "a2a task", TOOL]).await;
        let child_of = |parent: &SpanData, name: &str| -> SpanData {
            spans
                .iter()
                .find(|s| s.name == name && s.parent_span_id == parent.span_context.span_id())
                .unwrap_or_else(|| {
                    let all: Vec<_> = spans
                        .iter()
                        .map(|s| {
                            (
                                s.name.to_string(),
                                s.span_context.span_id(),
                                s.parent_span_id,
                            )
                        })
                        .collect();
                    panic!("{agent}: no {name} under {}: {all:?}", parent.name)
                })
                .clone()
        };
        let rpc = named(&spans, RPC).clone();
        let run = child_of(&rpc, "run");
        let invoke = child_of(&run, &invoke_name);
        assert_eq!(attr(&invoke, "gen_ai.agent.name").as_deref(), Some(agent));
        let task = child_of(&invoke, "a2a task");
        assert!(
            task.parent_span_is_remote,
            "the task span continues a remote parent"
        );
        let task_id = attr(&task, "a2a.task.id");
        assert!(task_id.is_some());
        assert_eq!(
            attr(&invoke, "a2a.task.id"),
            task_id,
            "both ends name the task"
        );
        let remote_run = child_of(&task, "run");
        child_of(&remote_run, TOOL);
    }
    d.stop().await;
    remote.stop().await;
}

/// A replayed turn's span names the agent that ran it, like the first run's.
#[tokio::test]
async fn a_replays_run_span_names_the_agent_that_ran_the_turn() {
    telemetry();
    let mut d = openai_support::Agentd::start("").await;
    let session = d.session("alice").await;
    let first = traced_run(
        session.clone(),
        "",
        "Where is order 1187?",
        "00-7bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    events_of(d.client.raw().run(first).await.unwrap().into_inner()).await;
    let again = traced_run(
        session,
        "",
        "Where is order 1187?",
        "00-8bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    );
    let events = events_of(d.client.raw().run(again).await.unwrap().into_inner()).await;
    assert_eq!(events.len(), 3, "the replay sends the turn's three events");

    let trace = TraceId::from_hex("8bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let spans = spans_of(trace, &["run"]).await;
    let replay = named(&spans, "run");
    assert_eq!(attr(replay, "mode").as_deref(), Some("replay"));
    assert_eq!(attr(replay, "agent").as_deref(), Some("order_helper"));
    d.stop().await;
}

/// An A2A message sent over gRPC without a `traceparent`: its task's span
/// is in the trace of the call that sent it, under that call's span (the
/// A2A SDK runs the task outside the call), and the run's log lines carry
/// that trace's id, as a Run's do.
#[tokio::test]
async fn an_a2a_task_sent_without_a_traceparent_is_in_its_calls_trace() {
    use a2a::{Part, StreamResponse};
    use futures::StreamExt;
    telemetry();
    let server = a2a_support::A2aServer::start(Duration::ZERO).await;
    let client = server.grpc_client().await;
    let req = a2a_support::echo_request(vec![Part::text("trace me")]);
    let mut events = client.raw().send_streaming_message(&req).await.unwrap();
    let mut task_id = None;
    while let Some(ev) = events.next().await {
        if let StreamResponse::Task(t) = ev.unwrap() {
            task_id = Some(t.id);
        }
    }
    let task_id = task_id.expect("the stream named its task");
    // The task's span, once finished.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let task = loop {
        let found = telemetry()
            .0
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .find(|s| s.name == "a2a task" && attr(s, "a2a.task.id").as_deref() == Some(&task_id));
        if let Some(s) = found {
            break s;
        }
        assert!(tokio::time::Instant::now() < deadline, "no a2a task span");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let trace = task.span_context.trace_id();
    let rpc_name = "lf.a2a.v1.A2AService/SendStreamingMessage";
    let spans = spans_of(trace, &[rpc_name, "a2a task"]).await;
    let rpc = named(&spans, rpc_name);
    assert_eq!(task.parent_span_id, rpc.span_context.span_id());
    let logs = telemetry().1.text();
    let finished = line_with(&logs, &["run finished", &format!("{task_id}.0")]);
    assert!(
        finished.contains(&trace.to_string()),
        "the line carries the trace id {trace}: {finished}"
    );
    server.stop().await;
}

/// A Run that goes on after its client left (`ON_DISCONNECT_CONTINUE`): the
/// call's span ends when the call does (its client went away: CANCELLED),
/// not when the run does, though the run's span is its child in the trace.
/// As the run's tracing parent the call's span was held open until the run
/// ended, its end in the trace seconds after the call's.
#[tokio::test]
async fn a_continued_runs_rpc_span_ends_with_the_call_not_with_the_run() {
    telemetry();
    let delay = Duration::from_secs(2);
    let server = SecureServer::start(
        Ca::new("ca"),
        Secure {
            tool_delay: delay,
            ..Secure::default()
        },
    )
    .await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let mut run = run_request("alice", &session, "r1", "Where is order 1187?");
    run.on_disconnect = agentd::pb::OnDisconnect::Continue as i32;
    let mut req = tonic::Request::new(run);
    req.metadata_mut().insert(
        "traceparent",
        "00-9bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    let mut stream = c.raw().run(req).await.unwrap().into_inner();
    stream
        .message()
        .await
        .unwrap()
        .expect("the tool call's event");
    // The client goes away while the tool runs; the run goes on.
    drop(stream);

    let trace = TraceId::from_hex("9bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let spans = spans_of(trace, &[RPC, "run", TOOL]).await;
    let rpc = named(&spans, RPC);
    let run = named(&spans, "run");
    assert_eq!(attr(rpc, "rpc.grpc.status_code").as_deref(), Some("1"));
    assert_eq!(
        run.parent_span_id,
        rpc.span_context.span_id(),
        "the run is a child of the RPC in the trace"
    );
    assert!(!run.parent_span_is_remote);
    assert_eq!(attr(run, "trace_id"), Some(trace.to_string()));
    let gap = run
        .end_time
        .duration_since(rpc.end_time)
        .unwrap_or_else(|e| panic!("the RPC span ended {:?} after the run's", e.duration()));
    assert!(
        gap >= delay / 2,
        "the RPC span ended only {gap:?} before the run's: it lasted as long as the run"
    );
    server.stop().await;
}

/// A tool name the model made up (a hallucination, a prompt injection) names
/// no span: a call of a tool the agent does not have is `execute_tool
/// unknown`, the name it sent kept as `gen_ai.tool.name`, cut short and its
/// control characters escaped.
#[tokio::test]
async fn a_call_of_a_tool_the_agent_does_not_have_is_execute_tool_unknown() {
    telemetry();
    let made_up = format!("stock\n\x1b[31m{}", "x".repeat(1000));
    let (mut d, _) = helper_calling(&made_up).await;
    let session = d.session("alice").await;
    let req = traced_run(
        session,
        "helper",
        "Any cups?",
        "00-a1f92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01",
    );
    let events = events_of(d.client.raw().run(req).await.unwrap().into_inner()).await;
    assert!(
        events.last().is_some_and(|e| e.is_final),
        "the model answered"
    );

    let trace = TraceId::from_hex("a1f92f3577b34da6a3ce929d0e0e4736").unwrap();
    let unknown = "execute_tool unknown";
    let spans = spans_of(trace, &["run", unknown]).await;
    let run = named(&spans, "run");
    let tool = named(&spans, unknown);
    assert_eq!(tool.parent_span_id, run.span_context.span_id());
    let names: Vec<_> = spans.iter().map(|s| s.name.to_string()).collect();
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with("execute_tool") || n == unknown),
        "{names:?}"
    );
    let name = attr(tool, "gen_ai.tool.name").expect("the name sent");
    assert!(
        name.starts_with("stock\\n\\u{1b}[31mxxx") && name.ends_with('…'),
        "{name}"
    );
    assert!(name.chars().count() < 150, "{name}");
    assert!(!name.chars().any(char::is_control), "{name}");
    d.stop().await;
}

/// A caller's ids, logged as they came when its Run is refused, stay inside
/// their JSON line: serde_json escapes control characters (the text format
/// escapes them itself: tests/text_logs.rs).
#[tokio::test]
async fn a_forged_request_id_stays_inside_its_json_log_line() {
    telemetry();
    let injected =
        "{\"timestamp\":\"2025-06-01T12:00:00Z\",\"level\":\"INFO\",\"message\":\"run finished\"}";
    let session = openai_support::refused_run(format!("x\n{injected}\x1b[31m")).await;

    let logs = telemetry().1.text();
    let refused = line_with(&logs, &["run refused", &session]);
    assert!(refused.contains("x\\n{\\\"timestamp"), "{refused}");
    assert!(!logs.lines().any(|l| l.starts_with(injected)), "{logs}");
    assert!(!logs.contains('\x1b'), "{logs}");
}
