//! An agentd server with its A2A faces on 127.0.0.1:0, and the Python test
//! peers (the official A2A SDK, installed by scripts/test into
//! $AGENTD_TEST_VENV).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::demo::{OrderHelper, ToolStats};
use agentd::agent::synthetic::{Echo, Streamer};
use agentd::agent::{Agent, AgentRegistry};
use agentd::server::{A2aHttp, ServerOptions};
use agentd::store::memory::MemoryStore;
use agentd::turn::{TurnConfig, Turns};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct A2aServer {
    /// agents.v1 and A2A over gRPC.
    pub grpc: SocketAddr,
    /// A2A JSON-RPC and the agent card.
    pub http: SocketAddr,
    pub turns: Arc<Turns>,
    pub tool: Arc<ToolStats>,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<()>>>,
}

impl A2aServer {
    pub async fn start(tool_delay: Duration) -> Self {
        Self::start_with(tool_delay, None).await
    }

    /// `conformance`: serve the conformance agent with this resubscribe wait.
    pub async fn start_with(tool_delay: Duration, conformance: Option<Duration>) -> Self {
        Self::start_full(
            tool_delay,
            conformance,
            None,
            Arc::new(MemoryStore::new()),
            "test",
        )
        .await
    }

    /// On `store`, without authentication.
    pub async fn start_on(store: Arc<dyn agentd::store::Store>) -> Self {
        Self::start_full(Duration::ZERO, None, None, store, "test").await
    }

    /// With authentication on: bearer tokens from `tokens_json` (the
    /// `--auth-tokens` format) on every face.
    pub async fn start_secured(tokens_json: &str) -> Self {
        Self::start_secured_on(
            tokens_json,
            Arc::new(MemoryStore::new()),
            Duration::ZERO,
            "test",
        )
        .await
    }

    /// [`Self::start_secured`] on `store` as replica `replica_id`, the order
    /// helper's tool taking `tool_delay`.
    pub async fn start_secured_on(
        tokens_json: &str,
        store: Arc<dyn agentd::store::Store>,
        tool_delay: Duration,
        replica_id: &str,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.json");
        std::fs::write(&path, tokens_json).unwrap();
        let auth = agentd::auth::Authenticator::new(
            Some(&path),
            false,
            &agentd::auth::DEFAULT_OPEN_SERVICES
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        Self::start_full(tool_delay, None, Some(Arc::new(auth)), store, replica_id).await
    }

    async fn start_full(
        tool_delay: Duration,
        conformance: Option<Duration>,
        auth: Option<Arc<agentd::auth::Authenticator>>,
        store: Arc<dyn agentd::store::Store>,
        replica_id: &str,
    ) -> Self {
        let helper = OrderHelper::new(tool_delay);
        let tool = helper.stats();
        let agents: Vec<Arc<dyn Agent>> =
            vec![Arc::new(helper), Arc::new(Echo), Arc::new(Streamer)];
        let registry = AgentRegistry::new(agents, "order_helper").unwrap();
        let turns = Turns::new(
            store,
            registry,
            TurnConfig {
                replica_id: replica_id.into(),
                ..TurnConfig::default()
            },
        );
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc, http) = (
            grpc_listener.local_addr().unwrap(),
            http_listener.local_addr().unwrap(),
        );
        let a2a = A2aHttp {
            listener: http_listener,
            advertised: agentd::a2a::advertised(grpc, http, None, false, None),
        };
        let opts = ServerOptions {
            drain_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(10),
            a2a_conformance: conformance,
            security: agentd::server::Security { tls: None, auth },
            ..ServerOptions::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(agentd::server::run_with_a2a(
            grpc_listener,
            Some(a2a),
            turns.clone(),
            opts,
            async {
                let _ = rx.await;
            },
        ));
        Self {
            grpc,
            http,
            turns,
            tool,
            shutdown: Some(tx),
            handle: Some(handle),
        }
    }

    /// Our A2A client on this server's gRPC face.
    pub async fn grpc_client(&self) -> agentd::client::a2a::A2aClient {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        agentd::client::a2a::A2aClient::from_transport(Box::new(
            a2a_grpc::GrpcTransport::from_channel(channel),
        ))
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Waits (bounded) until no run is in flight.
    pub async fn idle(&self, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        while self.turns.in_flight() > 0 {
            if tokio::time::Instant::now() > until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let handle = self.handle.take().unwrap();
        tokio::time::timeout(Duration::from_secs(20), handle)
            .await
            .expect("server did not stop")
            .unwrap()
            .unwrap();
    }
}

/// The venv's python, or `None` (with a note) when the peers are not
/// installed. Under CI they must be: a missing venv fails there.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("AGENTD_TEST_VENV") {
        Some(v) => Some(PathBuf::from(v).join("bin/python")),
        None if std::env::var_os("CI").is_some() => {
            panic!("AGENTD_TEST_VENV is not set; run the tests with scripts/test")
        }
        None => {
            eprintln!(
                "skipped: AGENTD_TEST_VENV is not set (scripts/test installs the Python peers)"
            );
            None
        }
    }
}

pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}

/// Runs a Python script to its end (bounded) and parses its stdout as JSON.
pub async fn run_json(python: &PathBuf, args: &[&str]) -> serde_json::Value {
    let out = tokio::time::timeout(
        Duration::from_secs(150),
        tokio::process::Command::new(python)
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the Python peer did not finish")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("bad JSON from {args:?}: {e}\n{stdout}"))
}

/// The Python test agent (tests/a2a_test_agent.py), killed on drop.
pub struct PyAgent {
    pub base_url: String,
    _child: tokio::process::Child,
}

impl PyAgent {
    pub async fn start(python: &PathBuf, bare_snapshots: bool) -> Self {
        Self::start_with(python, bare_snapshots, None).await
    }

    /// Serves over https with the PEM files `(cert, key)` when given.
    pub async fn start_with(
        python: &PathBuf,
        bare_snapshots: bool,
        tls: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Self {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        if bare_snapshots {
            args.push("--bare-snapshots".into());
        }
        if let Some((cert, key)) = tls {
            args.extend(["--tls".into(), cert.into(), key.into()]);
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        Self::start_args(python, &args, scheme).await
    }

    /// Started with the script's own flags (see tests/a2a_test_agent.py).
    pub async fn start_flags(python: &PathBuf, flags: &[&str]) -> Self {
        let args: Vec<std::ffi::OsString> = flags.iter().map(Into::into).collect();
        Self::start_args(python, &args, "http").await
    }

    async fn start_args(python: &PathBuf, args: &[std::ffi::OsString], scheme: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut cmd = tokio::process::Command::new(python);
        cmd.arg(script("a2a_test_agent.py")).args(args);
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the Python agent did not start")
            .unwrap()
            .expect("the Python agent exited before listening");
        let port = line
            .strip_prefix("LISTENING ")
            .expect("unexpected first line")
            .trim()
            .to_owned();
        Self {
            base_url: format!("{scheme}://127.0.0.1:{port}"),
            _child: child,
        }
    }
}

/// A server reached over an in-memory duplex pipe, and our A2A client on its
/// gRPC face (tonic's mock-transport pattern).
pub async fn in_process(
    tool_delay: Duration,
) -> (
    agentd::client::a2a::A2aClient,
    Arc<ToolStats>,
    oneshot::Sender<()>,
    JoinHandle<anyhow::Result<()>>,
) {
    let helper = OrderHelper::new(tool_delay);
    let tool = helper.stats();
    let agents: Vec<Arc<dyn Agent>> = vec![Arc::new(helper), Arc::new(Echo), Arc::new(Streamer)];
    let registry = AgentRegistry::new(agents, "order_helper").unwrap();
    let turns = Turns::new(
        Arc::new(MemoryStore::new()),
        registry,
        TurnConfig {
            replica_id: "test".into(),
            ..TurnConfig::default()
        },
    );
    let (client_io, server_io) = tokio::io::duplex(1 << 20);
    let incoming = futures::StreamExt::chain(
        tokio_stream::once(Ok::<_, std::io::Error>(server_io)),
        futures::stream::pending(),
    );
    let opts = ServerOptions {
        drain_delay: Duration::ZERO,
        shutdown_grace: Duration::from_secs(10),
        ..ServerOptions::default()
    };
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(agentd::server::serve(incoming, turns, opts, async {
        let _ = rx.await;
    }));
    let mut client_io = Some(client_io);
    let channel = tonic::transport::Endpoint::try_from("http://in-process.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let io = client_io.take();
            async move {
                io.map(hyper_util::rt::TokioIo::new).ok_or_else(|| {
                    std::io::Error::other("the in-process connection was already used")
                })
            }
        }))
        .await
        .unwrap();
    let client = agentd::client::a2a::A2aClient::from_transport(Box::new(
        a2a_grpc::GrpcTransport::from_channel(channel),
    ));
    (client, tool, tx, handle)
}

/// A SendMessage of `parts` from the user to the `echo` agent.
pub fn echo_request(parts: Vec<a2a::Part>) -> a2a::SendMessageRequest {
    a2a::SendMessageRequest {
        message: a2a::Message::new(a2a::Role::User, parts),
        configuration: None,
        metadata: Some([("agent".to_owned(), serde_json::json!("echo"))].into()),
        tenant: None,
    }
}

/// A port on 127.0.0.1 that refuses connections, held (bound, not
/// listening) for as long as the socket lives, so that no other test's
/// server takes it meanwhile.
pub fn refusing_port() -> (tokio::net::TcpSocket, u16) {
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    (held, port)
}

/// ListTasks with no filter: every task of the caller, without artifacts.
/// The text of `task`'s artifacts, joined.
pub fn answer_of(task: &a2a::Task) -> String {
    task.artifacts
        .iter()
        .flatten()
        .map(|a| agentd::client::a2a::parts_text(&a.parts))
        .collect()
}

pub fn all_tasks() -> a2a::ListTasksRequest {
    a2a::ListTasksRequest {
        context_id: None,
        status: None,
        page_size: None,
        page_token: None,
        history_length: None,
        status_timestamp_after: None,
        include_artifacts: None,
        tenant: None,
    }
}

/// Reads a task's stream until the status update that carries the order
/// tool's call (the tool then runs, for as long as `--tool-delay` says);
/// at most 100 events.
pub async fn until_tool_call<S>(stream: &mut S)
where
    S: futures::Stream<Item = Result<a2a::StreamResponse, a2a::A2AError>> + Unpin,
{
    use futures::StreamExt as _;
    for _ in 0..100 {
        let ev = stream
            .next()
            .await
            .expect("ended before the tool call")
            .unwrap();
        if let a2a::StreamResponse::StatusUpdate(u) = ev
            && u.status.message.as_ref().is_some_and(|m| {
                m.parts
                    .iter()
                    .any(|p| matches!(&p.content, a2a::PartContent::Data(_)))
            })
        {
            return;
        }
    }
    panic!("no tool call in 100 events");
}

/// Our A2A client on the gRPC face of a server at `addr` (an `agentd serve`
/// child, say).
pub async fn a2a_at(addr: SocketAddr) -> agentd::client::a2a::A2aClient {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    agentd::client::a2a::A2aClient::from_transport(Box::new(a2a_grpc::GrpcTransport::from_channel(
        channel,
    )))
}

/// Task `id` once it has ended, read every `every` for at most 200 reads
/// (or as it stands then, for the caller to assert on).
pub async fn ended_task(
    client: &agentd::client::a2a::A2aClient,
    id: &str,
    every: Duration,
) -> a2a::Task {
    let mut task = client.get_task(id).await.unwrap();
    for _ in 0..200 {
        if task.status.state.is_terminal() {
            break;
        }
        tokio::time::sleep(every).await;
        task = client.get_task(id).await.unwrap();
    }
    task
}
