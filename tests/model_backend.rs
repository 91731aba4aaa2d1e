//! The model backend against a scripted OpenAI-compatible server written
//! here (axum on 127.0.0.1:0): failures the mock peers cannot produce on a
//! stream (429 with Retry-After, 500, a stream cut before [DONE], an error
//! object mid-stream), what agentd sends (system prompt, history, tool
//! results, unknown per-call fields), and cancellation reaching the model
//! server as a closed connection.

mod openai_support;
mod support;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentd::grpc::status::TURN_OUTCOME_HEADER;

use agentd::pb::EventKind;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use openai_support::{Agentd, kinds, partial_text};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tonic::Code;

/// What the scripted server does with the n-th request it gets.
#[derive(Clone)]
enum Reply {
    /// SSE `data:` payloads, each sent as its own chunk; `[DONE]` is not
    /// added, so a script without it is a cut stream.
    Sse(Vec<String>),
    /// An HTTP error with headers and a JSON body.
    Error(u16, Vec<(&'static str, &'static str)>, String),
    /// Text chunks forever, slowly; reports on `closed` when agentd hangs up.
    Endless,
    /// SSE `data:` payloads all in one body write, as a fast server bursts.
    Burst(Vec<String>),
    /// SSE `data:` payloads, each its own chunk, this long apart (a model
    /// that generates slower than agentd forwards).
    Paced(Vec<String>, Duration),
    /// Body chunks sent as they are (lines other than `data:`).
    Raw(Vec<String>),
}

#[derive(Clone)]
struct Script {
    replies: Arc<Vec<Reply>>,
    /// Every request body received, in order.
    seen: Arc<Mutex<Vec<Value>>>,
    /// Fires when an `Endless` body is dropped (the connection closed).
    closed: mpsc::UnboundedSender<()>,
}

struct OnDrop(mpsc::UnboundedSender<()>);
impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

async fn chat(State(s): State<Script>, _h: HeaderMap, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    let n = {
        let mut seen = s.seen.lock().unwrap();
        seen.push(v);
        seen.len() - 1
    };
    match s
        .replies
        .get(n)
        .cloned()
        .unwrap_or_else(|| panic!("unexpected request #{n}"))
    {
        Reply::Sse(items) => {
            let chunks = futures::stream::iter(
                items
                    .into_iter()
                    .map(|d| Ok::<_, Infallible>(format!("data: {d}\n\n"))),
            );
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
        Reply::Error(code, headers, body) => {
            let mut r = (StatusCode::from_u16(code).unwrap(), body).into_response();
            for (k, v) in headers {
                r.headers_mut().insert(k, v.parse().unwrap());
            }
            r
        }
        Reply::Burst(items) => {
            let body: String = items.iter().map(|d| format!("data: {d}\n\n")).collect();
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from(body))
                .unwrap()
        }
        Reply::Paced(items, gap) => {
            let chunks =
                futures::StreamExt::then(futures::stream::iter(items), move |d| async move {
                    tokio::time::sleep(gap).await;
                    Ok::<_, Infallible>(format!("data: {d}\n\n"))
                });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
        Reply::Raw(chunks) => Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(futures::stream::iter(
                chunks.into_iter().map(Ok::<_, Infallible>),
            )))
            .unwrap(),
        Reply::Endless => {
            let guard = OnDrop(s.closed.clone());
            let chunks = futures::stream::unfold(guard, |g| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let d = json!({"choices":[{"index":0,"delta":{"content":"tick "}}]});
                Some((Ok::<_, Infallible>(format!("data: {d}\n\n")), g))
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(chunks))
                .unwrap()
        }
    }
}

struct Fake {
    url: String,
    seen: Arc<Mutex<Vec<Value>>>,
    closed: mpsc::UnboundedReceiver<()>,
}

impl Fake {
    /// Waits (5 s at most) for the model server to see a call's connection
    /// close; `what` says which.
    async fn call_closed(&mut self, what: &str) {
        tokio::time::timeout(Duration::from_secs(5), self.closed.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: not within 5 s"))
            .unwrap();
    }
}

async fn fake(replies: Vec<Reply>) -> Fake {
    let (tx, rx) = mpsc::unbounded_channel();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let script = Script {
        replies: Arc::new(replies),
        seen: seen.clone(),
        closed: tx,
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        // Conversations of more than axum's default 2 MiB (tool results
        // up to the run's budget).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(script);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Fake {
        url,
        seen,
        closed: rx,
    }
}

fn agents_file(base_url: &str, extra: &str) -> String {
    format!(
        r#"
[agents.helper]
description = "test agent"
instruction = "You answer order questions."
tools = ["lookup_order"]
max_tool_turns = 2
call_timeout = "10s"
{extra}
[agents.helper.model]
base_url = "{base_url}"
model = "test-model"
"#
    )
}

/// One turn of `text` to the file's `helper` agent, in a new session of
/// u1: the session, the turn's events and how it ended.
async fn helper_turn(
    d: &mut Agentd,
    text: &str,
) -> (
    String,
    Vec<agentd::pb::AgentEvent>,
    Result<(), tonic::Status>,
) {
    let s = d.session("u1").await;
    let (events, status) = d
        .run("u1", &s, "helper", text, Duration::from_secs(20))
        .await;
    (s, events, status)
}

/// One chunk that makes call `id` of `lookup_order` with `arguments` (a
/// JSON string) and finishes for tool calls.
fn lookup_call(id: &str, arguments: &str) -> String {
    json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":id,"type":"function",
        "function":{"name":"lookup_order","arguments":arguments}}]},"finish_reason":"tool_calls"}]})
    .to_string()
}

fn text(t: &str) -> String {
    json!({"choices":[{"index":0,"delta":{"content":t}}]}).to_string()
}
fn stop() -> String {
    json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}).to_string()
}
const DONE: &str = "[DONE]";

const SECRET: &str = "my card number is 4111-1111-1111-1111";

#[tokio::test]
async fn a_gemini_style_tool_call_runs_the_tool_and_its_unknown_fields_go_back_to_the_model() {
    let call = json!({"choices":[{"delta":{"role":"assistant","tool_calls":[{
        "extra_content":{"google":{"thought_signature":"sig-123"}},
        "function":{"arguments":"{\"order_id\":\"1187\"}","name":"lookup_order"},
        "id":"function-call-1","type":"function"}]},"finish_reason":"stop","index":0}]});
    let f = fake(vec![
        Reply::Sse(vec![call.to_string(), DONE.into()]),
        Reply::Sse(vec![text("It has "), text("shipped."), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "Where is order 1187?").await;
    status.unwrap();
    // Text deltas that arrive together may be merged into one event.
    let k = kinds(&events);
    assert_eq!(
        k[..3],
        [
            EventKind::ToolCall,
            EventKind::ToolResult,
            EventKind::PartialText
        ],
        "{events:#?}"
    );
    assert!(
        k[3..k.len() - 1]
            .iter()
            .all(|k| *k == EventKind::PartialText)
    );
    assert_eq!(partial_text(&events), "It has shipped.");
    assert_eq!(events[0].tool_name, "lookup_order");
    assert_eq!(
        serde_json::from_str::<Value>(&events[0].payload_json).unwrap(),
        json!({"order_id": "1187"})
    );
    assert_eq!(events[1].tool_call_id, "function-call-1");
    assert_eq!(
        serde_json::from_str::<Value>(&events[1].payload_json).unwrap()["status"],
        "shipped"
    );
    let last = events.last().unwrap();
    assert_eq!(last.kind(), EventKind::FinalAnswer);
    assert_eq!(last.text, "It has shipped.");
    assert!(last.is_final);

    let seen = f.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let first = &seen[0];
    assert_eq!(first["stream"], true);
    assert_eq!(first["model"], "test-model");
    assert_eq!(
        first["messages"][0],
        json!({"role": "system", "content": "You answer order questions."})
    );
    assert_eq!(first["tools"][0]["function"]["name"], "lookup_order");
    let msgs = seen[1]["messages"].as_array().unwrap();
    let assistant = &msgs[2];
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(
        assistant["tool_calls"][0]["extra_content"]["google"]["thought_signature"],
        "sig-123"
    );
    assert_eq!(assistant["tool_calls"][0]["id"], "function-call-1");
    let tool = &msgs[3];
    assert_eq!(tool["role"], "tool");
    assert_eq!(tool["tool_call_id"], "function-call-1");
    assert_eq!(
        serde_json::from_str::<Value>(tool["content"].as_str().unwrap()).unwrap()["carrier"],
        "DHL"
    );
    d.stop().await;
}

#[tokio::test]
async fn the_sessions_earlier_turns_are_sent_as_history() {
    let f = fake(vec![
        Reply::Sse(vec![text("First answer."), stop(), DONE.into()]),
        Reply::Sse(vec![text("Second answer."), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    d.run(
        "u1",
        &s,
        "helper",
        "first question",
        Duration::from_secs(20),
    )
    .await
    .1
    .unwrap();
    d.run(
        "u1",
        &s,
        "helper",
        "second question",
        Duration::from_secs(20),
    )
    .await
    .1
    .unwrap();
    let seen = f.seen.lock().unwrap().clone();
    let msgs: Vec<(String, String)> = seen[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_owned(),
                m["content"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let want = [
        ("system", "You answer order questions."),
        ("user", "first question"),
        ("assistant", "First answer."),
        ("user", "second question"),
    ];
    assert_eq!(
        msgs,
        want.map(|(a, b)| (a.to_owned(), b.to_owned())).to_vec()
    );
    d.stop().await;
}

/// PostgreSQL, two replicas: replica A keeps the session's history in
/// memory and starts its model call beside the claim; when B ran a turn in
/// the session since, A's claim says so, the call started with the old
/// history is dropped, and the model is called again with every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_call_started_with_a_history_another_replica_changed_is_made_again_with_all_of_it()
{
    let Some(db) = support::TestDb::fresh(support::Backend::Postgres).await else {
        return;
    };
    let ok = || Reply::Sse(vec![text("Answer."), stop(), DONE.into()]);
    // Enough replies for a dropped call besides the three that answer.
    let f = fake(vec![ok(), ok(), ok(), ok()]).await;
    let file = agents_file(&f.url, "");
    let mut a = Agentd::start_with(&file, db.open().await, Default::default()).await;
    let mut b = Agentd::start_with(&file, db.open().await, Default::default()).await;
    let s = a.session("u1").await;
    for (d, q) in [(&mut a, "first question"), (&mut b, "second question")] {
        d.run("u1", &s, "helper", q, Duration::from_secs(20))
            .await
            .1
            .unwrap();
    }
    a.run(
        "u1",
        &s,
        "helper",
        "third question",
        Duration::from_secs(20),
    )
    .await
    .1
    .unwrap();
    let users = |m: &Value| -> Vec<String> {
        m["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| m["content"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let seen = f.seen.lock().unwrap().clone();
    let last = users(seen.last().unwrap());
    assert_eq!(
        last,
        ["first question", "second question", "third question"],
        "the call that answered has B's turn: {seen:#?}"
    );
    a.stop().await;
    b.stop().await;
}

/// The crate's client sends a request_id of its own, which a resend
/// would replay: the recorded UNAVAILABLE carries no retry pushback
/// (tests/recorded_outcomes.rs has the Run without one, which does).
#[tokio::test]
async fn a_429_is_unavailable_recorded_and_without_model_text() {
    let body =
        json!({"error": {"message": format!("rate limited; you said: {SECRET}")}}).to_string();
    let f = fake(vec![Reply::Error(429, vec![("retry-after", "3")], body)]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, _, status) = helper_turn(&mut d, SECRET).await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(!st.message().contains("4111"), "{}", st.message());
    assert!(st.metadata().get(TURN_OUTCOME_HEADER).is_some(), "{st:?}");
    assert_eq!(st.metadata().get("grpc-retry-pushback-ms"), None);
    d.stop().await;
}

#[tokio::test]
async fn a_500_is_unavailable_and_a_401_is_failed_precondition_both_sanitised() {
    let body = json!({"error": {"message": format!("boom: {SECRET}")}}).to_string();
    let f = fake(vec![
        Reply::Error(500, vec![], body.clone()),
        Reply::Error(401, vec![], body),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    let st = d
        .run("u1", &s, "helper", "hello one", Duration::from_secs(20))
        .await
        .1
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(!st.message().contains("4111"));
    let st = d
        .run("u1", &s, "helper", "hello two", Duration::from_secs(20))
        .await
        .1
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(!st.message().contains("4111"));
    d.stop().await;
}

#[tokio::test]
async fn a_stream_cut_before_done_is_unavailable_not_a_success() {
    // The answer looks complete (finish_reason stop) but [DONE] never came.
    let f = fake(vec![Reply::Sse(vec![text("Order 1187 has "), stop()])]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "where?").await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(partial_text(&events), "Order 1187 has ");
    assert!(events.iter().all(|e| !e.is_final));
    d.stop().await;
}

/// An error object mid-stream with `code` (echoing the prompt): the
/// run's end status, sanitised, after the text that came before it.
#[tokio::test]
async fn an_error_object_mid_stream_ends_the_run_sanitised() {
    // A server failure may pass; a request the server refuses will not.
    for (code, want) in [(500, Code::Unavailable), (400, Code::FailedPrecondition)] {
        let err =
            json!({"error": {"code": code, "message": format!("parser failed on: {SECRET}")}})
                .to_string();
        let f = fake(vec![Reply::Sse(vec![text("partial "), err, DONE.into()])]).await;
        let mut d = Agentd::start(&agents_file(&f.url, "")).await;
        let s = d.session("u1").await;
        let (events, status) = d
            .run("u1", &s, "helper", "where?", Duration::from_secs(20))
            .await;
        let st = status.unwrap_err();
        assert_eq!(st.code(), want, "code {code}: {st:?}");
        assert!(!st.message().contains("4111"));
        assert_eq!(kinds(&events), vec![EventKind::PartialText]);
        d.stop().await;
    }
}

/// Some llama-server builds report a failure met mid-answer as an `error:`
/// line, then `data: [DONE]`: the run fails as the error says (a full
/// context window is INVALID_ARGUMENT, a server failure UNAVAILABLE),
/// sanitised, after the text that came before it; never an OK answer.
#[tokio::test]
async fn an_error_line_mid_stream_ends_the_run_as_its_error_says() {
    let context = json!({"code": 400, "message": format!("the request exceeds the available context size: {SECRET}"),
        "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192});
    let failed = json!({"code": 500, "message": format!("decode failed on: {SECRET}"), "type": "server_error"});
    for (err, want) in [
        (context, Code::InvalidArgument),
        (failed, Code::Unavailable),
    ] {
        let f = fake(vec![Reply::Raw(vec![
            format!("data: {}\n\n", text("partial ")),
            format!("error: {err}\n\n"),
            "data: [DONE]\n\n".into(),
        ])])
        .await;
        let mut d = Agentd::start(&agents_file(&f.url, "")).await;
        let (_, events, status) = helper_turn(&mut d, "where?").await;
        let st = status.unwrap_err();
        assert_eq!(st.code(), want, "{err}: {st:?}");
        assert!(!st.message().contains("4111"), "{st:?}");
        assert_eq!(kinds(&events), vec![EventKind::PartialText]);
        d.stop().await;
    }
}

/// `[DONE]` with no finish reason, no text and no tool call is a failure
/// the server did not report (as when the line above is dropped), not an
/// empty answer.
#[tokio::test]
async fn done_with_nothing_before_it_is_unavailable_not_an_empty_answer() {
    let role = json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]});
    let f = fake(vec![Reply::Sse(vec![role.to_string(), DONE.into()])]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "where?").await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.message().contains("without a finish reason"), "{st:?}");
    assert!(events.iter().all(|e| e.kind() != EventKind::FinalAnswer));
    d.stop().await;
}

/// A model stopped for another reason than the end of its answer (a
/// content filter, an aborted request) with no text: FAILED_PRECONDITION
/// naming the reason, as a short label, not an empty answer. With text, the
/// text is the answer.
#[tokio::test]
async fn a_stop_for_another_reason_or_the_token_limit_without_text_is_failed_precondition() {
    let end = |reason: &str| {
        json!({"choices":[{"index":0,"delta":{},"finish_reason":reason}]}).to_string()
    };
    let f = fake(vec![
        Reply::Sse(vec![end("content_filter"), DONE.into()]),
        Reply::Sse(vec![end(SECRET), DONE.into()]),
        Reply::Sse(vec![text("Half an answer"), end("abort"), DONE.into()]),
        Reply::Sse(vec![end("length"), DONE.into()]),
        Reply::Sse(vec![text("Cut"), end("length"), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    let mut run = async |rid: &str| {
        d.run("u1", &s, "helper", rid, Duration::from_secs(20))
            .await
    };
    let st = run("filtered").await.1.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert_eq!(st.message(), "the model stopped: content_filter");
    let st = run("odd reason").await.1.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert_eq!(
        st.message(),
        "the model stopped: an unreadable reason (the server log has it)"
    );
    let (events, status) = run("aborted").await;
    status.unwrap();
    assert_eq!(events.last().unwrap().text, "Half an answer");
    // The token limit reached before any text is no answer either; with
    // text, that text is the (cut) answer.
    let st = run("thought too long").await.1.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("raise max_tokens"), "{st:?}");
    let (events, status) = run("cut").await;
    status.unwrap();
    assert_eq!(events.last().unwrap().text, "Cut");
    d.stop().await;
}

#[tokio::test]
async fn a_model_that_keeps_calling_tools_stops_at_max_tool_turns() {
    let call = |id: &str| lookup_call(id, r#"{"order_id":"1042"}"#);
    let f = fake(
        (0..3)
            .map(|i| Reply::Sse(vec![call(&format!("c{i}")), DONE.into()]))
            .collect(),
    )
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "loop").await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    // max_tool_turns = 2: two rounds of tools ran, the third call was refused.
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind() == EventKind::ToolResult)
            .count(),
        2
    );
    assert_eq!(f.seen.lock().unwrap().len(), 3);
    d.stop().await;
}

/// Text the model streams before a tool call is part of the answer: the
/// final answer is every partial event's text in order (what a client that
/// renders partials showed), and the next turn's history holds it whole.
#[tokio::test]
async fn text_streamed_before_a_tool_call_is_part_of_the_final_answer() {
    let call = lookup_call("c1", r#"{"order_id":"1187"}"#);
    let f = fake(vec![
        Reply::Sse(vec![text("Let me check. "), call.clone(), DONE.into()]),
        Reply::Sse(vec![text("It has "), text("shipped."), stop(), DONE.into()]),
        Reply::Sse(vec![text("Anything else?"), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (s, events, status) = helper_turn(&mut d, "Where is 1187?").await;
    status.unwrap();
    assert_eq!(partial_text(&events), "Let me check. It has shipped.");
    let last = events.last().unwrap();
    assert_eq!(last.kind(), EventKind::FinalAnswer);
    assert_eq!(last.text, "Let me check. It has shipped.");
    d.run("u1", &s, "helper", "thanks", Duration::from_secs(20))
        .await
        .1
        .unwrap();
    let seen = f.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    let history = &seen[2]["messages"];
    assert_eq!(history[2]["role"], "assistant");
    assert_eq!(history[2]["content"], "Let me check. It has shipped.");
    d.stop().await;
}

/// The answer (all the text of the turn's model calls) is bounded as one
/// call's text is: two calls of 1.5 MiB each fail the run instead of a
/// 3 MiB final answer, stored and sent back as every later turn's history.
#[tokio::test]
async fn an_answer_past_the_text_bound_across_model_calls_fails_the_run() {
    let call = lookup_call("c1", r#"{"order_id":"1187"}"#);
    let half = "x".repeat(1536 * 1024);
    let f = fake(vec![
        Reply::Sse(vec![text(&half), call.clone(), DONE.into()]),
        Reply::Sse(vec![text(&half), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "Where is 1187?").await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("across its model calls"), "{st:?}");
    assert!(events.iter().all(|e| e.kind() != EventKind::FinalAnswer));
    d.stop().await;
}

/// One turn whose model calls `lookup_order` with `arguments` and then
/// answers: the turn's events, and the messages of the second model call.
async fn call_with_arguments(arguments: &str) -> (Vec<agentd::pb::AgentEvent>, Vec<Value>) {
    let call = lookup_call("c1", arguments);
    let f = fake(vec![
        Reply::Sse(vec![call.clone(), DONE.into()]),
        Reply::Sse(vec![text("Sorry."), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "where is 1187").await;
    status.unwrap();
    d.stop().await;
    let seen = f.seen.lock().unwrap().clone();
    let messages = seen[1]["messages"].as_array().unwrap().clone();
    (events, messages)
}

#[tokio::test]
async fn bad_arguments_go_back_to_the_model_as_a_tool_error() {
    let (events, messages) = call_with_arguments("{\"order\":1187}").await;
    let result: Value = serde_json::from_str(&events[1].payload_json).unwrap();
    assert!(
        result["error"].as_str().unwrap().contains("order_id"),
        "{result}"
    );
    let tool_msg = messages.last().unwrap();
    assert!(
        tool_msg["content"].as_str().unwrap().contains("schema"),
        "{tool_msg}"
    );
}

/// Arguments that are not JSON (a call cut by the token limit) get a tool
/// error, and go back to the model as `{}`: model servers parse the
/// arguments of every call in a request, and would refuse the next one.
#[tokio::test]
async fn arguments_that_are_not_json_go_back_to_the_model_as_an_empty_object() {
    let (events, messages) = call_with_arguments("{\"order_id\": \"11").await;
    assert_eq!(
        events[0].payload_json,
        json!("{\"order_id\": \"11").to_string(),
        "the event shows what the model wrote, as a JSON string"
    );
    let result: Value = serde_json::from_str(&events[1].payload_json).unwrap();
    assert!(
        result["error"].as_str().unwrap().contains("not valid JSON"),
        "{result}"
    );
    let assistant = &messages[messages.len() - 2];
    let arguments = assistant["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    assert_eq!(arguments, "{}", "{assistant}");
}

/// Arguments that are JSON but not an object (`[1]`, `42`, an object
/// encoded twice, as a string) are no call a server accepts back: the tool
/// does not run (its error says why) and the call goes back as `{}`.
#[tokio::test]
async fn arguments_that_are_json_but_not_an_object_go_back_to_the_model_as_an_empty_object() {
    for arguments in ["[1]", "42", r#""{\"order_id\":\"1187\"}""#] {
        let (events, messages) = call_with_arguments(arguments).await;
        let result: Value = serde_json::from_str(&events[1].payload_json).unwrap();
        assert!(
            result["error"]
                .as_str()
                .unwrap()
                .contains("not a JSON object"),
            "{arguments}: {result}"
        );
        let assistant = &messages[messages.len() - 2];
        assert_eq!(
            assistant["tool_calls"][0]["function"]["arguments"], "{}",
            "{arguments}: {assistant}"
        );
    }
}

/// Parallel calls whose fragments interleave: each TOOL_CALL event shows
/// the whole arguments the tool ran with, not what had come when the next
/// call opened.
#[tokio::test]
async fn interleaved_fragments_of_parallel_calls_show_the_arguments_the_tool_ran_with() {
    let frag = |index: u32, first: bool, arguments: &str| {
        let mut call = json!({"index": index, "function": {"arguments": arguments}});
        if first {
            call["id"] = json!(format!("c{index}"));
            call["type"] = json!("function");
            call["function"]["name"] = json!("lookup_order");
        }
        json!({"choices":[{"index":0,"delta":{"tool_calls":[call]}}]}).to_string()
    };
    let finish =
        json!({"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}).to_string();
    let f = fake(vec![
        Reply::Sse(vec![
            frag(0, true, r#"{"order_id""#),
            frag(1, true, r#"{"order_id":"1042"}"#),
            frag(0, false, r#":"1187"}"#),
            finish,
            DONE.into(),
        ]),
        Reply::Sse(vec![text("Both found."), stop(), DONE.into()]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "where are 1187 and 1042?").await;
    status.unwrap();
    let calls: Vec<(String, Value)> = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolCall)
        .map(|e| {
            (
                e.tool_call_id.clone(),
                serde_json::from_str(&e.payload_json).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        calls,
        vec![
            ("c0".to_owned(), json!({"order_id": "1187"})),
            ("c1".to_owned(), json!({"order_id": "1042"}))
        ]
    );
    let results: Vec<Value> = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolResult)
        .map(|e| serde_json::from_str(&e.payload_json).unwrap())
        .collect();
    assert!(
        results.iter().any(|r| r["order_id"] == "1187")
            && results.iter().all(|r| r["found"] == true),
        "{results:?}"
    );
    d.stop().await;
}

/// A 200 that is not an event stream (a gateway that ignores `stream`, a
/// proxy's login page) is a misconfiguration: FAILED_PRECONDITION, not a
/// retryable UNAVAILABLE.
#[tokio::test]
async fn a_model_server_answering_without_an_event_stream_is_failed_precondition() {
    let body = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#;
    let f = fake(vec![Reply::Error(
        200,
        vec![("content-type", "application/json")],
        body.into(),
    )])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    let st = d
        .run("u1", &s, "helper", "hi", Duration::from_secs(20))
        .await
        .1
        .unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert!(st.message().contains("event stream"), "{st:?}");
    d.stop().await;
}

#[tokio::test]
async fn a_client_deadline_closes_the_connection_to_the_model_server() {
    let mut f = fake(vec![Reply::Endless]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    let (events, status) = d
        .run(
            "u1",
            &s,
            "helper",
            "talk forever",
            Duration::from_millis(500),
        )
        .await;
    assert_eq!(status.unwrap_err().code(), Code::DeadlineExceeded);
    assert!(!events.is_empty(), "text was streaming before the deadline");
    f.call_closed("the model server saw the connection close")
        .await;
    d.stop().await;
}

/// Holds SQLite's write lock, as another connection's open write
/// transaction does, until [`held_writes_end`]: agentd's claims wait.
async fn hold_writes(db_url: &str) -> sqlx::SqliteConnection {
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(db_url).await.unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut c)
        .await
        .unwrap();
    c
}

async fn held_writes_end(mut c: sqlx::SqliteConnection) {
    sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
}

/// Waits (at most 5 s) until the model server has had `n` requests.
async fn requests_seen(f: &Fake, n: usize) -> bool {
    for _ in 0..500 {
        if f.seen.lock().unwrap().len() >= n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The `helper` agent of a fake model answering `replies`, served on a
/// fresh SQLite store, with a session of u1's.
struct OnSqlite {
    _dir: tempfile::TempDir,
    db: String,
    store: Arc<dyn agentd::store::Store>,
    f: Fake,
    d: Agentd,
    session: String,
}

async fn on_sqlite(replies: Vec<Reply>, cfg: agentd::turn::TurnConfig) -> OnSqlite {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("agentd.db").display());
    let store = agentd::store::open(&db).await.unwrap();
    let f = fake(replies).await;
    let mut d = Agentd::start_with(&agents_file(&f.url, ""), store.clone(), cfg).await;
    let session = d.session("u1").await;
    OnSqlite {
        _dir: dir,
        db,
        store,
        f,
        d,
        session,
    }
}

type RunEnd = (Vec<agentd::pb::AgentEvent>, Result<(), tonic::Status>);

/// Holds the store's writes, then sends u1's Run `r1` ("hi"): its claim
/// waits until the lock is given to [`held_writes_end`].
async fn r1_behind_held_writes(
    db: &str,
    d: &Agentd,
    session: &str,
) -> (
    sqlx::SqliteConnection,
    tokio::task::JoinHandle<Result<RunEnd, tonic::Status>>,
) {
    let lock = hold_writes(db).await;
    let mut client = d.client.clone();
    let req = run_r1(session, "hi");
    let run = tokio::spawn(async move { client.run_to_end(req, Duration::from_secs(20)).await });
    (lock, run)
}

fn run_r1(session: &str, text: &str) -> agentd::pb::RunRequest {
    agentd::pb::RunRequest {
        user_id: "u1".into(),
        session_id: session.into(),
        text: text.into(),
        request_id: "r1".into(),
        agent: "helper".into(),
        ..Default::default()
    }
}

/// A model-backed run calls its model while its turn is still being
/// claimed (here the claim waits on a SQLite write lock): its first token
/// then waits for the slower of the two, not for both. Nothing reaches the
/// client before the claim is won; then the run goes on as any other and
/// its turn is stored.
#[tokio::test]
async fn a_model_backed_run_calls_its_model_while_its_turn_is_being_claimed() {
    let OnSqlite {
        _dir,
        db,
        store,
        f,
        d,
        session: s,
    } = on_sqlite(
        vec![Reply::Sse(vec![
            text("early "),
            text("bird"),
            stop(),
            DONE.into(),
        ])],
        Default::default(),
    )
    .await;

    let (lock, run) = r1_behind_held_writes(&db, &d, &s).await;
    assert!(
        requests_seen(&f, 1).await,
        "the model was called while the claim waited"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished(), "nothing is answered before the claim");
    held_writes_end(lock).await;

    let (events, status) = run.await.unwrap().unwrap();
    status.unwrap();
    assert_eq!(partial_text(&events), "early bird");
    assert_eq!(kinds(&events).last(), Some(&EventKind::FinalAnswer));
    let sessions = store
        .list_sessions(&agentd::domain::UserId::parse("u1").unwrap(), 10, None)
        .await
        .unwrap();
    let turns = store
        .list_turns(sessions.sessions[0].id, None, 10)
        .await
        .unwrap();
    assert_eq!(turns.len(), 1);
    assert_eq!(turns[0].state, agentd::store::TurnState::Completed);
    d.stop().await;
}

/// A repeated request id of a turn that ended does not call the model:
/// the Run's read before its claim tells that the turn is stored, so it
/// claims first (here the claim waits on a write lock, and the model is
/// still not called), finds the turn and replays it event for event.
#[tokio::test]
async fn a_repeat_of_an_ended_turn_replays_without_calling_the_model() {
    let OnSqlite {
        _dir,
        db,
        f,
        d,
        session: s,
        ..
    } = on_sqlite(
        vec![
            Reply::Sse(vec![text("the answer"), stop(), DONE.into()]),
            Reply::Endless,
        ],
        Default::default(),
    )
    .await;
    let (first, status) = d
        .client
        .clone()
        .run_to_end(run_r1(&s, "hi"), Duration::from_secs(20))
        .await
        .unwrap();
    status.unwrap();

    let lock = hold_writes(&db).await;
    let mut client = d.client.clone();
    let again = tokio::spawn(async move {
        let call = client
            .run(run_r1(&s, "hi"), Duration::from_secs(20))
            .await?;
        let mode = call.mode.clone();
        let mut events = call.events;
        let mut got = Vec::new();
        while let Some(e) = events.message().await? {
            got.push(e);
        }
        Ok::<_, tonic::Status>((mode, got))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        f.seen.lock().unwrap().len(),
        1,
        "no model call while the repeat's claim waits"
    );
    held_writes_end(lock).await;

    let (mode, replayed) = again.await.unwrap().unwrap();
    assert_eq!(mode, "replay");
    assert_eq!(replayed, first, "the stored turn, event for event");
    assert_eq!(f.seen.lock().unwrap().len(), 1, "one model call in all");
    d.stop().await;
}

/// u1's Run `r1` ("hi") sent to each of `to` at once.
fn send_r1<const N: usize>(
    session: &str,
    to: [&Agentd; N],
) -> Vec<tokio::task::JoinHandle<Result<agentd::client::RunCall, tonic::Status>>> {
    to.into_iter()
        .map(|d| {
            let mut client = d.client.clone();
            let req = run_r1(session, "hi");
            tokio::spawn(async move { client.run(req, Duration::from_secs(20)).await })
        })
        .collect()
}

/// Runs of one turn sent together, each read to its first tick: one ran
/// the turn ("new"), the other attached to it.
async fn one_new_one_attached(
    calls: Vec<tokio::task::JoinHandle<Result<agentd::client::RunCall, tonic::Status>>>,
) -> Vec<agentd::client::RunCall> {
    let mut modes = Vec::new();
    let mut runs = Vec::new();
    for call in calls {
        let mut run = call.await.unwrap().unwrap();
        run.events.message().await.unwrap().expect("a first tick");
        modes.push(run.mode.clone());
        runs.push(run);
    }
    modes.sort();
    assert_eq!(modes, ["attach", "new"]);
    runs
}

/// Two Runs of one new turn sent together to one server make one model
/// call: the first calls its model beside its claim, the second sees the
/// turn being claimed here and waits for its own claim, which finds the
/// turn; it then attaches to it.
#[tokio::test]
async fn two_runs_of_one_new_turn_sent_together_to_one_server_make_one_model_call() {
    let OnSqlite {
        _dir,
        db,
        mut f,
        d,
        session: s,
        ..
    } = on_sqlite(vec![Reply::Endless, Reply::Endless], Default::default()).await;
    let lock = hold_writes(&db).await;
    let calls = send_r1(&s, [&d, &d]);
    assert!(requests_seen(&f, 1).await, "the first called the model");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        f.seen.lock().unwrap().len(),
        1,
        "the second waits for its claim without a model call"
    );
    held_writes_end(lock).await;
    let mut runs = one_new_one_attached(calls).await;
    for run in &mut runs {
        run.events.message().await.unwrap().expect("another tick");
    }
    assert_eq!(f.seen.lock().unwrap().len(), 1, "one model call in all");
    assert!(f.closed.try_recv().is_err(), "the model call goes on");
    drop(runs);
    f.call_closed("the run was cancelled with its callers")
        .await;
    d.stop().await;
}

/// Two Runs of one new turn sent together to two servers on one database
/// both start a model call beside their claims (neither turn is stored
/// when they read, and neither server knows of the other's claim); the
/// claim decides: one runs the turn, the other's model call is dropped
/// (the model server sees its connection close) and it attaches to the
/// running turn through the store.
#[tokio::test]
async fn of_two_servers_runs_of_one_new_turn_the_one_that_loses_the_claim_drops_its_model_call() {
    let OnSqlite {
        _dir,
        db,
        mut f,
        d,
        session: s,
        ..
    } = on_sqlite(vec![Reply::Endless, Reply::Endless], Default::default()).await;
    let other_store = agentd::store::open(&db).await.unwrap();
    let d2 = Agentd::start_with(&agents_file(&f.url, ""), other_store, Default::default()).await;
    let lock = hold_writes(&db).await;
    let calls = send_r1(&s, [&d, &d2]);
    assert!(
        requests_seen(&f, 2).await,
        "both called the model beside their claims"
    );
    held_writes_end(lock).await;
    let mut runs = one_new_one_attached(calls).await;
    f.call_closed("the losing model call's connection closed")
        .await;
    // The winner's model call goes on: both callers still get its ticks.
    for run in &mut runs {
        run.events.message().await.unwrap().expect("another tick");
    }
    assert!(f.closed.try_recv().is_err(), "only the loser's call closed");
    assert_eq!(f.seen.lock().unwrap().len(), 2);
    drop(runs);
    f.call_closed("the run was cancelled with its callers")
        .await;
    d2.stop().await;
    d.stop().await;
}

/// A repeat of a turn that runs in this process attaches to it, and its
/// claim (which finds the turn) is not raced by a model call of its own.
#[tokio::test]
async fn a_repeat_of_a_turn_running_here_attaches_without_calling_the_model() {
    let OnSqlite {
        _dir,
        mut f,
        d,
        session: s,
        ..
    } = on_sqlite(vec![Reply::Endless], Default::default()).await;
    let mut first = d
        .client
        .clone()
        .run(run_r1(&s, "hi"), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(first.mode, "new");
    first.events.message().await.unwrap().expect("a first tick");
    let mut again = d
        .client
        .clone()
        .run(run_r1(&s, "hi"), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(again.mode, "attach");
    again
        .events
        .message()
        .await
        .unwrap()
        .expect("the first tick again");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(f.seen.lock().unwrap().len(), 1, "one model call");
    drop((first, again));
    f.call_closed("the run was cancelled").await;
    d.stop().await;
}

/// With `--claim-first` the model is called only once the turn is claimed.
#[tokio::test]
async fn with_claim_first_the_model_is_called_only_once_the_turn_is_claimed() {
    let cfg = agentd::turn::TurnConfig {
        claim_first: true,
        ..Default::default()
    };
    let OnSqlite {
        _dir,
        db,
        f,
        d,
        session: s,
        ..
    } = on_sqlite(
        vec![Reply::Sse(vec![text("late bird"), stop(), DONE.into()])],
        cfg,
    )
    .await;

    let (lock, run) = r1_behind_held_writes(&db, &d, &s).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        f.seen.lock().unwrap().is_empty(),
        "no model call before the claim"
    );
    held_writes_end(lock).await;
    let (events, status) = run.await.unwrap().unwrap();
    status.unwrap();
    assert_eq!(partial_text(&events), "late bird");
    assert_eq!(f.seen.lock().unwrap().len(), 1);
    d.stop().await;
}

#[tokio::test]
async fn the_per_call_timeout_bounds_a_model_call() {
    let mut f = fake(vec![Reply::Endless]).await;
    let file =
        agents_file(&f.url, "").replace("call_timeout = \"10s\"", "call_timeout = \"300ms\"");
    let mut d = Agentd::start(&file).await;
    let (_, _, status) = helper_turn(&mut d, "talk forever").await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(
        st.message().contains("did not finish within 300ms"),
        "the per-call timeout, not another failure: {st:?}"
    );
    f.call_closed("connection closed").await;
    d.stop().await;
}

#[tokio::test]
async fn an_unreachable_model_server_is_unavailable() {
    // A port that refuses connections, held for the test (bound, not
    // listening), so that no other test's server takes it meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    let mut d = Agentd::start(&agents_file(&format!("http://127.0.0.1:{port}/v1"), "")).await;
    let s = d.session("u1").await;
    let st = d
        .run("u1", &s, "helper", "anyone?", Duration::from_secs(20))
        .await
        .1
        .unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    d.stop().await;
}

#[tokio::test]
async fn an_unknown_agent_is_not_found() {
    let f = fake(vec![]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    let st = d
        .run("u1", &s, "nobody", "hi", Duration::from_secs(5))
        .await
        .1
        .unwrap_err();
    assert_eq!(st.code(), Code::NotFound);
    d.stop().await;
}

/// An HTTP tool server whose `/both` answers only once two calls are in
/// (so it proves they ran at the same time), and whose `/big` answers with
/// more than the tool's size cap.
async fn tool_server() -> String {
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let app = axum::Router::new()
        .route(
            "/both",
            post(move |axum::Json(args): axum::Json<Value>| {
                let barrier = barrier.clone();
                async move {
                    let met = tokio::time::timeout(Duration::from_secs(10), barrier.wait())
                        .await
                        .is_ok();
                    axum::Json(json!({"sku": args["sku"], "met_the_other_call": met}))
                }
            }),
        )
        .route("/big", post(|| async { "x".repeat(10_000) }))
        .route("/text", post(|| async { "In stock: 4\n" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// An HTTP tool server whose `/slow` takes 100 ms a call and counts the
/// calls in flight: the most it saw at once.
async fn counting_tool_server() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let now = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let seen_most = most.clone();
    let app = axum::Router::new().route(
        "/slow",
        post(move || {
            let (now, most) = (now.clone(), most.clone());
            async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                axum::Json(json!({"in_stock": 1}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen_most)
}

/// One chunk that calls the HTTP tool `name` `n` times, with ids c0, c1, ….
fn many_calls(name: &str, n: usize) -> String {
    let calls: Vec<Value> = (0..n)
        .map(|i| {
            json!({"index": i, "id": format!("c{i}"), "type": "function",
            "function": {"name": name, "arguments": "{}"}})
        })
        .collect();
    json!({"choices":[{"index":0,"delta":{"tool_calls":calls},"finish_reason":"tool_calls"}]})
        .to_string()
}

/// A model that asks for many calls in one answer: they all run and are
/// answered, but at most MAX_TOOLS_IN_FLIGHT at a time.
#[tokio::test]
async fn many_tool_calls_in_one_answer_run_a_bounded_number_at_a_time() {
    let n = 3 * agentd::agent::openai::agent::MAX_TOOLS_IN_FLIGHT;
    let f = fake(vec![
        Reply::Sse(vec![many_calls("slow", n), DONE.into()]),
        Reply::Sse(vec![text("All checked."), stop(), DONE.into()]),
    ])
    .await;
    let (tools, most) = counting_tool_server().await;
    let file = agents_file(&f.url, "")
        .replace(r#"tools = ["lookup_order"]"#, r#"tools = ["slow"]"#)
        + &format!(
            "[tools.slow]\ndescription = \"Slow.\"\nurl = \"{tools}/slow\"\nparameters = {{ type = \"object\" }}\n"
        );
    let mut d = Agentd::start(&file).await;
    let (_, events, status) = helper_turn(&mut d, "check everything").await;
    status.unwrap();
    let results = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolResult)
        .count();
    assert_eq!(results, n);
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (2..=agentd::agent::openai::agent::MAX_TOOLS_IN_FLIGHT).contains(&most),
        "{most} calls in flight at once"
    );
    let seen = f.seen.lock().unwrap().clone();
    let tool_msgs = seen[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .count();
    assert_eq!(tool_msgs, n);
    d.stop().await;
}

/// The tool results a run keeps in its conversation are bounded: past
/// MAX_TOOL_RESULT_BYTES the model (and the TOOL_RESULT event) gets an
/// error saying the budget is spent, in place of the result.
#[tokio::test]
async fn tool_results_past_the_runs_budget_go_to_the_model_as_an_error() {
    use agentd::agent::openai::agent::MAX_TOOL_RESULT_BYTES;
    const EACH: usize = 500_000;
    let fit = MAX_TOOL_RESULT_BYTES / EACH;
    let f = fake(vec![
        Reply::Sse(vec![many_calls("half", fit + 2), DONE.into()]),
        Reply::Sse(vec![text("That is a lot."), stop(), DONE.into()]),
    ])
    .await;
    let app = axum::Router::new().route("/half", post(|| async { "x".repeat(EACH) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tools = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let file = agents_file(&f.url, "")
        .replace(r#"tools = ["lookup_order"]"#, r#"tools = ["half"]"#)
        + &format!(
            "[tools.half]\ndescription = \"Big.\"\nurl = \"{tools}/half\"\nparameters = {{ type = \"object\" }}\nmax_response_bytes = 524288\n"
        );
    let mut d = Agentd::start(&file).await;
    let (_, events, status) = helper_turn(&mut d, "everything").await;
    status.unwrap();
    let spent = |r: &str| r.contains("budget") && r.contains("is spent");
    let spent_events = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolResult && spent(&e.payload_json))
        .count();
    assert_eq!(spent_events, 2);
    let seen = f.seen.lock().unwrap().clone();
    let contents: Vec<String> = seen[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(contents.len(), fit + 2);
    assert_eq!(contents.iter().filter(|c| c.len() == EACH).count(), fit);
    assert_eq!(contents.iter().filter(|c| spent(c)).count(), 2);
    d.stop().await;
}

fn http_tools(tools_url: &str) -> String {
    format!(
        r#"
[tools.stock]
description = "Stock of a product."
url = "{tools_url}/both"
parameters = {{ type = "object", properties = {{ sku = {{ type = "string" }} }}, required = ["sku"] }}
[tools.catalog]
description = "The whole catalog."
url = "{tools_url}/big"
parameters = {{ type = "object" }}
max_response_bytes = 1000
[tools.note]
description = "A note in plain text."
url = "{tools_url}/text"
parameters = {{ type = "object" }}
"#
    )
}

#[tokio::test]
async fn a_tool_result_in_plain_text_goes_back_to_the_model_as_it_came() {
    let call = json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"n","type":"function",
        "function":{"name":"note","arguments":"{}"}}]},"finish_reason":"tool_calls"}]});
    let f = fake(vec![
        Reply::Sse(vec![call.to_string(), DONE.into()]),
        Reply::Sse(vec![text("Four."), stop(), DONE.into()]),
    ])
    .await;
    let tools = tool_server().await;
    let file = agents_file(&f.url, "")
        .replace(r#"tools = ["lookup_order"]"#, r#"tools = ["note"]"#)
        + &http_tools(&tools);
    let mut d = Agentd::start(&file).await;
    let (_, _, status) = helper_turn(&mut d, "stock?").await;
    status.unwrap();
    let seen = f.seen.lock().unwrap().clone();
    let tool = seen[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .cloned()
        .unwrap();
    assert_eq!(tool["content"], "In stock: 4\n", "not quoted as JSON");
    d.stop().await;
}

/// What agentd holds of one answer is bounded: text, and each server-sent
/// event (the SSE parser holds a line whole until it ends).
#[tokio::test]
async fn an_answer_past_agentds_bounds_is_failed_precondition_not_held_in_memory() {
    let mib = "x".repeat(1 << 20);
    let f = fake(vec![
        Reply::Sse(vec![
            text(&mib),
            text(&mib),
            text(&mib),
            stop(),
            DONE.into(),
        ]),
        // One event of 5 MiB whose text is short: only the event is large.
        Reply::Sse(vec![
            json!({"choices":[{"index":0,"delta":{"content":"y"}}],"padding":"y".repeat(5 << 20)})
                .to_string(),
            stop(),
            DONE.into(),
        ]),
    ])
    .await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let s = d.session("u1").await;
    for rid in ["long-text", "long-event"] {
        let (_, status) = d
            .run("u1", &s, "helper", rid, Duration::from_secs(30))
            .await;
        let st = status.unwrap_err();
        assert_eq!(st.code(), Code::FailedPrecondition, "{rid}: {st:?}");
        assert!(st.message().contains("max_tokens"), "{rid}: {st:?}");
    }
    d.stop().await;
}

#[tokio::test]
async fn parallel_tool_calls_run_at_once_and_their_results_go_back_in_call_order() {
    let calls = json!({"choices":[{"index":0,"delta":{"tool_calls":[
        {"index":0,"id":"a","type":"function","function":{"name":"stock","arguments":"{\"sku\":\"cup\"}"}},
        {"index":1,"id":"b","type":"function","function":{"name":"stock","arguments":"{\"sku\":\"pot\"}"}}]},
        "finish_reason":"tool_calls"}]});
    let f = fake(vec![
        Reply::Sse(vec![calls.to_string(), DONE.into()]),
        Reply::Sse(vec![text("Both in stock."), stop(), DONE.into()]),
    ])
    .await;
    let tools = tool_server().await;
    let file = agents_file(&f.url, "")
        .replace(r#"tools = ["lookup_order"]"#, r#"tools = ["stock"]"#)
        + &http_tools(&tools);
    let mut d = Agentd::start(&file).await;
    let (_, events, status) = helper_turn(&mut d, "stock of cups and pots?").await;
    status.unwrap();
    let results: Vec<Value> = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolResult)
        .map(|e| serde_json::from_str(&e.payload_json).unwrap())
        .collect();
    assert_eq!(results.len(), 2);
    assert!(
        results.iter().all(|r| r["met_the_other_call"] == true),
        "the calls ran concurrently: {results:?}"
    );
    let seen = f.seen.lock().unwrap().clone();
    let msgs = seen[1]["messages"].as_array().unwrap();
    let tool_msgs: Vec<(&str, Value)> = msgs
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap(),
                serde_json::from_str(m["content"].as_str().unwrap()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tool_msgs.iter().map(|t| t.0).collect::<Vec<_>>(),
        vec!["a", "b"]
    );
    assert_eq!(tool_msgs[1].1["sku"], "pot");
    d.stop().await;
}

#[tokio::test]
async fn an_http_tool_response_over_its_cap_is_an_error_for_the_model() {
    let call = json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function",
        "function":{"name":"catalog","arguments":"{}"}}]},"finish_reason":"tool_calls"}]});
    let f = fake(vec![
        Reply::Sse(vec![call.to_string(), DONE.into()]),
        Reply::Sse(vec![text("Too big."), stop(), DONE.into()]),
    ])
    .await;
    let tools = tool_server().await;
    let file = agents_file(&f.url, "")
        .replace(r#"tools = ["lookup_order"]"#, r#"tools = ["catalog"]"#)
        + &http_tools(&tools);
    let mut d = Agentd::start(&file).await;
    let (_, events, status) = helper_turn(&mut d, "show the catalog").await;
    status.unwrap();
    let r: Value = serde_json::from_str(&events[1].payload_json).unwrap();
    assert!(
        r["error"].as_str().unwrap().contains("exceeded 1000 bytes"),
        "{r}"
    );
    d.stop().await;
}

#[tokio::test]
async fn text_deltas_that_arrive_together_become_fewer_events_with_the_text_intact() {
    let mut items: Vec<String> = (0..200).map(|i| text(&format!("w{i} "))).collect();
    items.push(stop());
    items.push(DONE.into());
    let f = fake(vec![Reply::Burst(items)]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "burst").await;
    status.unwrap();
    let want: String = (0..200).map(|i| format!("w{i} ")).collect();
    assert_eq!(partial_text(&events), want);
    assert_eq!(events.last().unwrap().text, want);
    let partials = events
        .iter()
        .filter(|e| e.kind() == EventKind::PartialText)
        .count();
    assert!(
        partials < 200,
        "deltas read together are merged: {partials} events"
    );
    d.stop().await;
}

/// A server that writes each delta as its own HTTP chunk, as fast as it can:
/// agentd's HTTP client hands them over one chunk at a time, and the chat
/// client lets the ones already read join a step. The first delta is never
/// held back to merge.
#[tokio::test]
async fn deltas_sent_as_separate_chunks_faster_than_they_are_forwarded_are_merged_after_the_first()
{
    let mut items: Vec<String> = (0..300).map(|i| text(&format!("w{i} "))).collect();
    items.push(stop());
    items.push(DONE.into());
    let f = fake(vec![Reply::Sse(items)]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "stream").await;
    status.unwrap();
    let want: String = (0..300).map(|i| format!("w{i} ")).collect();
    assert_eq!(partial_text(&events), want);
    let partials: Vec<&str> = events
        .iter()
        .filter(|e| e.kind() == EventKind::PartialText)
        .map(|e| e.text.as_str())
        .collect();
    assert_eq!(partials[0], "w0 ", "the first delta goes out alone");
    assert!(
        partials.len() < 300,
        "deltas already read are merged: {} events",
        partials.len()
    );
    d.stop().await;
}

/// A model slower than agentd: merging never waits for it, so every delta
/// is an event of its own, sent as it arrives.
#[tokio::test]
async fn deltas_from_a_slow_model_are_each_forwarded_alone() {
    let mut items: Vec<String> = (0..5).map(|i| text(&format!("s{i} "))).collect();
    items.push(stop());
    items.push(DONE.into());
    let f = fake(vec![Reply::Paced(items, Duration::from_millis(40))]).await;
    let mut d = Agentd::start(&agents_file(&f.url, "")).await;
    let (_, events, status) = helper_turn(&mut d, "slow").await;
    status.unwrap();
    let partials: Vec<&str> = events
        .iter()
        .filter(|e| e.kind() == EventKind::PartialText)
        .map(|e| e.text.as_str())
        .collect();
    assert_eq!(partials, ["s0 ", "s1 ", "s2 ", "s3 ", "s4 "]);
    d.stop().await;
}
