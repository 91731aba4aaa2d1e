//! Shared test harness: stores per backend (a fresh SQLite file or a fresh
//! PostgreSQL database per test), in-process servers on 127.0.0.1:0, child
//! `agentd serve` processes, a TCP proxy that can cut a database off, and
//! bounded waiting.
#![allow(dead_code)]

#[path = "../serve_cmd/mod.rs"]
mod serve_cmd;

use std::future::Future;
use std::net::SocketAddr;
use std::process::Stdio;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agentd::agent::demo::{OrderHelper, ToolStats};
use agentd::agent::{Agent, AgentRegistry, synthetic};
use agentd::client::AgentClient;
use agentd::pb;
use agentd::pb::agent_service_client::AgentServiceClient;
use agentd::server::ServerOptions;
use agentd::store::Store;
use agentd::turn::{TurnConfig, Turns};
use tokio::io::AsyncBufReadExt;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

pub const ALICE: &str = "alice";
pub const BOB: &str = "bob";

/// Which store a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Sqlite,
    Postgres,
}

/// See [`TestDb::hold_writes`].
pub enum HeldWrites {
    Sqlite(sqlx::SqliteConnection),
    Postgres(sqlx::PgConnection),
}

impl HeldWrites {
    pub async fn release(self) {
        match self {
            HeldWrites::Sqlite(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
            }
            HeldWrites::Postgres(mut c) => {
                sqlx::query("ROLLBACK").execute(&mut c).await.unwrap();
            }
        }
    }
}

/// A store for one test, with whatever must be cleaned up after it.
pub struct TestDb {
    pub backend: Backend,
    /// The `--store` URL of this database (for child processes).
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg: Option<PgDatabase>,
}

impl TestDb {
    /// A fresh database of `backend`; `None` (the test is skipped, loudly)
    /// when the backend is PostgreSQL and AGENTD_TEST_POSTGRES_URL is unset.
    pub async fn fresh(backend: Backend) -> Option<TestDb> {
        match backend {
            Backend::Memory => Some(TestDb {
                backend,
                url: "memory:".into(),
                _dir: None,
                pg: None,
            }),
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!("sqlite://{}", dir.path().join("agentd.db").display());
                Some(TestDb {
                    backend,
                    url,
                    _dir: Some(dir),
                    pg: None,
                })
            }
            Backend::Postgres => {
                let pg = PgDatabase::create().await?;
                Some(TestDb {
                    backend,
                    url: pg.url.clone(),
                    _dir: None,
                    pg: Some(pg),
                })
            }
        }
    }

    /// Opens (another) store on this database. For `memory:` every call is a
    /// new, empty store: open it once.
    pub async fn open(&self) -> Arc<dyn Store> {
        agentd::store::open(&self.url)
            .await
            .expect("open the store")
    }

    /// Holds the store's writes to its turn table, as another connection's
    /// open transaction does, until [`HeldWrites::release`]: claims wait
    /// (reads do not). SQLite: `BEGIN IMMEDIATE`; PostgreSQL: an exclusive
    /// lock on `turns`.
    pub async fn hold_writes(&self) -> HeldWrites {
        use sqlx::Connection;
        match self.backend {
            Backend::Sqlite => {
                let mut c = sqlx::SqliteConnection::connect(&self.url).await.unwrap();
                sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut c)
                    .await
                    .unwrap();
                HeldWrites::Sqlite(c)
            }
            Backend::Postgres => {
                let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
                sqlx::query("BEGIN").execute(&mut c).await.unwrap();
                sqlx::query("LOCK TABLE turns IN EXCLUSIVE MODE")
                    .execute(&mut c)
                    .await
                    .unwrap();
                HeldWrites::Postgres(c)
            }
            Backend::Memory => panic!("the memory store has no writes to hold"),
        }
    }

    /// The database's URL as seen through `port` on 127.0.0.1 (PostgreSQL).
    pub fn url_via(&self, port: u16) -> String {
        let pg = self.pg.as_ref().expect("a PostgreSQL database");
        format!("postgres://{}@127.0.0.1:{port}/{}", pg.user, pg.name)
    }

    /// Ends every server connection to this PostgreSQL database (as a
    /// server restart or an idle timeout would); how many it ended.
    pub async fn terminate_pg_connections(&self) -> usize {
        use sqlx::Connection;
        let pg = self.pg.as_ref().expect("a PostgreSQL database");
        let mut admin = sqlx::PgConnection::connect(&pg.admin)
            .await
            .expect("connect to AGENTD_TEST_POSTGRES_URL");
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&pg.name)
        .fetch_all(&mut admin)
        .await
        .expect("end the database's connections");
        let _ = admin.close().await;
        ended.into_iter().filter(|&e| e).count()
    }

    pub fn pg_addr(&self) -> SocketAddr {
        self.pg.as_ref().expect("a PostgreSQL database").addr
    }
}

/// A database created for one test and dropped after it.
struct PgDatabase {
    admin: String,
    name: String,
    user: String,
    addr: SocketAddr,
    url: String,
}

impl PgDatabase {
    async fn create() -> Option<PgDatabase> {
        let Ok(admin) = std::env::var("AGENTD_TEST_POSTGRES_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must set AGENTD_TEST_POSTGRES_URL (.ci/run does)"
            );
            eprintln!(
                "SKIPPED: AGENTD_TEST_POSTGRES_URL is not set (scripts/test and .ci/run set it)"
            );
            return None;
        };
        use sqlx::Connection;
        let opts =
            sqlx::postgres::PgConnectOptions::from_str(&admin).expect("AGENTD_TEST_POSTGRES_URL");
        let name = format!("agentd_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect_with(&opts)
            .await
            .expect("connect to AGENTD_TEST_POSTGRES_URL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .expect("create a test database");
        let _ = conn.close().await;
        let user = opts.get_username().to_owned();
        let host = if opts.get_host().starts_with('/') {
            "127.0.0.1"
        } else {
            opts.get_host()
        };
        let addr = tokio::net::lookup_host((host, opts.get_port()))
            .await
            .expect("resolve the PostgreSQL host")
            .next()
            .expect("an address for the PostgreSQL host");
        let base = admin.split('?').next().unwrap_or(&admin);
        let url = format!(
            "{}/{name}",
            &base[..base.rfind('/').expect("a database path in the URL")]
        );
        Some(PgDatabase {
            admin,
            name,
            user,
            addr,
            url,
        })
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs outside async; a thread with its own runtime does it.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                use sqlx::Connection;
                if let Ok(mut c) = sqlx::PgConnection::connect(&admin).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut c)
                        .await;
                }
            })
        })
        .join();
    }
}

/// How one in-process server is set up.
#[derive(Clone)]
pub struct Opts {
    pub tool_delay: Duration,
    pub replica_id: String,
    pub lease: Duration,
    pub retain_turns: Option<Duration>,
    pub retain_sessions: Option<Duration>,
    pub store_check: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            tool_delay: Duration::ZERO,
            replica_id: "replica-a".into(),
            lease: Duration::from_secs(10),
            retain_turns: None,
            retain_sessions: None,
            store_check: Duration::from_millis(100),
        }
    }
}

/// `nul_answer`: answers with text holding U+0000, as a model may.
pub struct NulAnswer;

pub const NUL_ANSWER: &str = "before\0after";

impl Agent for NulAnswer {
    fn name(&self) -> &str {
        "nul_answer"
    }
    fn description(&self) -> &str {
        "Answers with a NUL character in its text."
    }
    fn run(&self, _ctx: agentd::agent::RunContext, _input: String) -> agentd::agent::EventStream {
        Box::pin(futures::stream::once(async {
            Ok(agentd::agent::Event::final_answer(
                "nul_answer",
                NUL_ANSWER.into(),
            ))
        }))
    }
}

/// `notes`: answers with what it finds in its history, one turn a line
/// (`request_id agent payload`, a payload over 64 bytes as `<N bytes>`),
/// and gives its final answer the payload
/// `{"note": TEXT}` (TEXT its message), as an agent keeping state for its
/// next turn does; a message `big` gets a payload over what is kept
/// ([`agentd::agent::MAX_ANSWER_PAYLOAD_BYTES`]).
pub struct Notes;

impl Agent for Notes {
    fn name(&self) -> &str {
        "notes"
    }
    fn description(&self) -> &str {
        "Answers with the agents and payloads of its history."
    }
    fn run(&self, ctx: agentd::agent::RunContext, input: String) -> agentd::agent::EventStream {
        let seen: Vec<String> = ctx
            .history
            .iter()
            .map(|t| {
                let payload = match t.answer_payload.len() {
                    n if n > 64 => format!("<{n} bytes>"),
                    _ => t.answer_payload.clone(),
                };
                format!("{} {} {payload}", t.request_id, t.agent)
            })
            .collect();
        let note = if input == "big" {
            "x".repeat(agentd::agent::MAX_ANSWER_PAYLOAD_BYTES)
        } else {
            input
        };
        let answer = agentd::agent::Event {
            payload_json: serde_json::json!({ "note": note }).to_string(),
            ..agentd::agent::Event::final_answer("notes", seen.join("\n"))
        };
        Box::pin(futures::stream::once(async { Ok(answer) }))
    }
}

/// `panics`: one partial event, then a panic, as a bug in an agent would.
pub struct Panics;

impl Agent for Panics {
    fn name(&self) -> &str {
        "panics"
    }
    fn description(&self) -> &str {
        "Sends one event, then panics."
    }
    fn run(&self, _ctx: agentd::agent::RunContext, _input: String) -> agentd::agent::EventStream {
        use futures::StreamExt as _;
        Box::pin(futures::stream::iter([0, 1]).map(|i| {
            if i == 1 {
                panic!("a bug in an agent");
            }
            Ok(agentd::agent::Event::partial("panics", "half".into()))
        }))
    }
}

/// An agentd server in this process on 127.0.0.1:0.
pub struct Server {
    pub addr: SocketAddr,
    pub client: AgentClient,
    /// The demo tool's counters: how often it really ran.
    pub stats: Arc<ToolStats>,
    pub turns: Arc<Turns>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Server {
    pub async fn start(store: Arc<dyn Store>, opts: Opts) -> Server {
        let helper = OrderHelper::new(opts.tool_delay);
        let stats = helper.stats();
        let agents: Vec<Arc<dyn Agent>> = vec![
            Arc::new(helper),
            Arc::new(synthetic::Echo),
            Arc::new(synthetic::Streamer),
            Arc::new(NulAnswer),
            Arc::new(Panics),
            Arc::new(Notes),
        ];
        let registry = AgentRegistry::new(agents, agentd::agent::demo::NAME).unwrap();
        let mut server = Server::with_agents(store, registry, opts).await;
        server.stats = stats;
        server
    }

    /// A server of `registry`'s agents, otherwise as [`Server::start`]
    /// sets one up: `opts.tool_delay` is not used, and `stats` counts
    /// nothing.
    pub async fn with_agents(store: Arc<dyn Store>, registry: AgentRegistry, opts: Opts) -> Server {
        let cfg = TurnConfig {
            replica_id: opts.replica_id,
            lease: opts.lease,
            retain_turns: opts.retain_turns,
            retain_sessions: opts.retain_sessions,
            store_check: opts.store_check,
            follow_poll: Duration::from_millis(20),
            max_run_duration: Duration::from_secs(60),
            ..TurnConfig::default()
        };
        let turns = Turns::new(store, registry, cfg);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server_opts = ServerOptions {
            drain_delay: Duration::ZERO,
            shutdown_grace: Duration::from_secs(70),
            ..ServerOptions::default()
        };
        let join = tokio::spawn(agentd::server::run(
            listener,
            turns.clone(),
            server_opts,
            async {
                let _ = stopped.await;
            },
        ));
        let client = AgentClient::connect(&format!("http://{addr}"))
            .await
            .unwrap();
        Server {
            addr,
            client,
            stats: Arc::default(),
            turns,
            stop: Some(stop),
            join: Some(join),
        }
    }

    pub fn raw(&self) -> AgentServiceClient<Channel> {
        self.client.raw()
    }

    /// Graceful shutdown, awaited.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            j.await.unwrap().unwrap();
        }
    }

    pub async fn session(&self, user: &str) -> String {
        session_on(&self.client, user).await
    }

    /// A Run collected to its end.
    pub async fn run(
        &self,
        user: &str,
        session: &str,
        request_id: &str,
        text: &str,
    ) -> (Vec<pb::AgentEvent>, Result<(), Status>) {
        run_on(&self.client, user, session, request_id, text).await
    }

    pub async fn get_session(&self, user: &str, session: &str) -> Result<pb::SessionInfo, Status> {
        let req = pb::GetSessionRequest {
            user_id: user.into(),
            session_id: session.into(),
            ..Default::default()
        };
        self.raw().get_session(req).await.map(|r| r.into_inner())
    }

    /// Attach collected to its end.
    pub async fn attach(
        &self,
        user: &str,
        session: &str,
        request_id: &str,
        after_seq: Option<u64>,
    ) -> Result<(Vec<pb::AgentEvent>, Result<(), Status>), Status> {
        let req = pb::AttachRequest {
            user_id: user.into(),
            session_id: session.into(),
            request_id: request_id.into(),
            after_seq,
        };
        let mut r = Request::new(req);
        r.set_timeout(Duration::from_secs(30));
        let mut stream = self.raw().attach(r).await?.into_inner();
        Ok(collect(&mut stream).await)
    }

    /// Waits (bounded) until the turn has ended; returns its row.
    pub async fn ended_turn(&self, user: &str, session: &str, request_id: &str) -> pb::TurnInfo {
        eventually("the turn to end", || async {
            let s = self.get_session(user, session).await.ok()?;
            s.turns
                .into_iter()
                .find(|t| t.request_id == request_id && t.state() != pb::TurnState::Running)
        })
        .await
    }

    pub async fn health(&self) -> Option<tonic_health::pb::health_check_response::ServingStatus> {
        self.client.clone().health("").await.ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(j) = self.join.take() {
            j.abort();
        }
    }
}

pub fn run_request(user: &str, session: &str, request_id: &str, text: &str) -> pb::RunRequest {
    pb::RunRequest {
        user_id: user.into(),
        session_id: session.into(),
        text: text.into(),
        request_id: request_id.into(),
        ..Default::default()
    }
}

/// A new session of `user`'s, through `client`: its id.
pub async fn session_on(client: &AgentClient, user: &str) -> String {
    client
        .clone()
        .create_session(user)
        .await
        .unwrap()
        .session_id
}

pub async fn run_on(
    client: &AgentClient,
    user: &str,
    session: &str,
    request_id: &str,
    text: &str,
) -> (Vec<pb::AgentEvent>, Result<(), Status>) {
    client
        .clone()
        .run_to_end(
            run_request(user, session, request_id, text),
            Duration::from_secs(30),
        )
        .await
        .unwrap()
}

/// Every event of a stream, then its status: a tonic `Streaming` or the
/// client's `RunEvents`.
pub async fn collect<S>(stream: &mut S) -> (Vec<pb::AgentEvent>, Result<(), Status>)
where
    S: futures::Stream<Item = Result<pb::AgentEvent, Status>> + Unpin,
{
    use futures::StreamExt as _;
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(e) => events.push(e),
            Err(s) => return (events, Err(s)),
        }
    }
    (events, Ok(()))
}

pub fn seqs(events: &[pb::AgentEvent]) -> Vec<u64> {
    events.iter().map(|e| e.seq).collect()
}

pub fn code<T>(r: &Result<T, Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Long enough for a lease of no time to have run out by every store's
/// clock (SQLite's counts milliseconds), which alone judges leases.
pub async fn lapse() {
    tokio::time::sleep(Duration::from_millis(5)).await;
}

/// Polls `probe` every 20ms until it yields `Some`, for at most 15 s.
pub async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    for _ in 0..750 {
        if let Some(v) = probe().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A TCP proxy in front of a database that the test can cut off and
/// restore: down, it closes every proxied connection and refuses new ones;
/// hung, it closes them and takes new ones that never get an answer (a
/// database or network that stopped answering); frozen, it is hung and
/// the open connections stay open but nothing more passes either way (a
/// network cut without a reset).
pub struct Proxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    hung: Arc<AtomicBool>,
    frozen: tokio::sync::watch::Sender<bool>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let hung = Arc::new(AtomicBool::new(false));
        let (frozen, frozen_rx) = tokio::sync::watch::channel(false);
        let conns: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (up2, hung2, conns2) = (up.clone(), hung.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if hung2.load(Ordering::SeqCst) {
                    let task = tokio::spawn(async move {
                        let _held = inbound;
                        std::future::pending::<()>().await
                    });
                    conns2.lock().unwrap().push(task.abort_handle());
                    continue;
                }
                if !up2.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let mut freeze = frozen_rx.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        // Biased: bytes that arrive with the freeze (one
                        // wake-up for both) are held, not passed first.
                        tokio::select! {
                            biased;
                            _ = async { freeze.wait_for(|f| *f).await.map(|_| ()) } => {
                                // Both ends held open, nothing passed.
                                std::future::pending::<()>().await;
                            }
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        }
                    }
                });
                conns2.lock().unwrap().push(task.abort_handle());
            }
        });
        Proxy {
            port,
            up,
            hung,
            frozen,
            conns,
            accept,
        }
    }

    pub fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut();
    }

    pub fn hang(&self) {
        self.hung.store(true, Ordering::SeqCst);
        self.cut();
    }

    pub fn freeze(&self) {
        self.hung.store(true, Ordering::SeqCst);
        self.frozen.send_replace(true);
    }

    pub fn up(&self) {
        self.hung.store(false, Ordering::SeqCst);
        self.up.store(true, Ordering::SeqCst);
    }

    fn cut(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.down();
        self.accept.abort();
    }
}

/// A real `agentd serve` child process; killed (SIGKILL) when dropped.
pub struct Child {
    pub child: tokio::process::Child,
    pub addr: SocketAddr,
    /// The admin HTTP port (`/metrics`), unless the test turned it off.
    pub admin: Option<SocketAddr>,
    pub client: AgentClient,
    /// Its log lines (JSON) since it printed its address.
    logs: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Child {
    /// Starts `agentd serve` on 127.0.0.1:0 with `args` and waits for its
    /// "agentd starting" log line to learn the port (and for the admin
    /// port's line before it, to learn that one).
    pub async fn serve(args: &[&str]) -> Child {
        // A free port for the A2A face too, unless the test picks one: the
        // default (8080) would make parallel tests race for it.
        let a2a: &[&str] = if args.contains(&"--a2a-listen") {
            &[]
        } else {
            &["--a2a-listen", "127.0.0.1:0"]
        };
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
            // Not the default SQLite file: parallel tests would share it.
            .env("AGENTD_STORE", "memory:")
            .args([
                "--log-format",
                "json",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--drain-delay",
                "0s",
            ])
            .args(a2a)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn agentd serve");
        let stderr = child.stderr.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let mut admin = None;
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if let Some(a) = v.get("admin").and_then(|a| a.as_str()) {
                    admin = a.parse::<SocketAddr>().ok();
                }
                if let Some(a) = v.get("listen").and_then(|l| l.as_str()) {
                    return a.parse::<SocketAddr>().ok();
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .expect("agentd serve printed its address");
        // Keep draining stderr so the child never blocks on a full pipe.
        let logs = Arc::new(std::sync::Mutex::new(Vec::new()));
        tokio::spawn({
            let logs = logs.clone();
            async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    logs.lock().unwrap().push(line);
                }
            }
        });
        let client = AgentClient::connect(&format!("http://{addr}"))
            .await
            .unwrap();
        Child {
            child,
            addr,
            admin,
            client,
            logs,
        }
    }

    /// Its log lines (JSON) so far, from the one that gave its address on.
    pub fn log_lines(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// SIGKILL, and wait until the process is gone.
    pub async fn kill9(mut self) {
        self.child.kill().await.expect("kill -9");
    }

    /// Sends SIGTERM, as the kubelet does (a second one cuts a drain short).
    pub async fn sigterm(&self) {
        let pid = self.child.id().expect("still running").to_string();
        let sent = tokio::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .expect("run kill");
        assert!(sent.success(), "kill -TERM {pid}");
    }

    /// SIGTERM, as the kubelet sends, and the exit status once the process
    /// has shut down by itself (within 60 s).
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        self.sigterm().await;
        tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("agentd stops within 60 s of SIGTERM")
            .expect("wait for agentd")
    }
}

/// `agentd serve` with `args`, for a test to set up further and spawn: the
/// memory store, JSON logs, and the gRPC port alone, on 127.0.0.1:0 (the
/// admin and A2A ports off).
pub fn serve_grpc_alone(args: &[&str]) -> std::process::Command {
    serve_cmd::agentd_serve("off", "off", args)
}

/// A health check over a new connection to `addr`, connecting and checking
/// each within `timeout`.
pub async fn check_on_new_connection(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .map(drop)
        .map_err(|s| format!("check: {s}"))
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
