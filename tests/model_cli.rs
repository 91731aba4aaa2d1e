//! `agentd serve --agents FILE` as a user runs it: a bad file stops start-up
//! with file, line and reason; a good one is served, its `default` included.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_agentd");

fn write(dir: &std::path::Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_owned()
}

#[test]
fn a_bad_agents_file_stops_start_up_with_file_line_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "agents.toml",
        "[agents.smart]\n[agents.smart.model]\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\napi_key_env = \"AGENTD_TEST_SURELY_UNSET_KEY\"\n",
    );
    let out = Command::new(BIN)
        // Not the default SQLite file: parallel tests would share it.
        .env("AGENTD_STORE", "memory:")
        .args(["serve", "--listen", "127.0.0.1:0", "--agents", &path])
        .env_remove("AGENTD_TEST_SURELY_UNSET_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agents.toml:5:"), "{err}");
    assert!(
        err.contains("AGENTD_TEST_SURELY_UNSET_KEY is not set"),
        "{err}"
    );

    let path = write(
        dir.path(),
        "typo.toml",
        "[agents.smart]\ndescripton = \"x\"\n",
    );
    let out = Command::new(BIN)
        // Not the default SQLite file: parallel tests would share it.
        .env("AGENTD_STORE", "memory:")
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("AGENTD_AGENTS", &path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("typo.toml:2:") && err.contains("unknown field"),
        "{err}"
    );
}

#[test]
fn the_files_agents_are_served_by_name_and_its_default_serves_an_empty_agent() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on the model's port: the file's agent answers
    // UNAVAILABLE, which tells it apart from order_helper. The port is held
    // (bound, not listening: connections are refused) so that no other
    // test's server takes it meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    let path = write(
        dir.path(),
        "agents.toml",
        &format!(
            "default = \"smart\"\n[agents.smart]\n[agents.smart.model]\nbase_url = \"http://127.0.0.1:{port}/v1?key=SEKRET-77\"\nmodel = \"m\"\n"
        ),
    );
    let mut child = KillOnDrop(
        Command::new(BIN)
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
                "--a2a-listen",
                "127.0.0.1:0",
                "--drain-delay",
                "0s",
                "--agents",
                &path,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(child.0.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("server exited before listening")
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if v["message"] == "agentd starting" {
            break v["listen"].as_str().unwrap().to_owned();
        }
    };
    // The server's log, kept for the checks below.
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let mut log = kept.lock().unwrap();
            log.push_str(&line);
            log.push('\n');
        }
    });
    let url = format!("http://{addr}");
    let cli = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env("AGENTD_SERVER", &url)
            .output()
            .unwrap()
    };
    let out = cli(&["session", "create", "--user", "u1"]);
    assert!(out.status.success(), "{out:?}");
    let session = String::from_utf8_lossy(&out.stdout).trim().to_owned();

    let out = cli(&[
        "run",
        "--user",
        "u1",
        "--session",
        &session,
        "--deadline",
        "20s",
        "hello",
    ]);
    assert!(
        !out.status.success(),
        "the default is the file's agent, whose model is down"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unavailable"),
        "{out:?}"
    );
    // The refused connection is logged, without the base URL's query (it
    // may carry a key; reqwest's own message ends with the whole URL).
    let until = Instant::now() + Duration::from_secs(10);
    while !log.lock().unwrap().contains("model server unreachable") {
        assert!(Instant::now() < until, "no log of the refused connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !log.lock().unwrap().contains("SEKRET"),
        "{}",
        log.lock().unwrap()
    );

    let out = cli(&[
        "run",
        "--user",
        "u1",
        "--session",
        &session,
        "--agent",
        "order_helper",
        "Where is order 1187?",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("DHL"));

    Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while child.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < until, "server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server, killed if the test fails before stopping it.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
