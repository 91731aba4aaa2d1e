//! A real agentd on 127.0.0.1 with TLS (certificates made here with rcgen),
//! optional mTLS and tokens, and its admin HTTP port; and the binary,
//! `agentd serve`, started with such files.
#![allow(dead_code)]

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::process::{ChildStderr, Stdio};
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::demo::{OrderHelper, ToolStats};
use agentd::agent::synthetic::{Echo, Streamer};
use agentd::agent::{Agent, AgentRegistry};
use agentd::auth::Authenticator;
use agentd::auth::tls::TlsFiles;
use agentd::client::{AgentClient, ClientSecurity};
use agentd::server::{Security, ServerOptions};
use agentd::store::memory::MemoryStore;
use agentd::turn::{TurnConfig, Turns};
use http_body_util::BodyExt;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[path = "../prom/mod.rs"]
mod prom;
// Also loaded by `support`, in test binaries that use both: a copy each
// of one function.
#[allow(clippy::duplicate_mod)]
#[path = "../serve_cmd/mod.rs"]
mod serve_cmd;
pub use prom::Metrics;

/// A certificate authority made for one test.
pub struct Ca {
    pub pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
#[derive(Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    fn sign(&self, params: CertificateParams) -> Pem {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// The server's certificate: valid for `localhost` and 127.0.0.1.
    pub fn server(&self) -> Pem {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        params
            .distinguished_name
            .push(DnType::CommonName, "agentd test server");
        self.sign(params)
    }

    /// A client certificate whose DNS name is `name`.
    pub fn client(&self, name: &str) -> Pem {
        let mut params = CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        self.sign(params)
    }
}

/// What the server trusts and requires.
#[derive(Default)]
pub struct Secure {
    /// The CA of client certificates: mTLS.
    pub client_ca: Option<String>,
    /// The `--auth-tokens` file's content.
    pub tokens_json: Option<String>,
    /// `--auth-open-services`; `None` keeps the default.
    pub open_services: Option<Vec<String>>,
    pub tool_delay: Duration,
    pub turn: TurnConfig,
    /// Default 10 s.
    pub shutdown_grace: Option<Duration>,
}

pub struct SecureServer {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub ca: Ca,
    pub tool: Arc<ToolStats>,
    pub store: Arc<MemoryStore>,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<()>>>,
    admin_stop: Option<oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl SecureServer {
    /// A TLS server on 127.0.0.1:0 with the admin port on 127.0.0.1:0.
    pub async fn start(ca: Ca, secure: Secure) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let server_pem = ca.server();
        let tls = TlsFiles::from_pem(
            server_pem.cert.into_bytes(),
            server_pem.key.into_bytes(),
            secure.client_ca.map(String::into_bytes),
        );
        let mtls = tls.mtls();
        let tokens_path = secure.tokens_json.map(|json| {
            let p = dir.path().join("tokens.json");
            std::fs::write(&p, json).unwrap();
            p
        });
        let open = secure.open_services.unwrap_or_else(|| {
            agentd::auth::DEFAULT_OPEN_SERVICES
                .iter()
                .map(|s| s.to_string())
                .collect()
        });
        let auth = (tokens_path.is_some() || mtls)
            .then(|| Arc::new(Authenticator::new(tokens_path.as_deref(), mtls, &open).unwrap()));

        let helper = OrderHelper::new(secure.tool_delay);
        let tool = helper.stats();
        let agents: Vec<Arc<dyn Agent>> =
            vec![Arc::new(helper), Arc::new(Echo), Arc::new(Streamer)];
        let registry = AgentRegistry::new(agents, "order_helper").unwrap();
        let store = Arc::new(MemoryStore::new());
        let turns = Turns::new(
            store.clone(),
            registry,
            TurnConfig {
                replica_id: "test".into(),
                ..secure.turn
            },
        );
        let opts = ServerOptions {
            drain_delay: Duration::ZERO,
            shutdown_grace: secure.shutdown_grace.unwrap_or(Duration::from_secs(10)),
            security: Security {
                tls: Some(tls),
                auth,
            },
            ..ServerOptions::default()
        };

        let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let (admin_stop, admin_rx) = oneshot::channel::<()>();
        tokio::spawn(agentd::telemetry::admin::serve(
            admin_listener,
            opts.readiness.clone(),
            async {
                let _ = admin_rx.await;
            },
        ));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(agentd::server::run(listener, turns, opts, async {
            let _ = rx.await;
        }));
        Self {
            addr,
            admin,
            ca,
            tool,
            store,
            shutdown: Some(tx),
            handle: Some(handle),
            admin_stop: Some(admin_stop),
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// A client over TLS trusting the test CA, with optional client
    /// certificate and token.
    pub async fn client(
        &self,
        identity: Option<&Pem>,
        token: Option<&str>,
    ) -> anyhow::Result<AgentClient> {
        let tls = ClientSecurity::tls_from_pem(
            self.ca.pem.as_bytes(),
            identity.map(|p| (p.cert.as_bytes(), p.key.as_bytes())),
        );
        AgentClient::connect_with(
            &self.url(),
            &ClientSecurity {
                tls: Some(tls),
                token: token.map(str::to_owned),
            },
        )
        .await
    }

    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    pub async fn stop(mut self) {
        self.begin_shutdown();
        let h = self.handle.take().unwrap();
        tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("server did not stop")
            .unwrap()
            .unwrap();
        if let Some(tx) = self.admin_stop.take() {
            let _ = tx.send(());
        }
    }

    /// GET `path` on the admin port: status and body.
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path).await
    }

    pub async fn metrics(&self) -> Metrics {
        let (status, body) = self.admin_get("/metrics").await;
        assert_eq!(status, 200, "{body}");
        Metrics(body)
    }

    /// Scrapes until `cond` holds (bounded), returning that scrape.
    pub async fn metrics_until(&self, what: &str, cond: impl Fn(&Metrics) -> bool) -> Metrics {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let m = self.metrics().await;
            if cond(&m) {
                return m;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; metrics:\n{}",
                m.0
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `req` on a new HTTP/1.1 connection to `addr`, through hyper: the
/// response.
pub async fn http_send(
    addr: SocketAddr,
    req: hyper::Request<http_body_util::Full<bytes::Bytes>>,
) -> hyper::Response<hyper::body::Incoming> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender.send_request(req).await.unwrap()
}

/// `agentd serve` (the binary) with `args`, for a test to set up further
/// and spawn: the memory store, JSON logs, the gRPC and A2A ports on
/// 127.0.0.1:0, the admin port on `admin` (an address, or `off`), no drain
/// delay; stdout dropped, stderr piped for [`started`].
pub fn serve_binary(admin: &str, args: &[&str]) -> std::process::Command {
    let mut cmd = serve_cmd::agentd_serve(admin, "127.0.0.1:0", &["--drain-delay", "0s"]);
    cmd.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    cmd
}

/// The "agentd starting" log line of `child` (spawned from
/// [`serve_binary`]), its stderr read up to it; and the lines after it,
/// which the test must go on reading (or the child blocks on a full pipe).
pub fn started(
    child: &mut std::process::Child,
) -> (serde_json::Value, std::io::Lines<BufReader<ChildStderr>>) {
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    loop {
        let line = lines
            .next()
            .expect("agentd exited before listening")
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["message"] == "agentd starting" {
            return (v, lines);
        }
    }
}

/// Stops `child` (from [`serve_binary`]) as a test's server is dropped:
/// SIGTERM, at most 20 s for it to exit, then SIGKILL, and it is reaped.
pub fn stop_binary(child: &mut std::process::Child) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A plain HTTP/1.1 GET through hyper.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let req = hyper::Request::get(path)
        .header("host", addr.to_string())
        .body(http_body_util::Full::default())
        .unwrap();
    let resp = http_send(addr, req).await;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// Labels of one gRPC method of the agents service.
pub fn rpc<'a>(method: &'a str, code: &'a str) -> [(&'a str, &'a str); 3] {
    [
        ("grpc_service", "agents.v1.AgentService"),
        ("grpc_method", method),
        ("grpc_code", code),
    ]
}

impl SecureServer {
    /// The stored turn `(session, request_id)`, if any.
    pub async fn turn_exists(
        &self,
        session: &str,
        request_id: &str,
    ) -> Option<agentd::store::TurnRecord> {
        use agentd::domain::{RequestId, SessionId, TurnKey};
        use agentd::store::Store;
        let key = TurnKey {
            session_id: SessionId::parse(session).unwrap(),
            request_id: RequestId::parse(request_id).unwrap(),
        };
        self.store.get_turn(&key).await.unwrap()
    }
}
