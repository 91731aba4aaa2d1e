//! A real agentd server for black-box tests, reached through the real client,
//! either in-process over `tokio::io::duplex` or on 127.0.0.1:0.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::demo::{OrderHelper, ToolStats};
use agentd::agent::synthetic::{Echo, Streamer};
use agentd::agent::{Agent, AgentRegistry};
use agentd::client::AgentClient;
use agentd::domain::{RequestId, SessionId, TurnKey};
use agentd::pb;
use agentd::server::ServerOptions;
use agentd::store::memory::MemoryStore;
use agentd::store::{Store, TurnRecord};
use agentd::turn::{TurnConfig, Turns};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Endpoint, Uri};

pub struct Options {
    pub turn: TurnConfig,
    pub server: ServerOptions,
    pub tool_delay: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            turn: TurnConfig {
                replica_id: "test".into(),
                ..TurnConfig::default()
            },
            server: ServerOptions {
                drain_delay: Duration::ZERO,
                shutdown_grace: Duration::from_secs(10),
                ..ServerOptions::default()
            },
            tool_delay: Duration::ZERO,
        }
    }
}

impl Options {
    pub fn tool_delay(mut self, d: Duration) -> Self {
        self.tool_delay = d;
        self
    }
}

pub struct TestServer {
    /// Set for servers on TCP.
    pub addr: Option<SocketAddr>,
    pub client: AgentClient,
    /// What the demo agent's `lookup_order` tool did.
    pub tool: Arc<ToolStats>,
    pub store: Arc<MemoryStore>,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<()>>>,
}

fn turns(opts: &Options) -> (Arc<Turns>, Arc<ToolStats>, Arc<MemoryStore>) {
    let helper = OrderHelper::new(opts.tool_delay);
    let stats = helper.stats();
    let agents: Vec<Arc<dyn Agent>> = vec![Arc::new(helper), Arc::new(Echo), Arc::new(Streamer)];
    let registry = AgentRegistry::new(agents, "order_helper").unwrap();
    let store = Arc::new(MemoryStore::new());
    (
        Turns::new(store.clone(), registry, opts.turn.clone()),
        stats,
        store,
    )
}

impl TestServer {
    /// A server on 127.0.0.1:0 and a client connected to it.
    pub async fn tcp(opts: Options) -> Self {
        let (turns, tool, store) = turns(&opts);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(agentd::server::run(listener, turns, opts.server, async {
            let _ = rx.await;
        }));
        let client = AgentClient::connect(&format!("http://{addr}"))
            .await
            .unwrap();
        Self {
            addr: Some(addr),
            client,
            tool,
            store,
            shutdown: Some(tx),
            handle: Some(handle),
        }
    }

    /// A server reached over an in-memory duplex pipe (tonic's mock transport).
    pub async fn in_process(opts: Options) -> Self {
        let (turns, tool, store) = turns(&opts);
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        // One connection, then an incoming stream that never ends (an ended
        // stream would start tonic's shutdown).
        let incoming = futures::StreamExt::chain(
            tokio_stream::once(Ok::<_, std::io::Error>(server_io)),
            futures::stream::pending(),
        );
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(agentd::server::serve(incoming, turns, opts.server, async {
            let _ = rx.await;
        }));
        let mut client_io = Some(client_io);
        let channel = Endpoint::try_from("http://in-process.invalid")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let io = client_io.take();
                async move {
                    io.map(hyper_util::rt::TokioIo::new).ok_or_else(|| {
                        std::io::Error::other("the in-process connection was already used")
                    })
                }
            }))
            .await
            .unwrap();
        let client = AgentClient::from_channel(channel);
        Self {
            addr: None,
            client,
            tool,
            store,
            shutdown: Some(tx),
            handle: Some(handle),
        }
    }

    /// Starts the shutdown sequence (as SIGTERM would).
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for the server to finish shutting down, at most `within`.
    pub async fn join(&mut self, within: Duration) -> anyhow::Result<()> {
        let handle = self.handle.take().expect("joined twice");
        tokio::time::timeout(within, handle)
            .await
            .map_err(|_| anyhow::anyhow!("server did not stop within {within:?}"))??
    }

    /// A new gRPC channel to a server started with [`TestServer::tcp`].
    pub async fn channel(&self) -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr.unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn stop(mut self) {
        self.begin_shutdown();
        self.join(Duration::from_secs(20)).await.unwrap();
    }

    pub async fn session(&mut self, user: &str) -> String {
        self.client.create_session(user).await.unwrap().session_id
    }

    pub async fn turn(&self, session: &str, request_id: &str) -> Option<TurnRecord> {
        let key = TurnKey {
            session_id: SessionId::parse(session).unwrap(),
            request_id: RequestId::parse(request_id).unwrap(),
        };
        self.store.get_turn(&key).await.unwrap()
    }

    /// Waits (bounded) until the turn is recorded as ended.
    pub async fn ended_turn(&self, session: &str, request_id: &str) -> TurnRecord {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(t) = self
                .turn(session, request_id)
                .await
                .filter(|t| t.state.is_terminal())
            {
                return t;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "turn {session}/{request_id} did not end"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
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

pub fn with_agent(mut req: pb::RunRequest, agent: &str) -> pb::RunRequest {
    req.agent = agent.into();
    req
}

/// Waits (bounded) until `cond` holds.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub const DEADLINE: Duration = Duration::from_secs(30);

/// A server on 127.0.0.1:0 that accepts connections and never speaks; it
/// stops when dropped.
pub struct Silent {
    pub addr: SocketAddr,
    accept: JoinHandle<()>,
}

impl Silent {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                held.push(c);
            }
        });
        Self { addr, accept }
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// In front of `upstream`, a server whose first connection answers the
/// client's first request with an HTTP/2 GOAWAY naming no stream as
/// processed (last stream id 0, NO_ERROR), as a replica that begins to
/// shut down as the request arrives does; later connections are carried
/// through to `upstream`. `refused` counts the requests so refused.
pub struct Refusing {
    pub addr: SocketAddr,
    pub refused: Arc<std::sync::atomic::AtomicUsize>,
    accept: JoinHandle<()>,
}

impl Refusing {
    pub async fn start(upstream: SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let refused: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let count = refused.clone();
        let accept = tokio::spawn(async move {
            let mut first = true;
            while let Ok((mut down, _)) = listener.accept().await {
                if !std::mem::take(&mut first) {
                    tokio::spawn(carry(down, upstream, false));
                    continue;
                }
                // The client's preface, then frames until its first HEADERS.
                let mut preface = [0u8; 24];
                if down.read_exact(&mut preface).await.is_err() {
                    continue;
                }
                loop {
                    let mut head = [0u8; 9];
                    if down.read_exact(&mut head).await.is_err() {
                        break;
                    }
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let mut payload = vec![0u8; len];
                    if down.read_exact(&mut payload).await.is_err() {
                        break;
                    }
                    if head[3] == 0x1 {
                        // SETTINGS (none), SETTINGS ACK, GOAWAY(0, NO_ERROR).
                        let mut out = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0];
                        out.extend_from_slice(&[0, 0, 0, 0x4, 0x1, 0, 0, 0, 0]);
                        out.extend_from_slice(&[0, 0, 8, 0x7, 0, 0, 0, 0, 0]);
                        out.extend_from_slice(&[0; 8]);
                        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = down.write_all(&out).await;
                        let _ = down.flush().await;
                        // Held open a moment: the client reads the GOAWAY
                        // before the connection closes.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        break;
                    }
                }
            }
        });
        Self {
            addr,
            refused,
            accept,
        }
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Carries connection `down` to `upstream` both ways, or, `muted`, only
/// what the client sends (every byte the server answers is dropped).
async fn carry(mut down: tokio::net::TcpStream, upstream: SocketAddr, muted: bool) {
    let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    if !muted {
        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
        return;
    }
    let (mut down_rx, _down_tx) = down.split();
    let (mut up_rx, mut up_tx) = up.split();
    let mut drop_all = tokio::io::sink();
    let _ = tokio::join!(
        tokio::io::copy(&mut down_rx, &mut up_tx),
        tokio::io::copy(&mut up_rx, &mut drop_all),
    );
}

/// A TCP proxy on 127.0.0.1:0 in front of `upstream`; `cut()` drops every
/// connection through it at once, as a network failure would.
pub struct Proxy {
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub accepted: Arc<std::sync::atomic::AtomicUsize>,
    /// Whether the connections it accepts from now on drop the answers.
    muted: Arc<std::sync::atomic::AtomicBool>,
    tasks: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        Self::start_with(upstream, false).await
    }

    /// A proxy that carries what the client sends and drops every byte the
    /// server answers: a request reaches the server and its answer is lost.
    pub async fn muted(upstream: SocketAddr) -> Self {
        Self::start_with(upstream, true).await
    }

    async fn start_with(upstream: SocketAddr, muted: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tasks: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accepted: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let muted = Arc::new(std::sync::atomic::AtomicBool::new(muted));
        let (t, n, m) = (tasks.clone(), accepted.clone(), muted.clone());
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let muted = m.load(std::sync::atomic::Ordering::SeqCst);
                let h = tokio::spawn(carry(down, upstream, muted));
                t.lock().unwrap().push(h);
            }
        });
        Self {
            addr,
            accepted,
            muted,
            tasks,
            accept,
        }
    }

    /// Connections accepted from now on carry the answers too.
    pub fn unmute(&self) {
        self.muted.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn cut(&self) {
        for h in self.tasks.lock().unwrap().drain(..) {
            h.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
