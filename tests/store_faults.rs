//! The database going away: unreachable at start-up (exit with one line),
//! lost mid-flight (UNAVAILABLE and NOT_SERVING, then recovery by itself),
//! and a kill -9 of a SQLite-backed server (its turns are all there after a
//! restart, and the interrupted one has a definite status).

mod a2a_support;
mod log_capture;
mod support;

use std::time::Duration;

use agentd::pb;
use log_capture::Logs;
use support::*;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

const ORDER_Q: &str = "Where is order 1187?";

/// `agentd serve` with `store`, which must fail: its exit status and stderr.
async fn serve_fails(store: &str) -> (bool, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "off",
                "--store",
                store,
            ])
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("agentd serve exits")
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn an_unreachable_postgres_at_start_up_exits_with_one_clear_line() {
    // A port nothing listens on.
    let (_held, port) = refusing_port();
    let (ok, stderr) =
        serve_fails(&format!("postgres://agentd:secret@127.0.0.1:{port}/agentd")).await;
    assert!(!ok);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: cannot open the PostgreSQL session store"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("secret"),
        "the password is not printed: {stderr}"
    );
}

#[tokio::test]
async fn an_unopenable_sqlite_file_at_start_up_exits_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, stderr) = serve_fails(&format!(
        "sqlite://{}/missing-dir/agentd.db",
        dir.path().display()
    ))
    .await;
    assert!(!ok);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: cannot open the SQLite session store"),
        "{stderr}"
    );
}

/// A pooled connection is handed out without a ping only when it was in use
/// moments ago: one the server dropped while it sat idle is pinged, found
/// dead and replaced, so no statement fails on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_the_server_dropped_while_idle_are_replaced_without_failing_a_call() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let alice = agentd::domain::UserId::parse(ALICE).unwrap();
    // Several connections into the pool.
    let sessions = futures::future::try_join_all((0..4).map(|_| store.create_session(&alice)))
        .await
        .unwrap();
    assert!(db.terminate_pg_connections().await >= 1);
    // Longer than a connection may sit idle and still skip its ping.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for s in &sessions {
        let got = store
            .get_session(s.id)
            .await
            .expect("a call after the server dropped the pool's connections");
        assert_eq!(got.map(|g| g.id), Some(s.id));
    }
    store
        .create_session(&alice)
        .await
        .expect("a write after the server dropped the pool's connections");
}

/// A fresh PostgreSQL store reached through a [`Proxy`] the test can cut
/// off (the proxy must live as long as the store).
async fn store_behind_proxy() -> Option<(TestDb, Proxy, std::sync::Arc<dyn agentd::store::Store>)> {
    let db = TestDb::fresh(Backend::Postgres).await?;
    let proxy = Proxy::start(db.pg_addr()).await;
    let store = agentd::store::open(&db.url_via(proxy.port)).await.unwrap();
    Some((db, proxy, store))
}

/// Turn `r` of session `session_id`, claimed for ORDER_Q by replica `a`.
fn new_turn(session_id: agentd::domain::SessionId, r: &str) -> agentd::store::NewTurn {
    agentd::store::NewTurn {
        key: agentd::domain::TurnKey {
            session_id,
            request_id: agentd::domain::RequestId::parse(r).unwrap(),
        },
        user_text: ORDER_Q.into(),
        agent: "order_helper".into(),
        owner: "a".into(),
        lease: Duration::from_secs(60),
    }
}

/// Ends turn `key` completed, with one event.
async fn finish(
    store: &dyn agentd::store::Store,
    key: &agentd::domain::TurnKey,
) -> agentd::store::StoreResult<()> {
    use agentd::store::{EncodedEvent, SeqEvent, TurnOutcome, TurnState};
    let event = SeqEvent {
        seq: 0,
        event: agentd::agent::Event::partial("order_helper", "x".into()),
    };
    let outcome = TurnOutcome {
        state: TurnState::Completed,
        code: 0,
        message: String::new(),
    };
    store
        .append_and_finish(
            key,
            vec![EncodedEvent::of(&event)],
            &outcome,
            Some("x".into()),
        )
        .await
        .map(drop)
}

/// With the database no longer answering, the claims, session reads and
/// commits queued together fail together as UNAVAILABLE, each group once:
/// not written again one at a time, each waiting out another connection
/// attempt (the pool's 3 s), which made the last of 24 claims wait a
/// minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_queued_together_on_a_lost_database_fail_together_as_unavailable() {
    use agentd::domain::{RequestId, UserId};
    use agentd::store::{NewTurn, StoreError};
    let Some((db, proxy, store)) = store_behind_proxy().await else {
        return;
    };
    // Made through another replica's store: this one reads them from the
    // database, holding none in memory.
    let other = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let sessions = futures::future::try_join_all((0..24).map(|_| other.create_session(&alice)))
        .await
        .unwrap();
    for s in &sessions {
        other.claim_turn(&new_turn(s.id, "r1")).await.unwrap();
    }

    proxy.hang();
    // Idle past the pool's ping: every call needs a new connection.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let started = std::time::Instant::now();
    let new_turns: Vec<NewTurn> = sessions.iter().map(|s| new_turn(s.id, "r2")).collect();
    let claims = futures::future::join_all(new_turns.iter().map(|t| store.claim_turn(t)));
    let r2 = RequestId::parse("r2").unwrap();
    let reads = futures::future::join_all(
        sessions
            .iter()
            .map(|s| store.session_for_run(s.id, Some(&r2), 5)),
    );
    let ended: Vec<NewTurn> = sessions.iter().map(|s| new_turn(s.id, "r1")).collect();
    let commits = futures::future::join_all(ended.iter().map(|t| finish(store.as_ref(), &t.key)));
    let (claims, reads, commits) = tokio::join!(claims, reads, commits);
    let took = started.elapsed();
    let unavailable = |r: &Result<(), &StoreError>| matches!(r, Err(StoreError::Unavailable(_)));
    for (what, results) in [
        (
            "claim",
            claims
                .iter()
                .map(|r| r.as_ref().map(|_| ()))
                .collect::<Vec<_>>(),
        ),
        (
            "read",
            reads.iter().map(|r| r.as_ref().map(|_| ())).collect(),
        ),
        (
            "commit",
            commits.iter().map(|r| r.as_ref().map(|_| ())).collect(),
        ),
    ] {
        assert_eq!(results.len(), 24);
        assert!(
            results.iter().all(unavailable),
            "every {what} fails as unavailable: {:?}",
            results.iter().find(|r| !unavailable(r))
        );
    }
    // A few connection attempts of 3 s each, not one per call.
    assert!(took < Duration::from_secs(20), "the calls took {took:?}");
    proxy.up();
}

/// A database that stops answering on connections already open (a
/// network cut without a reset): a claim, a session read and a commit
/// waiting on it fail as UNAVAILABLE after the store's bound on a group's
/// statement (15 s) instead of waiting until TCP gives up, minutes later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_database_that_stopped_answering_fail_as_unavailable() {
    use agentd::domain::{RequestId, UserId};
    use agentd::store::StoreError;
    let Some((db, proxy, store)) = store_behind_proxy().await else {
        return;
    };
    // Made through another replica's store: this one reads it from the
    // database, not holding it in memory.
    let other = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = other.create_session(&alice).await.unwrap();
    let r1 = new_turn(session.id, "r1");
    other.claim_turn(&r1).await.unwrap();

    proxy.freeze();
    let r2 = RequestId::parse("r2").unwrap();
    let c2 = new_turn(session.id, "r2");
    let (claimed, read, committed) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(
            store.claim_turn(&c2),
            store.session_for_run(session.id, Some(&r2), 5),
            finish(store.as_ref(), &r1.key),
        )
    })
    .await
    .expect("the calls ended");
    assert!(
        matches!(claimed, Err(StoreError::Unavailable(_))),
        "{claimed:?}"
    );
    assert!(matches!(read, Err(StoreError::Unavailable(_))), "{read:?}");
    assert!(
        matches!(committed, Err(StoreError::Unavailable(_))),
        "{committed:?}"
    );
}

/// Every store call waiting on a database that stopped answering fails as
/// UNAVAILABLE once the store's call bound (`--store-timeout`) is past, the
/// calls outside the claim, commit and read groups included: listings,
/// replays, lease renewals, upkeep's sweeps. Without the bound each waits
/// until TCP gives up; upkeep, stuck in one, would stop its health checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_call_on_a_database_that_stopped_answering_fails_within_the_store_timeout() {
    use agentd::domain::UserId;
    use agentd::store::{StoreError, StoreResult, TurnOutcome, TurnState};
    use std::time::SystemTime;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let proxy = Proxy::start(db.pg_addr()).await;
    let bound = Duration::from_secs(2);
    let store = agentd::store::open_bounded(&db.url_via(proxy.port), Some(bound))
        .await
        .unwrap();
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let turn = new_turn(session.id, "r1");
    store.claim_turn(&turn).await.unwrap();

    proxy.freeze();
    let failed = TurnOutcome {
        state: TurnState::Failed,
        code: 14,
        message: "x".into(),
    };
    let now = SystemTime::now();
    let unavailable = |what: &str, r: StoreResult<()>| {
        assert!(
            matches!(r, Err(StoreError::Unavailable(_))),
            "{what}: {r:?}"
        );
    };
    let started = std::time::Instant::now();
    let k = &turn.key;
    let s = session.id;
    let results = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(
            async { store.create_session(&alice).await.map(drop) },
            async { store.get_session(s).await.map(drop) },
            async { store.get_turn(k).await.map(drop) },
            async { store.events_after(k, None, 10).await.map(drop) },
            async { store.history(s, 5).await.map(drop) },
            async { store.list_sessions(&alice, 10, None).await.map(drop) },
            async { store.list_turns(s, None, 10).await.map(drop) },
            async {
                store
                    .renew_lease(k, "a", Duration::from_secs(30))
                    .await
                    .map(drop)
            },
            async { store.fail_expired(&failed).await.map(drop) },
            async { store.prune(now, 10).await.map(drop) },
            async { store.delete_session(s).await.map(drop) },
        )
    })
    .await
    .expect("every call ended");
    let took = started.elapsed();
    let (a, b, c, d, e, f, g, h, i, j, l) = results;
    for (what, r) in [
        ("create_session", a),
        ("get_session", b),
        ("get_turn", c),
        ("events_after", d),
        ("history", e),
        ("list_sessions", f),
        ("list_turns", g),
        ("renew_lease", h),
        ("fail_expired", i),
        ("prune", j),
        ("delete_session", l),
    ] {
        unavailable(what, r);
    }
    assert!(took >= bound, "failed at the bound, not before: {took:?}");
    assert!(took < bound * 4, "the calls took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_refuses_runs_and_reports_not_serving_until_it_is_back() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let proxy = Proxy::start(db.pg_addr()).await;
    let store = agentd::store::open(&db.url_via(proxy.port)).await.unwrap();
    let s = Server::start(store, Opts::default()).await;
    let sid = s.session(ALICE).await;
    s.run(ALICE, &sid, "r1", ORDER_Q).await.1.unwrap();
    assert_eq!(s.health().await, Some(ServingStatus::Serving));

    // A run streaming when the database goes away.
    let long = pb::RunRequest {
        agent: "stream".into(),
        ..run_request(ALICE, &sid, "long", "n=3000 size=8 rate=200")
    };
    let mut streaming = s
        .client
        .clone()
        .run(long, Duration::from_secs(30))
        .await
        .unwrap();
    streaming.events.message().await.unwrap().unwrap();

    proxy.down();
    let (_, end) = collect(&mut streaming.events).await;
    let status = end.unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unavailable,
        "a run whose events cannot be stored ends: {status:?}"
    );
    eventually("health to report NOT_SERVING", || async {
        (s.health().await == Some(ServingStatus::NotServing)).then_some(())
    })
    .await;
    let refused = s
        .client
        .clone()
        .run(
            run_request(ALICE, &sid, "r2", ORDER_Q),
            Duration::from_secs(10),
        )
        .await;
    let status = refused.map(|_| ()).unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("session store is unavailable"),
        "{}",
        status.message()
    );
    assert_eq!(s.stats.started(), 1, "nothing ran while the store was away");

    proxy.up();
    eventually("health to report SERVING again", || async {
        (s.health().await == Some(ServingStatus::Serving)).then_some(())
    })
    .await;
    let (events, ok) = s.run(ALICE, &sid, "r2", ORDER_Q).await;
    ok.unwrap();
    assert_eq!(seqs(&events), vec![0, 1, 2]);
    let (replayed, ok) = s.run(ALICE, &sid, "r1", ORDER_Q).await;
    ok.unwrap();
    assert_eq!(
        replayed.len(),
        3,
        "what was stored before the outage is still there"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_9_and_a_restart_a_sqlite_server_has_every_turn_and_a_definite_status_for_the_interrupted_one()
 {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let first = Child::serve(&["--store", &db.url, "--tool-delay", "60s"]).await;
    let mut c = first.client.clone();
    let sid = c.create_session(ALICE).await.unwrap().session_id;
    let (done, ok) = run_on(&c, ALICE, &sid, "done", "hello").await;
    ok.unwrap();
    let mut call = c
        .run(
            run_request(ALICE, &sid, "cut", ORDER_Q),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(call.events.message().await.unwrap().unwrap().seq, 0);
    // Attach reads the store: once it hands out event 0, event 0 is stored.
    let req = pb::AttachRequest {
        user_id: ALICE.into(),
        session_id: sid.clone(),
        request_id: "cut".into(),
        after_seq: None,
    };
    let mut attached = c.raw().attach(req).await.unwrap().into_inner();
    assert_eq!(attached.message().await.unwrap().unwrap().seq, 0);
    first.kill9().await;

    let second = Child::serve(&["--store", &db.url]).await;
    let c = second.client.clone();
    let info = c
        .raw()
        .get_session(pb::GetSessionRequest {
            user_id: ALICE.into(),
            session_id: sid.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let turns: Vec<(String, pb::TurnState, Option<i32>)> = info
        .turns
        .iter()
        .map(|t| (t.request_id.clone(), t.state(), t.status_code))
        .collect();
    assert_eq!(
        turns,
        vec![
            ("done".into(), pb::TurnState::Completed, Some(0)),
            (
                "cut".into(),
                pb::TurnState::Failed,
                Some(Code::Unavailable as i32)
            ),
        ]
    );
    let (replayed, ok) = run_on(&c, ALICE, &sid, "done", "hello").await;
    ok.unwrap();
    assert_eq!(replayed, done, "the completed turn replays as it was");
    let (cut, end) = run_on(&c, ALICE, &sid, "cut", ORDER_Q).await;
    assert_eq!(
        seqs(&cut),
        vec![0],
        "the stored part of the interrupted turn"
    );
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("serving replica stopped"),
        "{}",
        status.message()
    );
    second.kill9().await;
}

/// PostgreSQL turned read-only under the store (a primary demoted by a
/// failover, its connections left open): the health check fails, a claim is
/// UNAVAILABLE (retry), not INTERNAL, and both recover once it takes writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_postgres_is_unavailable_until_it_takes_writes_again() {
    use agentd::store::{Claim, NewTurn, StoreError};
    use sqlx::Connection as _;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let alice = agentd::domain::UserId::parse("alice").unwrap();
    let session = store.create_session(&alice).await.unwrap();
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let read_only = |on: bool| {
        let (url, name) = (db.url.clone(), name.clone());
        async move {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            // This connection itself is read-only once the setting is on.
            sqlx::query("SET default_transaction_read_only = off")
                .execute(&mut c)
                .await
                .unwrap();
            let setting = if on { "on" } else { "off" };
            sqlx::query(&format!(
                "ALTER DATABASE {name} SET default_transaction_read_only = {setting}"
            ))
            .execute(&mut c)
            .await
            .unwrap();
        }
    };
    let turn = |rid: &str| NewTurn {
        key: agentd::domain::TurnKey {
            session_id: session.id,
            request_id: agentd::domain::RequestId::parse(rid).unwrap(),
        },
        user_text: "hi".into(),
        agent: "echo".into(),
        owner: "a".into(),
        lease: Duration::from_secs(30),
    };

    read_only(true).await;
    db.terminate_pg_connections().await;
    let why = eventually("the health check sees the read-only database", || async {
        match store.ping().await {
            Err(StoreError::Unavailable(e)) if format!("{e:#}").contains("no writes") => Some(e),
            _ => None,
        }
    })
    .await;
    assert!(format!("{why:#}").contains("read-only"), "{why:#}");
    let claim = store.claim_turn(&turn("r1")).await;
    assert!(
        matches!(claim, Err(StoreError::Unavailable(_))),
        "{claim:?}"
    );

    read_only(false).await;
    db.terminate_pg_connections().await;
    eventually("the store takes writes again", || async {
        store.ping().await.ok()?;
        matches!(store.claim_turn(&turn("r2")).await, Ok(Claim::New)).then_some(())
    })
    .await;
}

/// A statement PostgreSQL cancels (its `statement_timeout`, a
/// `lock_timeout`, an operator's `pg_cancel_backend`) is a store that
/// cannot answer now: UNAVAILABLE, which clients retry, not INTERNAL. Claims
/// waiting together fail together, not retried one at a time (each waiting
/// out the timeout again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_postgres_cancels_is_unavailable() {
    use agentd::domain::UserId;
    use agentd::store::StoreError;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    drop(db.open().await);
    let timeout = Duration::from_millis(300);
    let url = format!(
        "{}?options=-c%20statement_timeout%3D{}ms",
        db.url,
        timeout.as_millis()
    );
    let store = agentd::store::open(&url).await.unwrap();
    let session = store
        .create_session(&UserId::parse(ALICE).unwrap())
        .await
        .unwrap();
    let held = db.hold_writes().await;
    let started = std::time::Instant::now();
    let turns: Vec<_> = (0..4)
        .map(|i| new_turn(session.id, &format!("r{i}")))
        .collect();
    let claims = futures::future::join_all(turns.iter().map(|t| store.claim_turn(t))).await;
    let took = started.elapsed();
    drop(held);
    for c in claims {
        assert!(matches!(c, Err(StoreError::Unavailable(_))), "{c:?}");
    }
    assert!(
        took < timeout * 4,
        "the claims took {took:?}: retried one at a time"
    );
}

/// Runs refused because the store is known to be down (its health check
/// failed) are logged at debug: the outage is logged as it starts, not with
/// a warning and an info line for every Run a busy server refuses while it
/// lasts.
#[tokio::test] // current-thread: the server's tasks run under the capture
async fn runs_refused_while_the_store_is_down_do_not_each_log_a_warning() {
    let logs = Logs::default();
    let _capture = logs.capture();
    let Some((_db, proxy, store)) = store_behind_proxy().await else {
        return;
    };
    let s = Server::start(store, Opts::default()).await;
    let sid = s.session(ALICE).await;
    let start = logs.lines_from(0).len();

    // The outage starts: logged as it does (with what the pool and the
    // upkeep's calls cut short say), then come the calls it refuses.
    proxy.down();
    eventually("health to report NOT_SERVING", || async {
        (s.health().await == Some(ServingStatus::NotServing)).then_some(())
    })
    .await;
    assert!(
        logs.lines_from(start).iter().any(|l| l["level"] == "WARN"
            && l["message"]
                .as_str()
                .is_some_and(|m| m.contains("session store unreachable"))),
        "the outage itself is logged"
    );
    let before = logs.lines_from(0).len();
    // The raw client: the crate's own retries UNAVAILABLE.
    for i in 0..50 {
        let refused = s
            .raw()
            .run(run_request(ALICE, &sid, &format!("r{i}"), ORDER_Q))
            .await;
        let status = refused.map(|_| ()).unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    }
    let attach = s
        .raw()
        .attach(pb::AttachRequest {
            user_id: ALICE.into(),
            session_id: sid.clone(),
            request_id: "r0".into(),
            after_seq: None,
        })
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(attach.code(), Code::Unavailable, "{attach:?}");

    let during = logs.lines_from(before);
    let warnings: Vec<_> = during.iter().filter(|l| l["level"] == "WARN").collect();
    // At most a late line or two of the outage's start (the pool's).
    assert!(
        warnings.len() <= 2,
        "51 refused calls log no warning each: {warnings:#?}"
    );
    let refusals: Vec<_> = during
        .iter()
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.ends_with(" refused"))
        })
        .collect();
    assert!(
        refusals.is_empty(),
        "the refusals are logged at debug: {refusals:#?}"
    );
    proxy.up();
    s.stop().await;
}

/// The A2A face, as agents.v1: with the store known to be down, calls are
/// refused at once (the task store is unavailable; retry later), logged at
/// debug. Each used to make its own store call and log two warnings (the
/// task store's, then the request's).
#[tokio::test] // current-thread: the server's tasks run under the capture
async fn a2a_calls_refused_while_the_store_is_down_do_not_each_log_a_warning() {
    let logs = Logs::default();
    let _capture = logs.capture();
    let Some((_db, proxy, store)) = store_behind_proxy().await else {
        return;
    };
    let server = a2a_support::A2aServer::start_on(store).await;
    let client = server.grpc_client().await;
    let request = a2a_support::echo_request(vec![a2a::Part::text("hello")]);
    let task = match client.raw().send_message(&request).await.unwrap() {
        a2a::SendMessageResponse::Task(t) => t,
        other => panic!("not a task: {other:?}"),
    };

    proxy.down();
    let mut health = server.turns.store_health();
    tokio::time::timeout(Duration::from_secs(30), health.wait_for(|up| !*up))
        .await
        .expect("the store's health check never failed")
        .unwrap();
    let before = logs.lines_from(0).len();
    for _ in 0..25 {
        let got = client.get_task(&task.id).await.unwrap_err();
        assert_eq!(
            got.message, "the task store is unavailable; retry later",
            "{got:?}"
        );
        let sent = client.raw().send_message(&request).await.unwrap_err();
        assert_eq!(
            sent.message, "the task store is unavailable; retry later",
            "{sent:?}"
        );
    }
    let during = logs.lines_from(before);
    let warnings: Vec<_> = during.iter().filter(|l| l["level"] == "WARN").collect();
    // At most a late line or two of the outage's start (the pool's).
    assert!(
        warnings.len() <= 2,
        "50 refused A2A calls log no warning each: {warnings:#?}"
    );
    proxy.up();
    server.stop().await;
}
