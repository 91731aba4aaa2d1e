//! How a turn's end is recorded, and how a call's status says so: a final
//! answer the writer took is the turn's, whatever becomes of its delivery;
//! the `recorded` trailer only on an outcome the store confirmed; a repeat
//! is the same message (text and agent); a follower's own bound is its own.

mod store_wrap;

use std::sync::Arc;
use std::time::Duration;

use agentd::agent::synthetic::{Echo, Streamer};
use agentd::agent::{Agent, AgentRegistry, Event, EventStream, RunContext};
use agentd::domain::{OnDisconnect, RequestId, RunInput, TurnKey, UserId, UserText};
use agentd::grpc::status::{self, TURN_OUTCOME_HEADER};
use agentd::pb;
use agentd::store::memory::MemoryStore;
use agentd::store::{Store, StoreError, StoreResult, TurnOutcome, TurnRecord};
use agentd::turn::{Failure, Mode, RunError, RunStream, SlowConsumer, TurnConfig, Turns};
use futures::StreamExt;
use tonic::Code;

/// Echo and the `stream` agent, echo the default.
fn agents() -> AgentRegistry {
    let agents: Vec<Arc<dyn Agent>> = vec![Arc::new(Echo), Arc::new(Streamer)];
    AgentRegistry::new(agents, "echo").unwrap()
}

/// A new session of alice's and the input of its turn `r1`: `text` to
/// `agent` (`None`: the default).
async fn first_turn(store: &dyn Store, text: &str, agent: Option<&str>) -> RunInput {
    let user = UserId::parse("alice").unwrap();
    let session = store.create_session(&user).await.unwrap();
    RunInput {
        user_id: user,
        key: TurnKey {
            session_id: session.id,
            request_id: RequestId::parse("r1").unwrap(),
        },
        generated_request_id: false,
        text: UserText::parse(text.into(), 100).unwrap(),
        agent: agent.map(str::to_owned),
        on_disconnect: OnDisconnect::Cancel,
    }
}

/// Every event of a stream, and how it ended.
async fn read_all(mut stream: RunStream) -> (Vec<pb::AgentEvent>, Result<(), Failure>) {
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(e) => events.push(e),
            Err(f) => return (events, Err(f)),
        }
    }
    (events, Ok(()))
}

/// Waits (bounded) until `check` holds.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    for _ in 0..2000 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("gave up waiting for {what}");
}

/// The turn `key` once it has ended (bounded wait).
async fn ended(store: &dyn Store, key: &TurnKey) -> TurnRecord {
    until("the turn to end", || async {
        store
            .get_turn(key)
            .await
            .unwrap()
            .is_some_and(|t| t.state.is_terminal())
    })
    .await;
    store.get_turn(key).await.unwrap().unwrap()
}

/// The call's status for a stream that ended with `f`: its code, its
/// message, and whether it carries the `recorded` trailer.
fn status_of(f: Failure) -> (Code, String, bool) {
    let s = status::failure(f, false);
    let recorded = s.metadata().get(TURN_OUTCOME_HEADER).is_some();
    (s.code(), s.message().to_owned(), recorded)
}

/// What ends the call whose final event waits for room in a full channel.
enum Stuck {
    /// Nothing: a `--slow-consumer fail` stall ends it.
    Stall,
    /// The call's own deadline (under `--slow-consumer wait`).
    Deadline,
    /// Its client goes away (under `wait`).
    ClientGone,
    /// The shutdown's cut (under `wait`).
    Cut,
}

/// A turn of the `stream` agent (one partial, then the final answer) into
/// a channel of one event that nobody reads, so the final event waits for
/// room after the writer took it, until `how` ends the call. The call's
/// end (none when its client went away), the turn as stored, and a
/// repeat's replay on a second engine.
async fn final_answer_stuck(
    how: Stuck,
) -> (
    Option<Result<(), Failure>>,
    TurnRecord,
    (Mode, Vec<pb::AgentEvent>, Result<(), Failure>),
) {
    let store = Arc::new(MemoryStore::new());
    let cfg = TurnConfig {
        channel_capacity: 1,
        slow_consumer: match how {
            Stuck::Stall => SlowConsumer::Fail,
            _ => SlowConsumer::Wait,
        },
        stall_timeout: Duration::from_secs(1),
        ..TurnConfig::default()
    };
    let turns = Turns::new(store.clone(), agents(), cfg);
    let input = first_turn(&*store, "n=1", Some("stream")).await;
    let key = input.key.clone();
    let timeout = matches!(how, Stuck::Deadline).then_some(Duration::from_secs(1));
    let started = turns.start(input.clone(), timeout).await.unwrap();
    assert_eq!(started.mode, Mode::New);
    let stream = started.stream;
    until("both events to be stored", || async {
        store.events_after(&key, None, 10).await.unwrap().len() == 2
    })
    .await;
    let stream = match how {
        Stuck::ClientGone => {
            drop(stream);
            None
        }
        Stuck::Cut => {
            turns.cut_all();
            Some(stream)
        }
        Stuck::Stall | Stuck::Deadline => Some(stream),
    };
    let stored = ended(&*store, &key).await;
    let end = match stream {
        Some(s) => Some(read_all(s).await.1),
        None => None,
    };
    turns.begin_drain();
    turns.wait_idle().await;

    let again = Turns::new(store.clone(), agents(), TurnConfig::default());
    let replay = again.start(input, None).await.unwrap();
    let mode = replay.mode;
    let (events, replay_end) = read_all(replay.stream).await;
    (end, stored, (mode, events, replay_end))
}

/// The turn is recorded OK and replays as a clean end after its final
/// event.
fn assert_completed(stored: &TurnRecord, replay: (Mode, Vec<pb::AgentEvent>, Result<(), Failure>)) {
    let outcome = stored.outcome.clone().unwrap();
    assert_eq!(
        Code::from(outcome.code),
        Code::Ok,
        "recorded {outcome:?} for a turn whose final answer is stored"
    );
    let (mode, events, end) = replay;
    assert_eq!(mode, Mode::Replay);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[1].is_final);
    if let Err(f) = end {
        panic!("the replay ended with {f:?} after the final event");
    }
}

/// A reader that stalls on the final event (`--slow-consumer fail`): the
/// call ends RESOURCE_EXHAUSTED, not recorded; the turn is recorded OK.
#[tokio::test(start_paused = true)]
async fn a_final_answer_a_stalled_reader_did_not_take_is_recorded_ok() {
    let (end, stored, replay) = final_answer_stuck(Stuck::Stall).await;
    assert_completed(&stored, replay);
    let f = end
        .unwrap()
        .expect_err("the call could not deliver its end");
    let (code, message, recorded) = status_of(f);
    assert_eq!(code, Code::ResourceExhausted, "{message}");
    assert!(!recorded, "the call's end is not the turn's: {message}");
    // A slow-consumer termination, as any stalled reader's; not an agent
    // run cancelled (it had finished).
    let metrics = agentd::telemetry::metrics::render();
    assert!(
        metrics
            .lines()
            .any(|l| l == "agentd_slow_consumer_terminations_total 1"),
        "{metrics}"
    );
}

/// The call's deadline passes while its final event waits for room: the
/// call ends DEADLINE_EXCEEDED, not recorded; the turn is recorded OK.
#[tokio::test(start_paused = true)]
async fn a_final_answer_past_the_calls_deadline_is_recorded_ok() {
    let (end, stored, replay) = final_answer_stuck(Stuck::Deadline).await;
    assert_completed(&stored, replay);
    let (code, message, recorded) = status_of(end.unwrap().unwrap_err());
    assert_eq!(code, Code::DeadlineExceeded, "{message}");
    assert!(!recorded, "{message}");
}

/// The client goes away (ON_DISCONNECT_CANCEL) while its final event waits
/// for room: the turn is recorded OK, not CANCELLED.
#[tokio::test(start_paused = true)]
async fn a_final_answer_whose_client_went_away_is_recorded_ok() {
    let (end, stored, replay) = final_answer_stuck(Stuck::ClientGone).await;
    assert!(end.is_none());
    assert_completed(&stored, replay);
}

/// The shutdown's cut while the final event waits for room: the call ends
/// UNAVAILABLE without the trailer (a retry replays the turn), and the turn
/// is recorded OK.
#[tokio::test(start_paused = true)]
async fn a_final_answer_cut_by_the_shutdown_is_recorded_ok() {
    let (end, stored, replay) = final_answer_stuck(Stuck::Cut).await;
    assert_completed(&stored, replay);
    let (code, message, recorded) = status_of(end.unwrap().unwrap_err());
    assert_eq!(code, Code::Unavailable, "{message}");
    assert!(!recorded, "{message}");
}

/// A store that never records an outcome: every write of one fails as a
/// database that is away does.
struct NoOutcomes;

#[async_trait::async_trait]
impl store_wrap::Hooks for NoOutcomes {
    async fn finish_turn(
        &self,
        _: &dyn Store,
        _: &TurnKey,
        _: &TurnOutcome,
        _: Option<agentd::store::FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        Err(StoreError::Unavailable(anyhow::anyhow!(
            "the database is away"
        )))
    }
    async fn append_and_finish(
        &self,
        _: &dyn Store,
        _: &TurnKey,
        _: Vec<agentd::store::EncodedEvent>,
        _: &TurnOutcome,
        _: Option<agentd::store::FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        Err(StoreError::Unavailable(anyhow::anyhow!(
            "the database is away"
        )))
    }
}

/// A run that fails on its own (here its input is invalid) whose outcome
/// could not be stored ends UNAVAILABLE without the `recorded` trailer, as
/// an OK run does: a resend with the same request id gets the turn once it
/// is stored, not this status.
#[tokio::test(start_paused = true)]
async fn a_failed_run_whose_outcome_was_not_stored_is_not_marked_recorded() {
    let store = Arc::new(store_wrap::Wrapped {
        inner: Arc::new(MemoryStore::new()),
        hooks: Arc::new(NoOutcomes),
    });
    let cfg = TurnConfig {
        lease: Duration::from_millis(300),
        ..TurnConfig::default()
    };
    let turns = Turns::new(store.clone(), agents(), cfg);
    let input = first_turn(&*store, "bogus=1", Some("stream")).await;
    let key = input.key.clone();
    let (events, end) = read_all(turns.start(input, None).await.unwrap().stream).await;
    assert!(events.is_empty());
    let (code, message, recorded) = status_of(end.unwrap_err());
    assert_eq!(code, Code::Unavailable, "{message}");
    assert!(!recorded, "nothing was recorded: {message}");
    let turn = store.get_turn(&key).await.unwrap().unwrap();
    assert!(!turn.state.is_terminal(), "{:?}", turn.state);
    turns.begin_drain();
    turns.wait_idle().await;
}

/// Yields one event, then waits for ever.
struct OneThenWaits;

impl Agent for OneThenWaits {
    fn name(&self) -> &str {
        "waits"
    }
    fn description(&self) -> &str {
        "Yields one event, then waits for ever."
    }
    fn run(&self, _ctx: RunContext, _input: String) -> EventStream {
        Box::pin(async_stream::stream! {
            yield Ok(Event::partial("waits", "x".into()));
            std::future::pending::<()>().await;
        })
    }
}

fn waiting_agents() -> AgentRegistry {
    AgentRegistry::new(vec![Arc::new(OneThenWaits) as Arc<dyn Agent>], "waits").unwrap()
}

/// A run cut by the shutdown still ends UNAVAILABLE with the `recorded`
/// trailer when its outcome is stored: the cut waits for the writer's
/// write of it rather than ending the call unconfirmed.
#[tokio::test(start_paused = true)]
async fn a_run_cut_by_the_shutdown_ends_recorded_once_its_outcome_is_stored() {
    let store = Arc::new(MemoryStore::new());
    let turns = Turns::new(store.clone(), waiting_agents(), TurnConfig::default());
    let input = first_turn(&*store, "go", None).await;
    let key = input.key.clone();
    let mut stream = turns.start(input, None).await.unwrap().stream;
    stream.next().await.unwrap().unwrap();
    turns.begin_drain();
    turns.cut_all();
    let (_, end) = read_all(stream).await;
    let (code, message, recorded) = status_of(end.unwrap_err());
    assert_eq!(code, Code::Unavailable, "{message}");
    assert!(recorded, "the cut turn's outcome is stored: {message}");
    let outcome = store
        .get_turn(&key)
        .await
        .unwrap()
        .unwrap()
        .outcome
        .unwrap();
    assert_eq!(Code::from(outcome.code), Code::Unavailable);
    turns.wait_idle().await;
}

/// A repeated request id naming another agent than its turn's is refused
/// as a request id reused for a different message, not answered with the
/// other agent's turn.
#[tokio::test]
async fn a_repeat_naming_another_agent_is_refused_as_a_reused_request_id() {
    let store = Arc::new(MemoryStore::new());
    let turns = Turns::new(store.clone(), agents(), TurnConfig::default());
    let input = first_turn(&*store, "n=1", Some("stream")).await;
    let (_, end) = read_all(turns.start(input.clone(), None).await.unwrap().stream).await;
    end.unwrap();
    let other = RunInput {
        agent: Some("echo".into()),
        ..input.clone()
    };
    match turns.start(other, None).await {
        Err(RunError::RequestIdReused) => {}
        Err(e) => panic!("refused with {e:?}"),
        Ok(s) => panic!("answered as {:?}", s.mode),
    }
    // Naming its own agent, or none, is the same message.
    let same = turns.start(input.clone(), None).await.unwrap();
    assert_eq!(same.mode, Mode::Replay);
    let unnamed = RunInput {
        agent: None,
        ..input
    };
    assert_eq!(turns.start(unnamed, None).await.unwrap().mode, Mode::Replay);
    turns.begin_drain();
    turns.wait_idle().await;
}

/// A repeat naming an agent this server no longer serves is still
/// answered from its stored turn; a new turn for that agent is refused.
#[tokio::test]
async fn a_repeat_naming_an_agent_no_longer_served_replays_its_turn() {
    let store = Arc::new(MemoryStore::new());
    let before = Turns::new(store.clone(), agents(), TurnConfig::default());
    let input = first_turn(&*store, "n=1", Some("stream")).await;
    let (events, end) = read_all(before.start(input.clone(), None).await.unwrap().stream).await;
    end.unwrap();
    before.begin_drain();
    before.wait_idle().await;

    let echo_only: Vec<Arc<dyn Agent>> = vec![Arc::new(Echo)];
    let after = Turns::new(
        store.clone(),
        AgentRegistry::new(echo_only, "echo").unwrap(),
        TurnConfig::default(),
    );
    let replay = match after.start(input.clone(), None).await {
        Ok(s) => s,
        Err(e) => panic!("refused with {e:?}"),
    };
    assert_eq!(replay.mode, Mode::Replay);
    let (replayed, end) = read_all(replay.stream).await;
    end.unwrap();
    assert_eq!(replayed, events);

    let new = RunInput {
        key: TurnKey {
            request_id: RequestId::parse("r2").unwrap(),
            ..input.key.clone()
        },
        ..input
    };
    assert!(matches!(
        after.start(new, None).await,
        Err(RunError::UnknownAgent)
    ));
    after.begin_drain();
    after.wait_idle().await;
}

/// A follower held past its server's maximum run duration is told that
/// following it took too long, not that the turn ran too long: the turn
/// goes on (here on another engine over the same store).
#[tokio::test(start_paused = true)]
async fn a_follower_past_the_servers_maximum_duration_is_not_told_the_run_exceeded_it() {
    let store = Arc::new(MemoryStore::new());
    let running = Turns::new(store.clone(), waiting_agents(), TurnConfig::default());
    let input = first_turn(&*store, "go", None).await;
    let key = input.key.clone();
    let mut run = running.start(input, None).await.unwrap().stream;
    run.next().await.unwrap().unwrap();

    let following = Turns::new(
        store.clone(),
        waiting_agents(),
        TurnConfig {
            max_run_duration: Duration::from_secs(1),
            ..TurnConfig::default()
        },
    );
    let user = UserId::parse("alice").unwrap();
    let attached = following
        .attach(&user, key.clone(), None, None)
        .await
        .unwrap();
    assert_eq!(attached.mode, Mode::Attach);
    let (events, end) = read_all(attached.stream).await;
    assert_eq!(events.len(), 1);
    let (code, message, recorded) = status_of(end.unwrap_err());
    assert_eq!(code, Code::DeadlineExceeded, "{message}");
    assert!(!recorded, "{message}");
    assert!(message.contains("following the turn"), "{message}");
    assert!(!message.contains("the run exceeded"), "{message}");
    let turn = store.get_turn(&key).await.unwrap().unwrap();
    assert!(
        !turn.state.is_terminal(),
        "the turn goes on: {:?}",
        turn.state
    );
    drop(run);
    running.begin_drain();
    running.wait_idle().await;
    following.begin_drain();
    following.wait_idle().await;
}
