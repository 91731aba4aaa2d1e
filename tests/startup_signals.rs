//! Signals that reach `agentd serve` before it serves.

mod support;

use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_agentd");

/// A SIGHUP while the server waits to migrate its database (another
/// replica holds the migration lock; a migration can take minutes) does
/// not stop it, as the signal's default action would: once serving, SIGHUP
/// reloads the TLS and token files.
#[tokio::test]
async fn a_sighup_before_the_server_serves_does_not_stop_it() {
    let Some(db) = support::TestDb::fresh(support::Backend::Postgres).await else {
        return;
    };
    use sqlx::Connection as _;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    // The lock replicas take, one at a time, to migrate (src/store/postgres.rs).
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(0x6167_656e_7464_0001_i64)
        .execute(&mut holder)
        .await
        .unwrap();
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--store", &db.url, "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "off", "--a2a-listen", "off"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Waiting for the lock: its connection asked for it.
    let asked = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND query LIKE '%pg_try_advisory_lock%'";
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar(asked)
            .fetch_one(&mut holder)
            .await
            .unwrap();
        if n > 0 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the server stopped while starting"
        );
        assert!(
            tokio::time::Instant::now() < until,
            "the server never asked for the migration lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        child.try_wait().unwrap(),
        None,
        "a SIGHUP during start-up stopped the server"
    );
    child.kill().await.unwrap();
}
