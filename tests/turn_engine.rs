//! The turn engine as a library: what a server does not expose over the wire.

mod store_wrap;

use std::sync::Arc;

use agentd::agent::synthetic::Echo;
use agentd::agent::{Agent, AgentRegistry};
use agentd::domain::{RequestId, RunInput, TurnKey, UserId, UserText};
use agentd::store::Store;
use agentd::store::memory::MemoryStore;
use agentd::turn::{RunError, TurnConfig, Turns};

#[tokio::test]
async fn a_draining_engine_refuses_new_runs_and_stores_nothing() {
    let store = Arc::new(MemoryStore::new());
    let agents = AgentRegistry::new(vec![Arc::new(Echo) as Arc<dyn Agent>], "echo").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    let (input, key) = first_turn(&*store, "hi").await;
    turns.begin_drain();
    assert!(matches!(
        turns.start(input, None).await,
        Err(RunError::ShuttingDown)
    ));
    assert!(store.get_turn(&key).await.unwrap().is_none());
    turns.wait_idle().await;
}

#[test]
fn the_default_agent_must_be_served() {
    let err = AgentRegistry::new(vec![Arc::new(Echo) as Arc<dyn Agent>], "order_helper")
        .err()
        .unwrap();
    assert!(err.to_string().contains("order_helper"), "{err}");
}

/// On SQLite a Run's events are stored with their kinds by number (12
/// bytes less each than by name) and are replayed as they were sent.
#[tokio::test]
async fn on_sqlite_a_runs_events_are_stored_with_kinds_by_number_and_replay_as_sent() {
    use agentd::agent::demo::OrderHelper;
    use agentd::store::KindEncoding;
    use futures::StreamExt;

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("a.db");
    let store = agentd::store::open(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    assert_eq!(store.kind_encoding(), KindEncoding::Code);
    let agent = Arc::new(OrderHelper::new(std::time::Duration::ZERO)) as Arc<dyn Agent>;
    let agents = AgentRegistry::new(vec![agent], "order_helper").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    let (input, key) = first_turn(&*store, "Where is order 1187?").await;
    let started = turns.start(input, None).await.unwrap();
    let sent: Vec<_> = started
        .stream
        .map(|e| e.expect("the run ends with its final answer"))
        .collect()
        .await;
    assert_eq!(sent.len(), 3, "{sent:?}");
    let stored = store.events_after(&key, None, 100).await.unwrap();
    let as_sent: Vec<_> = sent
        .iter()
        .map(|e| (e.seq, e.kind, e.text.clone()))
        .collect();
    let as_stored: Vec<_> = stored
        .iter()
        .map(|e| {
            let wire = agentd::grpc::convert::into_wire(e.seq, e.event.clone());
            (wire.seq, wire.kind, wire.text)
        })
        .collect();
    assert_eq!(as_stored, as_sent);

    // The rows themselves: no kind written out by name.
    let log = sqlx::SqlitePool::connect(&format!("sqlite://{}-events?mode=ro", db.display()))
        .await
        .unwrap();
    let blobs: Vec<Vec<u8>> = sqlx::query_scalar("SELECT events FROM event_log")
        .fetch_all(&log)
        .await
        .unwrap();
    let bytes: Vec<u8> = blobs.concat();
    assert!(!bytes.is_empty());
    for name in ["tool_call", "tool_result", "final_answer"] {
        assert!(
            !bytes.windows(name.len()).any(|w| w == name.as_bytes()),
            "{name} stored by name"
        );
    }
    turns.begin_drain();
    turns.wait_idle().await;
}

/// A new session of alice's and the input of its turn `r1` saying `text`.
async fn first_turn(store: &dyn Store, text: &str) -> (RunInput, TurnKey) {
    let user = UserId::parse("alice").unwrap();
    let session = store.create_session(&user).await.unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let input = RunInput {
        user_id: user,
        key: key.clone(),
        generated_request_id: false,
        text: UserText::parse(text.into(), 100).unwrap(),
        agent: None,
        on_disconnect: Default::default(),
    };
    (input, key)
}

/// How [`Late`] delays the outcome's write.
#[derive(Clone, Copy, PartialEq)]
enum Lateness {
    /// The write lands, and its answer comes a whole lease later.
    AnswersLate,
    /// The first write lands, and is reported failed (as a write that
    /// outlasted `--store-timeout` and committed after all).
    ReportedFailed,
    /// Events are never stored: every append waits for ever (a store that
    /// stopped answering, without its timeout).
    Stalled,
    /// The first two outcome writes fail without writing (a failover).
    RefusesTwice,
}

/// The outcome writes and event appends of a memory store, landing but
/// answering late or wrongly ([`Lateness`]).
struct Late {
    how: Lateness,
    wait: std::time::Duration,
    failed_once: std::sync::atomic::AtomicBool,
    refused: std::sync::atomic::AtomicUsize,
}

impl Late {
    /// A memory store with these hooks.
    fn store(how: Lateness, wait: std::time::Duration) -> Arc<store_wrap::Wrapped> {
        Arc::new(store_wrap::Wrapped {
            inner: Arc::new(MemoryStore::new()),
            hooks: Arc::new(Late {
                how,
                wait,
                failed_once: Default::default(),
                refused: Default::default(),
            }),
        })
    }

    async fn after_write(&self, written: bool) -> agentd::store::StoreResult<bool> {
        use std::sync::atomic::Ordering;
        match self.how {
            Lateness::AnswersLate => {
                tokio::time::sleep(self.wait).await;
                Ok(written)
            }
            Lateness::ReportedFailed if !self.failed_once.swap(true, Ordering::SeqCst) => Err(
                agentd::store::StoreError::Unavailable(anyhow::anyhow!("no answer in time")),
            ),
            Lateness::ReportedFailed | Lateness::Stalled | Lateness::RefusesTwice => Ok(written),
        }
    }

    /// An outcome write (`write`, not started yet): refused unwritten, or
    /// written and then answered as [`Lateness`] says.
    async fn outcome_write(
        &self,
        write: impl std::future::Future<Output = agentd::store::StoreResult<bool>>,
    ) -> agentd::store::StoreResult<bool> {
        use std::sync::atomic::Ordering;
        if self.how == Lateness::RefusesTwice && self.refused.fetch_add(1, Ordering::SeqCst) < 2 {
            return Err(agentd::store::StoreError::Unavailable(anyhow::anyhow!(
                "failover"
            )));
        }
        let written = write.await?;
        self.after_write(written).await
    }
}

#[async_trait::async_trait]
impl store_wrap::Hooks for Late {
    async fn append_encoded(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        e: Vec<agentd::store::EncodedEvent>,
    ) -> agentd::store::StoreResult<()> {
        if self.how == Lateness::Stalled {
            std::future::pending::<()>().await;
        }
        inner.append_encoded(k, e).await
    }
    async fn finish_turn(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        o: &agentd::store::TurnOutcome,
        a: Option<agentd::store::FinalAnswer<'_>>,
    ) -> agentd::store::StoreResult<bool> {
        self.outcome_write(inner.finish_turn(k, o, a)).await
    }
    async fn append_and_finish(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        e: Vec<agentd::store::EncodedEvent>,
        o: &agentd::store::TurnOutcome,
        a: Option<agentd::store::FinalAnswer<'_>>,
    ) -> agentd::store::StoreResult<bool> {
        self.outcome_write(inner.append_and_finish(k, e, o, a))
            .await
    }
}

/// One turn of the demo agent on a [`Late`] store with a 300 ms lease:
/// the stream's end, and the turn as stored.
async fn run_on_late_store(
    how: Lateness,
) -> (Result<(), agentd::turn::Failure>, agentd::store::TurnRecord) {
    use agentd::agent::demo::OrderHelper;
    use futures::StreamExt;
    let lease = std::time::Duration::from_millis(300);
    let store = Late::store(how, lease * 2);
    let agent = Arc::new(OrderHelper::new(std::time::Duration::ZERO)) as Arc<dyn Agent>;
    let agents = AgentRegistry::new(vec![agent], "order_helper").unwrap();
    let cfg = TurnConfig {
        lease,
        ..TurnConfig::default()
    };
    let turns = Turns::new(store.clone(), agents, cfg);
    let (input, key) = first_turn(&*store, "Where is order 1187?").await;
    let mut stream = turns.start(input, None).await.unwrap().stream;
    let mut end = Ok(());
    while let Some(e) = stream.next().await {
        if let Err(f) = e {
            end = Err(f);
        }
    }
    let stored = store.get_turn(&key).await.unwrap().unwrap();
    turns.begin_drain();
    turns.wait_idle().await;
    (end, stored)
}

/// A lease renewal that finds the turn ended because its outcome's write
/// just landed is not a lost lease: the run ends OK, as stored (it ended
/// UNAVAILABLE "replica stopped" when the renewal came before the write's
/// answer).
#[tokio::test]
async fn a_renewal_that_finds_the_outcome_written_does_not_fail_the_run() {
    let (end, stored) = run_on_late_store(Lateness::AnswersLate).await;
    assert_eq!(stored.outcome.unwrap().code, tonic::Code::Ok as i32);
    if let Err(f) = end {
        panic!("the run ended with {f:?}");
    }
}

/// An outcome's write reported failed that landed after all: the run ends
/// as the store has it (OK), not as a lost lease telling the client to run
/// the turn again under a new request id.
#[tokio::test]
async fn an_outcome_write_reported_failed_that_landed_ends_the_run_as_stored() {
    let (end, stored) = run_on_late_store(Lateness::ReportedFailed).await;
    assert_eq!(stored.outcome.unwrap().code, tonic::Code::Ok as i32);
    if let Err(f) = end {
        panic!("the run ended with {f:?}");
    }
}

/// Streams text for ever; says when its stream is dropped.
struct Endless(Arc<std::sync::atomic::AtomicBool>);

struct SetOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Agent for Endless {
    fn name(&self) -> &str {
        "endless"
    }
    fn description(&self) -> &str {
        "Streams text for ever."
    }
    fn run(&self, _ctx: agentd::agent::RunContext, _input: String) -> agentd::agent::EventStream {
        let guard = SetOnDrop(self.0.clone());
        Box::pin(async_stream::stream! {
            let _guard = guard;
            loop {
                yield Ok(agentd::agent::Event::partial("endless", "x".into()));
                tokio::task::yield_now().await;
            }
        })
    }
}

/// A client that goes away while its run waits for room in the turn
/// writer's queue (the store stalled, the queue full) stops the run at
/// once: the agent's stream (its model call, its tools) is dropped, not
/// kept until the store answers again.
#[tokio::test]
async fn a_client_gone_while_its_run_waits_on_a_stalled_store_stops_the_run() {
    use futures::StreamExt;
    use std::sync::atomic::Ordering;
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let store = Late::store(Lateness::Stalled, std::time::Duration::ZERO);
    let agent = Arc::new(Endless(dropped.clone())) as Arc<dyn Agent>;
    let agents = AgentRegistry::new(vec![agent], "endless").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    let (input, _key) = first_turn(&*store, "go").await;
    let mut stream = turns.start(input, None).await.unwrap().stream;
    // Read until no event comes for a while: the run waits on the store.
    let mut read = 0u64;
    while let Ok(Some(e)) =
        tokio::time::timeout(std::time::Duration::from_millis(300), stream.next()).await
    {
        e.unwrap();
        read += 1;
    }
    assert!(read > 1000, "read {read} events");
    assert!(!dropped.load(Ordering::SeqCst));
    drop(stream);
    let stopped = async {
        while !dropped.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), stopped)
        .await
        .expect("the agent's stream was not dropped when its client went away");
}

/// An outcome whose writes fail for a moment (a failover) is written again
/// while the turn's lease would last: the turn ends with a definite
/// outcome, not left running until its lease makes it "replica stopped".
#[tokio::test]
async fn an_outcome_write_that_fails_for_a_moment_is_written_again() {
    let (end, stored) = run_on_late_store(Lateness::RefusesTwice).await;
    assert!(
        stored.state.is_terminal(),
        "the turn was left {:?}",
        stored.state
    );
    // Its events' write failed with the first outcome's: it ends
    // UNAVAILABLE, stored so, and the run says the same.
    let outcome = stored.outcome.unwrap();
    assert_eq!(outcome.code, tonic::Code::Unavailable as i32);
    assert!(
        matches!(end, Err(agentd::turn::Failure::Store(_))),
        "{end:?}"
    );
}

/// What the shutdown's logs count: agent runs and followers, not the
/// engine's tasks (a run is three: its pump, writer and lease keeper).
#[tokio::test]
async fn runs_and_followers_in_flight_count_calls_not_tasks() {
    let store = Arc::new(MemoryStore::new());
    let agent = Arc::new(Endless(Default::default())) as Arc<dyn Agent>;
    let agents = AgentRegistry::new(vec![agent], "endless").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    assert_eq!(
        (turns.runs_in_flight(), turns.followers_in_flight()),
        (0, 0)
    );
    let (input, _key) = first_turn(&*store, "go").await;
    let run = turns.start(input.clone(), None).await.unwrap();
    let repeat = turns.start(input, None).await.unwrap();
    assert_eq!(repeat.mode, agentd::turn::Mode::Attach);
    assert_eq!(
        (turns.runs_in_flight(), turns.followers_in_flight()),
        (1, 1)
    );
    assert!(turns.in_flight() > 2, "{}", turns.in_flight());
    drop((run, repeat));
}

/// A store whose writes hang (the sweep of expired leases never returns)
/// and whose reads then fail: the health checks go on beside the sweep, so
/// the engine still learns the store is down and refuses new runs.
#[tokio::test]
async fn a_sweep_that_hangs_holds_up_no_health_check() {
    use agentd::store::{StoreError, StoreResult, TurnOutcome};
    struct Hanging {
        down: std::sync::atomic::AtomicBool,
    }
    #[async_trait::async_trait]
    impl store_wrap::Hooks for Hanging {
        async fn fail_expired(&self, _: &dyn Store, _: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
            std::future::pending().await
        }
        async fn ping(&self, inner: &dyn Store) -> StoreResult<()> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Unavailable(anyhow::anyhow!(
                    "the database is away"
                )));
            }
            inner.ping().await
        }
    }
    let hooks = Arc::new(Hanging {
        down: Default::default(),
    });
    let store = Arc::new(store_wrap::Wrapped {
        inner: Arc::new(MemoryStore::new()),
        hooks: hooks.clone(),
    });
    let agents: Vec<Arc<dyn Agent>> = vec![Arc::new(Echo)];
    let turns = Turns::new(
        store,
        AgentRegistry::new(agents, "echo").unwrap(),
        TurnConfig {
            store_check: std::time::Duration::from_millis(50),
            ..TurnConfig::default()
        },
    );
    let upkeep = tokio::spawn(turns.upkeep());
    // Let the sweep start (and hang) behind a good health check.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    hooks.down.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut health = turns.store_health();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        health.wait_for(|ok| !*ok),
    )
    .await
    .expect("the health check saw the store go down")
    .unwrap();
    upkeep.abort();
}

/// A follower of a turn running elsewhere whose lease looks expired by this
/// replica's clock, while the store (whose clock decides, and here runs
/// behind it) ends nothing: the follower waits its poll interval as for a
/// live turn instead of asking the store to end it again at once, in a
/// loop that used to hammer the store for as long as the clocks disagreed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_whose_clock_runs_ahead_of_the_stores_does_not_hammer_the_sweep() {
    use agentd::store::{NewTurn, StoreResult, TurnOutcome};
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Behind {
        sweeps: AtomicUsize,
    }
    #[async_trait::async_trait]
    impl store_wrap::Hooks for Behind {
        async fn fail_expired(&self, _: &dyn Store, _: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
            self.sweeps.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
            Ok(Vec::new())
        }
    }
    let inner = Arc::new(MemoryStore::new());
    let hooks = Arc::new(Behind {
        sweeps: AtomicUsize::new(0),
    });
    let store = Arc::new(store_wrap::Wrapped {
        inner: inner.clone(),
        hooks: hooks.clone(),
    });
    let agents = AgentRegistry::new(vec![Arc::new(Echo) as Arc<dyn Agent>], "echo").unwrap();
    let config = TurnConfig::default();
    let poll = config.follow_poll;
    let turns = Turns::new(store, agents, config);
    let (input, key) = first_turn(&*inner, "hi").await;
    // Claimed by another replica, its lease already past by this clock.
    inner
        .claim_turn(&NewTurn {
            key: key.clone(),
            user_text: "hi".into(),
            agent: "echo".into(),
            owner: "replica-elsewhere".into(),
            lease: std::time::Duration::ZERO,
        })
        .await
        .unwrap();
    let started = turns
        .attach(
            &input.user_id,
            key,
            None,
            Some(std::time::Duration::from_secs(30)),
        )
        .await
        .unwrap();
    assert_eq!(started.mode, agentd::turn::Mode::Attach);
    let watched = std::time::Duration::from_millis(500);
    tokio::time::sleep(watched).await;
    let sweeps = hooks.sweeps.load(Ordering::SeqCst);
    drop(started);
    let most = (watched.as_millis() / poll.as_millis()) as usize + 3;
    assert!(
        (1..=most).contains(&sweeps),
        "one sweep per poll at most ({most} in {watched:?}), got {sweeps}"
    );
}
