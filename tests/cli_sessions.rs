//! The session and resume commands of the `agentd` binary against a real
//! `agentd serve` on a fresh SQLite store.

mod support;

use std::process::Stdio;
use std::time::Duration;

use support::*;
use tokio::io::AsyncBufReadExt;

async fn cli(server: &std::net::SocketAddr, args: &[&str]) -> (bool, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
            .args(args)
            .env("AGENTD_SERVER", format!("http://{server}"))
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the command exits")
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A new session of alice's, made with `agentd session create`: its id.
async fn cli_session(server: &std::net::SocketAddr) -> String {
    let (ok, sid, _) = cli(server, &["session", "create", "--user", "alice"]).await;
    assert!(ok);
    sid.trim().to_owned()
}

/// `agentd run` of turn r1 of `sid` with `--on-disconnect continue`,
/// killed once it has printed its first event (the demo agent's
/// lookup_order tool call): the run goes on in the server without it.
async fn run_left_running(server: &std::net::SocketAddr, sid: &str) {
    let mut run = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
        .args(["run", "--user", "alice", "--session", sid])
        .args(["--request-id", "r1", "--on-disconnect", "continue"])
        .arg("Where is order 1187?")
        .env("AGENTD_SERVER", format!("http://{server}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(run.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.starts_with("[0] tool_call lookup_order"), "{first}");
    run.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_with_on_disconnect_continue_is_resumed_with_attach_and_shown_by_session_get() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = Child::serve(&["--store", &db.url, "--tool-delay", "700ms"]).await;
    let addr = server.addr;
    let sid = cli_session(&addr).await;

    // A run whose client goes away after the first event.
    run_left_running(&addr, &sid).await;

    let (ok, out, err) = cli(
        &addr,
        &[
            "attach",
            "--user",
            "alice",
            "--session",
            &sid,
            "--request-id",
            "r1",
            "--after-seq",
            "0",
        ],
    )
    .await;
    assert!(ok, "{err}");
    let printed: Vec<&str> = out.lines().collect();
    assert_eq!(printed.len(), 2, "{out}");
    assert!(
        printed[0].starts_with("[1] tool_result lookup_order"),
        "{out}"
    );
    assert!(
        printed[1].starts_with("[2] final_answer: Order 1187"),
        "{out}"
    );

    let (ok, out, err) = cli(
        &addr,
        &["session", "get", "--user", "alice", "--session", &sid],
    )
    .await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["turns"][0]["request_id"], "r1");
    assert_eq!(v["turns"][0]["state"], "completed");
    assert_eq!(v["turns"][0]["status_code"], "Ok");
    assert!(v["turns"][0].get("answer").is_none(), "{v}");
    // With --text, the conversation: each turn's question and answer.
    let (ok, out, err) = cli(
        &addr,
        &[
            "session",
            "get",
            "--user",
            "alice",
            "--session",
            &sid,
            "--text",
        ],
    )
    .await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["turns"][0]["user_text"], "Where is order 1187?");
    let answer = v["turns"][0]["answer"].as_str().unwrap();
    assert!(
        answer.starts_with("Order 1187")
            && answer == printed[1].trim_start_matches("[2] final_answer: "),
        "{v}"
    );

    let (ok, out, _) = cli(&addr, &["session", "list", "--user", "alice"]).await;
    assert!(ok);
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.contains(&sid));

    let (ok, _, err) = cli(
        &addr,
        &["session", "delete", "--user", "alice", "--session", &sid],
    )
    .await;
    assert!(ok, "{err}");
    let (ok, _, err) = cli(
        &addr,
        &["session", "get", "--user", "alice", "--session", &sid],
    )
    .await;
    assert!(!ok);
    assert!(err.contains("NotFound"), "{err}");
    server.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_by_sigterm_leaves_its_sqlite_files_without_wals() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let path = std::path::PathBuf::from(db.url.strip_prefix("sqlite://").unwrap());
    let events = agentd::store::sqlite::event_log_path(&path);
    let wal = |f: &std::path::Path| {
        let mut name = f.as_os_str().to_owned();
        name.push("-wal");
        std::path::PathBuf::from(name)
    };
    let server = Child::serve(&["--store", &db.url]).await;
    let sid = session_on(&server.client, "alice").await;
    let (events_seen, end) =
        run_on(&server.client, "alice", &sid, "r1", "Where is order 1187?").await;
    assert!(end.is_ok(), "{end:?}");
    assert_eq!(events_seen.len(), 3);
    // Running, the database's WAL holds what was written since the last
    // checkpoint; the event log keeps a rollback journal, never a WAL.
    assert!(wal(&path).exists());
    assert!(!wal(&events).exists());

    let status = server.terminate().await;
    assert!(status.success(), "{status}");
    for f in [wal(&path), wal(&events)] {
        assert!(!f.exists(), "{} is left after a clean stop", f.display());
    }
    // Everything is in the files themselves.
    let store = db.open().await;
    let id = agentd::domain::SessionId::parse(&sid).unwrap();
    let turns = store.list_turns(id, None, 10).await.unwrap();
    assert_eq!(turns.len(), 1);
    assert_eq!(turns[0].state, agentd::store::TurnState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_with_on_disconnect_continue_is_stopped_with_cancel() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = Child::serve(&["--store", &db.url, "--tool-delay", "60s"]).await;
    let addr = server.addr;
    let sid = cli_session(&addr).await;

    // A run whose client goes away while its tool runs (for a minute).
    run_left_running(&addr, &sid).await;

    let turn = ["--user", "alice", "--session", &sid, "--request-id", "r1"];
    let (ok, out, err) = cli(&addr, &[&["cancel"], &turn[..]].concat()).await;
    assert!(ok, "{err}");
    assert_eq!(out, "r1 cancelled Cancelled: cancelled by CancelTurn\n");
    assert_eq!(err, "");

    // Again, as JSON: the turn as it was left, unchanged.
    let (ok, out, err) = cli(&addr, &[&["cancel", "--json"], &turn[..]].concat()).await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["request_id"], "r1");
    assert_eq!(v["state"], "cancelled");
    assert_eq!(v["status_code"], "Cancelled");
    assert_eq!(v["status_message"], "cancelled by CancelTurn");
    assert_eq!(v["cancelled_now"], false);
    assert!(err.contains("had ended already"), "{err}");

    let (ok, _, err) = cli(&addr, &[&["attach"], &turn[..]].concat()).await;
    assert!(!ok);
    assert!(err.contains("Cancelled: cancelled by CancelTurn"), "{err}");

    let (ok, _, err) = cli(
        &addr,
        &[
            "cancel",
            "--user",
            "alice",
            "--session",
            &sid,
            "--request-id",
            "r2",
        ],
    )
    .await;
    assert!(!ok);
    assert!(err.contains("NotFound"), "{err}");
    server.kill9().await;
}
