//! Settings and clients that would weaken authentication: refused at
//! start-up, warned about, or kept from sending a token where it does not
//! belong. Everything on 127.0.0.1, every wait bounded.

mod secured;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use secured::Ca;

const BIN: &str = env!("CARGO_BIN_EXE_agentd");
const TOKEN: &str = "tok-hardening-0123456789";
const WAIT: Duration = Duration::from_secs(20);

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_owned()
}

fn tokens_file(dir: &Path) -> String {
    write(
        dir,
        "tokens.json",
        &format!(r#"{{"tokens": [{{"token": "{TOKEN}", "caller": "web", "user_ids": ["web"]}}]}}"#),
    )
}

/// `agentd --log-format json serve` on loopback ports, the store in memory,
/// and the extra `args`.
fn serve(args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(BIN)
        .env("AGENTD_STORE", "memory:")
        .envs(env.iter().copied())
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "off", "--drain-delay", "0s"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The child's log lines (JSON) as they come, read on a thread.
fn log_lines(child: &mut Child) -> mpsc::Receiver<serde_json::Value> {
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let v = serde_json::from_str(&line)
                .unwrap_or_else(|_| serde_json::json!({ "message": line }));
            if tx.send(v).is_err() {
                return;
            }
        }
    });
    rx
}

/// Lines up to and including the one whose message is `message`.
fn lines_until(rx: &mpsc::Receiver<serde_json::Value>, message: &str) -> Vec<serde_json::Value> {
    let until = Instant::now() + WAIT;
    let mut seen = Vec::new();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(v) => {
                let done = v["message"] == message;
                seen.push(v);
                if done {
                    return seen;
                }
            }
            Err(_) => panic!("no line {message:?} within {WAIT:?}; seen: {seen:#?}"),
        }
    }
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// An open agents.v1 (or A2A) service would let any client act for any
/// user: start-up refuses it, naming the flag and the service.
#[test]
fn serve_refuses_to_open_a_service_other_than_health_and_reflection() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path());
    for open in [
        "grpc.health.v1.Health,agents.v1.AgentService",
        "lf.a2a.v1.A2AService",
    ] {
        let mut child = serve(
            &[
                "--a2a-listen",
                "off",
                "--auth-tokens",
                &tokens,
                "--auth-open-services",
                open,
            ],
            &[],
        );
        let rx = log_lines(&mut child);
        let until = Instant::now() + WAIT;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > until {
                stop(child);
                panic!("--auth-open-services {open}: the server started");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(!status.success(), "{open}");
        // Every line it wrote: the reader thread ends at the pipe's end.
        let mut said: Vec<serde_json::Value> = Vec::new();
        let until = Instant::now() + WAIT;
        while let Ok(v) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            said.push(v);
        }
        let error = said
            .iter()
            .find(|v| v["level"] == "ERROR")
            .unwrap_or_else(|| panic!("no error line: {said:#?}"));
        let message = error["message"].as_str().unwrap_or_default();
        let service = open.rsplit(',').next().unwrap();
        assert!(
            message.contains("--auth-open-services") && message.contains(service),
            "{message}"
        );
        assert!(
            !said.iter().any(|v| v["message"] == "agentd starting"),
            "{said:#?}"
        );
    }
}

/// `--tls-client-ca` without a tokens file trusts every certificate the CA
/// signed for every user: start-up says so in one warning line.
#[test]
fn a_client_ca_without_a_tokens_file_is_warned_about_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("hardening ca");
    let server = ca.server();
    let cert = write(dir.path(), "server.pem", &server.cert);
    let key = write(dir.path(), "server.key", &server.key);
    let client_ca = write(dir.path(), "clients-ca.pem", &ca.pem);
    let tls = [
        "--a2a-listen",
        "off",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &client_ca,
    ];
    let warnings = |extra: &[&str]| {
        let mut child = serve(&[&tls[..], extra].concat(), &[]);
        let rx = log_lines(&mut child);
        let lines = lines_until(&rx, "agentd starting");
        stop(child);
        lines
            .into_iter()
            .filter(|v| v["level"] == "WARN")
            .map(|v| v["message"].as_str().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    let warned = warnings(&[]);
    assert_eq!(
        warned
            .iter()
            .filter(|m| m.starts_with("--tls-client-ca without --auth-tokens")
                && m.contains("any user"))
            .count(),
        1,
        "{warned:#?}"
    );
    // With a tokens file only its `clients` are trusted: nothing to say.
    let tokens = tokens_file(dir.path());
    let warned = warnings(&["--auth-tokens", &tokens]);
    assert!(warned.is_empty(), "{warned:#?}");
}

/// Anyone can send calls without credentials: each refusal is logged at
/// debug (the metrics count them), not at info, so they cannot flood the
/// log.
#[tokio::test]
async fn refused_unauthenticated_calls_are_logged_at_debug() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = tokens_file(dir.path());
    let mut child = serve(
        &["--a2a-listen", "127.0.0.1:0", "--auth-tokens", &tokens],
        // Debug lines of the two authentication layers shown, so that the
        // refusals' lines are seen whatever their level.
        &[(
            "AGENTD_LOG",
            "info,agentd::auth=debug,agentd::a2a::auth=debug",
        )],
    );
    let rx = log_lines(&mut child);
    let started = lines_until(&rx, "agentd starting");
    let start = started.last().unwrap().clone();
    let grpc = start["listen"].as_str().unwrap().to_owned();
    let a2a = start["a2a_listen"].as_str().unwrap().to_owned();

    let mut c = agentd::client::AgentClient::connect(&format!("http://{grpc}"))
        .await
        .unwrap();
    let refused = c.create_session("web").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let status = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(&a2a).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":"t"}}"#;
        write!(
            s,
            "POST / HTTP/1.1\r\nhost: {a2a}\r\ncontent-type: application/json\r\nA2A-Version: 1.0\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.lines().next().unwrap_or_default().to_owned()
    })
    .await
    .unwrap();
    assert!(status.contains(" 401 "), "{status}");

    let until = Instant::now() + WAIT;
    let mut refusals = Vec::new();
    while refusals.len() < 2 {
        let left = until.saturating_duration_since(Instant::now());
        let Ok(v) = rx.recv_timeout(left) else {
            panic!("the two refusals were not logged; seen: {refusals:#?}");
        };
        if v["message"]
            .as_str()
            .is_some_and(|m| m.contains("refused: unauthenticated"))
        {
            refusals.push(v);
        }
    }
    stop(child);
    for r in &refusals {
        assert_eq!(r["level"], "DEBUG", "{r}");
    }
}

/// What a plaintext HTTP listener was sent: the head of every request.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<String>>>);

impl Heard {
    fn requests(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// A plaintext HTTP/1.1 listener on 127.0.0.1 that records each request's
/// head and answers 500: the "other host" a card points at.
async fn plaintext_listener() -> (u16, Heard) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let heard = Heard::default();
    let h = heard.clone();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut s, _)) = l.accept().await {
            let h = h.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let read = async {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 65536 {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
                h.0.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf).into_owned());
                let _ = s
                    .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            });
        }
    });
    (port, heard)
}

/// An https server on `l` (certificate of `ca`) serving an agent card that
/// lists `interfaces` (protocol binding, URL), and answering every JSON-RPC
/// call at `/` with TaskNotFound, recording its `authorization`.
fn https_card(ca: &Ca, l: tokio::net::TcpListener, interfaces: Vec<(String, String)>) -> Heard {
    use axum::routing::{get, post};
    let pem = ca.server();
    let identity = tonic::transport::Identity::from_pem(pem.cert, pem.key);
    let card = serde_json::json!({
        "name": "partner",
        "description": "a partner's agent",
        "version": "1.0.0",
        "supportedInterfaces": interfaces
            .iter()
            .map(|(binding, url)| serde_json::json!({
                "url": url, "protocolBinding": binding, "protocolVersion": "1.0"
            }))
            .collect::<Vec<_>>(),
        "capabilities": {"streaming": true},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [],
    })
    .to_string();
    let heard = Heard::default();
    let h = heard.clone();
    let router = axum::Router::new()
        .route(
            "/.well-known/agent-card.json",
            get(move || {
                let card = card.clone();
                async move { ([("content-type", "application/json")], card) }
            }),
        )
        .route(
            "/",
            post(move |headers: axum::http::HeaderMap, body: String| {
                let h = h.clone();
                async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default();
                    h.0.lock().unwrap().push(format!("authorization: {auth}"));
                    let id = serde_json::from_str::<serde_json::Value>(&body)
                        .map(|v| v["id"].clone())
                        .unwrap_or_default();
                    let answer = serde_json::json!({
                        "jsonrpc": "2.0", "id": id,
                        "error": {"code": -32001, "message": "task not found"},
                    });
                    ([("content-type", "application/json")], answer.to_string())
                }
            }),
        );
    let server = tonic::transport::Server::builder()
        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
        .unwrap()
        .accept_http1(true)
        .add_routes(tonic::service::Routes::from(router))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l));
    tokio::spawn(server);
    heard
}

async fn loopback() -> (tokio::net::TcpListener, u16) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// A card read over https that lists its interface at a plaintext URL
/// elsewhere: with a token the client refuses it (the token would cross
/// the network in cleartext) and names the problem, never the token; a
/// plaintext interface beside an https one is skipped; another host over
/// https is used (a card may name the pod rather than the Service); and
/// without a token nothing is at stake.
#[tokio::test]
async fn a_bearer_token_is_never_sent_to_a_plaintext_interface_of_an_https_card() {
    use agentd::client::a2a::{A2aClient, Binding};
    let ca = Ca::new("partner ca");
    let (plain_port, plain) = plaintext_listener().await;
    let plain_rpc = format!("http://127.0.0.1:{plain_port}/");
    let plain_grpc = format!("127.0.0.1:{plain_port}");

    // Every interface plaintext: refused, with either binding.
    let (l, port) = loopback().await;
    https_card(
        &ca,
        l,
        vec![
            ("JSONRPC".into(), plain_rpc.clone()),
            ("GRPC".into(), plain_grpc.clone()),
        ],
    );
    let card = format!("https://127.0.0.1:{port}");
    for binding in [None, Some(Binding::Jsonrpc), Some(Binding::Grpc)] {
        let connected = tokio::time::timeout(
            WAIT,
            A2aClient::connect_trusting(&card, binding, Some(TOKEN), Some(ca.pem.as_bytes())),
        )
        .await
        .expect("connect within the wait");
        if let Ok(c) = &connected {
            // Shows what the client would send there.
            let _ = tokio::time::timeout(Duration::from_secs(5), c.get_task("t")).await;
        }
        let leaked: Vec<String> = plain
            .requests()
            .into_iter()
            .filter(|r| r.contains(TOKEN))
            .collect();
        assert!(
            leaked.is_empty(),
            "{binding:?}: the token was sent in plaintext: {leaked:?}"
        );
        let err = format!("{:#}", connected.err().expect("refused"));
        assert!(
            err.contains("plaintext") && err.contains(&card) && !err.contains(TOKEN),
            "{binding:?}: {err}"
        );
    }
    // Without a token there is no secret to keep: the card is usable.
    A2aClient::connect_trusting(&card, None, None, Some(ca.pem.as_bytes()))
        .await
        .unwrap();

    // A plaintext interface first, then one over https on another host
    // name (localhost, where the card was read at 127.0.0.1): the https
    // one is used, and gets the token.
    let (l, port) = loopback().await;
    let heard = https_card(
        &ca,
        l,
        vec![
            ("JSONRPC".into(), plain_rpc.clone()),
            ("JSONRPC".into(), format!("https://localhost:{port}/")),
        ],
    );
    let card = format!("https://127.0.0.1:{port}");
    let c = A2aClient::connect_trusting(&card, None, Some(TOKEN), Some(ca.pem.as_bytes()))
        .await
        .unwrap();
    let err = tokio::time::timeout(WAIT, c.get_task("t"))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code, a2a::error_code::TASK_NOT_FOUND, "{err:?}");
    assert_eq!(
        heard.requests(),
        vec![format!("authorization: Bearer {TOKEN}")]
    );
    assert!(
        !plain.requests().iter().any(|r| r.contains(TOKEN)),
        "{:?}",
        plain.requests()
    );
}
