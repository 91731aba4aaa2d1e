//! The TLS and token files reloaded while serving: a real `agentd serve`
//! whose files live in a directory laid out as the kubelet lays out a
//! mounted Secret (updated by an atomic swap of its `..data` link), reloaded
//! on SIGHUP or every `--reload-interval`.

mod common;
mod secured;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentd::client::{AgentClient, ClientSecurity};
use common::{DEADLINE, run_request};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use secured::{Ca, Pem, Secure, SecureServer};
use tonic::Code;

/// The longest any wait here lasts.
const WAIT: Duration = Duration::from_secs(15);

/// A directory as the kubelet mounts a Secret: each key a symlink to
/// `..data/KEY`, `..data` a symlink to a directory of this version's files,
/// replaced at once (a new directory, a new link renamed over `..data`).
struct SecretDir {
    dir: tempfile::TempDir,
    files: BTreeMap<String, String>,
    version: usize,
}

impl SecretDir {
    fn new(files: &[(&str, &str)]) -> Self {
        let mut s = Self {
            dir: tempfile::tempdir().unwrap(),
            files: BTreeMap::new(),
            version: 0,
        };
        s.update(files);
        s
    }

    fn path(&self, key: &str) -> String {
        self.dir.path().join(key).to_str().unwrap().to_owned()
    }

    /// Sets `files` (the others stay as they are), all at once.
    fn update(&mut self, files: &[(&str, &str)]) {
        for (k, v) in files {
            self.files.insert((*k).to_owned(), (*v).to_owned());
        }
        self.version += 1;
        let root = self.dir.path();
        let version = format!("..v{}", self.version);
        std::fs::create_dir(root.join(&version)).unwrap();
        for (k, v) in &self.files {
            std::fs::write(root.join(&version).join(k), v).unwrap();
        }
        let tmp = root.join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        let old = std::fs::read_link(root.join("..data")).ok();
        std::fs::rename(&tmp, root.join("..data")).unwrap();
        if let Some(old) = old {
            std::fs::remove_dir_all(root.join(old)).unwrap();
        }
        for k in self.files.keys() {
            let link = root.join(k);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(Path::new("..data").join(k), &link).unwrap();
            }
        }
    }
}

/// `agentd serve` on 127.0.0.1:0 (gRPC and A2A HTTP), its JSON logs kept.
struct Agentd {
    child: Child,
    addr: SocketAddr,
    a2a: SocketAddr,
    logs: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl Agentd {
    fn start(args: &[&str]) -> Self {
        let mut child = secured::serve_binary("off", args)
            .env("AGENTD_LOG", "info")
            .spawn()
            .unwrap();
        let (starting, lines) = secured::started(&mut child);
        let addr = starting["listen"].as_str().unwrap().parse().unwrap();
        let a2a = starting["a2a_listen"].as_str().unwrap().parse().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let kept = logs.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let v = serde_json::from_str(&line).unwrap_or(serde_json::Value::String(line));
                kept.lock().unwrap_or_else(|e| e.into_inner()).push(v);
            }
        });
        Self {
            child,
            addr,
            a2a,
            logs,
        }
    }

    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    fn hup(&self) {
        let ok = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -HUP failed");
    }

    /// How many lines were logged so far.
    fn mark(&self) -> usize {
        self.logs.lock().unwrap().len()
    }

    /// The lines logged since `mark` that `pred` accepts.
    fn since(
        &self,
        mark: usize,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Vec<serde_json::Value> {
        self.logs.lock().unwrap()[mark..]
            .iter()
            .filter(|v| pred(v))
            .cloned()
            .collect()
    }

    /// Waits (bounded) for a line after `mark` that `pred` accepts.
    async fn wait_log(
        &self,
        mark: usize,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let until = Instant::now() + WAIT;
        loop {
            if let Some(v) = self.since(mark, &pred).into_iter().next() {
                return v;
            }
            if Instant::now() >= until {
                // Copied first: a panic holding the lock would poison it
                // for the thread that reads the logs.
                let logged = self.logs.lock().unwrap()[mark..].to_vec();
                panic!("no log line {what}; logged: {logged:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every line logged, as text.
    fn all_logs(&self) -> String {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Agentd {
    /// SIGTERM, and a bounded wait for the exit, which lets the test's own
    /// connections close meanwhile (a wait in `drop` would block them, and
    /// the server would wait for them).
    async fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let until = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Agentd {
    fn drop(&mut self) {
        secured::stop_binary(&mut self.child);
    }
}

fn message(v: &serde_json::Value) -> &str {
    v["message"].as_str().unwrap_or_default()
}

fn is_warning(v: &serde_json::Value) -> bool {
    v["level"] == "WARN"
}

fn tls_reloaded(v: &serde_json::Value) -> bool {
    message(v).starts_with("reloaded the TLS files")
}

fn tokens_reloaded(v: &serde_json::Value) -> bool {
    message(v).starts_with("reloaded --auth-tokens")
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// The leaf certificate a TLS handshake with `addr` is served now (a new
/// connection, ALPN h2, trusting `cas`); the error of a failed handshake.
async fn served_leaf(addr: SocketAddr, cas: &[&Ca]) -> Result<CertificateDer<'static>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        roots.add(der(&ca.pem)).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio::time::timeout(WAIT, connector.connect(name, tcp))
        .await
        .expect("the handshake ends")
        .map_err(|e| e.to_string())?;
    let (_, session) = tls.get_ref();
    assert_eq!(session.alpn_protocol(), Some(&b"h2"[..]));
    Ok(session.peer_certificates().unwrap()[0].clone())
}

async fn tls_client(
    server: &Agentd,
    ca: &Ca,
    identity: Option<&Pem>,
) -> anyhow::Result<AgentClient> {
    AgentClient::connect_with(
        &server.url(),
        &ClientSecurity {
            tls: Some(ClientSecurity::tls_from_pem(
                ca.pem.as_bytes(),
                identity.map(|p| (p.cert.as_bytes(), p.key.as_bytes())),
            )),
            token: None,
        },
    )
    .await
}

/// A session and a whole run, on `c`'s connection.
async fn serves(c: &mut AgentClient, user: &str) -> Result<(), tonic::Status> {
    let session = c.create_session(user).await?.session_id;
    let (events, end) = c
        .run_to_end(
            run_request(user, &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await?;
    end?;
    assert!(events.last().is_some_and(|e| e.is_final), "{events:?}");
    Ok(())
}

fn tls_args(paths: &[String; 2]) -> Vec<&str> {
    vec!["--tls-cert", &paths[0], "--tls-key", &paths[1]]
}

/// cert-manager renews the certificate (here, from another CA): after a
/// SIGHUP new connections get the new certificate, while a connection
/// opened before keeps its session and completes calls. The log names
/// what changed, with the certificate's subject and expiry, and no key.
#[tokio::test]
async fn a_renewed_certificate_serves_new_connections_and_open_ones_keep_theirs() {
    let (ca_a, ca_b) = (Ca::new("ca a"), Ca::new("ca b"));
    let (a, b) = (ca_a.server(), ca_b.server());
    let mut secret = SecretDir::new(&[("tls.crt", &a.cert), ("tls.key", &a.key)]);
    let paths = [secret.path("tls.crt"), secret.path("tls.key")];
    let mut args = tls_args(&paths);
    // Only SIGHUP reloads.
    args.extend(["--reload-interval", "0s"]);
    let server = Agentd::start(&args);

    let mut before = tls_client(&server, &ca_a, None).await.unwrap();
    serves(&mut before, "alice").await.unwrap();
    assert_eq!(
        served_leaf(server.addr, &[&ca_a]).await.unwrap(),
        der(&a.cert)
    );

    secret.update(&[("tls.crt", &b.cert), ("tls.key", &b.key)]);
    // Nothing is read again until told.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        served_leaf(server.addr, &[&ca_a]).await.unwrap(),
        der(&a.cert)
    );

    let mark = server.mark();
    server.hup();
    let line = server
        .wait_log(mark, "reloading the TLS files", tls_reloaded)
        .await;
    let changed = line["changed"].as_str().unwrap();
    assert!(
        changed.contains(&format!("--tls-cert {}", paths[0]))
            && changed.contains(&format!("--tls-key {}", paths[1])),
        "{line}"
    );
    assert!(
        line["subject"]
            .as_str()
            .unwrap()
            .contains("agentd test server"),
        "{line}"
    );
    assert!(!line["not_after"].as_str().unwrap().is_empty(), "{line}");

    assert_eq!(
        served_leaf(server.addr, &[&ca_a, &ca_b]).await.unwrap(),
        der(&b.cert),
        "a new connection gets the new certificate"
    );
    let mut after = tls_client(&server, &ca_b, None).await.unwrap();
    serves(&mut after, "bob").await.unwrap();
    assert!(
        served_leaf(server.addr, &[&ca_a]).await.is_err(),
        "the old certificate is still served"
    );
    // The connection opened before: it trusts only the old CA, so it could
    // not connect again; its calls complete on the session it has.
    serves(&mut before, "carol").await.unwrap();

    let logs = server.all_logs();
    let key_b64 = b.key.lines().nth(1).unwrap();
    assert!(
        !logs.contains("PRIVATE KEY") && !logs.contains(key_b64),
        "{logs}"
    );
    assert!(server.since(0, is_warning).is_empty(), "{logs}");
    drop((before, after));
    server.stop().await;
}

/// `files` put in `secret`, which do not pass: one warning that names
/// `file` and says `reason`, still the only one several reload intervals
/// later, and the certificate `leaf` of `ca` still served. The log's mark
/// from before the update.
async fn refused_with_one_warning(
    server: &Agentd,
    secret: &mut SecretDir,
    files: &[(&str, &str)],
    file: &str,
    reason: &str,
    ca: &Ca,
    leaf: &CertificateDer<'static>,
) -> usize {
    let mark = server.mark();
    secret.update(files);
    let warning = server
        .wait_log(mark, &format!("warning of {file}"), is_warning)
        .await;
    let text = message(&warning);
    assert!(text.contains(file) && text.contains(reason), "{warning}");
    assert_eq!(served_leaf(server.addr, &[ca]).await.unwrap(), *leaf);
    // Several intervals later: still one warning.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(
        server.since(mark, is_warning).len(),
        1,
        "{}",
        server.all_logs()
    );
    mark
}

/// Replacement files that do not pass keep the old certificate serving,
/// with one warning naming the file (not one per interval); the file
/// fixed later is picked up.
#[tokio::test]
async fn a_bad_replacement_keeps_the_old_certificate_with_one_warning_until_fixed() {
    let ca = Ca::new("ca");
    let (a, b) = (ca.server(), ca.server());
    let mut secret = SecretDir::new(&[("tls.crt", &a.cert), ("tls.key", &a.key)]);
    let paths = [secret.path("tls.crt"), secret.path("tls.key")];
    let mut args = tls_args(&paths);
    args.extend(["--reload-interval", "200ms"]);
    let server = Agentd::start(&args);
    let leaf_a = der(&a.cert);

    // Not PEM at all.
    let mark = refused_with_one_warning(
        &server,
        &mut secret,
        &[("tls.crt", "garbage, not a certificate\n")],
        &format!("--tls-cert {}", paths[0]),
        "no PEM certificate",
        &ca,
        &leaf_a,
    )
    .await;
    assert!(server.since(mark, tls_reloaded).is_empty());
    let mut c = tls_client(&server, &ca, None).await.unwrap();
    serves(&mut c, "alice").await.unwrap();

    // A certificate with a key that is not its own.
    refused_with_one_warning(
        &server,
        &mut secret,
        &[("tls.crt", &b.cert), ("tls.key", &a.key)],
        &format!("--tls-key {}", paths[1]),
        "does not match",
        &ca,
        &leaf_a,
    )
    .await;

    // Fixed: picked up.
    let mark = server.mark();
    secret.update(&[("tls.key", &b.key)]);
    server
        .wait_log(mark, "reloading the fixed files", tls_reloaded)
        .await;
    assert_eq!(
        served_leaf(server.addr, &[&ca]).await.unwrap(),
        der(&b.cert)
    );
    serves(&mut c, "bob").await.unwrap();
    let logs = server.all_logs();
    assert!(!logs.contains("PRIVATE KEY"), "{logs}");
    drop(c);
    server.stop().await;
}

/// With mutual TLS, a new client CA: a certificate it signed is refused
/// before the reload and accepted after; one signed by the CA it replaced
/// is refused from then on.
#[tokio::test]
async fn a_new_client_ca_is_trusted_after_a_reload() {
    let ca = Ca::new("server ca");
    let server_pem = ca.server();
    let (old_clients, new_clients) = (Ca::new("old client ca"), Ca::new("new client ca"));
    let (old_client, new_client) = (
        old_clients.client("web.internal"),
        new_clients.client("batch.internal"),
    );
    let mut secret = SecretDir::new(&[
        ("tls.crt", &server_pem.cert),
        ("tls.key", &server_pem.key),
        ("ca.crt", &old_clients.pem),
    ]);
    let paths = [secret.path("tls.crt"), secret.path("tls.key")];
    let client_ca = secret.path("ca.crt");
    let mut args = tls_args(&paths);
    args.extend(["--tls-client-ca", &client_ca, "--reload-interval", "200ms"]);
    let server = Agentd::start(&args);

    let mut old = tls_client(&server, &ca, Some(&old_client)).await.unwrap();
    serves(&mut old, "alice").await.unwrap();
    assert!(
        refused(&server, &ca, &new_client).await,
        "a certificate of the new CA was accepted before the reload"
    );

    let mark = server.mark();
    secret.update(&[("ca.crt", &new_clients.pem)]);
    let line = server
        .wait_log(mark, "reloading the client CA", tls_reloaded)
        .await;
    assert!(
        line["changed"]
            .as_str()
            .unwrap()
            .contains(&format!("--tls-client-ca {client_ca}"))
            && line["client_ca"]
                .as_str()
                .unwrap()
                .contains("new client ca"),
        "{line}"
    );

    let mut new = tls_client(&server, &ca, Some(&new_client)).await.unwrap();
    serves(&mut new, "bob").await.unwrap();
    assert!(
        refused(&server, &ca, &old_client).await,
        "a new connection with a certificate of the replaced CA was accepted"
    );
    // The connection verified before keeps its session.
    serves(&mut old, "carol").await.unwrap();
    drop((old, new));
    server.stop().await;
}

/// Whether a new connection presenting `identity` is refused (at connect,
/// or at its first call: rustls may report it either way).
async fn refused(server: &Agentd, ca: &Ca, identity: &Pem) -> bool {
    match tls_client(server, ca, Some(identity)).await {
        Err(_) => true,
        Ok(mut c) => c.create_session("alice").await.is_err(),
    }
}

fn tokens_json(tokens: &[(&str, &str)]) -> String {
    let entries: Vec<String> = tokens
        .iter()
        .map(|(token, caller)| {
            format!(r#"{{"token": "{token}", "caller": "{caller}", "user_ids": ["*"]}}"#)
        })
        .collect();
    format!(r#"{{"tokens": [{}]}}"#, entries.join(", "))
}

/// A JSON-RPC call on the A2A HTTP port with `token`: its HTTP status.
async fn a2a_status(addr: SocketAddr, token: &str) -> u16 {
    use http_body_util::BodyExt as _;
    let body =
        r#"{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "no-such-task"}}"#;
    let req = hyper::Request::post("/")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = secured::http_send(addr, req).await;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    status
}

/// The tokens file rotated: an added token works after the reload (gRPC
/// and A2A HTTP alike), a removed one is UNAUTHENTICATED, also on a
/// connection opened before; a bad file keeps the tokens loaded before,
/// with a warning that quotes no token.
#[tokio::test]
async fn rotated_tokens_take_effect_and_a_bad_file_keeps_the_old_ones() {
    const OLD: &str = "tok-old-0123456789abcdef";
    const NEW: &str = "tok-new-0123456789abcdef";
    let mut secret = SecretDir::new(&[("tokens.json", &tokens_json(&[(OLD, "old")]))]);
    let tokens = secret.path("tokens.json");
    let server = Agentd::start(&["--auth-tokens", &tokens, "--reload-interval", "0s"]);
    let url = format!("http://{}", server.addr);
    let client = |token: &str| {
        let url = url.clone();
        let token = token.to_owned();
        async move {
            AgentClient::connect_with(
                &url,
                &ClientSecurity {
                    tls: None,
                    token: Some(token),
                },
            )
            .await
            .unwrap()
        }
    };
    let mut old = client(OLD).await;
    old.create_session("alice").await.unwrap();
    let mut new = client(NEW).await;
    let err = new.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert_eq!(a2a_status(server.a2a, NEW).await, 401);
    assert_ne!(a2a_status(server.a2a, OLD).await, 401);

    // Added.
    let mark = server.mark();
    secret.update(&[("tokens.json", &tokens_json(&[(OLD, "old"), (NEW, "new")]))]);
    server.hup();
    let line = server
        .wait_log(mark, "reloading the tokens", tokens_reloaded)
        .await;
    assert_eq!(line["tokens"], 2, "{line}");
    assert_eq!(line["clients"], 0, "{line}");
    assert_eq!(line["file"], tokens.as_str(), "{line}");
    new.create_session("alice").await.unwrap();
    assert_ne!(a2a_status(server.a2a, NEW).await, 401);
    old.create_session("alice").await.unwrap();

    // Removed: refused, on the connection opened before too.
    let mark = server.mark();
    secret.update(&[("tokens.json", &tokens_json(&[(NEW, "new")]))]);
    server.hup();
    server
        .wait_log(mark, "reloading the tokens", tokens_reloaded)
        .await;
    let err = old.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert_eq!(a2a_status(server.a2a, OLD).await, 401);
    new.create_session("alice").await.unwrap();

    // A file start-up would refuse (a token too short): the table stays.
    let mark = server.mark();
    let short = "short-secret";
    secret.update(&[("tokens.json", &tokens_json(&[(short, "x"), (OLD, "old")]))]);
    server.hup();
    let warning = server
        .wait_log(mark, "warning of the bad tokens file", is_warning)
        .await;
    let text = message(&warning);
    assert!(
        text.contains(&format!("--auth-tokens {tokens}")) && text.contains("at least 16"),
        "{warning}"
    );
    new.create_session("alice").await.unwrap();
    let err = old.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    // Told again, nothing changed: no second warning, but the answer says
    // what is still refused.
    let mark = server.mark();
    server.hup();
    let line = server
        .wait_log(mark, "the unchanged report", |v| {
            message(v).contains("unchanged")
        })
        .await;
    assert!(
        line["still_refused"]
            .as_str()
            .is_some_and(|r| r.contains("--auth-tokens")),
        "{line}"
    );
    assert!(server.since(mark, is_warning).is_empty());

    let logs = server.all_logs();
    for token in [OLD, NEW, short] {
        assert!(!logs.contains(token), "a token was logged: {logs}");
    }
    drop((old, new));
    server.stop().await;
}

/// Handshakes are done side by side: clients that connect and never start
/// theirs hold up no other client's (each would otherwise wait for the
/// handshake timeout of those before it).
#[tokio::test]
async fn silent_clients_do_not_hold_up_other_handshakes() {
    let server = SecureServer::start(Ca::new("ca"), Secure::default()).await;
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(tokio::net::TcpStream::connect(server.addr).await.unwrap());
    }
    let started = Instant::now();
    let mut c = tokio::time::timeout(
        agentd::auth::tls::TLS_HANDSHAKE_TIMEOUT / 2,
        server.client(None, None),
    )
    .await
    .expect("connected while the silent clients hold their handshakes")
    .unwrap();
    c.create_session("alice").await.unwrap();
    assert!(started.elapsed() < agentd::auth::tls::TLS_HANDSHAKE_TIMEOUT / 2);
    drop(silent);
    server.stop().await;
}
