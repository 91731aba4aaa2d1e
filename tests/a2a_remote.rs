//! `kind = "remote_a2a"` agents: an `agentd serve` child whose agents file
//! delegates to a second agentd (in-process, A2A on 127.0.0.1) or to the
//! Python SDK test agent. A Run streams the remote's answer through, a
//! dropped Run cancels the remote task, remote failures are sanitised, the
//! remote conversation (its context, a question waiting for its reply)
//! goes on across a restart on SQLite and across replicas on PostgreSQL,
//! and a bad entry stops start-up with the file, line and reason. A
//! scripted A2A peer (the A2A crates' JSON-RPC router on a handler that
//! answers from a script) sends what those agents do not: artifact chunks
//! that replace rather than append, and a turn replayed from its first
//! chunk after a resubscription.

mod a2a_support;
mod support;

use std::time::Duration;

use a2a::TaskState;
use a2a_support::{A2aServer, PyAgent, python};
use agentd::client::a2a::A2aClient;
use agentd::pb;
use support::{Child, collect, session_on};
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(60);
const BILLING: &str = "tok-billing-service-0000001";

fn write_agents(dir: &tempfile::TempDir, text: &str) -> String {
    let p = dir.path().join("agents.toml");
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// Every task the remote holds, as its ListTasks gives them.
async fn remote_tasks(remote: &A2aServer) -> Vec<a2a::Task> {
    let client = A2aClient::connect(&remote.base_url(), None).await.unwrap();
    client
        .raw()
        .list_tasks(&a2a_support::all_tasks())
        .await
        .unwrap()
        .tasks
}

/// agentd serving `name`: a remote_a2a agent for `remote`'s stream agent.
async fn serve_remote_stream(remote: &A2aServer, name: &str) -> (Child, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            "[agents.{name}]\nkind = \"remote_a2a\"\n[agents.{name}.a2a]\ncard_url = \"{}\"\nagent = \"stream\"\n",
            remote.base_url()
        ),
    );
    (serve(&agents).await, dir)
}

async fn serve(agents: &str) -> Child {
    Child::serve(&[
        "--agents",
        agents,
        "--store",
        "memory:",
        "--a2a-listen",
        "off",
    ])
    .await
}

async fn run(
    child: &Child,
    agent: &str,
    text: &str,
) -> (Vec<pb::AgentEvent>, Result<(), tonic::Status>) {
    let mut c = child.client.clone();
    let session = c.create_session("alice").await.unwrap().session_id;
    let req = pb::RunRequest {
        user_id: "alice".into(),
        session_id: session,
        request_id: "r1".into(),
        text: text.into(),
        agent: agent.into(),
        ..Default::default()
    };
    match c.run(req, DEADLINE).await {
        Ok(mut call) => collect(&mut call.events).await,
        Err(e) => (vec![], Err(e)),
    }
}

fn kinds(events: &[pb::AgentEvent]) -> Vec<pb::EventKind> {
    events.iter().map(|e| e.kind()).collect()
}

#[tokio::test]
async fn a_run_streams_the_remote_agents_tool_calls_text_and_answer() {
    let remote = A2aServer::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            r#"
[agents.orders]
kind = "remote_a2a"
description = "Order questions, answered by another agentd."
[agents.orders.a2a]
card_url = "{url}/.well-known/agent-card.json"
agent = "order_helper"

[agents.streamer]
kind = "remote_a2a"
call_timeout = "30s"
[agents.streamer.a2a]
jsonrpc_url = "{url}/"
agent = "stream"
idle_timeout = "10s"
"#,
            url = remote.base_url()
        ),
    );
    let child = serve(&agents).await;

    let (events, end) = run(&child, "orders", "Where is order 1187?").await;
    end.unwrap();
    assert_eq!(
        kinds(&events),
        [
            pb::EventKind::ToolCall,
            pb::EventKind::ToolResult,
            // The remote's answer chunk, then the answer as a whole.
            pb::EventKind::PartialText,
            pb::EventKind::FinalAnswer
        ],
        "{events:?}"
    );
    assert_eq!(events[2].text, events[3].text);
    assert_eq!(events[0].tool_name, "lookup_order");
    assert!(events[0].payload_json.contains("1187"), "{events:?}");
    assert_eq!(events[1].tool_call_id, events[0].tool_call_id);
    let last = events.last().unwrap();
    assert!(last.is_final && last.author == "orders");
    assert!(
        last.text.contains("Order 1187") && last.text.contains("DHL"),
        "{last:?}"
    );

    let (events, end) = run(&child, "streamer", "n=3 size=2").await;
    end.unwrap();
    // The remote's partials, as it sent them (those waiting together as one).
    let partials: String = events
        .iter()
        .filter(|e| e.kind() == pb::EventKind::PartialText)
        .map(|e| e.text.as_str())
        .collect();
    let last = events.last().unwrap();
    assert_eq!(last.kind(), pb::EventKind::FinalAnswer);
    // The partials as streamed, once each; the answer is the remote's
    // answer artifact, whose last chunk replaced them (the stream agent's
    // answer is not its streamed text).
    assert_eq!(partials, "xxxxxx");
    assert_eq!(last.text, "sent 3 events");
    remote.stop().await;
}

/// A Run of `agent` on `text` in a new session of alice's: its stream, and
/// its first event (within 30 s).
async fn first_event(
    child: &Child,
    agent: &str,
    text: &str,
) -> (agentd::client::RunEvents, pb::AgentEvent) {
    let mut c = child.client.clone();
    let session = c.create_session("alice").await.unwrap().session_id;
    let req = pb::RunRequest {
        user_id: "alice".into(),
        session_id: session,
        request_id: "r1".into(),
        text: text.into(),
        agent: agent.into(),
        ..Default::default()
    };
    let mut stream = c.run(req, DEADLINE).await.unwrap().events;
    let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("no event from the remote")
        .unwrap()
        .unwrap();
    (stream, first)
}

#[tokio::test]
async fn a_cancelled_run_cancels_the_remote_task() {
    let remote = A2aServer::start(Duration::ZERO).await;
    let (child, _dir) = serve_remote_stream(&remote, "slow").await;
    // 1000 events at 5/s: minutes, unless cancelled.
    let (stream, first) = first_event(&child, "slow", "n=1000 size=4 rate=5").await;
    assert_eq!(first.kind(), pb::EventKind::PartialText);
    assert!(remote.turns.in_flight() > 0);
    drop(stream);

    assert!(
        remote.idle(Duration::from_secs(20)).await,
        "the remote run was not cancelled"
    );
    let tasks = remote_tasks(&remote).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].status.state, TaskState::Canceled);
    remote.stop().await;
}

/// A remote answer larger than an answer may be (2 MiB, as from a model)
/// ends the run FAILED_PRECONDITION and cancels the remote task, rather than
/// being held, stored and sent back as every later turn's history.
#[tokio::test]
async fn a_remote_answer_over_the_answer_limit_fails_and_cancels_the_remote_task() {
    let remote = A2aServer::start(Duration::ZERO).await;
    let (child, _dir) = serve_remote_stream(&remote, "big").await;
    // 3.2 MiB of text over about 8 s: still running when the limit is hit.
    let (events, end) = run(&child, "big", "n=400 size=8192 rate=50").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("2 MiB"), "{status:?}");
    let streamed: usize = events.iter().map(|e| e.text.len()).sum();
    assert!(streamed <= 2 << 20, "{streamed} bytes forwarded");
    assert!(!events.iter().any(|e| e.is_final));
    assert!(
        remote.idle(Duration::from_secs(20)).await,
        "the remote run was not cancelled"
    );
    let tasks = remote_tasks(&remote).await;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].status.state, TaskState::Canceled);
    remote.stop().await;
}

#[tokio::test]
async fn a_token_from_the_environment_reaches_a_secured_remote() {
    let remote = A2aServer::start_secured(&format!(
        r#"{{"tokens": [{{"token": "{BILLING}", "caller": "billing", "user_ids": ["*"]}}]}}"#
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("wrong-token");
    std::fs::write(&token_file, "tok-not-a-real-token-000\n").unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            r#"
[agents.good]
kind = "remote_a2a"
[agents.good.a2a]
card_url = "{url}"
agent = "echo"
token_env = "AGENTD_TEST_REMOTE_TOKEN"

[agents.bad]
kind = "remote_a2a"
[agents.bad.a2a]
card_url = "{url}"
agent = "echo"
token_file = "{file}"
"#,
            url = remote.base_url(),
            file = token_file.display()
        ),
    );
    // SAFETY: nextest runs each test in its own process; the variable is
    // set before the child that reads it starts, and nothing else reads it.
    unsafe { std::env::set_var("AGENTD_TEST_REMOTE_TOKEN", BILLING) };
    let child = serve(&agents).await;
    let (events, end) = run(&child, "good", "hello").await;
    end.unwrap();
    assert_eq!(events.last().unwrap().text, "hello");

    let (_, end) = run(&child, "bad", "hello").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("credentials") && !status.message().contains("tok-"),
        "{status:?}"
    );
    remote.stop().await;
}

#[tokio::test]
async fn remote_failures_are_sanitised_and_input_required_is_an_answer_that_says_so() {
    let Some(py) = python() else { return };
    let agent = PyAgent::start(&py, false).await;
    let dir = tempfile::tempdir().unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            "[agents.py]\nkind = \"remote_a2a\"\n[agents.py.a2a]\ncard_url = \"{}\"\n",
            agent.base_url
        ),
    );
    let child = serve(&agents).await;

    let (events, end) = run(&child, "py", "chunks=3 delay=0").await;
    end.unwrap();
    assert_eq!(
        kinds(&events),
        [
            pb::EventKind::PartialText,
            pb::EventKind::PartialText,
            pb::EventKind::PartialText,
            pb::EventKind::FinalAnswer
        ]
    );
    assert_eq!(events.last().unwrap().text, "c0 c1 c2 ");

    let (_, end) = run(&child, "py", "fail=1").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("failed the task") && !status.message().contains("boom"),
        "{status:?}"
    );
    let (_, end) = run(&child, "py", "reject=1").await;
    assert_eq!(end.unwrap_err().code(), Code::FailedPrecondition);

    let (events, end) = run(&child, "py", "input=1").await;
    end.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind(), pb::EventKind::FinalAnswer);
    assert_eq!(last.text, "The remote agent needs more input: which order?");

    let (events, end) = run(&child, "py", "message=1").await;
    end.unwrap();
    assert_eq!(events.last().unwrap().text, "direct reply");
}

/// agentd on `store` as replica `replica` (its agents file in `dir`),
/// serving `agent`: a remote_a2a agent for the remote at `url`, its own
/// agent `remote_agent` there when given.
async fn serve_on(
    dir: &tempfile::TempDir,
    store: &str,
    replica: &str,
    agent: &str,
    url: &str,
    remote_agent: Option<&str>,
) -> Child {
    serve_on_with(dir, store, replica, agent, url, remote_agent, &[]).await
}

/// [`serve_on`], with `extra` flags for `agentd serve`.
async fn serve_on_with(
    dir: &tempfile::TempDir,
    store: &str,
    replica: &str,
    agent: &str,
    url: &str,
    remote_agent: Option<&str>,
    extra: &[&str],
) -> Child {
    let pick = remote_agent.map_or(String::new(), |a| format!("agent = \"{a}\"\n"));
    let agents = write_agents(
        dir,
        &format!(
            "[agents.{agent}]\nkind = \"remote_a2a\"\n[agents.{agent}.a2a]\ncard_url = \"{url}\"\n{pick}"
        ),
    );
    let mut args = vec![
        "--agents",
        &agents,
        "--store",
        store,
        "--replica-id",
        replica,
        "--a2a-listen",
        "off",
    ];
    args.extend_from_slice(extra);
    Child::serve(&args).await
}

/// Turn `rid` of alice's `session`, run by `agent` on `child`: its events,
/// and what its final answer's payload records of the remote conversation
/// (`{"context_id", "task_id", "state"}`).
async fn turn(
    child: &Child,
    session: &str,
    rid: &str,
    agent: &str,
    text: &str,
) -> (Vec<pb::AgentEvent>, serde_json::Value) {
    let req = pb::RunRequest {
        user_id: "alice".into(),
        session_id: session.into(),
        request_id: rid.into(),
        text: text.into(),
        agent: agent.into(),
        ..Default::default()
    };
    let mut call = child.client.clone().run(req, DEADLINE).await.unwrap();
    let (events, end) = collect(&mut call.events).await;
    end.unwrap_or_else(|e| panic!("{rid}: {e:?} after {events:?}"));
    let last = events.last().expect("no events");
    assert_eq!(last.kind(), pb::EventKind::FinalAnswer, "{events:?}");
    let payload: serde_json::Value = serde_json::from_str(&last.payload_json)
        .unwrap_or_else(|e| panic!("{rid}: payload {:?}: {e}", last.payload_json));
    (events, payload["a2a"].clone())
}

/// The first turn (r1) of `session` on `child`, which names an order: it
/// completes, and the remote context it began is returned.
async fn first_turn(child: &Child, session: &str) -> String {
    let (_, first) = turn(child, session, "r1", "orders", "Where is order 2301?").await;
    assert_eq!(first["state"], "completed", "{first}");
    first["context_id"].as_str().expect("a context").to_owned()
}

/// The next turn (r2) of `session` on `child`, after a first that asked the
/// remote (another agentd) about order 2301 in the remote context
/// `context`: sent in that context, it is answered about that order, and
/// the remote holds the two turns' tasks, both in that context.
async fn assert_the_conversation_goes_on(
    child: &Child,
    session: &str,
    context: &str,
    remote: &A2aServer,
) {
    let (events, second) = turn(child, session, "r2", "orders", "and when will it arrive?").await;
    assert_eq!(second["context_id"], context, "{second}");
    let answer = &events.last().unwrap().text;
    assert!(
        answer.contains("2301"),
        "the remote's session goes on: {answer}"
    );
    let tasks = remote_tasks(remote).await;
    assert_eq!(tasks.len(), 2, "{tasks:?}");
    assert!(tasks.iter().all(|t| t.context_id == context), "{tasks:?}");
}

/// The remote conversation is kept with the session, in the store: an
/// agentd restarted on its SQLite file continues it, its next turn sent in
/// the remote context of the first (the remote, another agentd, then
/// remembers the order the first turn named).
#[tokio::test]
async fn a_remote_conversation_continues_across_a_restart() {
    let remote = A2aServer::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("agentd.db").display());
    let url = remote.base_url();
    let serve = || serve_on(&dir, &store, "a", "orders", &url, Some("order_helper"));
    let child = serve().await;
    let session = session_on(&child.client, "alice").await;
    let context = first_turn(&child, &session).await;
    child.kill9().await;

    let child = serve().await;
    assert_the_conversation_goes_on(&child, &session, &context, &remote).await;
    remote.stop().await;
}

/// The remote conversation outlives the history's byte budget: with
/// `--history-bytes 1` every earlier turn is too large to be sent as
/// history (as one large answer makes the turns before it), and the next
/// turn still goes on in the first's remote context.
#[tokio::test]
async fn a_remote_conversation_continues_past_the_history_budget() {
    let remote = A2aServer::start(Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("agentd.db").display());
    let (url, budget) = (remote.base_url(), ["--history-bytes", "1"]);
    let child = serve_on_with(
        &dir,
        &store,
        "a",
        "orders",
        &url,
        Some("order_helper"),
        &budget,
    )
    .await;
    let session = session_on(&child.client, "alice").await;
    let context = first_turn(&child, &session).await;
    assert_the_conversation_goes_on(&child, &session, &context, &remote).await;
    remote.stop().await;
}

/// Two replicas on one PostgreSQL database: a session's turn on B goes on
/// in the remote context its turn on A began.
#[tokio::test]
async fn a_remote_conversation_begun_on_one_replica_continues_on_another() {
    let Some(db) = support::TestDb::fresh(support::Backend::Postgres).await else {
        return;
    };
    let remote = A2aServer::start(Duration::ZERO).await;
    let url = remote.base_url();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = serve_on(&dir_a, &db.url, "a", "orders", &url, Some("order_helper")).await;
    let b = serve_on(&dir_b, &db.url, "b", "orders", &url, Some("order_helper")).await;
    let session = session_on(&a.client, "alice").await;
    let context = first_turn(&a, &session).await;
    assert_the_conversation_goes_on(&b, &session, &context, &remote).await;
    remote.stop().await;
}

/// A remote task that waits for input (INPUT_REQUIRED) in a turn on
/// replica A is answered by the session's next turn, on replica B: the
/// reply goes to that task, which completes. The turn after that, back on
/// A, starts a new task in the same context: A holds nothing of the
/// session that could have gone stale meanwhile.
#[tokio::test]
async fn a_question_asked_on_one_replica_is_answered_by_the_next_turn_on_another() {
    let Some(py) = python() else { return };
    let Some(db) = support::TestDb::fresh(support::Backend::Postgres).await else {
        return;
    };
    let peer = PyAgent::start(&py, false).await;
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = serve_on(&dir_a, &db.url, "a", "py", &peer.base_url, None).await;
    let b = serve_on(&dir_b, &db.url, "b", "py", &peer.base_url, None).await;
    let session = session_on(&a.client, "alice").await;

    let (events, asked) = turn(&a, &session, "r1", "py", "input=1").await;
    assert_eq!(
        events.last().unwrap().text,
        "The remote agent needs more input: which order?"
    );
    assert_eq!(asked["state"], "input_required", "{asked}");
    let waiting = asked["task_id"].as_str().expect("a task").to_owned();
    let context = asked["context_id"].as_str().expect("a context").to_owned();

    let (events, answered) = turn(&b, &session, "r2", "py", "said=1").await;
    assert_eq!(events.last().unwrap().text, "all done");
    assert_eq!(answered["task_id"], waiting.as_str(), "{answered}");
    assert_eq!(answered["state"], "completed", "{answered}");
    let remote = A2aClient::connect(&peer.base_url, None).await.unwrap();
    let task = remote.get_task(&waiting).await.unwrap();
    assert_eq!(
        task.status.state,
        TaskState::Completed,
        "the reply went to the waiting task"
    );

    let (events, next) = turn(&a, &session, "r3", "py", "chunks=1 delay=0").await;
    assert_eq!(events.last().unwrap().text, "c0 ");
    assert_ne!(next["task_id"], waiting.as_str(), "{next}");
    assert_eq!(next["context_id"], context.as_str(), "{next}");
}

#[tokio::test]
async fn an_unreachable_remote_is_unavailable_and_not_a_start_up_failure() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on.
    let (_held, port) = support::refusing_port();
    let agents = write_agents(
        &dir,
        &format!(
            "[agents.gone]\nkind = \"remote_a2a\"\n[agents.gone.a2a]\ncard_url = \"http://127.0.0.1:{port}\"\n"
        ),
    );
    let child = serve(&agents).await;
    let (_, end) = run(&child, "gone", "hello").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("cannot be reached"), "{status:?}");
}

#[test]
fn a_bad_remote_entry_stops_start_up_with_file_line_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &str); 6] = [
        (
            "[agents.r]\nkind = \"remote_a2a\"\n",
            "agents.toml:1:",
            "needs an [agents.r.a2a] table",
        ),
        (
            "[agents.r]\nkind = \"remote_a2a\"\n[agents.r.a2a]\ncard_url = \"ftp://x\"\n",
            "agents.toml:4:",
            "a2a.card_url: the URL must be http:// or https://",
        ),
        (
            "[agents.r]\nkind = \"remote_a2a\"\n[agents.r.a2a]\ncard_url = \"http://x\"\ntoken = \"tok-0123456789abcdef\"\n",
            "agents.toml:5:",
            "a token is never written in the agents file",
        ),
        (
            "[agents.r]\nkind = \"remote_a2a\"\n[agents.r.a2a]\ncard_url = \"http://x\"\ntoken_env = \"AGENTD_TEST_SURELY_UNSET_TOKEN\"\n",
            "agents.toml:5:",
            "AGENTD_TEST_SURELY_UNSET_TOKEN is not set",
        ),
        (
            "[agents.r]\nkind = \"remote_a2a\"\n[agents.r.a2a]\njsonrpc_url = \"http://x/\"\nidle_timeout = \"never\"\n",
            "agents.toml:5:",
            "use e.g. 500ms",
        ),
        (
            "[agents.r]\nkind = \"remot_a2a\"\n",
            "agents.toml:2:",
            "unknown kind \"remot_a2a\"",
        ),
    ];
    for (text, position, reason) in cases {
        let path = write_agents(&dir, text);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "off",
                "--a2a-listen",
                "off",
                "--store",
                "memory:",
                "--agents",
                &path,
            ])
            .env_remove("AGENTD_TEST_SURELY_UNSET_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(position), "{text}\n{err}");
        assert!(err.contains(reason), "{text}\n{err}");
        assert!(!err.contains("tok-0123456789abcdef"), "{err}");
    }
}

/// A CA made for one test, and a server certificate it signed for
/// 127.0.0.1: (CA PEM, certificate PEM, key PEM).
fn private_ca() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    server
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let key = KeyPair::generate().unwrap();
    let cert = server.signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

#[tokio::test]
async fn an_https_remote_behind_a_private_ca_is_trusted_through_ca_file_and_refused_without_it() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = private_ca();
    let [ca_file, cert_file, key_file] =
        ["ca.pem", "server.pem", "server.key"].map(|f| dir.path().join(f));
    std::fs::write(&ca_file, ca).unwrap();
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let agent = PyAgent::start_with(&py, false, Some((&cert_file, &key_file))).await;
    assert!(agent.base_url.starts_with("https://"), "{}", agent.base_url);
    let agents = write_agents(
        &dir,
        &format!(
            r#"
[agents.trusted]
kind = "remote_a2a"
[agents.trusted.a2a]
card_url = "{url}"
ca_file = "{ca}"

[agents.trusted_rpc]
kind = "remote_a2a"
[agents.trusted_rpc.a2a]
jsonrpc_url = "{url}/"
ca_file = "{ca}"

[agents.untrusted]
kind = "remote_a2a"
[agents.untrusted.a2a]
card_url = "{url}"
"#,
            url = agent.base_url,
            ca = ca_file.display()
        ),
    );
    let child = serve(&agents).await;

    for name in ["trusted", "trusted_rpc"] {
        let (events, end) = run(&child, name, "chunks=3 delay=0").await;
        end.unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert_eq!(events.last().unwrap().text, "c0 c1 c2 ", "{name}");
    }

    // The system's roots do not include the test CA: the handshake fails,
    // the run is UNAVAILABLE, and nothing of the certificate error leaks.
    let (events, end) = run(&child, "untrusted", "chunks=3 delay=0").await;
    assert!(events.is_empty(), "{events:?}");
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("cannot be reached"), "{status:?}");
}

/// A2A peer that answers every message from a script picked by the
/// message's text (the last one sent also picks what GetTask and
/// SubscribeToTask answer); it keeps the ids of the tasks it was asked to
/// cancel:
/// - `replace`: the answer as whole-text-so-far chunks, each replacing the
///   last (`append` false): "Hel", "Hello", "Hello world".
/// - `replay`: "Hel", then "lo" appended, then the stream ends before the
///   task does; GetTask shows "Hello" so far, and SubscribeToTask replays the
///   turn from its first chunk ("Hel", "lo") before the rest (" world"), as
///   a replica following the task's turn from the store does.
/// - `said-stale`: a WORKING status saying "Looking up the order", then
///   COMPLETED with no message and no artifact.
/// - `said-late`: the same WORKING status, then the stream ends; GetTask
///   shows the task COMPLETED, its status saying "Order 1187 shipped".
/// - `rewrite-big`: "Hel", then a chunk that replaces it with 3 MiB of
///   text (a rewrite, which is not streamed), then COMPLETED.
/// - `big-late`: "Hel", then the stream ends; GetTask shows the task
///   COMPLETED with 3 MiB of text.
/// - `no-subscribe`: "Hel", then the stream ends; SubscribeToTask is not
///   offered (METHOD_NOT_FOUND); GetTask shows "Hel" WORKING twice, then
///   "Hello world" COMPLETED.
/// - `get-refused`: "Hel", then the stream ends; GetTask and
///   SubscribeToTask are refused (METHOD_NOT_FOUND).
/// - `auth`: the task comes to wait for an authorization (AUTH_REQUIRED).
#[derive(Default)]
struct ScriptedPeer {
    script: std::sync::Mutex<String>,
    gets: std::sync::atomic::AtomicUsize,
    cancelled: std::sync::Mutex<Vec<String>>,
}

impl ScriptedPeer {
    fn script(&self) -> String {
        self.script.lock().unwrap().clone()
    }

    fn cancelled(&self) -> Vec<String> {
        self.cancelled.lock().unwrap().clone()
    }
}

/// 3 MiB of answer: past the answer limit (2 MiB), within what the client
/// buffers.
fn big_answer() -> String {
    "x".repeat(3 << 20)
}

mod scripted {
    use a2a::*;
    use futures::stream::BoxStream;

    pub const TASK: &str = "t-scripted";
    pub const CONTEXT: &str = "c-scripted";

    pub fn task(state: TaskState, artifact: Option<&str>) -> Task {
        Task {
            id: TASK.into(),
            context_id: CONTEXT.into(),
            status: TaskStatus {
                state,
                message: None,
                timestamp: Some(chrono::Utc::now()),
            },
            artifacts: artifact.map(|text| vec![answer(text)]),
            history: None,
            metadata: None,
        }
    }

    /// The task, its status saying `text`.
    pub fn task_saying(state: TaskState, text: &str) -> Task {
        let mut t = task(state, None);
        t.status.message = Some(agent_says(text));
        t
    }

    fn agent_says(text: &str) -> Message {
        Message {
            task_id: Some(TASK.into()),
            context_id: Some(CONTEXT.into()),
            ..Message::new(Role::Agent, vec![Part::text(text)])
        }
    }

    /// A status update saying `text`.
    pub fn status_saying(state: TaskState, text: &str) -> StreamResponse {
        let StreamResponse::StatusUpdate(mut u) = status(state) else {
            unreachable!()
        };
        u.status.message = Some(agent_says(text));
        StreamResponse::StatusUpdate(u)
    }

    fn answer(text: &str) -> Artifact {
        Artifact {
            artifact_id: "answer".into(),
            name: None,
            description: None,
            parts: vec![Part::text(text)],
            metadata: None,
            extensions: None,
        }
    }

    pub fn chunk(text: &str, append: bool, last: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: TASK.into(),
            context_id: CONTEXT.into(),
            artifact: answer(text),
            append: Some(append),
            last_chunk: Some(last),
            metadata: None,
        })
    }

    pub fn status(state: TaskState) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: TASK.into(),
            context_id: CONTEXT.into(),
            status: TaskStatus {
                state,
                message: None,
                timestamp: Some(chrono::Utc::now()),
            },
            metadata: None,
        })
    }

    pub fn stream(
        events: Vec<StreamResponse>,
    ) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        Box::pin(futures::stream::iter(events.into_iter().map(Ok)))
    }
}

#[async_trait::async_trait]
impl a2a_server::RequestHandler for ScriptedPeer {
    async fn send_message(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::SendMessageRequest,
    ) -> Result<a2a::SendMessageResponse, a2a::A2AError> {
        Err(a2a::A2AError::unsupported_operation("streaming only"))
    }
    async fn send_streaming_message(
        &self,
        _: &a2a_server::ServiceParams,
        req: a2a::SendMessageRequest,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<a2a::StreamResponse, a2a::A2AError>>,
        a2a::A2AError,
    > {
        use scripted::*;
        let script = agentd::client::a2a::parts_text(&req.message.parts);
        *self.script.lock().unwrap() = script.clone();
        let start = vec![
            a2a::StreamResponse::Task(task(TaskState::Submitted, None)),
            status(TaskState::Working),
        ];
        if script == "huge-cancel" {
            // A first chunk, then nothing, for ever: the run is dropped.
            let events = start.into_iter().chain([chunk("Hel", false, false)]);
            use futures::StreamExt as _;
            return Ok(Box::pin(
                futures::stream::iter(events.map(Ok)).chain(futures::stream::pending()),
            ));
        }
        // Those that end before the task does have the client recover.
        let rest = match script.as_str() {
            "replace" => vec![
                chunk("Hel", false, false),
                chunk("Hello", false, false),
                chunk("Hello world", false, true),
                status(TaskState::Completed),
            ],
            "replay" => vec![chunk("Hel", false, false), chunk("lo", true, false)],
            "said-stale" => vec![
                status_saying(TaskState::Working, "Looking up the order"),
                status(TaskState::Completed),
            ],
            "said-late" => vec![status_saying(TaskState::Working, "Looking up the order")],
            "rewrite-big" => vec![
                chunk("Hel", false, false),
                chunk(&big_answer(), false, true),
                status(TaskState::Completed),
            ],
            "big-late" | "no-subscribe" | "get-refused" => vec![chunk("Hel", false, false)],
            "auth" => vec![status_saying(TaskState::AuthRequired, "sign in first")],
            other => panic!("no script {other:?}"),
        };
        Ok(stream(start.into_iter().chain(rest).collect()))
    }
    async fn get_task(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::GetTaskRequest,
    ) -> Result<a2a::Task, a2a::A2AError> {
        use scripted::*;
        let n = self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match self.script().as_str() {
            "said-late" => Ok(task_saying(TaskState::Completed, "Order 1187 shipped")),
            "big-late" => Ok(task(TaskState::Completed, Some(&big_answer()))),
            "no-subscribe" if n < 2 => Ok(task(TaskState::Working, Some("Hel"))),
            "no-subscribe" => Ok(task(TaskState::Completed, Some("Hello world"))),
            "get-refused" => Err(a2a::A2AError::new(
                a2a::error_code::METHOD_NOT_FOUND,
                "GetTask is not offered",
            )),
            _ => Ok(task(TaskState::Working, Some("Hello"))),
        }
    }
    async fn list_tasks(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::ListTasksRequest,
    ) -> Result<a2a::ListTasksResponse, a2a::A2AError> {
        Err(a2a::A2AError::unsupported_operation("not scripted"))
    }
    async fn cancel_task(
        &self,
        _: &a2a_server::ServiceParams,
        req: a2a::CancelTaskRequest,
    ) -> Result<a2a::Task, a2a::A2AError> {
        self.cancelled.lock().unwrap().push(req.id);
        if self.script() == "huge-cancel" {
            // 24 MiB of artifact: within the client's default bounds (129
            // MiB), past a remote_a2a run's (17 MiB).
            return Ok(scripted::task(
                TaskState::Canceled,
                Some(&"x".repeat(24 << 20)),
            ));
        }
        Ok(scripted::task(TaskState::Canceled, None))
    }
    async fn subscribe_to_task(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::SubscribeToTaskRequest,
    ) -> Result<
        futures::stream::BoxStream<'static, Result<a2a::StreamResponse, a2a::A2AError>>,
        a2a::A2AError,
    > {
        use scripted::*;
        if let "no-subscribe" | "get-refused" = self.script().as_str() {
            return Err(a2a::A2AError::new(
                a2a::error_code::METHOD_NOT_FOUND,
                "SubscribeToTask is not offered",
            ));
        }
        Ok(stream(vec![
            a2a::StreamResponse::Task(task(TaskState::Working, Some("Hello"))),
            chunk("Hel", false, false),
            chunk("lo", true, false),
            chunk(" world", true, true),
            status(TaskState::Completed),
        ]))
    }
    async fn create_push_config(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::TaskPushNotificationConfig,
    ) -> Result<a2a::TaskPushNotificationConfig, a2a::A2AError> {
        Err(a2a::A2AError::push_notification_not_supported())
    }
    async fn get_push_config(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::GetTaskPushNotificationConfigRequest,
    ) -> Result<a2a::TaskPushNotificationConfig, a2a::A2AError> {
        Err(a2a::A2AError::push_notification_not_supported())
    }
    async fn list_push_configs(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::ListTaskPushNotificationConfigsRequest,
    ) -> Result<a2a::ListTaskPushNotificationConfigsResponse, a2a::A2AError> {
        Err(a2a::A2AError::push_notification_not_supported())
    }
    async fn delete_push_config(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), a2a::A2AError> {
        Err(a2a::A2AError::push_notification_not_supported())
    }
    async fn get_extended_agent_card(
        &self,
        _: &a2a_server::ServiceParams,
        _: a2a::GetExtendedAgentCardRequest,
    ) -> Result<a2a::AgentCard, a2a::A2AError> {
        Err(a2a::A2AError::unsupported_operation("not scripted"))
    }
}

/// Serves a [`ScriptedPeer`]'s JSON-RPC on 127.0.0.1: its URL, and the
/// peer.
async fn scripted_peer() -> (String, std::sync::Arc<ScriptedPeer>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    let peer = std::sync::Arc::new(ScriptedPeer::default());
    let router = a2a_server::jsonrpc::jsonrpc_router(peer.clone());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, peer)
}

/// agentd serving agent `peer`: a remote_a2a agent for the scripted peer
/// at `url`.
async fn serve_peer(url: &str) -> (Child, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            "[agents.peer]\nkind = \"remote_a2a\"\n[agents.peer.a2a]\njsonrpc_url = \"{url}\"\n"
        ),
    );
    (serve(&agents).await, dir)
}

/// The partial texts and the final answer of a run.
fn streamed(events: &[pb::AgentEvent]) -> (Vec<&str>, &str) {
    let partials = events
        .iter()
        .filter(|e| e.kind() == pb::EventKind::PartialText)
        .map(|e| e.text.as_str())
        .collect();
    let last = events.last().expect("no events");
    assert_eq!(last.kind(), pb::EventKind::FinalAnswer, "{events:?}");
    (partials, last.text.as_str())
}

#[tokio::test]
async fn chunks_that_replace_the_answer_stream_only_their_new_text() {
    let (url, _peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    let (events, end) = run(&child, "peer", "replace").await;
    end.unwrap();
    let (partials, answer) = streamed(&events);
    assert_eq!(answer, "Hello world");
    assert_eq!(partials, ["Hel", "lo", " world"], "{events:?}");
}

#[tokio::test]
async fn a_turn_replayed_after_a_resubscription_streams_nothing_twice() {
    let (url, _peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    let (events, end) = run(&child, "peer", "replay").await;
    end.unwrap();
    let (partials, answer) = streamed(&events);
    assert_eq!(answer, "Hello world");
    assert_eq!(partials.concat(), "Hello world", "{events:?}");
}

/// The answer is the completed task's: its artifacts, else its final
/// status's own message. A progress note of an earlier status is not it,
/// and a completion seen only in a recovery's GetTask still has it.
#[tokio::test]
async fn the_answer_is_the_final_statuss_message_not_an_earlier_progress_note() {
    let (url, _peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    let (events, end) = run(&child, "peer", "said-stale").await;
    end.unwrap();
    let (_, answer) = streamed(&events);
    assert_eq!(answer, "", "{events:?}");

    let (events, end) = run(&child, "peer", "said-late").await;
    end.unwrap();
    let (_, answer) = streamed(&events);
    assert_eq!(answer, "Order 1187 shipped", "{events:?}");
}

/// Waits (bounded) until `peer` was asked to cancel `n` tasks (the run's
/// guard sends CancelTask after the run ends), then a moment more, to see
/// that no other comes.
async fn cancels(peer: &ScriptedPeer, n: usize) -> Vec<String> {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while peer.cancelled().len() < n && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    peer.cancelled()
}

/// The CancelTask sent when a run is dropped (its client went away) reads
/// its answer within the run's bounds, not the client's defaults: a remote
/// that answers it with a task of 24 MiB is cut off, and the failure is
/// logged.
#[tokio::test]
async fn the_cancel_of_a_dropped_run_reads_its_answer_within_the_runs_bounds() {
    let (url, peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    let (stream, first) = first_event(&child, "peer", "huge-cancel").await;
    assert_eq!(first.text, "Hel");
    drop(stream);
    assert_eq!(cancels(&peer, 1).await, ["t-scripted"]);
    let line = support::eventually("the cancel's outcome is logged", || async {
        child
            .log_lines()
            .into_iter()
            .find(|l| l.contains("run dropped; cancelled the remote task"))
    })
    .await;
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let outcome = v["outcome"].as_str().unwrap_or_default();
    assert!(outcome.starts_with("cancel failed"), "{line}");
}

/// The answer limit holds for text the run did not stream: a rewrite (not
/// forwarded) stops the call and cancels the task; an answer seen only in a
/// recovery's GetTask is refused before it is sent (the task has ended:
/// nothing to cancel).
#[tokio::test]
async fn an_answer_over_the_limit_that_was_not_streamed_is_refused_too() {
    let (url, peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    // The cancels sent so far, after each.
    for (script, cancelled) in [("rewrite-big", 1), ("big-late", 1)] {
        let (events, end) = run(&child, "peer", script).await;
        let status = end.unwrap_err();
        assert_eq!(
            status.code(),
            Code::FailedPrecondition,
            "{script}: {status:?}"
        );
        assert!(status.message().contains("2 MiB"), "{status:?}");
        assert!(!events.iter().any(|e| e.is_final), "{script}");
        let streamed: usize = events.iter().map(|e| e.text.len()).sum();
        assert!(streamed < 1024, "{script}: {streamed} bytes forwarded");
        assert_eq!(cancels(&peer, cancelled).await.len(), cancelled, "{script}");
    }
}

/// A remote that does not offer SubscribeToTask: after a drop, its task is
/// followed by GetTask to its end. One that refuses GetTask too, or waits
/// for an authorization this server cannot give, has its task cancelled
/// rather than left running with no one to follow it.
#[tokio::test]
async fn a_task_that_cannot_be_followed_is_polled_or_cancelled_never_orphaned() {
    let (url, peer) = scripted_peer().await;
    let (child, _dir) = serve_peer(&url).await;
    let (events, end) = run(&child, "peer", "no-subscribe").await;
    end.unwrap();
    let (partials, answer) = streamed(&events);
    assert_eq!(answer, "Hello world");
    assert_eq!(partials.concat(), "Hello world", "{events:?}");
    assert!(cancels(&peer, 0).await.is_empty());

    let (_, end) = run(&child, "peer", "get-refused").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert_eq!(cancels(&peer, 1).await, ["t-scripted"]);

    let (_, end) = run(&child, "peer", "auth").await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("authorization"), "{status:?}");
    assert_eq!(cancels(&peer, 2).await, ["t-scripted", "t-scripted"]);
}

/// A remote that takes the connection and never answers (its card, here)
/// holds a run no longer than call_timeout, nor every later run behind it:
/// each is UNAVAILABLE in about that time.
#[tokio::test]
async fn a_remote_that_never_answers_its_card_is_unavailable_within_call_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let agents = write_agents(
        &dir,
        &format!(
            "[agents.mute]\nkind = \"remote_a2a\"\ncall_timeout = \"1s\"\n[agents.mute.a2a]\ncard_url = \"http://{addr}\"\n"
        ),
    );
    let child = serve(&agents).await;
    let started = tokio::time::Instant::now();
    let (a, b) = tokio::join!(run(&child, "mute", "hello"), run(&child, "mute", "hello"));
    for (_, end) in [a, b] {
        let status = end.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("cannot be reached"), "{status:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}
