//! Several agentd replicas on one PostgreSQL database (a fresh database per
//! test on AGENTD_TEST_POSTGRES_URL): sessions move between replicas, a
//! request id runs once across them, a turn is followed from any replica,
//! and a replica that dies mid-turn leaves a definite answer behind.

mod support;

use std::time::Duration;

use agentd::pb;
use support::*;
use tonic::Code;

const ORDER_Q: &str = "Where is order 1187?";

/// Two in-process replicas on one fresh database.
async fn two_replicas(opts: Opts) -> Option<(TestDb, Server, Server)> {
    let db = TestDb::fresh(Backend::Postgres).await?;
    let a = Server::start(
        db.open().await,
        Opts {
            replica_id: "replica-a".into(),
            ..opts.clone()
        },
    )
    .await;
    let b = Server::start(
        db.open().await,
        Opts {
            replica_id: "replica-b".into(),
            ..opts
        },
    )
    .await;
    Some((db, a, b))
}

/// A `stream` turn of half a minute (600 events at 20/s): still running
/// when a follower attaches on a loaded machine; [`end_turn`] ends it.
const LONG_TURN: &str = "n=600 size=8 rate=20";

/// Attach to turn "r1" of `session` on `server`: the mode it is answered
/// with, and its stream.
async fn attach_on(server: &Server, session: &str) -> (String, tonic::Streaming<pb::AgentEvent>) {
    let req = pb::AttachRequest {
        user_id: ALICE.into(),
        session_id: session.into(),
        request_id: "r1".into(),
        after_seq: None,
    };
    let resp = server.raw().attach(req).await.unwrap();
    let mode = resp
        .metadata()
        .get("agentd-turn-mode")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    (mode, resp.into_inner())
}

/// Ends turn "r1" of `session` (a [`LONG_TURN`]) with CancelTurn, so that
/// the test does not wait for it to run its course.
async fn end_turn(server: &Server, session: &str) {
    let r = server
        .client
        .clone()
        .cancel_turn(ALICE, session, "r1")
        .await
        .unwrap();
    assert!(r.cancelled_now, "the turn was still running: {r:?}");
}

/// A stream on the turn [`end_turn`] ended: CANCELLED, as recorded.
fn assert_ended(end: &Result<(), tonic::Status>, what: &str) {
    let status = end.as_ref().expect_err(what);
    assert_eq!(status.code(), Code::Cancelled, "{what}: {status:?}");
    assert!(
        status.metadata().get("agentd-turn-outcome").is_some(),
        "{what}: {status:?}"
    );
}

fn stream_request(
    session: &str,
    request_id: &str,
    text: &str,
    on_disconnect: pb::OnDisconnect,
) -> pb::RunRequest {
    pb::RunRequest {
        agent: "stream".into(),
        on_disconnect: on_disconnect as i32,
        ..run_request(ALICE, session, request_id, text)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_created_on_one_replica_is_continued_on_another() {
    let Some((_db, a, b)) = two_replicas(Opts::default()).await else {
        return;
    };
    let sid = a.session(ALICE).await;
    a.run(ALICE, &sid, "r1", "Where is order 2301?")
        .await
        .1
        .unwrap();
    let (events, ok) = b.run(ALICE, &sid, "r2", "and when will it arrive?").await;
    ok.unwrap();
    assert!(
        events.last().unwrap().text.contains("2301"),
        "B remembers what the session said on A"
    );
    let on_a = a.get_session(ALICE, &sid).await.unwrap();
    let owners: Vec<(String, String)> = on_a
        .turns
        .iter()
        .map(|t| (t.request_id.clone(), t.owner.clone()))
        .collect();
    assert_eq!(
        owners,
        vec![
            ("r1".into(), "replica-a".into()),
            ("r2".into(), "replica-b".into())
        ]
    );
    assert_eq!(
        code(&b.get_session(BOB, &sid).await),
        Code::NotFound,
        "ownership holds on every replica"
    );
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_id_sent_to_two_replicas_at_once_runs_the_tool_exactly_once() {
    let opts = Opts {
        tool_delay: Duration::from_millis(150),
        ..Opts::default()
    };
    let Some((_db, a, b)) = two_replicas(opts).await else {
        return;
    };
    let sid = a.session(ALICE).await;
    for i in 0..5 {
        let rid = format!("race-{i}");
        let ((ea, ra), (eb, rb)) = tokio::join!(
            a.run(ALICE, &sid, &rid, ORDER_Q),
            b.run(ALICE, &sid, &rid, ORDER_Q)
        );
        ra.unwrap();
        rb.unwrap();
        assert_eq!(seqs(&ea), vec![0, 1, 2]);
        assert_eq!(ea, eb, "both callers see the one run's events");
        assert_eq!(
            a.stats.started() + b.stats.started(),
            i + 1,
            "the tool ran once for {rid}"
        );
    }
    a.stop().await;
    b.stop().await;
}

/// The turn runs for half a minute, far longer than B takes to attach: B
/// follows it live whatever the load, and the test ends it once B has
/// followed part of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_attached_on_b_gets_every_event_of_a_turn_running_on_a_in_order() {
    let Some((_db, a, b)) = two_replicas(Opts::default()).await else {
        return;
    };
    let sid = a.session(ALICE).await;
    let req = stream_request(&sid, "r1", LONG_TURN, pb::OnDisconnect::Cancel);
    let mut on_a = a
        .client
        .clone()
        .run(req, Duration::from_secs(60))
        .await
        .unwrap();
    let first = on_a.events.message().await.unwrap().unwrap();
    let (mode, mut on_b) = attach_on(&b, &sid).await;
    assert_eq!(mode, "attach", "B follows the turn while it runs on A");
    // B gets events as A makes them, then the turn is ended.
    let mut from_b = Vec::new();
    while from_b.len() < 10 {
        from_b.push(on_b.message().await.unwrap().unwrap());
    }
    end_turn(&a, &sid).await;
    let (mut from_a, end) = collect(&mut on_a.events).await;
    assert_ended(&end, "A's Run");
    from_a.insert(0, first);
    let (rest, end) = collect(&mut on_b).await;
    assert_ended(&end, "B's Attach");
    from_b.extend(rest);
    let n = from_b.len() as u64;
    assert_eq!(seqs(&from_b), (0..n).collect::<Vec<u64>>());
    assert_eq!(from_b, from_a);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_on_another_replica_after_a_dropped_stream_resumes_without_losing_an_event() {
    let Some((_db, a, b)) = two_replicas(Opts::default()).await else {
        return;
    };
    let sid = a.session(ALICE).await;
    let req = stream_request(
        &sid,
        "r1",
        "n=60 size=8 rate=120",
        pb::OnDisconnect::Continue,
    );
    let mut call = a
        .client
        .clone()
        .run(req, Duration::from_secs(30))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..10 {
        seen.push(call.events.message().await.unwrap().unwrap());
    }
    drop(call); // the connection to A dropped mid-stream
    let (rest, ok) = b
        .attach(ALICE, &sid, "r1", Some(seen.last().unwrap().seq))
        .await
        .unwrap();
    ok.unwrap();
    seen.extend(rest);
    assert_eq!(seqs(&seen), (0..=60).collect::<Vec<u64>>());
    let (replayed, ok) = b.attach(ALICE, &sid, "r1", None).await.unwrap();
    ok.unwrap();
    assert_eq!(seen, replayed, "the resumed stream is the turn's whole log");
    a.stop().await;
    b.stop().await;
}

/// A follower cut by its own server's shutdown says so, without the trailer
/// of a recorded outcome: the turn goes on on A, and the same Attach sent
/// again (as a client retries UNAVAILABLE) gets all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_cut_by_its_replicas_shutdown_is_retryable_and_the_turn_goes_on() {
    let Some((_db, a, b)) = two_replicas(Opts::default()).await else {
        return;
    };
    let sid = a.session(ALICE).await;
    let req = stream_request(&sid, "r1", LONG_TURN, pb::OnDisconnect::Cancel);
    let mut on_a = a
        .client
        .clone()
        .run(req, Duration::from_secs(60))
        .await
        .unwrap();
    let mut from_a = vec![on_a.events.message().await.unwrap().unwrap()];
    let (mode, mut on_b) = attach_on(&b, &sid).await;
    assert_eq!(mode, "attach", "B follows the running turn");
    on_b.message().await.unwrap().unwrap();
    b.turns.cut_all();
    let (_, cut) = collect(&mut on_b).await;
    let cut = cut.unwrap_err();
    assert_eq!(cut.code(), Code::Unavailable, "{cut:?}");
    assert!(cut.message().contains("attach to it again"), "{cut:?}");
    assert!(
        cut.metadata().get("agentd-turn-outcome").is_none(),
        "nothing was recorded: {cut:?}"
    );
    assert!(agentd::client::retry::run_is_retryable(&cut));

    // The turn goes on: A's Run gets more of it, and the Attach sent
    // again follows it from its start.
    let (mode, mut again) = attach_on(&a, &sid).await;
    assert_eq!(mode, "attach", "the turn still runs");
    let mut events = Vec::new();
    while events.len() < 10 {
        events.push(again.message().await.unwrap().unwrap());
    }
    while from_a.len() < 10 {
        from_a.push(on_a.events.message().await.unwrap().unwrap());
    }
    end_turn(&a, &sid).await;
    let (rest, end) = collect(&mut on_a.events).await;
    assert_ended(&end, "A's Run");
    from_a.extend(rest);
    let (rest, end) = collect(&mut again).await;
    assert_ended(&end, "the Attach sent again");
    events.extend(rest);
    let n = events.len() as u64;
    assert_eq!(seqs(&events), (0..n).collect::<Vec<u64>>());
    assert_eq!(events, from_a, "all of the turn");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_turn_leaves_the_turn_failed_unavailable_and_it_is_never_rerun() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = Child::serve(&[
        "--store",
        &db.url,
        "--replica-id",
        "replica-a",
        "--turn-lease",
        "1s",
        "--tool-delay",
        "60s",
    ])
    .await;
    let b = Server::start(
        db.open().await,
        Opts {
            replica_id: "replica-b".into(),
            ..Opts::default()
        },
    )
    .await;
    let sid = a
        .client
        .clone()
        .create_session(ALICE)
        .await
        .unwrap()
        .session_id;
    let mut call = a
        .client
        .clone()
        .run(
            run_request(ALICE, &sid, "r1", ORDER_Q),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(
        call.events.message().await.unwrap().unwrap().seq,
        0,
        "the tool is running on A"
    );
    a.kill9().await;
    assert!(call.events.message().await.is_err(), "A's stream broke");
    let (events, end) = b.run(ALICE, &sid, "r1", ORDER_Q).await;
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("serving replica stopped"),
        "{}",
        status.message()
    );
    assert!(
        seqs(&events).iter().all(|s| *s == 0),
        "only what A stored before it died"
    );
    assert_eq!(b.stats.started(), 0, "B never re-ran the turn");
    let turn = b.ended_turn(ALICE, &sid, "r1").await;
    assert_eq!(
        (turn.state(), turn.owner.as_str()),
        (pb::TurnState::Failed, "replica-a")
    );
    b.stop().await;
}

/// Replicas of a new deployment start together on an empty database: one
/// runs the migrations while the others wait for it, and all of them open
/// (an index built CONCURRENTLY under the migrator's lock waited for the
/// waiting replicas, which waited for the lock: PostgreSQL ended it as a
/// deadlock and left the index invalid). Every index is usable after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_on_an_empty_database_all_open_it() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let opened = futures::future::join_all((0..3).map(|_| agentd::store::open(&db.url))).await;
    for (i, o) in opened.iter().enumerate() {
        if let Err(e) = o {
            panic!("replica {i} did not open the store: {e:#}");
        }
    }
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let invalid: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE NOT i.indisvalid",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert!(invalid.is_empty(), "invalid indexes: {invalid:?}");
}

/// A database where that deadlock left 0006's index invalid (and recorded
/// 0006 as applied) gets the index rebuilt at the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_left_invalid_by_a_failed_concurrent_build_is_rebuilt_at_start() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    drop(db.open().await);
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let valid = "SELECT indisvalid FROM pg_index WHERE indexrelid = 'a2a_tasks_ended'::regclass";
    for sql in [
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'a2a_tasks_ended'::regclass",
        "DELETE FROM _sqlx_migrations WHERE version = 7",
    ] {
        sqlx::query(sql).execute(&mut c).await.unwrap();
    }
    let before: bool = sqlx::query_scalar(valid).fetch_one(&mut c).await.unwrap();
    assert!(!before);
    drop(db.open().await);
    let after: bool = sqlx::query_scalar(valid).fetch_one(&mut c).await.unwrap();
    assert!(after, "the index is still invalid");
}

/// A CONCURRENTLY build of the sessions' retention index cut short (its
/// process killed) leaves it invalid, and the migration's IF NOT EXISTS
/// would skip it for ever: the next start builds it again, CONCURRENTLY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_index_left_invalid_by_a_cut_build_is_built_again_at_start() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    drop(db.open().await);
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let valid = "SELECT indisvalid FROM pg_index WHERE indexrelid = 'sessions_by_update'::regclass";
    sqlx::query(
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'sessions_by_update'::regclass",
    )
    .execute(&mut c)
    .await
    .unwrap();
    let before: bool = sqlx::query_scalar(valid).fetch_one(&mut c).await.unwrap();
    assert!(!before);
    drop(db.open().await);
    let after: bool = sqlx::query_scalar(valid).fetch_one(&mut c).await.unwrap();
    assert!(after, "the index is still invalid");
}
