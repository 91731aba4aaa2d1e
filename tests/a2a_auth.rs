//! Bearer tokens on the A2A faces: JSON-RPC/SSE and gRPC refuse a call
//! without a valid token (HTTP 401 with a JSON-RPC error body, gRPC
//! UNAUTHENTICATED), the agent card stays public and declares the scheme,
//! and an authenticated caller's tasks run as that caller and are that
//! caller's alone: another caller can neither see nor touch them.

mod a2a_support;
mod support;

use std::time::Duration;

use a2a::{
    A2AError, ListTasksRequest, Message, Part, Role, SendMessageRequest, StreamResponse,
    SubscribeToTaskRequest, TaskState,
};
use a2a_support::{A2aServer, all_tasks};
use agentd::client::a2a::{A2aClient, Binding, CallError, CallOptions, Outcome, parts_text};
use agentd::domain::UserId;
use futures::StreamExt;
use support::{Backend, TestDb};

const BILLING: &str = "tok-billing-service-0000001";
const ORDERS: &str = "tok-orders-service-00000001";

fn tokens() -> String {
    format!(r#"{{"tokens": [{{"token": "{BILLING}", "caller": "billing", "user_ids": ["*"]}}]}}"#)
}

/// Two callers, `billing` and `orders`.
fn two_callers() -> String {
    format!(
        r#"{{"tokens": [{{"token": "{BILLING}", "caller": "billing", "user_ids": ["*"]}},
                        {{"token": "{ORDERS}", "caller": "orders", "user_ids": ["*"]}}]}}"#
    )
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

/// A JSON-RPC request body over `--max-message-bytes` is refused with 413
/// before it is parsed (parsing costs many times its size); one under it
/// reaches the handler.
#[tokio::test]
async fn a_json_rpc_body_over_the_message_limit_is_413_and_runs_nothing() {
    let server = A2aServer::start(Duration::ZERO).await;
    let http = agentd::agent::openai::http_client().unwrap();
    let limit = agentd::server::ServerOptions::default().max_message_bytes;
    let body = |text_bytes: usize| {
        serde_json::json!({
            "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
            "params": {"message": {"messageId": "m1", "role": "ROLE_USER",
                "parts": [{"text": "x".repeat(text_bytes)}]}}
        })
        .to_string()
    };
    let post = |body: String| {
        http.post(server.base_url())
            .header("A2A-Version", "1.0")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let refused = a2a_requests("unknown", "INVALID_REQUEST");
    let resp = post(body(limit + 1)).await.unwrap();
    assert_eq!(resp.status(), 413);
    assert_eq!(server.turns.in_flight(), 0);
    assert_eq!(
        a2a_requests("unknown", "INVALID_REQUEST"),
        refused + 1.0,
        "the refusal is counted"
    );
    // Under the limit (over --max-input-bytes): parsed, and answered with
    // the handler's own refusal.
    let resp = post(body(limit / 2)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let doc: serde_json::Value = resp.json().await.unwrap();
    assert!(
        doc.get("error").is_some() || doc.get("result").is_some(),
        "{doc}"
    );
    server.stop().await;
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

/// A2A tasks run as the user the caller's name is: a caller whose user_ids
/// do not include its own name (a token for some users only) is refused on
/// both bindings, and nothing runs; one whose scope names itself runs.
#[tokio::test]
async fn a_caller_whose_scope_excludes_its_own_name_is_refused_on_both_bindings() {
    const WEB: &str = "tok-web-frontend-000000001";
    const ALICE: &str = "tok-alice-herself-00000001";
    let tokens = format!(
        r#"{{"tokens": [{{"token": "{WEB}", "caller": "web", "user_ids": ["alice", "bob"]}},
                        {{"token": "{ALICE}", "caller": "alice", "user_ids": ["alice"]}}]}}"#
    );
    let server = A2aServer::start_secured(&tokens).await;
    for binding in [Binding::Jsonrpc, Binding::Grpc] {
        let client = A2aClient::connect_with(&server.base_url(), Some(binding), Some(WEB))
            .await
            .unwrap();
        let err = client
            .send_text("hello", echo(), &opts(), None)
            .await
            .unwrap_err();
        let CallError::Refused(e) = &err else {
            panic!("{binding:?}: {err:?}")
        };
        assert!(e.message.contains("user_ids"), "{binding:?}: {e:?}");
        let client = A2aClient::connect_with(&server.base_url(), Some(binding), Some(ALICE))
            .await
            .unwrap();
        let out = client
            .send_text("hello", echo(), &opts(), None)
            .await
            .unwrap();
        assert_eq!(answer(out), "hello", "{binding:?}");
    }
    assert_eq!(sessions_of(&server, "web").await, 0, "nothing ran as web");
    assert_eq!(sessions_of(&server, "alice").await, 2);
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

fn send_request(message: Message) -> SendMessageRequest {
    SendMessageRequest {
        message,
        configuration: None,
        metadata: None,
        tenant: None,
    }
}

/// SubscribeToTask's refusal, whether the call or its stream's first item
/// carries it.
async fn subscribe_refusal(client: &A2aClient, task_id: &str) -> A2AError {
    let req = SubscribeToTaskRequest {
        id: task_id.to_owned(),
        tenant: None,
    };
    match client.raw().subscribe_to_task(&req).await {
        Err(e) => e,
        Ok(mut stream) => match stream.next().await {
            Some(Err(e)) => e,
            other => panic!("subscribed to {task_id}: {other:?}"),
        },
    }
}

/// What a caller is answered for a task id that is not its own: exactly
/// what it is answered for one that does not exist.
fn assert_not_found(what: &str, task_id: &str, e: &A2AError) {
    let unknown = A2AError::task_not_found(task_id);
    assert_eq!(
        (e.code, e.message.as_str()),
        (unknown.code, unknown.message.as_str()),
        "{what} {task_id}: {e:?}"
    );
}

/// `billing` has a finished task and a running one (its tool takes a
/// minute); `orders`, over either binding, cannot get, list, cancel,
/// subscribe to or continue either, and is answered as for a task that does
/// not exist. `billing` still can. A context is the caller's own: `orders`
/// sending into `billing`'s context gets a task of its own, in its own
/// session, which `billing` does not see. With `other` (a second replica on
/// the same database), the same holds there, where the running task is
/// followed from the store rather than served from memory.
async fn tasks_are_their_callers_alone(
    store: std::sync::Arc<dyn agentd::store::Store>,
    other: Option<std::sync::Arc<dyn agentd::store::Store>>,
) {
    let server =
        A2aServer::start_secured_on(&two_callers(), store, Duration::from_secs(60), "replica-a")
            .await;
    let replica = match other {
        Some(store) => Some(
            A2aServer::start_secured_on(&two_callers(), store, Duration::ZERO, "replica-b").await,
        ),
        None => None,
    };
    let billing = A2aClient::connect_with(&server.base_url(), Some(Binding::Grpc), Some(BILLING))
        .await
        .unwrap();
    let Outcome::Completed {
        task_id: done,
        context_id,
        ..
    } = billing
        .send_text("hello", echo(), &opts(), None)
        .await
        .unwrap()
    else {
        panic!("the echo task did not complete")
    };
    let mut running_stream = billing
        .raw()
        .send_streaming_message(&send_request(Message::new(
            Role::User,
            vec![Part::text("Where is order 1187?")],
        )))
        .await
        .unwrap();
    let running = match running_stream.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t.id,
        other => panic!("first event is not the task: {other:?}"),
    };

    let urls: Vec<String> = std::iter::once(&server)
        .chain(replica.as_ref())
        .map(A2aServer::base_url)
        .collect();
    for (url, binding) in urls
        .iter()
        .flat_map(|u| [(u, Binding::Jsonrpc), (u, Binding::Grpc)])
    {
        let orders = A2aClient::connect_with(url, Some(binding), Some(ORDERS))
            .await
            .unwrap();
        for id in [&done, &running] {
            let what = format!("{url} {binding:?}");
            assert_not_found(&what, id, &orders.get_task(id).await.unwrap_err());
            assert_not_found(&what, id, &orders.cancel(id).await.unwrap_err());
            assert_not_found(&what, id, &subscribe_refusal(&orders, id).await);
            let reply = Message {
                task_id: Some(id.clone()),
                ..Message::new(Role::User, vec![Part::text("and now?")])
            };
            let e = orders
                .raw()
                .send_message(&send_request(reply.clone()))
                .await
                .unwrap_err();
            assert_not_found(&what, id, &e);
            let e = match orders
                .raw()
                .send_streaming_message(&send_request(reply))
                .await
            {
                Err(e) => e,
                Ok(mut s) => match s.next().await {
                    Some(Err(e)) => e,
                    other => panic!("{what}: continued {id}: {other:?}"),
                },
            };
            assert_not_found(&what, id, &e);
        }
        let listed = orders.raw().list_tasks(&all_tasks()).await.unwrap();
        assert_eq!(
            (listed.tasks.len(), listed.total_size),
            (0, 0),
            "{binding:?}"
        );
        let in_context = orders
            .raw()
            .list_tasks(&ListTasksRequest {
                context_id: Some(context_id.clone()),
                ..all_tasks()
            })
            .await
            .unwrap();
        assert_eq!(in_context.tasks.len(), 0, "{binding:?}");
    }

    // The owner still can, and the other caller's cancel changed nothing.
    assert_eq!(
        billing.get_task(&done).await.unwrap().status.state,
        TaskState::Completed
    );
    assert_eq!(
        billing.get_task(&running).await.unwrap().status.state,
        TaskState::Working
    );
    let listed = billing.raw().list_tasks(&all_tasks()).await.unwrap();
    let mut ids: Vec<_> = listed.tasks.iter().map(|t| t.id.clone()).collect();
    ids.sort();
    let mut expected = vec![done.clone(), running.clone()];
    expected.sort();
    assert_eq!((ids, listed.total_size), (expected, 2));
    for url in &urls {
        let billing = A2aClient::connect_with(url, Some(Binding::Jsonrpc), Some(BILLING))
            .await
            .unwrap();
        let mut followed = billing
            .raw()
            .subscribe_to_task(&SubscribeToTaskRequest {
                id: running.clone(),
                tenant: None,
            })
            .await
            .unwrap();
        match followed.next().await.unwrap().unwrap() {
            StreamResponse::Task(t) => assert_eq!(t.id, running, "{url}"),
            other => panic!("{url}: first event is not the task: {other:?}"),
        }
    }
    assert_eq!(
        billing.cancel(&running).await.unwrap().status.state,
        TaskState::Canceled
    );

    // `orders` in `billing`'s context: a task of its own, in its session.
    let orders = A2aClient::connect_with(&server.base_url(), Some(Binding::Jsonrpc), Some(ORDERS))
        .await
        .unwrap();
    let message = Message {
        context_id: Some(context_id.clone()),
        metadata: echo(),
        ..Message::new(Role::User, vec![Part::text("hello too")])
    };
    let Outcome::Completed {
        task_id: theirs,
        context_id: same,
        ..
    } = orders.send(message, &opts(), None).await.unwrap()
    else {
        panic!("the echo task did not complete")
    };
    assert_eq!(same, context_id);
    let session_of = |t: &a2a::Task| {
        t.metadata.as_ref().unwrap()[agentd::store::a2a_tasks::SESSION_METADATA_KEY]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let context_of = |user: &str| {
        agentd::store::a2a_tasks::context_session(&UserId::parse(user).unwrap(), &context_id)
            .to_string()
    };
    assert_eq!(
        session_of(&orders.get_task(&theirs).await.unwrap()),
        context_of("orders")
    );
    assert_eq!(
        session_of(&billing.get_task(&done).await.unwrap()),
        context_of("billing")
    );
    let in_context = |c: &A2aClient| {
        let c = c.clone();
        let context_id = context_id.clone();
        async move {
            c.raw()
                .list_tasks(&ListTasksRequest {
                    context_id: Some(context_id),
                    ..all_tasks()
                })
                .await
                .unwrap()
                .tasks
                .into_iter()
                .map(|t| t.id)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(in_context(&billing).await, [done]);
    assert_eq!(in_context(&orders).await, [theirs]);
    if let Some(replica) = replica {
        replica.stop().await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_caller_cannot_get_list_cancel_follow_or_continue_a_task_in_memory() {
    let db = TestDb::fresh(Backend::Memory).await.unwrap();
    tasks_are_their_callers_alone(db.open().await, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_caller_cannot_get_list_cancel_follow_or_continue_a_task_on_sqlite() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    tasks_are_their_callers_alone(db.open().await, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_caller_cannot_get_list_cancel_follow_or_continue_a_task_on_either_postgres_replica()
 {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    tasks_are_their_callers_alone(db.open().await, Some(db.open().await)).await;
}

/// A client that sends part of a request's headers and then nothing is cut
/// off after the header read timeout, not held for ever.
#[tokio::test]
async fn a_request_whose_headers_never_finish_is_cut_off() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let server = A2aServer::start(Duration::ZERO).await;
    let mut slow = tokio::net::TcpStream::connect(server.http).await.unwrap();
    slow.write_all(b"POST / HTTP/1.1\r\nHost: agentd\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = Vec::new();
    // Closed (an end of stream, or a reset) before the bound, never answered.
    let closed = tokio::time::timeout(
        agentd::a2a::HEADER_READ_TIMEOUT * 3,
        slow.read_to_end(&mut buf),
    )
    .await;
    assert!(closed.is_ok(), "the server closes the connection");
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"), "{buf:?}");
    assert!(started.elapsed() >= agentd::a2a::HEADER_READ_TIMEOUT / 2);
    // The face still serves everyone else.
    agentd::auth::tls::install_crypto_provider();
    let card = reqwest::get(format!("{}/.well-known/agent-card.json", server.base_url()))
        .await
        .unwrap();
    assert_eq!(card.status(), 200);
    server.stop().await;
}

/// Messages no agent could run are refused before a task (or a session) is
/// made: text past --max-input-bytes, no text, an unknown agent, no
/// messageId, a contextId past 256 bytes. A task id or a method name of
/// any length is quoted back short, and a refusal is always JSON-RPC.
#[tokio::test]
async fn refused_messages_store_nothing_and_refusals_quote_input_short() {
    let server = A2aServer::start(Duration::ZERO).await;
    let http = agentd::agent::openai::http_client().unwrap();
    let post = |body: serde_json::Value| {
        let req = http
            .post(server.base_url())
            .header("A2A-Version", "1.0")
            .header("content-type", "application/json")
            .body(body.to_string());
        async move {
            let resp = req.send().await.unwrap();
            let text = resp.text().await.unwrap();
            serde_json::from_str::<serde_json::Value>(&text)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {text:.200}"))
        }
    };
    let send = |message: serde_json::Value, metadata: serde_json::Value| {
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
            "params": {"message": message, "metadata": metadata}})
    };
    let msg = |text: &str| serde_json::json!({"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": text}]});
    let refusals = [
        send(msg(&"x".repeat(70 * 1024)), serde_json::json!({})),
        send(msg("   "), serde_json::json!({})),
        send(msg("hi"), serde_json::json!({"agent": "nosuch"})),
        send(
            serde_json::json!({"role": "ROLE_USER", "parts": [{"text": "hi"}]}),
            serde_json::json!({}),
        ),
        send(
            serde_json::json!({"messageId": "m1", "role": "ROLE_USER", "contextId": "c".repeat(300),
                "parts": [{"text": "hi"}]}),
            serde_json::json!({}),
        ),
    ];
    for body in refusals {
        let doc = post(body).await;
        assert_eq!(
            doc["error"]["code"],
            a2a::error_code::INVALID_PARAMS,
            "{doc:.300}"
        );
    }
    let user = agentd::domain::UserId::parse(agentd::store::a2a_tasks::A2A_USER).unwrap();
    let store = server.turns.store();
    assert!(
        store
            .list_sessions(&user, 10, None)
            .await
            .unwrap()
            .sessions
            .is_empty(),
        "no session was made"
    );
    let listed =
        post(serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {}}))
            .await;
    assert!(listed["result"].is_object(), "{listed}");
    assert_eq!(
        listed["result"]["tasks"].as_array().map_or(0, Vec::len),
        0,
        "no task was made: {listed}"
    );
    assert_eq!(server.tool.started(), 0);

    let doc = post(
        serde_json::json!({"jsonrpc": "2.0", "id": 3, "method": "GetTask",
        "params": {"id": "A".repeat(100_000)}}),
    )
    .await;
    assert_eq!(doc["error"]["code"], a2a::error_code::TASK_NOT_FOUND);
    assert!(doc.to_string().len() < 600, "{doc:.300}");
    let doc =
        post(serde_json::json!({"jsonrpc": "2.0", "id": 4, "method": "M".repeat(100_000)})).await;
    assert_eq!(
        doc["error"]["code"],
        a2a::error_code::METHOD_NOT_FOUND,
        "{doc:.300}"
    );
    assert!(doc.to_string().len() < 600, "{doc:.300}");
    server.stop().await;
}
