//! CancelTurn: a running turn (one left running by ON_DISCONNECT_CONTINUE
//! above all) is ended CANCELLED, its run stopped (at once on the replica
//! serving the cancel, as soon as the store's word reaches another, or at
//! its next lease renewal if that word is lost), and every
//! stream on it ends with CANCELLED; a turn that had ended is answered as
//! it ended, unchanged; bad, unknown or foreign turns are refused.

mod log_capture;
mod store_wrap;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agentd::agent::{Agent, AgentRegistry, Event, EventStream, RunContext, synthetic};
use agentd::grpc::agents::TURN_MODE_HEADER;
use agentd::grpc::status::TURN_OUTCOME_HEADER;
use agentd::pb;
use agentd::store::Store;
use log_capture::Logs;
use support::{ALICE, BOB, Backend, Opts, TestDb, collect, eventually, run_request};
use tonic::{Code, Request, Status};

const DEADLINE: Duration = Duration::from_secs(30);
const CANCELLED_MESSAGE: &str = "cancelled by CancelTurn";

/// What [`ToolLoop`]'s tool did.
#[derive(Default)]
struct Counts {
    /// Tool executions begun.
    started: AtomicU64,
    /// Executions that ended before their time: they saw the run's
    /// cancellation, or were dropped with the run.
    stopped: AtomicU64,
    /// Executions that ran their whole minute.
    completed: AtomicU64,
}

impl Counts {
    fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }
    fn stopped(&self) -> u64 {
        self.stopped.load(Ordering::SeqCst)
    }
    fn completed(&self) -> u64 {
        self.completed.load(Ordering::SeqCst)
    }
}

/// One tool execution; counted stopped if it ends before its minute.
struct Execution {
    counts: Arc<Counts>,
    done: bool,
}

impl Drop for Execution {
    fn drop(&mut self) {
        if !self.done {
            self.counts.stopped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// `tool_loop`: calls its `wait` tool over and over. Each execution waits
/// a minute, or until the run is cancelled; whatever happened, the agent
/// goes on to the next one (a careless agent): only the turn engine's
/// dropping the agent's stream keeps a tool from running after a cancel.
struct ToolLoop {
    counts: Arc<Counts>,
}

impl Agent for ToolLoop {
    fn name(&self) -> &str {
        "tool_loop"
    }
    fn description(&self) -> &str {
        "Runs a tool that blocks until the run is cancelled, again and again."
    }
    fn run(&self, ctx: RunContext, _input: String) -> EventStream {
        let counts = self.counts.clone();
        Box::pin(async_stream::stream! {
            for n in 0u64.. {
                let id = format!("call-{n}");
                yield Ok(Event::tool_call("tool_loop", "wait", &id, &serde_json::json!({})));
                {
                    counts.started.fetch_add(1, Ordering::SeqCst);
                    let mut execution = Execution { counts: counts.clone(), done: false };
                    tokio::select! {
                        _ = ctx.cancel.cancelled() => {}
                        _ = tokio::time::sleep(Duration::from_secs(60)) => {
                            counts.completed.fetch_add(1, Ordering::SeqCst);
                            execution.done = true;
                        }
                    }
                }
                yield Ok(Event::tool_result("wait", &id, "waited".into(), &serde_json::json!({})));
            }
        })
    }
}

/// An agentd in this process on 127.0.0.1:0: `tool_loop` (the default)
/// and `echo`. Its [`support::Server`] (client, session and the rest) is
/// reached through it.
struct Replica {
    server: support::Server,
    counts: Arc<Counts>,
}

impl std::ops::Deref for Replica {
    type Target = support::Server;

    fn deref(&self) -> &support::Server {
        &self.server
    }
}

impl Replica {
    async fn start(store: Arc<dyn Store>, replica_id: &str, lease: Duration) -> Replica {
        let counts = Arc::new(Counts::default());
        let agents: Vec<Arc<dyn Agent>> = vec![
            Arc::new(ToolLoop {
                counts: counts.clone(),
            }),
            Arc::new(synthetic::Echo),
        ];
        let registry = AgentRegistry::new(agents, "tool_loop").unwrap();
        let opts = Opts {
            replica_id: replica_id.into(),
            lease,
            ..Opts::default()
        };
        Replica {
            server: support::Server::with_agents(store, registry, opts).await,
            counts,
        }
    }

    async fn stop(self) {
        self.server.stop().await;
    }

    async fn cancel(
        &self,
        user: &str,
        session: &str,
        request_id: &str,
    ) -> Result<pb::CancelTurnResponse, Status> {
        self.client
            .clone()
            .cancel_turn(user, session, request_id)
            .await
    }

    async fn turn(&self, user: &str, session: &str, request_id: &str) -> pb::TurnInfo {
        let req = pb::GetSessionRequest {
            user_id: user.into(),
            session_id: session.into(),
            ..Default::default()
        };
        let s = self
            .client
            .raw()
            .get_session(self.client.request(req, DEADLINE))
            .await
            .unwrap()
            .into_inner();
        s.turns
            .into_iter()
            .find(|t| t.request_id == request_id)
            .expect("the turn is listed")
    }

    /// An Attach, collected to its end on a task of its own: the mode it
    /// was answered with ("attach" while the turn runs, "replay" once it
    /// has ended), its events and its end.
    fn attach(&self, session: &str, request_id: &str) -> tokio::task::JoinHandle<Attached> {
        let req = pb::AttachRequest {
            user_id: ALICE.into(),
            session_id: session.into(),
            request_id: request_id.into(),
            after_seq: None,
        };
        let req = self.client.request(req, DEADLINE);
        let mut raw = self.client.raw();
        tokio::spawn(async move {
            let resp = raw.attach(req).await.unwrap();
            let mode = resp
                .metadata()
                .get(TURN_MODE_HEADER)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let (events, end) = collect(&mut resp.into_inner()).await;
            (mode, events, end)
        })
    }

    /// A Run of the turn with ON_DISCONNECT_CONTINUE whose client goes
    /// away once the tool runs: the turn runs on without it.
    async fn left_running(&self, session: &str, request_id: &str) {
        let req = pb::RunRequest {
            on_disconnect: pb::OnDisconnect::Continue as i32,
            ..run_request(ALICE, session, request_id, "wait")
        };
        let before = self.counts.started();
        let mut call = self.client.clone().run(req, DEADLINE).await.unwrap();
        let first = call.events.message().await.unwrap().unwrap();
        assert_eq!(first.tool_name, "wait");
        let counts = self.counts.clone();
        eventually("the tool runs", || async {
            (counts.started() > before).then_some(())
        })
        .await;
        drop(call);
    }
}

/// What [`Replica::attach`] got: the mode, the events and the end.
type Attached = (String, Vec<pb::AgentEvent>, Result<(), Status>);

/// Waits (bounded) until each of `replicas` serves one follower: an
/// Attach sent before the cancel is then following the running turn (its
/// read found it running), not replaying a turn that had been cancelled.
async fn following(replicas: &[&Replica]) {
    eventually("the Attach follows the turn", || async {
        replicas
            .iter()
            .all(|r| r.turns.followers_in_flight() == 1)
            .then_some(())
    })
    .await;
}

/// The status a stream ended with, which must be the recorded CANCELLED
/// of CancelTurn.
fn assert_cancelled(end: &Result<(), Status>, what: &str) {
    let status = end.as_ref().expect_err(what);
    assert_eq!(
        (status.code(), status.message()),
        (Code::Cancelled, CANCELLED_MESSAGE),
        "{what}: {status:?}"
    );
}

fn assert_cancelled_turn(t: &pb::TurnInfo) {
    assert_eq!(t.state(), pb::TurnState::Cancelled, "{t:?}");
    assert_eq!(t.status_code, Some(Code::Cancelled as i32), "{t:?}");
    assert_eq!(t.status_message, CANCELLED_MESSAGE, "{t:?}");
}

/// A Run repeating the turn's request id: replayed, CANCELLED, with the
/// `recorded` trailer; never run again.
async fn assert_replays_cancelled(r: &Replica, session: &str, request_id: &str) {
    let mut call = r
        .client
        .clone()
        .run(run_request(ALICE, session, request_id, "wait"), DEADLINE)
        .await
        .unwrap();
    assert_eq!(call.mode, "replay");
    let status = loop {
        match call.events.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the replay ended OK"),
            Err(s) => break s,
        }
    };
    assert_cancelled(&Err(status.clone()), "the repeated Run");
    assert_eq!(
        status
            .metadata()
            .get(TURN_OUTCOME_HEADER)
            .map(|v| v.to_str().unwrap()),
        Some("recorded"),
        "{status:?}"
    );
}

async fn a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn(backend: Backend) {
    let Some(db) = TestDb::fresh(backend).await else {
        return;
    };
    // Renewed every 10 s, first at 10 s from the claim: a stop within the
    // bound below is the cancel's own, not the lease renewal's.
    let server = Replica::start(db.open().await, "replica-a", Duration::from_secs(30)).await;
    let s = server.session(ALICE).await;
    server.left_running(&s, "r1").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        server.turn(ALICE, &s, "r1").await.state(),
        pb::TurnState::Running,
        "CONTINUE: the run goes on without its client"
    );
    assert_eq!(server.counts.stopped(), 0);
    let follower = server.attach(&s, "r1");
    following(&[&server]).await;

    let r = server.cancel(ALICE, &s, "r1").await.unwrap();
    let acknowledged = tokio::time::Instant::now();
    assert!(r.cancelled_now, "{r:?}");
    let t = r.turn.unwrap();
    assert_eq!(t.request_id, "r1");
    assert_cancelled_turn(&t);
    // On the replica running it, the run stops at once, not at its next
    // lease renewal (a third of the 30 s lease; the margin is for a loaded
    // machine).
    let counts = server.counts.clone();
    eventually("the tool sees the cancellation", || async {
        (counts.stopped() == 1).then_some(())
    })
    .await;
    assert!(
        acknowledged.elapsed() < Duration::from_millis(2500),
        "promptly: {:?}",
        acknowledged.elapsed()
    );

    let (mode, _, end) = follower.await.unwrap();
    assert_eq!(mode, "attach", "the follower followed the running turn");
    assert_cancelled(&end, "the Attach following the turn");
    let (mode, events, end) = server.attach(&s, "r1").await.unwrap();
    assert_eq!(mode, "replay");
    assert_cancelled(&end, "an Attach after the cancel");
    assert_eq!(events[0].tool_name, "wait", "the events stored before it");
    assert_replays_cancelled(&server, &s, "r1").await;
    assert_cancelled_turn(&server.turn(ALICE, &s, "r1").await);

    // A second cancel answers the same, changing nothing.
    let again = server.cancel(ALICE, &s, "r1").await.unwrap();
    assert!(!again.cancelled_now);
    assert_eq!(again.turn.unwrap(), t);

    // No tool ran after the cancel, though the agent would have gone on.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        (
            server.counts.started(),
            server.counts.stopped(),
            server.counts.completed()
        ),
        (1, 1, 0)
    );
    server.stop().await;
}

#[tokio::test]
async fn a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn_in_memory() {
    a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn(Backend::Memory).await;
}

#[tokio::test]
async fn a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn_on_sqlite() {
    a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn(Backend::Sqlite).await;
}

#[tokio::test]
async fn a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn_on_postgres() {
    a_continue_run_whose_client_went_away_is_stopped_by_cancel_turn(Backend::Postgres).await;
}

#[tokio::test]
async fn the_run_still_streaming_to_its_client_ends_cancelled_recorded() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = Replica::start(db.open().await, "replica-a", Duration::from_secs(10)).await;
    let s = server.session(ALICE).await;
    let mut call = server
        .client
        .clone()
        .run(run_request(ALICE, &s, "r1", "wait"), DEADLINE)
        .await
        .unwrap();
    assert_eq!(call.events.message().await.unwrap().unwrap().seq, 0);
    let counts = server.counts.clone();
    eventually("the tool runs", || async {
        (counts.started() == 1).then_some(())
    })
    .await;
    let r = server.cancel(ALICE, &s, "r1").await.unwrap();
    assert!(r.cancelled_now);
    let status = loop {
        match call.events.message().await {
            Ok(Some(e)) => assert_ne!(e.tool_name, "", "{e:?}"),
            Ok(None) => panic!("the Run ended OK"),
            Err(s) => break s,
        }
    };
    assert_cancelled(&Err(status.clone()), "the Run that started the turn");
    assert!(
        status.metadata().get(TURN_OUTCOME_HEADER).is_some(),
        "{status:?}"
    );
    assert_eq!((counts.started(), counts.stopped()), (1, 1));
    server.stop().await;
}

/// A store that fails the turn read made right after CancelTurn's write
/// (the first cancel written while `armed`): the store blinking between
/// the cancel and its answer.
struct ReadsFailAfterCancel {
    /// Cleared by the first cancel written: the run's own write of the
    /// outcome, after it stopped, arms nothing more.
    armed: std::sync::atomic::AtomicBool,
    /// Set by that write, cleared by the next turn read, which fails.
    failing: std::sync::atomic::AtomicBool,
    /// Turn reads failed.
    injected: AtomicU64,
}

#[async_trait::async_trait]
impl store_wrap::Hooks for ReadsFailAfterCancel {
    async fn finish_turn(
        &self,
        inner: &dyn Store,
        k: &agentd::domain::TurnKey,
        o: &agentd::store::TurnOutcome,
        a: Option<agentd::store::FinalAnswer<'_>>,
    ) -> agentd::store::StoreResult<bool> {
        let done = inner.finish_turn(k, o, a).await;
        if *o == agentd::grpc::status::cancelled_by_request()
            && self.armed.swap(false, Ordering::SeqCst)
        {
            self.failing.store(true, Ordering::SeqCst);
        }
        done
    }
    async fn get_turn(
        &self,
        inner: &dyn Store,
        k: &agentd::domain::TurnKey,
    ) -> agentd::store::StoreResult<Option<agentd::store::TurnRecord>> {
        if self.failing.swap(false, Ordering::SeqCst) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(agentd::store::StoreError::Unavailable(anyhow::anyhow!(
                "the test's store blinked"
            )));
        }
        inner.get_turn(k).await
    }
}

/// A cancel that the store recorded is answered as done, even when the
/// store fails a read just after: UNAVAILABLE would tell the caller that
/// nothing changed (its retry would then read "had ended already").
#[tokio::test]
async fn a_recorded_cancel_is_answered_done_whatever_the_store_does_next() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let hooks = Arc::new(ReadsFailAfterCancel {
        armed: true.into(),
        failing: false.into(),
        injected: AtomicU64::new(0),
    });
    let store = Arc::new(store_wrap::Wrapped {
        inner: db.open().await,
        hooks: hooks.clone(),
    });
    let server = Replica::start(store, "replica-a", Duration::from_secs(10)).await;
    let s = server.session(ALICE).await;
    server.left_running(&s, "r1").await;
    let r = server.cancel(ALICE, &s, "r1").await.unwrap();
    // The cancel's write armed the failure and its read, the next one made
    // (nothing in between yields to another task on this thread), met it.
    assert!(
        !hooks.armed.load(Ordering::SeqCst),
        "the cancel was written"
    );
    assert!(
        !hooks.failing.load(Ordering::SeqCst),
        "the failure armed by the cancel's write was met by a read"
    );
    assert_eq!(hooks.injected.load(Ordering::SeqCst), 1, "reads failed");
    assert!(r.cancelled_now, "{r:?}");
    assert_cancelled_turn(r.turn.as_ref().unwrap());
    assert_cancelled_turn(&server.turn(ALICE, &s, "r1").await);
    server.stop().await;
}

#[tokio::test]
async fn cancelling_a_turn_that_ended_answers_its_state_and_changes_nothing() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = Replica::start(db.open().await, "replica-a", Duration::from_secs(10)).await;
    let s = server.session(ALICE).await;
    let echo = pb::RunRequest {
        agent: "echo".into(),
        ..run_request(ALICE, &s, "r1", "hello")
    };
    let (events, end) = server
        .client
        .clone()
        .run_to_end(echo.clone(), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    let before = server.turn(ALICE, &s, "r1").await;
    assert_eq!(before.state(), pb::TurnState::Completed);

    let r = server.cancel(ALICE, &s, "r1").await.unwrap();
    assert!(!r.cancelled_now);
    assert_eq!(r.turn.as_ref(), Some(&before), "its state, unchanged");
    assert_eq!(server.turn(ALICE, &s, "r1").await, before);
    let (replayed, end) = server
        .client
        .clone()
        .run_to_end(echo, DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(replayed, events, "replayed as it completed");
    server.stop().await;
}

#[tokio::test]
async fn unknown_foreign_and_malformed_turns_are_refused_and_nothing_changes() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = Replica::start(db.open().await, "replica-a", Duration::from_secs(10)).await;
    let s = server.session(ALICE).await;
    server.left_running(&s, "r1").await;
    let unknown_session = uuid::Uuid::new_v4().to_string();
    let cases: [(&str, &str, &str, Code, &str); 10] = [
        (ALICE, &s, "nope", Code::NotFound, "turn not found"),
        (
            ALICE,
            &unknown_session,
            "r1",
            Code::NotFound,
            "session not found",
        ),
        (BOB, &s, "r1", Code::NotFound, "session not found"),
        ("", &s, "r1", Code::InvalidArgument, "user_id is required"),
        ("al ice", &s, "r1", Code::InvalidArgument, "user_id must be"),
        (
            ALICE,
            "",
            "r1",
            Code::InvalidArgument,
            "session_id is required",
        ),
        (
            ALICE,
            "not-a-uuid",
            "r1",
            Code::InvalidArgument,
            "session_id must be a UUID",
        ),
        (
            ALICE,
            &s,
            "",
            Code::InvalidArgument,
            "request_id is required",
        ),
        (
            ALICE,
            &s,
            "bad id!",
            Code::InvalidArgument,
            "request_id must be",
        ),
        (
            ALICE,
            &s,
            &"r".repeat(129),
            Code::InvalidArgument,
            "request_id must be",
        ),
    ];
    for (user, session, request_id, code, message) in cases {
        let req = pb::CancelTurnRequest {
            user_id: user.into(),
            session_id: session.into(),
            request_id: request_id.into(),
        };
        let refused = server
            .client
            .raw()
            .cancel_turn(Request::new(req))
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            code,
            "{user:?} {session:?} {request_id:?}: {refused:?}"
        );
        assert!(
            refused.message().starts_with(message),
            "{user:?} {session:?} {request_id:?}: {refused:?}"
        );
    }
    assert_eq!(
        server.turn(ALICE, &s, "r1").await.state(),
        pb::TurnState::Running,
        "the refused cancels left the turn running"
    );
    assert_eq!(server.counts.stopped(), 0);
    // Its owner's cancel ends it.
    assert!(server.cancel(ALICE, &s, "r1").await.unwrap().cancelled_now);
    server.stop().await;
}

/// A store whose cancel announcements are lost on the way.
struct AnnouncementsLost;

#[async_trait::async_trait]
impl store_wrap::Hooks for AnnouncementsLost {
    async fn announce_cancel(
        &self,
        _inner: &dyn Store,
        _k: &agentd::domain::TurnKey,
    ) -> agentd::store::StoreResult<()> {
        Ok(())
    }
}

/// A CONTINUE run on A, cancelled through B, whose word to A is lost: B
/// records it CANCELLED at once, A stops the run at its next lease renewal
/// (and logs that it was cancelled elsewhere, not that its lease was lost),
/// and every stream on the turn, on either replica, ends CANCELLED.
#[tokio::test]
async fn a_turn_running_on_a_cancelled_through_b_stops_on_a_within_its_lease_renewal() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // Both replicas run on this thread: their logs are captured here.
    let logs = Logs::default();
    let _capture = logs.capture();
    // Long enough that a renewal held up on this busy thread does not let B
    // end the turn as "replica stopped" before the cancel.
    let lease = Duration::from_secs(6);
    let a = Replica::start(db.open().await, "replica-a", lease).await;
    let b_store = Arc::new(store_wrap::Wrapped {
        inner: db.open().await,
        hooks: Arc::new(AnnouncementsLost),
    });
    let b = Replica::start(b_store, "replica-b", lease).await;
    let s = a.session(ALICE).await;
    a.left_running(&s, "r1").await;
    let (on_a, on_b) = (a.attach(&s, "r1"), b.attach(&s, "r1"));
    following(&[&a, &b]).await;

    let r = b.cancel(ALICE, &s, "r1").await.unwrap();
    let acknowledged = tokio::time::Instant::now();
    assert!(r.cancelled_now);
    let t = r.turn.unwrap();
    assert_cancelled_turn(&t);
    assert_eq!(t.owner, "replica-a");
    // A renews its lease every third of it: it stops the run at the next
    // renewal.
    let counts = a.counts.clone();
    eventually("A stops the run", || async {
        (counts.stopped() == 1).then_some(())
    })
    .await;
    let took = acknowledged.elapsed();
    assert!(
        took < lease / 3 + Duration::from_millis(1500),
        "within A's lease renewal period (plus a margin): {took:?}"
    );

    let (mode, _, end) = on_b.await.unwrap();
    assert_eq!(mode, "attach", "B's Attach followed the running turn");
    assert_cancelled(&end, "the Attach on B");
    let (mode, _, end) = on_a.await.unwrap();
    assert_eq!(mode, "attach", "A's Attach followed the running turn");
    assert_cancelled(&end, "the Attach on A");
    for r in [&a, &b] {
        let (mode, _, end) = r.attach(&s, "r1").await.unwrap();
        assert_eq!(mode, "replay");
        assert_cancelled(&end, "an Attach after the cancel");
        assert_cancelled_turn(&r.turn(ALICE, &s, "r1").await);
        assert_replays_cancelled(r, &s, "r1").await;
    }
    let logged = logs.text();
    support_line(&logged, "the turn was cancelled elsewhere (CancelTurn)");
    assert!(
        !logged.contains("lease was lost"),
        "a cancel is not a lost lease:\n{logged}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        (a.counts.started(), a.counts.completed(), b.counts.started()),
        (1, 0, 0),
        "no tool ran after the cancel, anywhere"
    );
    a.stop().await;
    b.stop().await;
}

/// A CONTINUE run on A, cancelled through B, with a lease far longer than
/// the wait: B's word reaches A through the store, and A stops the run at
/// once, long before its next lease renewal; a replay on either replica
/// shows the cancel.
#[tokio::test]
async fn a_turn_running_on_a_cancelled_through_b_stops_on_a_at_once() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let logs = Logs::default();
    let _capture = logs.capture();
    // Renewed every 20 s: a stop within the wait below is B's word.
    let lease = Duration::from_secs(60);
    let a = Replica::start(db.open().await, "replica-a", lease).await;
    let b = Replica::start(db.open().await, "replica-b", lease).await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    listening(&admin, 2).await;
    let s = a.session(ALICE).await;
    a.left_running(&s, "r1").await;
    let on_a = a.attach(&s, "r1");
    following(&[&a]).await;

    let r = b.cancel(ALICE, &s, "r1").await.unwrap();
    assert!(r.cancelled_now);
    assert!(
        stops_within(&a.counts, 1, Duration::from_secs(5)).await,
        "A stopped the run long before its lease renewal"
    );
    let (mode, _, end) = on_a.await.unwrap();
    assert_eq!(mode, "attach", "A's Attach followed the running turn");
    assert_cancelled(&end, "the Attach on A");
    for r in [&a, &b] {
        assert_replays_cancelled(r, &s, "r1").await;
    }
    support_line(
        &logs.text(),
        "the turn was cancelled elsewhere (CancelTurn)",
    );

    // The listening connections cut (a database restart, a proxy's idle
    // timeout): they connect again, and the next cancel is heard as well.
    let cut = listeners(&admin).await;
    assert_eq!(cut.len(), 2, "one listening connection per replica");
    for pid in &cut {
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&admin)
            .await
            .unwrap();
    }
    eventually("both replicas listen again", || async {
        let now = listeners(&admin).await;
        (now.len() == 2 && !now.iter().any(|p| cut.contains(p))).then_some(())
    })
    .await;
    a.left_running(&s, "r2").await;
    let r = b.cancel(ALICE, &s, "r2").await.unwrap();
    assert!(r.cancelled_now);
    assert!(
        stops_within(&a.counts, 2, Duration::from_secs(5)).await,
        "A heard the cancel after its connection was cut"
    );
    assert_eq!(
        (a.counts.started(), a.counts.completed(), b.counts.started()),
        (2, 0, 0),
        "no tool ran after the cancels, anywhere"
    );
    a.stop().await;
    b.stop().await;
}

/// A CONTINUE run on A, cancelled through B while A shuts down (waiting
/// for its runs to end): A still hears B's word through the store and
/// stops the run at once, not at its next lease renewal, and its shutdown
/// ends with it.
#[tokio::test]
async fn a_turn_running_on_a_draining_replica_cancelled_through_another_stops_at_once() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // Renewed every 20 s: a stop within the wait below is B's word.
    let lease = Duration::from_secs(60);
    let a = Replica::start(db.open().await, "replica-a", lease).await;
    let b = Replica::start(db.open().await, "replica-b", lease).await;
    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    listening(&admin, 2).await;
    let s = a.session(ALICE).await;
    a.left_running(&s, "r1").await;

    // A's shutdown, waiting (its grace is 70 s) for the run.
    let (a_turns, a_counts) = (a.turns.clone(), a.counts.clone());
    let a_stopped = tokio::spawn(a.stop());
    eventually("A drains", || async { a_turns.is_draining().then_some(()) }).await;

    let r = b.cancel(ALICE, &s, "r1").await.unwrap();
    assert!(r.cancelled_now);
    assert!(
        stops_within(&a_counts, 1, Duration::from_secs(5)).await,
        "A stopped the run long before its lease renewal"
    );
    tokio::time::timeout(Duration::from_secs(10), a_stopped)
        .await
        .expect("A's shutdown ends with its run")
        .unwrap();
    assert_replays_cancelled(&b, &s, "r1").await;
    b.stop().await;
}

/// The server processes of this database listening for announcements.
async fn listeners(admin: &sqlx::PgPool) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(admin)
    .await
    .unwrap()
}

/// Waits (bounded) until `n` connections of this database listen.
async fn listening(admin: &sqlx::PgPool, n: usize) {
    eventually("the replicas listen for cancels", || async {
        (listeners(admin).await.len() == n).then_some(())
    })
    .await;
}

/// Whether `counts` shows `n` runs stopped within `within`.
async fn stops_within(counts: &Counts, n: u64, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        while counts.stopped() < n {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok()
}

/// The line of `logs` with `message`, at INFO.
fn support_line(logs: &str, message: &str) {
    let line = log_capture::line_with(logs, &[message]);
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["level"], "INFO", "{line}");
}
