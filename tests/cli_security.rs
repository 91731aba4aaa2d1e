//! The binary with TLS and tokens from files, as an operator configures it:
//! `serve --tls-cert --tls-key --auth-tokens`, and the CLI's `--tls-ca` and
//! `--token`; bad files fail start-up with one line that quotes no secret.

mod secured;
mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use secured::Ca;

const BIN: &str = env!("CARGO_BIN_EXE_agentd");
const TOKEN: &str = "tok-cli-0123456789abcdef";

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_owned()
}

struct Served {
    child: Child,
    addr: String,
}

impl Served {
    fn start(args: &[&str]) -> Self {
        let mut child = secured::serve_binary("127.0.0.1:0", args).spawn().unwrap();
        let (starting, lines) = secured::started(&mut child);
        assert_eq!(starting["tls"], true, "{starting}");
        assert_eq!(starting["auth"], true, "{starting}");
        let addr = starting["listen"].as_str().unwrap().to_owned();
        std::thread::spawn(move || for _ in lines {});
        Self { child, addr }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        secured::stop_binary(&mut self.child);
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_cli_reaches_a_tls_server_with_its_ca_and_token_and_is_refused_without_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("cli ca");
    let server_pem = ca.server();
    let cert = write(dir.path(), "server.pem", &server_pem.cert);
    let key = write(dir.path(), "server.key", &server_pem.key);
    let ca_file = write(dir.path(), "ca.pem", &ca.pem);
    let tokens = write(
        dir.path(),
        "tokens.json",
        &format!(
            r#"{{"tokens": [{{"token": "{TOKEN}", "caller": "cli", "user_ids": ["alice"]}}]}}"#
        ),
    );
    let served = Served::start(&[
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--auth-tokens",
        &tokens,
    ]);
    let url = format!("https://{}", served.addr);
    let cli = |args: &[&str], token: Option<&str>| -> Output {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("AGENTD_SERVER", &url)
            .env("AGENTD_TLS_CA", &ca_file);
        match token {
            Some(t) => c.env("AGENTD_TOKEN", t),
            None => c.env_remove("AGENTD_TOKEN"),
        };
        c.output().unwrap()
    };

    let out = cli(&["session", "create", "--user", "alice"], Some(TOKEN));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = text(&out.stdout).trim().to_owned();
    let out = cli(
        &[
            "run",
            "--user",
            "alice",
            "--session",
            &session,
            "Where is order 1187?",
        ],
        Some(TOKEN),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("DHL"), "{}", text(&out.stdout));

    let out = cli(&["session", "create", "--user", "alice"], None);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Unauthenticated"),
        "{}",
        text(&out.stderr)
    );
    let out = cli(&["session", "create", "--user", "bob"], Some(TOKEN));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("PermissionDenied"),
        "{}",
        text(&out.stderr)
    );
    // Health needs no token.
    let out = cli(&["health"], None);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn a_bad_tokens_file_or_certificate_fails_start_up_without_quoting_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let short = write(
        dir.path(),
        "short.json",
        r#"{"tokens": [{"token": "hunter2", "caller": "x", "user_ids": ["*"]}]}"#,
    );
    let out = Command::new(BIN)
        // Not the default SQLite file: parallel tests would share it.
        .env("AGENTD_STORE", "memory:")
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "off",
            "--auth-tokens",
            &short,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--auth-tokens") && err.contains("at least 16"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");

    let typo = write(
        dir.path(),
        "typo.json",
        r#"{"tokens": [{"token": "a-long-enough-secret-token", "caler": "x", "user_ids": ["*"]}]}"#,
    );
    let out = Command::new(BIN)
        // Not the default SQLite file: parallel tests would share it.
        .env("AGENTD_STORE", "memory:")
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "off",
            "--auth-tokens",
            &typo,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        !text(&out.stderr).contains("a-long-enough"),
        "{}",
        text(&out.stderr)
    );

    let ca = Ca::new("ca");
    let pem = ca.server();
    let other = ca.server();
    let cert = write(dir.path(), "c.pem", &pem.cert);
    let wrong_key = write(dir.path(), "k.pem", &other.key);
    let out = Command::new(BIN)
        // Not the default SQLite file: parallel tests would share it.
        .env("AGENTD_STORE", "memory:")
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "off",
            "--tls-cert",
            &cert,
            "--tls-key",
            &wrong_key,
        ])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a key that does not match the certificate was accepted"
    );
    assert!(text(&out.stderr).contains("TLS"), "{}", text(&out.stderr));
}

/// `--help` shows which environment variables a flag reads, and their
/// values: not the store's, whose PostgreSQL URL carries a password (in a
/// pod, from a Secret).
#[test]
fn serve_help_does_not_print_the_store_urls_password() {
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .env("AGENTD_STORE", "postgres://agentd:s3cret-pw@db/agentd")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = text(&out.stdout);
    assert!(help.contains("AGENTD_STORE"), "{help}");
    assert!(!help.contains("s3cret-pw"), "{help}");
}

/// With bearer tokens, a health service that needs one would fail every
/// kubelet gRPC probe (they carry no token): start-up warns, once.
#[test]
fn tokens_with_the_health_service_closed_are_warned_about_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(
        dir.path(),
        "tokens.json",
        &format!(r#"{{"tokens": [{{"token": "{TOKEN}", "caller": "cli", "user_ids": ["*"]}}]}}"#),
    );
    let warnings = |open: Option<&str>| -> Vec<String> {
        let mut cmd = support::serve_grpc_alone(&["--auth-tokens", &tokens]);
        if let Some(open) = open {
            cmd.args(["--auth-open-services", open]);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (mut warned, mut lines, mut started) = (Vec::new(), Vec::new(), false);
        for line in BufReader::new(child.stderr.take().unwrap()).lines() {
            let line = line.unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["message"] == "agentd starting" {
                started = true;
                break;
            }
            if v["level"] == "WARN" {
                warned.push(v["message"].as_str().unwrap_or_default().to_owned());
            }
            lines.push(line);
        }
        let _ = child.kill();
        let _ = child.wait();
        // A server that failed to start warned of nothing either.
        assert!(started, "{open:?}: the server did not start: {lines:#?}");
        warned
    };
    for open in ["", "grpc.reflection.v1.ServerReflection"] {
        let warned = warnings(Some(open));
        assert_eq!(
            warned
                .iter()
                .filter(|m| m.contains("does not name grpc.health.v1.Health")
                    && m.contains("UNAUTHENTICATED"))
                .count(),
            1,
            "{open:?}: {warned:#?}"
        );
    }
    for open in [None, Some("grpc.health.v1.Health")] {
        let warned = warnings(open);
        assert!(warned.is_empty(), "{open:?}: {warned:#?}");
    }
}
