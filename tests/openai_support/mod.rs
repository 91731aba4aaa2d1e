//! Shared by the model-backend tests: an agentd on 127.0.0.1:0 serving the
//! agents of an agents file, through the real client; Python peers from the
//! test venv.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::file::{self, LoadOptions};
use agentd::agent::{Agent, AgentRegistry, demo};
use agentd::client::AgentClient;
use agentd::pb;
use agentd::server::ServerOptions;
use agentd::store::Store;
use agentd::store::memory::MemoryStore;
use agentd::turn::{TurnConfig, Turns};
use tokio::sync::oneshot;

/// A running agentd; shuts down (and is awaited) on [`Agentd::stop`].
pub struct Agentd {
    pub client: AgentClient,
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Agentd {
    /// Serves order_helper plus the agents of `agents_toml`.
    pub async fn start(agents_toml: &str) -> Self {
        Self::start_with(
            agents_toml,
            Arc::new(MemoryStore::new()),
            TurnConfig::default(),
        )
        .await
    }

    /// [`Agentd::start`] on `store`, with `cfg`.
    pub async fn start_with(agents_toml: &str, store: Arc<dyn Store>, cfg: TurnConfig) -> Self {
        let f = file::parse(
            agents_toml,
            Path::new("agents.toml"),
            &LoadOptions::default(),
        )
        .expect("agents file");
        let mut agents: Vec<Arc<dyn Agent>> =
            vec![Arc::new(demo::OrderHelper::new(Duration::ZERO))];
        agents.extend(f.agents);
        let default = f.default.unwrap_or_else(|| demo::NAME.to_owned());
        let registry = AgentRegistry::new(agents, &default).unwrap();
        let turns = Turns::new(store, registry, cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stop_rx) = oneshot::channel::<()>();
        let opts = ServerOptions {
            drain_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(5),
            ..Default::default()
        };
        let task = tokio::spawn(agentd::server::run(listener, turns, opts, async {
            let _ = stop_rx.await;
        }));
        let client = AgentClient::connect(&format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            client,
            addr,
            stop: Some(stop),
            task,
        }
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("server stops")
            .unwrap()
            .unwrap();
    }

    pub async fn session(&mut self, user: &str) -> String {
        self.client.create_session(user).await.unwrap().session_id
    }

    /// One Run to its end: its events and final status.
    pub async fn run(
        &mut self,
        user: &str,
        session: &str,
        agent: &str,
        text: &str,
        deadline: Duration,
    ) -> (Vec<pb::AgentEvent>, Result<(), tonic::Status>) {
        let req = pb::RunRequest {
            user_id: user.into(),
            session_id: session.into(),
            text: text.into(),
            request_id: String::new(),
            agent: agent.into(),
            ..Default::default()
        };
        match self.client.run_to_end(req, deadline).await {
            Ok(r) => r,
            Err(s) => (Vec::new(), Err(s)),
        }
    }
}

/// Alice's Run with `request_id`, which agentd refuses (INVALID_ARGUMENT),
/// sent to a new session of an agentd served and stopped for it; the
/// session's id, to find the refusal's log line by.
pub async fn refused_run(request_id: String) -> String {
    let mut d = Agentd::start("").await;
    let session = d.session("alice").await;
    let req = pb::RunRequest {
        user_id: "alice".into(),
        session_id: session.clone(),
        text: "hello".into(),
        request_id,
        ..Default::default()
    };
    let status = d.client.raw().run(req).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    d.stop().await;
    session
}

/// The venv holding the Python test peers. `None` (with a loud message)
/// only outside CI; in CI a missing peer fails the test.
pub fn venv_bin(program: &str) -> Option<PathBuf> {
    let venv = std::env::var_os("AGENTD_TEST_VENV").map(PathBuf::from);
    let bin = venv.as_ref().map(|v| v.join("bin").join(program));
    match bin {
        Some(b) if b.exists() => Some(b),
        _ => {
            let msg = format!(
                "{program} not found (AGENTD_TEST_VENV={venv:?}); run scripts/test, which installs tests/requirements*.txt"
            );
            if std::env::var_os("CI").is_some() {
                panic!("{msg}");
            }
            eprintln!("\n!!!!!!!! SKIPPED: {msg} !!!!!!!!\n");
            None
        }
    }
}

/// A port that was free a moment ago, for peers that cannot take port 0.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed when dropped.
pub struct Peer {
    pub child: tokio::process::Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Peer {
    pub fn spawn(program: &Path, args: &[&str], port: u16, log: PathBuf) -> Self {
        let out = std::fs::File::create(&log).unwrap();
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        Self { child, port, log }
    }

    /// Starts `program` with `args(port)` on a port free a moment before
    /// and waits (bounded) until `GET ready` answers 200. A peer that exits
    /// because it could not bind (another process took the port meanwhile)
    /// is started again on another port; any other exit is the caller's to
    /// judge: its status and log.
    pub async fn start_on_free_port(
        program: &Path,
        args: impl Fn(u16) -> Vec<String>,
        log: PathBuf,
        ready: &str,
        limit: Duration,
    ) -> Result<Self, (std::process::ExitStatus, String)> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let port = free_port();
            let args = args(port);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut peer = Self::spawn(program, &args, port, log.clone());
            match peer.try_ready(ready, limit).await {
                Ok(()) => return Ok(peer),
                Err(status) => {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    if attempt < 3 && text.to_lowercase().contains("bind") {
                        eprintln!("peer could not bind port {port}; starting it on another");
                        continue;
                    }
                    return Err((status, text));
                }
            }
        }
    }

    /// Waits (bounded) until `GET path` answers 200.
    pub async fn wait_ready(&mut self, path: &str, limit: Duration) {
        if let Err(status) = self.try_ready(path, limit).await {
            panic!(
                "peer exited with {status}; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// As [`Peer::wait_ready`], but a peer that exits is the caller's to
    /// judge: its exit status.
    pub async fn try_ready(
        &mut self,
        path: &str,
        limit: Duration,
    ) -> Result<(), std::process::ExitStatus> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let http = agentd::agent::openai::http_client().unwrap();
        let until = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < until {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Err(status);
            }
            if let Ok(r) = http.get(&url).timeout(Duration::from_secs(1)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "peer not ready within {limit:?}; log:\n{}",
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
    }
}

pub fn kinds(events: &[pb::AgentEvent]) -> Vec<pb::EventKind> {
    events.iter().map(|e| e.kind()).collect()
}

/// Concatenated PARTIAL_TEXT of a run.
pub fn partial_text(events: &[pb::AgentEvent]) -> String {
    events
        .iter()
        .filter(|e| e.kind() == pb::EventKind::PartialText)
        .map(|e| e.text.as_str())
        .collect()
}
