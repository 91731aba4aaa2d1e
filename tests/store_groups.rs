//! How the SQL stores answer the calls they write together (a committer's
//! group of batches, a claimer's group of claims) when part of a group
//! fails, and what SQLite's session cache makes of writes whose answer was
//! lost. Each test queues its calls in the order it needs on a
//! current-thread runtime ([`queue`]): the committer or claimer cannot run
//! until the test waits, and then takes them all as one group.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use agentd::agent::Event;
use agentd::domain::{RequestId, SessionId, TurnKey, UserId};
use agentd::store::{
    EncodedEvent, NewTurn, SeqEvent, Store, StoreError, StoreResult, TurnOutcome, TurnState,
};
use support::*;

type Call<'a, T> = Pin<Box<dyn Future<Output = StoreResult<T>> + Send + 'a>>;

/// Polls `call` once: its batch or claim is queued for the store's
/// committer or claimer. Those run on threads of their own: a test that
/// needs its calls in one group queues them while it holds the queues
/// ([`Store::hold_queues`]).
async fn queue<T>(call: &mut Call<'_, T>) {
    assert!(futures::poll!(call.as_mut()).is_pending(), "queued");
}

/// Runs `calls` as one group of the store's claimer or committer: queued
/// while the queues are held, then answered together.
async fn in_one_group<'a, T>(
    store: &dyn Store,
    mut calls: Vec<Call<'a, T>>,
) -> Vec<StoreResult<T>> {
    let one_group = store.hold_queues().expect("a SQL store's queues");
    for call in &mut calls {
        queue(call).await;
    }
    drop(one_group);
    futures::future::join_all(calls).await
}

fn key(session: SessionId, r: &str) -> TurnKey {
    TurnKey {
        session_id: session,
        request_id: RequestId::parse(r).unwrap(),
    }
}

fn new_turn(key: &TurnKey) -> NewTurn {
    NewTurn {
        key: key.clone(),
        user_text: format!("question {}", key.request_id),
        agent: "echo".into(),
        owner: "replica-a".into(),
        lease: Duration::from_secs(60),
    }
}

fn events(seqs: std::ops::Range<u64>) -> Vec<SeqEvent> {
    seqs.map(|seq| SeqEvent {
        seq,
        event: Event {
            created_unix_nanos: 1,
            ..Event::partial("echo", format!("t{seq}"))
        },
    })
    .collect()
}

fn encoded(seqs: std::ops::Range<u64>) -> Vec<EncodedEvent> {
    events(seqs).iter().map(EncodedEvent::of).collect()
}

static COMPLETED: std::sync::LazyLock<TurnOutcome> = std::sync::LazyLock::new(|| TurnOutcome {
    state: TurnState::Completed,
    code: 0,
    message: String::new(),
});

static UNAVAILABLE: std::sync::LazyLock<TurnOutcome> = std::sync::LazyLock::new(|| TurnOutcome {
    state: TurnState::Failed,
    code: 14,
    message: "the store failed".into(),
});

/// A store with a session of alice's holding running turns `rids`.
async fn with_turns(db: &TestDb, rids: &[&str]) -> (std::sync::Arc<dyn Store>, SessionId) {
    let store = db.open().await;
    let session = store
        .create_session(&UserId::parse(ALICE).unwrap())
        .await
        .unwrap()
        .id;
    for r in rids {
        store.claim_turn(&new_turn(&key(session, r))).await.unwrap();
    }
    (store, session)
}

/// The turns' leases run out: renewed by their owner for no time, then
/// outlived ([`lapse`]).
async fn lapsed(store: &dyn Store, keys: &[&TurnKey]) {
    for k in keys {
        assert!(
            store
                .renew_lease(k, "replica-a", Duration::ZERO)
                .await
                .unwrap()
        );
    }
    lapse().await;
}

fn is_unavailable<T: std::fmt::Debug>(r: &StoreResult<T>) -> bool {
    matches!(r, Err(StoreError::Unavailable(_)))
}

/// A group whose events were committed but whose outcome could not be
/// (SQLite commits them one after the other; here the turn table is locked
/// by another connection past the busy timeout): the batches without an
/// outcome are stored, and their writers are told so, instead of ending
/// their runs UNAVAILABLE as if their events were lost. Only the turn whose
/// outcome failed is told it failed, its events stored all the same.
#[tokio::test]
async fn on_sqlite_batches_stored_in_a_group_whose_outcome_failed_are_answered_stored() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let (store, session) = with_turns(&db, &["a", "b", "c"]).await;
    let (a, b, c) = (key(session, "a"), key(session, "b"), key(session, "c"));
    let held = db.hold_writes().await;
    let mut appends: Vec<Call<()>> = vec![
        Box::pin(store.append_encoded(&a, encoded(0..2))),
        Box::pin(store.append_encoded(&b, encoded(0..3))),
    ];
    let mut ends: Call<bool> =
        Box::pin(store.append_and_finish(&c, encoded(0..1), &COMPLETED, Some("c".into())));
    let one_group = store.hold_queues().expect("a SQL store's queues");
    for call in &mut appends {
        queue(call).await;
    }
    queue(&mut ends).await;
    drop(one_group);
    let (appended, ended) = tokio::join!(futures::future::join_all(appends), ends);
    held.release().await;
    for r in &appended {
        assert!(r.is_ok(), "{r:?}");
    }
    assert!(is_unavailable(&ended), "{ended:?}");
    for (k, n) in [(&a, 2), (&b, 3), (&c, 1)] {
        assert_eq!(store.events_after(k, None, 10).await.unwrap(), events(0..n));
    }
    let c = store.get_turn(&c).await.unwrap().unwrap();
    assert_eq!(c.state, TurnState::Running, "its outcome was not recorded");
}

/// Two outcomes of one turn in one group (a writer's call that timed out
/// while queued, then the writer's own outcome): the first is recorded and
/// its caller told so; the second is answered not recorded, as it would
/// be in a later group, never told it was while the other one is kept.
async fn a_turns_second_outcome_in_a_group_is_answered_not_recorded(db: TestDb) {
    let (store, session) = with_turns(&db, &["r1"]).await;
    let k = key(session, "r1");
    let mut first: Call<bool> =
        Box::pin(store.append_and_finish(&k, encoded(0..2), &COMPLETED, Some("done".into())));
    let mut second: Call<bool> = Box::pin(store.finish_turn(&k, &UNAVAILABLE, None));
    let one_group = store.hold_queues().expect("a SQL store's queues");
    queue(&mut first).await;
    queue(&mut second).await;
    drop(one_group);
    let (first, second) = tokio::join!(first, second);
    assert!(first.unwrap(), "the first outcome is recorded");
    assert!(!second.unwrap(), "the second is not");
    let t = store.get_turn(&k).await.unwrap().unwrap();
    assert_eq!(t.outcome, Some(COMPLETED.clone()));
    assert_eq!(
        store.events_after(&k, None, 10).await.unwrap(),
        events(0..2)
    );
    let (_, history) = store
        .session_with_history(session, 5)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!(history[0].answer, "done");
}

#[tokio::test]
async fn on_sqlite_a_turns_second_outcome_in_a_group_is_answered_not_recorded() {
    a_turns_second_outcome_in_a_group_is_answered_not_recorded(
        TestDb::fresh(Backend::Sqlite).await.unwrap(),
    )
    .await
}

#[tokio::test]
async fn on_postgres_a_turns_second_outcome_in_a_group_is_answered_not_recorded() {
    if let Some(db) = TestDb::fresh(Backend::Postgres).await {
        a_turns_second_outcome_in_a_group_is_answered_not_recorded(db).await
    }
}

/// Sets turn `k` completed with `answer` behind the store's back, as a
/// write of the store whose answer was lost did (SQLite's thread committed
/// it after the call gave up on it).
async fn recorded_behind_the_store(db: &TestDb, k: &TurnKey, answer: &str) {
    use sqlx::Connection as _;
    let mut c = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    let done = sqlx::query(
        "UPDATE turns SET state = 'completed', status_code = 0, status_message = '', answer = $1, \
         updated_at = $2 WHERE session_id = $3 AND request_id = $4",
    )
    .bind(answer)
    .bind(agentd::store::to_micros(SystemTime::now()))
    .bind(k.session_id.to_string())
    .bind(k.request_id.as_str())
    .execute(&mut c)
    .await
    .unwrap();
    assert_eq!(done.rows_affected(), 1);
    c.close().await.unwrap();
}

/// SQLite: a turn whose outcome was recorded by a write whose answer was
/// lost (the writer tries again and hears it is not recorded, the turn no
/// longer running) is in the history a Run reads, not kept running in the
/// session cache.
#[tokio::test]
async fn on_sqlite_a_turn_ended_by_a_write_whose_answer_was_lost_is_in_the_history_a_run_reads() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let (store, session) = with_turns(&db, &["r1"]).await;
    let k = key(session, "r1");
    recorded_behind_the_store(&db, &k, "lost").await;
    assert!(
        !store
            .finish_turn(&k, &COMPLETED, Some("lost".into()))
            .await
            .unwrap()
    );
    let (_, history) = store
        .session_with_history(session, 5)
        .await
        .unwrap()
        .unwrap();
    let ids: Vec<_> = history.iter().map(|t| t.request_id.as_str()).collect();
    assert_eq!(ids, ["r1"]);
    assert_eq!(history[0].answer, "lost");
}

/// SQLite: a sweep of expired leases whose caller left while it waited
/// for the database (its call timed out) still ends the turns it ends in
/// the history a Run reads: the session cache lets go of them once the
/// update is done, not only when its caller is still there to hear of it.
#[tokio::test]
async fn on_sqlite_leases_expired_by_a_sweep_its_caller_left_reach_the_history_a_run_reads() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let (store, session) = with_turns(&db, &["r1"]).await;
    let k = key(session, "r1");
    lapsed(&*store, &[&k]).await;
    let held = db.hold_writes().await;
    let left =
        tokio::time::timeout(Duration::from_millis(300), store.fail_expired(&UNAVAILABLE)).await;
    assert!(left.is_err(), "the sweep waits for the held lock");
    held.release().await;
    eventually("the expired turn in the history a Run reads", || async {
        let (_, history) = store.session_with_history(session, 5).await.ok()??;
        (history.len() == 1).then_some(())
    })
    .await;
    let t = store.get_turn(&k).await.unwrap().unwrap();
    assert_eq!(t.outcome, Some(UNAVAILABLE.clone()));
}

/// SQLite: a group retried one batch at a time (one of it is bad) stops
/// writing once a batch finds the database away (here: its turn table
/// locked past the busy timeout); the rest fail with that error, each
/// without waiting as long again for the same answer, and nothing of
/// theirs is written.
#[tokio::test]
async fn on_sqlite_a_group_retried_one_batch_at_a_time_stops_once_the_database_is_away() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let (store, session) = with_turns(&db, &["a", "b"]).await;
    let (a, b, never) = (key(session, "a"), key(session, "b"), key(session, "never"));
    let held = db.hold_writes().await;
    let mut bad: Call<bool> =
        Box::pin(store.append_and_finish(&never, encoded(0..1), &COMPLETED, None));
    let mut first: Call<bool> =
        Box::pin(store.append_and_finish(&a, encoded(0..1), &COMPLETED, None));
    let mut rest: Call<bool> =
        Box::pin(store.append_and_finish(&b, encoded(0..1), &COMPLETED, None));
    let one_group = store.hold_queues().expect("a SQL store's queues");
    for call in [&mut bad, &mut first, &mut rest] {
        queue(call).await;
    }
    drop(one_group);
    let (bad, first) = tokio::join!(bad, first);
    assert!(matches!(bad, Err(StoreError::Unexpected(_))), "{bad:?}");
    assert!(is_unavailable(&first), "{first:?}");
    // The database is back before the rest would be written.
    held.release().await;
    let rest = rest.await;
    assert!(is_unavailable(&rest), "{rest:?}");
    assert!(store.events_after(&b, None, 10).await.unwrap().is_empty());
    assert_eq!(
        store.get_turn(&b).await.unwrap().unwrap().state,
        TurnState::Running
    );
}

/// PostgreSQL: claims retried one at a time (one of the group is bad)
/// stop once one finds the database away (here: a lock it waits for past
/// the lock timeout); the rest fail with that error without being written.
#[tokio::test]
async fn on_postgres_claims_retried_one_at_a_time_stop_once_the_database_is_away() {
    use sqlx::Connection as _;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // The store's statements give up on a lock after 200 ms.
    let store = agentd::store::open(&format!("{}?options=-c%20lock_timeout%3D200", db.url))
        .await
        .unwrap();
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap().id;
    let (a, b) = (key(session, "a"), key(session, "b"));
    // Another transaction inserting a's turn: a's claim waits for it.
    let mut other = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(
        "INSERT INTO turns (session_id, request_id, user_text, agent, state, owner, lease_expires_at, created_at, updated_at) \
         VALUES ($1, 'a', 'q', 'echo', 'running', 'replica-b', 0, 0, 0)",
    )
    .bind(session.to_string())
    .execute(&mut other)
    .await
    .unwrap();
    // Text PostgreSQL refuses: the group's statement fails on it alone.
    let bad_turn = NewTurn {
        user_text: "nul \0 byte".into(),
        ..new_turn(&key(session, "bad"))
    };
    let (a_turn, b_turn) = (new_turn(&a), new_turn(&b));
    let mut bad: Call<agentd::store::Claim> = Box::pin(store.claim_turn(&bad_turn));
    let mut first: Call<agentd::store::Claim> = Box::pin(store.claim_turn(&a_turn));
    let mut rest: Call<agentd::store::Claim> = Box::pin(store.claim_turn(&b_turn));
    let one_group = store.hold_queues().expect("a SQL store's queues");
    for call in [&mut bad, &mut first, &mut rest] {
        queue(call).await;
    }
    drop(one_group);
    let (bad, first, rest) = tokio::join!(bad, first, rest);
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    assert!(matches!(bad, Err(StoreError::Unexpected(_))), "{bad:?}");
    assert!(is_unavailable(&first), "{first:?}");
    assert!(is_unavailable(&rest), "{rest:?}");
    assert!(store.get_turn(&b).await.unwrap().is_none());
}

/// PostgreSQL: the lease sweep does not wait for a turn whose row another
/// transaction holds (a committer storing its events share-locks it) while
/// holding the rows of the turns it has ended, which could deadlock with a
/// committer storing several of those turns; it answers those it ended,
/// and ends the held one once it is let go of.
#[tokio::test]
async fn on_postgres_the_lease_sweep_answers_what_it_ended_around_a_held_turn() {
    use sqlx::Connection as _;
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let (store, session) = with_turns(&db, &["a", "b"]).await;
    let (a, b) = (key(session, "a"), key(session, "b"));
    lapsed(&*store, &[&a, &b]).await;
    let mut writer = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut writer).await.unwrap();
    sqlx::query("SELECT 1 FROM turns WHERE session_id = $1 AND request_id = 'a' FOR SHARE")
        .bind(session.to_string())
        .execute(&mut writer)
        .await
        .unwrap();
    let swept = tokio::time::timeout(Duration::from_secs(10), store.fail_expired(&UNAVAILABLE))
        .await
        .expect("the sweep waited for the held turn")
        .unwrap();
    assert_eq!(swept, vec![b.clone()]);
    assert_eq!(
        store.get_turn(&a).await.unwrap().unwrap().state,
        TurnState::Running
    );
    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
    assert_eq!(
        store.fail_expired(&UNAVAILABLE).await.unwrap(),
        vec![a.clone()]
    );
    assert_eq!(
        store.get_turn(&a).await.unwrap().unwrap().state,
        TurnState::Failed
    );
}

/// SQLite: three claims in one group, then the three turns' last events
/// and outcomes in one group (statements padded to four rows, the fourth
/// of NULLs): each turn is claimed once and numbered apart (its events,
/// keyed by its number, are its own), and each is ended; the padding
/// writes nothing.
#[tokio::test]
async fn on_sqlite_claims_and_outcomes_of_three_turns_in_one_group_are_stored_as_three() {
    use sqlx::Connection as _;
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let store = db.open().await;
    let alice = UserId::parse(ALICE).unwrap();
    let session = store.create_session(&alice).await.unwrap().id;
    let keys = [key(session, "a"), key(session, "b"), key(session, "c")];
    let turns: Vec<NewTurn> = keys.iter().map(new_turn).collect();
    let claims: Vec<Call<agentd::store::Claim>> = turns
        .iter()
        .map(|t| Box::pin(store.claim_turn(t)) as Call<_>)
        .collect();
    for claim in in_one_group(&*store, claims).await {
        assert!(matches!(claim, Ok(agentd::store::Claim::New)), "{claim:?}");
    }
    let ends: Vec<Call<bool>> = keys
        .iter()
        .zip([2, 3, 4])
        .map(|(k, n)| {
            Box::pin(store.append_and_finish(k, encoded(0..n), &COMPLETED, Some("done".into())))
                as Call<_>
        })
        .collect();
    for ended in in_one_group(&*store, ends).await {
        assert!(ended.unwrap(), "recorded");
    }
    for (k, n) in keys.iter().zip([2, 3, 4]) {
        assert_eq!(store.events_after(k, None, 10).await.unwrap(), events(0..n));
        let t = store.get_turn(k).await.unwrap().unwrap();
        assert_eq!(t.outcome, Some(COMPLETED.clone()), "{k}");
    }
    let mut conn = sqlx::SqliteConnection::connect(&db.url).await.unwrap();
    let (rows, numbers): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT turn_no) FROM turns")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!((rows, numbers), (3, 3));
}
