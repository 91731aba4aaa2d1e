//! The tool loop end to end through a real agentd Run, with fakellm (an
//! OpenAI-compatible mock that follows YAML rules per conversation turn and
//! streams spec-shaped tool calls) as the model, and an HTTP tool served by
//! a tiny HTTP server in this test.
//!
//! fakellm 0.3.5 ignores a rule's `status` on streaming requests and cannot
//! cut a stream, so error injection lives in `model_backend.rs`.

mod openai_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentd::pb::EventKind;
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use openai_support::{Agentd, Peer, kinds, venv_bin};
use serde_json::{Value, json};
use tonic::Code;

const RULES: &str = r#"
rules:
  - name: look_up_first
    when:
      turn: 1
      messages_contain: "where is order 1187"
    respond:
      tool_calls:
        - name: lookup_order
          arguments: {order_id: "1187"}
  - name: then_check_stock
    when:
      turn: 2
      tool_result_contains: "espresso cups"
    respond:
      tool_calls:
        - name: stock
          arguments: {sku: "espresso-cup", warehouse: "north"}
  - name: then_answer
    when:
      turn: 3
      tool_result_contains: "in_stock"
    respond:
      content: "Order 1187 has shipped with DHL, and espresso cups are in stock."
  - name: follow_up_sees_history
    when:
      turn: 4
      messages_contain: "espresso cups are in stock"
    respond:
      content: "As I said, it arrives on 2026-12-04."
  - name: greedy_tool_user
    when:
      messages_contain: "keep calling tools"
    respond:
      tool_calls:
        - name: lookup_order
          arguments: {order_id: "1042"}
"#;

/// The inventory service behind the `stock` HTTP tool.
async fn stock(State(seen): State<Arc<Mutex<Vec<Value>>>>, Json(args): Json<Value>) -> Json<Value> {
    seen.lock().unwrap().push(args.clone());
    Json(json!({"sku": args["sku"], "in_stock": 12}))
}

async fn fakellm(dir: &std::path::Path) -> Option<Peer> {
    let bin = venv_bin("fakellm")?;
    let rules = dir.join("fakellm.yaml");
    std::fs::write(&rules, RULES).unwrap();
    let args = |port: u16| {
        [
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--config",
            rules.to_str().unwrap(),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    match Peer::start_on_free_port(
        &bin,
        args,
        dir.join("fakellm.log"),
        "/_fakellm/stats",
        Duration::from_secs(30),
    )
    .await
    {
        Ok(peer) => Some(peer),
        Err((status, log)) => panic!("fakellm exited with {status}; log:\n{log}"),
    }
}

#[tokio::test]
async fn a_multi_turn_tool_loop_with_an_http_tool_runs_end_to_end_and_remembers_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let Some(llm) = fakellm(dir.path()).await else {
        return;
    };

    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = axum::Router::new()
        .route("/stock", post(stock))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let inventory = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let agents = format!(
        r#"
default = "support"

[agents.support]
description = "Order support backed by a model"
instruction = "You are a support agent. Use the tools."
tools = ["lookup_order", "stock"]
max_tool_turns = 4
call_timeout = "10s"

[agents.support.model]
base_url = "http://127.0.0.1:{port}/v1"
model = "gpt-4o-mini"

[agents.support.sampling]
temperature = 0.0

[tools.stock]
description = "Units in stock for a product."
url = "http://{inventory}/stock"
parameters = {{ type = "object", properties = {{ sku = {{ type = "string" }}, warehouse = {{ type = "string" }} }}, required = ["sku"] }}
timeout = "5s"
"#,
        port = llm.port
    );
    let mut d = Agentd::start(&agents).await;
    let s = d.session("alice").await;
    // Empty agent: the file's default serves it.
    let (events, status) = d
        .run(
            "alice",
            &s,
            "",
            "Where is order 1187? Are cups in stock?",
            Duration::from_secs(30),
        )
        .await;
    status.unwrap();
    let k = kinds(&events);
    assert_eq!(
        k[..4],
        [
            EventKind::ToolCall,
            EventKind::ToolResult,
            EventKind::ToolCall,
            EventKind::ToolResult
        ],
        "{events:#?}"
    );
    assert!(
        k[4..k.len() - 1]
            .iter()
            .all(|k| *k == EventKind::PartialText)
            && k.len() > 6,
        "{events:#?}"
    );
    assert_eq!(k.last(), Some(&EventKind::FinalAnswer));
    assert!(events.iter().enumerate().all(|(i, e)| e.seq == i as u64));
    assert_eq!(
        (events[0].tool_name.as_str(), events[0].author.as_str()),
        ("lookup_order", "support")
    );
    assert_eq!(
        serde_json::from_str::<Value>(&events[0].payload_json).unwrap(),
        json!({"order_id": "1187"})
    );
    assert_eq!(events[1].tool_call_id, events[0].tool_call_id);
    assert_eq!(
        serde_json::from_str::<Value>(&events[1].payload_json).unwrap()["items"],
        "2 x espresso cups"
    );
    assert_eq!(events[2].tool_name, "stock");
    assert_eq!(
        serde_json::from_str::<Value>(&events[3].payload_json).unwrap(),
        json!({"sku": "espresso-cup", "in_stock": 12})
    );
    let last = events.last().unwrap();
    assert!(last.is_final);
    assert_eq!(
        last.text,
        "Order 1187 has shipped with DHL, and espresso cups are in stock."
    );
    assert_eq!(
        openai_support::partial_text(&events),
        last.text,
        "the partials make the answer"
    );
    // The HTTP tool got exactly the model's arguments.
    assert_eq!(
        *seen.lock().unwrap(),
        vec![json!({"sku": "espresso-cup", "warehouse": "north"})]
    );

    // A follow-up in the same session: fakellm only answers it if the
    // earlier answer is in the messages agentd sends.
    let (events, status) = d
        .run(
            "alice",
            &s,
            "support",
            "And when will it arrive?",
            Duration::from_secs(30),
        )
        .await;
    status.unwrap();
    assert_eq!(
        events.last().unwrap().text,
        "As I said, it arrives on 2026-12-04."
    );
    d.stop().await;
}

#[tokio::test]
async fn a_model_that_never_stops_calling_tools_fails_after_max_tool_turns() {
    let dir = tempfile::tempdir().unwrap();
    let Some(llm) = fakellm(dir.path()).await else {
        return;
    };
    let agents = format!(
        r#"
[agents.greedy]
tools = ["lookup_order"]
max_tool_turns = 2
[agents.greedy.model]
base_url = "http://127.0.0.1:{}/v1"
model = "gpt-4o-mini"
"#,
        llm.port
    );
    let mut d = Agentd::start(&agents).await;
    let s = d.session("bob").await;
    let (events, status) = d
        .run(
            "bob",
            &s,
            "greedy",
            "please keep calling tools",
            Duration::from_secs(30),
        )
        .await;
    let st = status.unwrap_err();
    assert_eq!(st.code(), Code::FailedPrecondition, "{st:?}");
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind() == EventKind::ToolResult)
            .count(),
        2
    );
    d.stop().await;
}
