//! Bearer tokens on the A2A faces: JSON-RPC/SSE and gRPC refuse a call
//! without a valid token (HTTP 401 with a JSON-RPC error body, gRPC
//! UNAUTHENTICATED), the agent card stays public and declares the scheme,
//! and an authenticated caller's tasks run as that caller.

mod a2a_support;

use std::time::Duration;

use a2a_support::A2aServer;
use agentd::client::a2a::{A2aClient, Binding, CallError, CallOptions, Outcome, parts_text};
use agentd::domain::UserId;

const BILLING: &str = "tok-billing-service-0000001";

fn tokens() -> String {
    format!(r#"{{"tokens": [{{"token": "{BILLING}", "caller": "billing", "user_ids": ["*"]}}]}}"#)
}

/// `agentd_a2a_requests_total` for one method and outcome in this process
/// (0 before the first).
fn a2a_requests(method: &str, outcome: &str) -> f64 {
    let series = format!("agentd_a2a_requests_total{{method=\"{method}\",outcome=\"{outcome}\"}} ");
    agentd::telemetry::metrics::render()
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

fn opts() -> CallOptions {
    CallOptions {
        idle_timeout: Duration::from_secs(10),
        deadline: Duration::from_secs(30),
        ..CallOptions::default()
    }
}

fn echo() -> Option<std::collections::HashMap<String, serde_json::Value>> {
    Some(
        [("agent".to_owned(), serde_json::json!("echo"))]
            .into_iter()
            .collect(),
    )
}

fn answer(out: Outcome) -> String {
    match out {
        Outcome::Completed { artifacts, .. } => parts_text(&artifacts[0].parts),
        other => panic!("{other:?}"),
    }
}

async fn sessions_of(server: &A2aServer, user: &str) -> usize {
    server
        .turns
        .store()
        .list_sessions(&UserId::parse(user.to_owned()).unwrap(), 100, None)
        .await
        .unwrap()
        .sessions
        .len()
}

#[tokio::test]
async fn the_card_is_public_and_declares_the_bearer_scheme() {
    let server = A2aServer::start_secured(&tokens()).await;
    // reqwest is built without a default crypto provider; agentd installs ring.
    agentd::auth::tls::install_crypto_provider();
    let resp = reqwest::get(format!("{}/.well-known/agent-card.json", server.base_url()))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let card: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(
        card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"], "Bearer",
        "{card}"
    );
    assert!(
        card["securityRequirements"][0]["schemes"]
            .get("bearer")
            .is_some(),
        "{card}"
    );
    server.stop().await;

    // Without authentication the card declares nothing.
    let open = A2aServer::start(Duration::ZERO).await;
    let card: serde_json::Value =
        reqwest::get(format!("{}/.well-known/agent-card.json", open.base_url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert!(card.get("securitySchemes").is_none(), "{card}");
    open.stop().await;
}

#[tokio::test]
async fn json_rpc_without_a_good_token_is_401_with_a_json_rpc_error_and_runs_nothing() {
    let server = A2aServer::start_secured(&tokens()).await;
    let http = agentd::agent::openai::http_client().unwrap();
    let body = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
        "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}}
    });
    let refused_before = a2a_requests("unknown", "UNAUTHENTICATED");
    for auth in [
        None,
        Some("Bearer tok-not-a-real-token-000"),
        Some("Basic abc"),
    ] {
        let mut req = http
            .post(server.base_url())
            .header("A2A-Version", "1.0")
            .json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{auth:?}");
        assert!(resp.headers().contains_key("www-authenticate"));
        let doc: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(doc["jsonrpc"], "2.0");
        assert_eq!(
            doc["error"]["code"],
            agentd::a2a::auth::UNAUTHENTICATED_CODE,
            "{doc}"
        );
        assert!(!doc["error"]["message"].as_str().unwrap().contains("tok-"));
    }
    assert_eq!(server.turns.in_flight(), 0);
    assert_eq!(sessions_of(&server, "a2a-anonymous").await, 0);
    // Counted as refused, never as a request the handler saw.
    assert_eq!(
        a2a_requests("unknown", "UNAUTHENTICATED") - refused_before,
        3.0
    );
    assert_eq!(a2a_requests("SendMessage", "OK"), 0.0);
    server.stop().await;
}

#[tokio::test]
async fn with_a_token_both_bindings_work_and_tasks_run_as_the_caller() {
    let server = A2aServer::start_secured(&tokens()).await;
    for binding in [Binding::Jsonrpc, Binding::Grpc] {
        let client = A2aClient::connect_with(&server.base_url(), Some(binding), Some(BILLING))
            .await
            .unwrap();
        let out = client
            .send_text("hello", echo(), &opts(), None)
            .await
            .unwrap();
        assert_eq!(answer(out), "hello", "{binding:?}");
    }
    assert_eq!(sessions_of(&server, "billing").await, 2);
    assert_eq!(sessions_of(&server, "a2a-anonymous").await, 0);
    server.stop().await;
}

#[tokio::test]
async fn without_a_token_both_bindings_are_refused() {
    let server = A2aServer::start_secured(&tokens()).await;
    for (binding, token) in [
        (Binding::Jsonrpc, None),
        (Binding::Grpc, None),
        (Binding::Jsonrpc, Some("tok-not-a-real-token-000")),
        (Binding::Grpc, Some("tok-not-a-real-token-000")),
    ] {
        let client = A2aClient::connect_with(&server.base_url(), Some(binding), token)
            .await
            .unwrap();
        let err = client
            .send_text("hello", echo(), &opts(), None)
            .await
            .unwrap_err();
        let CallError::Refused(e) = &err else {
            panic!("{binding:?}: {err:?}")
        };
        assert!(
            e.message.contains("unauthenticated") || e.message.contains("token"),
            "{binding:?}: {e:?}"
        );
    }
    // The gRPC face answers UNAUTHENTICATED itself.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = a2a_pb::proto::a2a_service_client::A2aServiceClient::new(channel);
    let status = raw
        .get_task(a2a_pb::proto::GetTaskRequest {
            id: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    assert_eq!(server.turns.in_flight(), 0);
    assert_eq!(sessions_of(&server, "billing").await, 0);
    assert_eq!(sessions_of(&server, "a2a-anonymous").await, 0);
    server.stop().await;
}

#[tokio::test]
async fn a_client_cannot_name_its_own_caller() {
    // Authentication on: the header a client sends is replaced by the
    // authenticated caller's name.
    let server = A2aServer::start_secured(&tokens()).await;
    let http = agentd::agent::openai::http_client().unwrap();
    let body = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
        "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}],
                               "metadata": {"agent": "echo"}}}
    });
    let resp = http
        .post(server.base_url())
        .header("A2A-Version", "1.0")
        .header("authorization", format!("Bearer {BILLING}"))
        .header(agentd::auth::CALLER_HEADER, "mallory")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(sessions_of(&server, "billing").await, 1);
    assert_eq!(sessions_of(&server, "mallory").await, 0);
    server.stop().await;

    // Authentication off: the header is ignored, tasks run anonymously.
    let open = A2aServer::start(Duration::ZERO).await;
    let resp = http
        .post(open.base_url())
        .header("A2A-Version", "1.0")
        .header(agentd::auth::CALLER_HEADER, "mallory")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(sessions_of(&open, "mallory").await, 0);
    assert_eq!(sessions_of(&open, "a2a-anonymous").await, 1);
    open.stop().await;
}
