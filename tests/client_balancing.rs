//! The client over several replicas behind one name: balancing, replicas
//! leaving and joining, deadlines, and retries that keep the request_id.
//!
//! Each test starts real servers on 127.0.0.1:0 and puts them behind one
//! name with an in-memory resolver it changes as the test goes. The replicas
//! share one store, as replicas on PostgreSQL do, so a session created
//! through any of them is known to all and dedup spans them.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentd::agent::{Agent, AgentError, AgentRegistry, Event, EventStream, RunContext, synthetic};
use agentd::client::{ATTEMPTS_METADATA, AgentClient, ClientConfig, RetryPolicy, StaticResolver};
use agentd::domain::{RequestId, SessionId, TurnKey};
use agentd::pb;
use agentd::server::ServerOptions;
use agentd::store::Store;
use agentd::store::memory::MemoryStore;
use agentd::turn::{TurnConfig, Turns};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::Code;

/// Answers with the name of the replica that ran it, and keeps count.
struct WhoAmI {
    replica: String,
    runs: Arc<AtomicUsize>,
    /// Time left before the run's deadline, as each run saw it.
    deadlines: Arc<Mutex<Vec<Duration>>>,
}

impl Agent for WhoAmI {
    fn name(&self) -> &str {
        "whoami"
    }
    fn description(&self) -> &str {
        "Answers with the replica's name."
    }
    fn run(&self, ctx: RunContext, _input: String) -> EventStream {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let left = ctx
            .deadline
            .saturating_duration_since(tokio::time::Instant::now());
        self.deadlines.lock().unwrap().push(left);
        let answer = Event::final_answer("whoami", self.replica.clone());
        Box::pin(futures::stream::once(async move { Ok(answer) }))
    }
}

/// Fails with UNAVAILABLE before any event, like a model that is down.
struct Unavailable {
    runs: Arc<AtomicUsize>,
}

impl Agent for Unavailable {
    fn name(&self) -> &str {
        "unavailable"
    }
    fn description(&self) -> &str {
        "Always fails as a model that is down would."
    }
    fn run(&self, _ctx: RunContext, _input: String) -> EventStream {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let err = AgentError::Unavailable {
            message: "the model is unavailable".into(),
            retry_after: None,
        };
        Box::pin(futures::stream::once(async move { Err(err) }))
    }
}

struct Replica {
    name: String,
    /// Runs of the `unavailable` agent here.
    flaky_runs: Arc<AtomicUsize>,
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    deadlines: Arc<Mutex<Vec<Duration>>>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<anyhow::Result<()>>>,
}

impl Replica {
    async fn start(name: &str, store: Arc<MemoryStore>, opts: ServerOptions) -> Replica {
        Self::start_at("127.0.0.1:0".parse().unwrap(), name, store, opts).await
    }

    async fn start_at(
        bind: SocketAddr,
        name: &str,
        store: Arc<MemoryStore>,
        opts: ServerOptions,
    ) -> Replica {
        let runs = Arc::new(AtomicUsize::new(0));
        let flaky_runs = Arc::new(AtomicUsize::new(0));
        let deadlines = Arc::new(Mutex::new(Vec::new()));
        let agents: Vec<Arc<dyn Agent>> = vec![
            Arc::new(WhoAmI {
                replica: name.to_owned(),
                runs: runs.clone(),
                deadlines: deadlines.clone(),
            }),
            Arc::new(Unavailable {
                runs: flaky_runs.clone(),
            }),
            Arc::new(synthetic::Streamer),
        ];
        let registry = AgentRegistry::new(agents, "whoami").unwrap();
        let cfg = TurnConfig {
            replica_id: name.to_owned(),
            max_run_duration: Duration::from_secs(600),
            ..TurnConfig::default()
        };
        let turns = Turns::new(store, registry, cfg);
        let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(agentd::server::run(listener, turns, opts, async {
            let _ = stopped.await;
        }));
        Replica {
            name: name.to_owned(),
            flaky_runs,
            addr,
            runs,
            deadlines,
            stop: Some(stop),
            server: Some(server),
        }
    }

    /// Starts the shutdown sequence (NOT_SERVING, drain delay, ...).
    fn begin_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Shuts down and waits until the server has exited.
    async fn stop(&mut self) {
        self.begin_shutdown();
        if let Some(server) = self.server.take() {
            tokio::time::timeout(Duration::from_secs(20), server)
                .await
                .expect("server stops")
                .unwrap()
                .unwrap();
        }
    }
}

fn quick_shutdown() -> ServerOptions {
    ServerOptions {
        drain_delay: Duration::ZERO,
        shutdown_grace: Duration::from_secs(2),
        ..ServerOptions::default()
    }
}

/// Re-resolves only when a test calls `refresh()`, and retries quickly.
fn client_config() -> ClientConfig {
    ClientConfig {
        resolve_interval: Duration::from_secs(3600),
        retry: RetryPolicy {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
            multiplier: 2.0,
        },
        ..ClientConfig::default()
    }
}

const NAME: &str = "agents.test";

async fn cluster(n: usize, store: &Arc<MemoryStore>) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for i in 0..n {
        replicas
            .push(Replica::start(&format!("replica-{i}"), store.clone(), quick_shutdown()).await);
    }
    replicas
}

fn addrs<'a>(replicas: impl IntoIterator<Item = &'a Replica>) -> Vec<SocketAddr> {
    replicas.into_iter().map(|r| r.addr).collect()
}

async fn connect(resolver: &StaticResolver, cfg: ClientConfig) -> AgentClient {
    AgentClient::balanced(NAME, 50051, Arc::new(resolver.clone()), cfg)
        .await
        .unwrap()
}

/// A client that does not watch the replicas' health: a replica that is
/// gone stays in its balancer, and calls sent there fail.
async fn connect_unwatched(resolver: &StaticResolver) -> AgentClient {
    connect(
        resolver,
        ClientConfig {
            health_check: false,
            ..client_config()
        },
    )
    .await
}

/// Waits (bounded) until the balancer's addresses satisfy `ok`.
async fn wait_for_endpoints(client: &AgentClient, ok: impl Fn(&BTreeSet<SocketAddr>) -> bool) {
    let mut endpoints = client.endpoints().expect("a dns target");
    tokio::time::timeout(Duration::from_secs(10), endpoints.wait_for(|set| ok(set)))
        .await
        .expect("the balancer reached the expected addresses in time")
        .unwrap();
}

struct Answer {
    replica: String,
    request_id: String,
    attempts: u32,
}

fn run_request(session: &str, request_id: &str) -> pb::RunRequest {
    pb::RunRequest {
        user_id: "u1".into(),
        session_id: session.into(),
        text: "who are you?".into(),
        request_id: request_id.into(),
        ..Default::default()
    }
}

/// One `whoami` turn to its end; panics on any failure.
async fn ask(client: &mut AgentClient, session: &str, request_id: &str) -> Answer {
    let mut call = client
        .run(run_request(session, request_id), Duration::from_secs(20))
        .await
        .expect("run starts");
    let mut replica = None;
    while let Some(e) = call.events.message().await.expect("run succeeds") {
        if e.is_final {
            replica = Some(e.text);
        }
    }
    Answer {
        replica: replica.expect("a final answer"),
        request_id: call.request_id.clone(),
        attempts: call.attempts(),
    }
}

async fn ask_many(client: &mut AgentClient, session: &str, n: usize) -> Vec<Answer> {
    let mut answers = Vec::new();
    for _ in 0..n {
        answers.push(ask(client, session, "").await);
    }
    answers
}

fn per_replica(answers: &[Answer]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for a in answers {
        *counts.entry(a.replica.clone()).or_default() += 1;
    }
    counts
}

#[tokio::test]
async fn calls_spread_across_every_replica_behind_one_name() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(3, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    let answers = ask_many(&mut client, &session, 60).await;

    let counts = per_replica(&answers);
    for r in &replicas {
        // Uniform choice: a replica missing from 60 calls has odds of 3·(2/3)^60.
        assert!(
            counts.get(&r.name).copied().unwrap_or(0) > 0,
            "{} served no call: {counts:?}",
            r.name
        );
        assert_eq!(
            r.runs.load(Ordering::SeqCst),
            counts[&r.name],
            "each answer is one run on that replica"
        );
    }
    assert!(
        answers.iter().all(|a| a.attempts == 1),
        "no call needed a retry"
    );
}

/// A name with more addresses than the balancer takes before its first
/// call (it reads its queue only when a call comes) connects, and an idle
/// client refreshes; before, the first resolve waited on the full queue
/// forever.
#[tokio::test]
async fn a_name_with_more_addresses_than_the_balancer_queue_connects_and_refreshes() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(1, &store).await;
    for extra in [200usize, 1500] {
        // One live replica among many addresses nothing listens on.
        let mut listed = addrs(&replicas);
        listed.extend((0..extra).map(|i| SocketAddr::from(([127, 0, 0, 1], 1 + i as u16))));
        let resolver = StaticResolver::new(listed.clone());
        let cfg = ClientConfig {
            health_check: false,
            ..client_config()
        };
        let client = tokio::time::timeout(
            Duration::from_secs(10),
            AgentClient::balanced(NAME, 50051, Arc::new(resolver.clone()), cfg),
        )
        .await
        .expect("connecting did not wait on the balancer")
        .unwrap();
        let seen = client.endpoints().unwrap().borrow().clone();
        assert!(
            !seen.is_empty() && seen.len() <= listed.len(),
            "{}",
            seen.len()
        );
        // Refreshing an idle client whose balancer queue may be full returns.
        tokio::time::timeout(Duration::from_secs(10), client.refresh())
            .await
            .expect("a refresh did not wait on the balancer");
    }
}

#[tokio::test]
async fn a_draining_replica_gets_no_new_calls() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(2, &store).await;
    // Drains for a long time: NOT_SERVING, yet still accepting calls, as a
    // terminating pod does during its drain delay.
    let mut draining = Replica::start(
        "draining",
        store.clone(),
        ServerOptions {
            drain_delay: Duration::from_secs(60),
            ..quick_shutdown()
        },
    )
    .await;
    let resolver = StaticResolver::new(addrs(replicas.iter().chain([&draining])));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;
    wait_for_endpoints(&client, |s| s.len() == 3).await;

    draining.begin_shutdown();
    wait_for_endpoints(&client, |s| !s.contains(&draining.addr)).await;
    let answers = ask_many(&mut client, &session, 30).await;

    let counts = per_replica(&answers);
    assert_eq!(counts.get("draining"), None, "{counts:?}");
    assert_eq!(
        counts.len(),
        2,
        "the other replicas share the calls: {counts:?}"
    );
    assert!(answers.iter().all(|a| a.attempts == 1));
    for r in &mut replicas {
        r.stop().await;
    }
}

#[tokio::test]
async fn a_replica_that_stops_is_left_out_and_its_calls_move_to_the_others() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(3, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;
    let before = per_replica(&ask_many(&mut client, &session, 30).await);
    assert_eq!(before.len(), 3, "{before:?}");

    let mut gone = replicas.pop().unwrap();
    gone.stop().await;
    let runs_before = gone.runs.load(Ordering::SeqCst);
    // Still listed (DNS lags behind), yet every call succeeds.
    let after = ask_many(&mut client, &session, 30).await;
    let counts = per_replica(&after);
    assert_eq!(counts.get(&gone.name), None, "{counts:?}");
    assert_eq!(gone.runs.load(Ordering::SeqCst), runs_before);
    wait_for_endpoints(&client, |s| !s.contains(&gone.addr)).await;

    // Once the name drops it, it is gone from the balancer for good.
    resolver.set(addrs(&replicas));
    client.refresh().await;
    assert_eq!(
        *client.endpoints().unwrap().borrow(),
        addrs(&replicas).into_iter().collect::<BTreeSet<_>>()
    );
    let answers = ask_many(&mut client, &session, 20).await;
    assert!(
        answers
            .iter()
            .all(|a| a.attempts == 1 && a.replica != gone.name)
    );
}

#[tokio::test]
async fn a_replica_that_comes_back_on_its_address_is_used_again() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(2, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    let addr = replicas[1].addr;
    replicas[1].stop().await;
    wait_for_endpoints(&client, |s| !s.contains(&addr)).await;
    // The same address serves again (a restarted process), without any
    // change to the name: its health watch sees it and it rejoins.
    let back = Replica::start_at(addr, "back", store.clone(), quick_shutdown()).await;
    wait_for_endpoints(&client, |s| s.contains(&addr)).await;

    let mut served_by_back = 0;
    for _ in 0..200 {
        if ask(&mut client, &session, "").await.replica == "back" {
            served_by_back += 1;
            if served_by_back == 3 {
                break;
            }
        }
    }
    assert_eq!(served_by_back, 3, "the replica that came back takes calls");
    assert_eq!(back.runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_replica_added_later_is_used_after_the_next_resolve() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(2, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    // Real periodic re-resolution, short for the test.
    let cfg = ClientConfig {
        resolve_interval: Duration::from_millis(100),
        ..client_config()
    };
    let mut client = connect(&resolver, cfg).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    let added = Replica::start("added", store.clone(), quick_shutdown()).await;
    resolver.set(addrs(replicas.iter().chain([&added])));
    wait_for_endpoints(&client, |s| s.contains(&added.addr)).await;

    let mut served_by_added = 0;
    for _ in 0..200 {
        if ask(&mut client, &session, "").await.replica == "added" {
            served_by_added += 1;
            if served_by_added == 3 {
                break;
            }
        }
    }
    assert_eq!(served_by_added, 3, "the added replica takes calls");
    assert_eq!(added.runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn unavailable_before_any_event_is_retried_with_the_same_request_id() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(2, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    // Without health watching, the stopped replica stays in the balancer and
    // every call sent to it is refused (connection refused: UNAVAILABLE).
    let mut client = connect_unwatched(&resolver).await;
    let session = client.create_session("u1").await.unwrap().session_id;
    let mut stopped = replicas.remove(0);
    stopped.stop().await;
    let alive = &replicas[0];

    let mut answers = Vec::new();
    for i in 0..30 {
        // Half name their request, half leave it to the client.
        let rid = if i % 2 == 0 {
            format!("req-{i}")
        } else {
            String::new()
        };
        let a = ask(&mut client, &session, &rid).await;
        if !rid.is_empty() {
            assert_eq!(a.request_id, rid, "a retry never changes the request_id");
        }
        answers.push(a);
    }

    assert!(answers.iter().all(|a| a.replica == alive.name));
    let retried = answers.iter().filter(|a| a.attempts > 1).count();
    // Each call picks the stopped replica first with odds ½: none of 30 is 2^-30.
    assert!(
        retried > 0,
        "some calls were sent to the stopped replica and retried"
    );
    assert_eq!(
        alive.runs.load(Ordering::SeqCst),
        30,
        "every turn ran exactly once"
    );
    let session = SessionId::parse(&session).unwrap();
    let mut ids = BTreeSet::new();
    for a in &answers {
        assert!(
            !a.request_id.is_empty() && !a.request_id.starts_with("gen-"),
            "the client chose the id: {}",
            a.request_id
        );
        let key = TurnKey {
            session_id: session,
            request_id: RequestId::parse(a.request_id.clone()).unwrap(),
        };
        let turn = store
            .get_turn(&key)
            .await
            .unwrap()
            .expect("the turn is stored under the call's request_id");
        assert_eq!(turn.owner, alive.name);
        ids.insert(a.request_id.clone());
    }
    assert_eq!(ids.len(), 30, "one request_id per call");

    // Sending a generated id again is the same turn: replayed, not rerun.
    let again = answers.iter().find(|a| a.attempts == 1).unwrap();
    let call = client
        .run(
            run_request(&session.to_string(), &again.request_id),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(call.mode, "replay");
    assert_eq!(alive.runs.load(Ordering::SeqCst), 30);
}

/// A replica whose shutdown cuts what runs there after 300 ms.
async fn cutting_replica(store: Arc<MemoryStore>) -> Replica {
    Replica::start(
        "cutting",
        store,
        ServerOptions {
            drain_delay: Duration::ZERO,
            shutdown_grace: Duration::from_millis(300),
            ..quick_shutdown()
        },
    )
    .await
}

#[tokio::test]
async fn a_run_that_fails_after_an_event_is_not_retried() {
    let store = Arc::new(MemoryStore::new());
    let mut cutting = cutting_replica(store.clone()).await;
    let other = Replica::start("other", store.clone(), quick_shutdown()).await;
    let resolver = StaticResolver::new([cutting.addr]);
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;
    // The other replica joins, so a (wrong) retry would have somewhere to go.
    resolver.set([cutting.addr, other.addr]);

    let mut req = run_request(&session, "long-one");
    req.agent = "stream".into();
    req.text = "n=1000 rate=20".into();
    let mut call = client.run(req, Duration::from_secs(30)).await.unwrap();
    let first = call.events.message().await.unwrap().expect("a first event");
    assert_eq!(first.seq, 0);
    client.refresh().await;
    cutting.begin_shutdown();
    let status = cut_status(&mut call).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(call.attempts(), 1, "events had arrived: not retried");
    cutting.stop().await;
}

/// A Run following a turn that runs on another replica, cut after its
/// first event by its own replica's shutdown, ends UNAVAILABLE without a
/// recorded outcome (retryable on its own), and is still not retried: its
/// events were delivered, and a retry would deliver them again.
#[tokio::test]
async fn a_follower_cut_after_an_event_is_not_retried() {
    let store = Arc::new(MemoryStore::new());
    let mut cutting = cutting_replica(store.clone()).await;
    let mut runner = Replica::start("runner", store.clone(), quick_shutdown()).await;
    let mut direct = agentd::client::AgentClient::connect(&format!("http://{}", runner.addr))
        .await
        .unwrap();
    let session = direct.create_session("u1").await.unwrap().session_id;
    let mut req = run_request(&session, "long-one");
    req.agent = "stream".into();
    req.text = "n=1000 rate=20".into();
    let mut on_runner = direct
        .run(req.clone(), Duration::from_secs(30))
        .await
        .unwrap();
    on_runner
        .events
        .message()
        .await
        .unwrap()
        .expect("the turn runs");

    // The same request id through a client that knows only `cutting` yet:
    // it follows the turn there.
    let resolver = StaticResolver::new([cutting.addr]);
    let mut client = connect(&resolver, client_config()).await;
    let mut call = client.run(req, Duration::from_secs(30)).await.unwrap();
    assert_eq!(call.mode, "attach");
    call.events.message().await.unwrap().expect("a first event");
    resolver.set([cutting.addr, runner.addr]);
    client.refresh().await;
    cutting.begin_shutdown();
    let status = cut_status(&mut call).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        agentd::client::retry::run_is_retryable(&status),
        "cut with no recorded outcome: {status:?}"
    );
    assert_eq!(call.attempts(), 1, "events had arrived: not retried");
    drop(on_runner);
    cutting.stop().await;
    runner.stop().await;
}

/// The status a Run expected to be cut ends with (bounded wait).
async fn cut_status(call: &mut agentd::client::RunCall) -> tonic::Status {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), call.events.message())
            .await
            .expect("the run ends")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the run was expected to be cut"),
            Err(s) => return s,
        }
    }
}

fn attempts_of(s: &tonic::Status) -> Option<u32> {
    s.metadata()
        .get(ATTEMPTS_METADATA)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

#[tokio::test]
async fn retries_are_bounded_by_the_policy() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(1, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect_unwatched(&resolver).await;
    let session = client.create_session("u1").await.unwrap().session_id;
    replicas[0].stop().await;

    let err = match client
        .run(run_request(&session, "r1"), Duration::from_secs(20))
        .await
    {
        Ok(_) => panic!("no replica is up"),
        Err(s) => s,
    };
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(
        attempts_of(&err),
        Some(client_config().retry.max_attempts),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_recorded_turn_failure_is_not_retried_and_the_agent_runs_once() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(2, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    // The agent fails with UNAVAILABLE before any event. That status is the
    // turn's recorded outcome (a resend with the same request_id would only
    // replay it), so the client returns it at once instead of retrying.
    let mut req = run_request(&session, "flaky-1");
    req.agent = "unavailable".into();
    let status = match client.run(req, Duration::from_secs(20)).await {
        Err(s) => s,
        Ok(mut call) => match call.events.message().await {
            Ok(Some(e)) => panic!("no event expected: {e:?}"),
            Ok(None) => panic!("the run was expected to fail"),
            Err(s) => s,
        },
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        attempts_of(&status),
        Some(1),
        "a recorded outcome is final: {status:?}"
    );
    assert!(
        status.metadata().get("agentd-turn-outcome").is_some(),
        "{status:?}"
    );
    let ran: usize = replicas
        .iter()
        .map(|r| r.flaky_runs.load(Ordering::SeqCst))
        .sum();
    assert_eq!(ran, 1, "the agent ran once");
}

#[tokio::test]
async fn create_session_is_resent_when_no_connection_could_be_made() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(2, &store).await;
    // The first replica is gone before the client connects anywhere, so
    // every attempt sent its way finds nothing listening: the request
    // never left. (A connection made just before a replica stops may carry
    // a request and then break; that one is not resent, see below.)
    replicas[0].stop().await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect_unwatched(&resolver).await;
    for _ in 0..20 {
        // Half of the first attempts go to the stopped replica.
        let s = client
            .create_session("u1")
            .await
            .expect("resent to the live replica");
        assert_eq!(s.user_id, "u1");
    }
}

/// A Run waiting for its first event on a connection that breaks (a
/// network failure, a replica's pod torn down) is sent again with the same
/// request_id and attaches to the turn; a CreateSession whose connection
/// breaks after it reached the server is sent again with its request id,
/// and answered the session the first attempt made.
#[tokio::test]
async fn a_call_whose_connection_breaks_is_resent_with_its_request_id_and_runs_or_creates_once() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(1, &store).await;
    let proxy = common::Proxy::start(replicas[0].addr).await;
    let resolver = StaticResolver::new(vec![proxy.addr]);
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    let mut req = run_request(&session, "broken-1");
    req.agent = "stream".into();
    req.text = "n=3 wait=1s".into();
    req.on_disconnect = pb::OnDisconnect::Continue as i32;
    let mut runner = client.clone();
    let run = tokio::spawn(async move {
        let mut call = runner.run(req, Duration::from_secs(20)).await?;
        let mut events = Vec::new();
        while let Some(e) = call.events.message().await? {
            events.push(e);
        }
        Ok::<_, tonic::Status>((events, call.events.attempts()))
    });
    let key = TurnKey {
        session_id: SessionId::parse(&session).unwrap(),
        request_id: RequestId::parse("broken-1".to_owned()).unwrap(),
    };
    let claimed = async {
        while store.get_turn(&key).await.unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), claimed)
        .await
        .expect("the turn started");
    let cut_at = proxy.accepted.load(Ordering::SeqCst);
    proxy.cut();

    let (events, attempts) = run.await.unwrap().expect("resent and attached");
    assert_eq!(attempts, 2, "one resend");
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3], "every event once, in order");
    assert!(events.last().unwrap().is_final);
    assert!(
        proxy.accepted.load(Ordering::SeqCst) > cut_at,
        "the resend made a new connection"
    );
    let turn = store.get_turn(&key).await.unwrap().unwrap();
    assert_eq!(turn.owner, replicas[0].name, "one turn, run once");

    // A CreateSession whose connection breaks after the server got it: the
    // session exists, its answer is lost, and the call is sent again with
    // its request id, on a connection that carries the answer.
    let muted = common::Proxy::muted(replicas[0].addr).await;
    let resolver = StaticResolver::new(vec![muted.addr]);
    let mut client = connect_unwatched(&resolver).await;
    let user = agentd::domain::UserId::parse("u2".to_owned()).unwrap();
    let create = tokio::spawn(async move { client.create_session("u2").await });
    let created = async {
        while store
            .list_sessions(&user, 10, None)
            .await
            .unwrap()
            .sessions
            .is_empty()
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), created)
        .await
        .expect("the server created the session");
    let cut_at = muted.accepted.load(Ordering::SeqCst);
    muted.unmute();
    muted.cut();
    let made = create.await.unwrap().expect("sent again and answered");
    assert!(
        muted.accepted.load(Ordering::SeqCst) > cut_at,
        "the resend made a new connection"
    );
    let sessions = store.list_sessions(&user, 10, None).await.unwrap().sessions;
    assert_eq!(sessions.len(), 1, "one session");
    assert_eq!(
        made.session_id,
        sessions[0].id.to_string(),
        "the one made first"
    );
}

/// A replica that begins to shut down as a call arrives answers it with a
/// GOAWAY that names the call's stream as not processed: the call never
/// reached the service, so even a CreateSession is sent again, and one
/// session is made.
#[tokio::test]
async fn a_call_refused_by_goaway_before_it_was_processed_is_sent_again() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(1, &store).await;
    let refusing = common::Refusing::start(replicas[0].addr).await;
    let resolver = StaticResolver::new(vec![refusing.addr]);
    let mut client = connect_unwatched(&resolver).await;
    let made = client.create_session("u3").await;
    assert_eq!(
        refusing.refused.load(Ordering::SeqCst),
        1,
        "the first was refused"
    );
    let made = made.expect("sent again");
    assert_eq!(made.user_id, "u3");
    let user = agentd::domain::UserId::parse("u3".to_owned()).unwrap();
    let sessions = store.list_sessions(&user, 10, None).await.unwrap().sessions;
    assert_eq!(sessions.len(), 1, "one session");

    // A Run so refused: sent again, and run once.
    let refusing = common::Refusing::start(replicas[0].addr).await;
    let resolver = StaticResolver::new(vec![refusing.addr]);
    let mut client = connect_unwatched(&resolver).await;
    let mut req = run_request(&made.session_id, "refused-1");
    req.user_id = "u3".into();
    let mut call = client.run(req, Duration::from_secs(20)).await.unwrap();
    let mut events = Vec::new();
    while let Some(e) = call.events.message().await.expect("completed") {
        events.push(e);
    }
    assert_eq!(refusing.refused.load(Ordering::SeqCst), 1);
    assert_eq!(call.events.attempts(), 2);
    assert!(events.last().is_some_and(|e| e.is_final), "{events:?}");
    assert_eq!(replicas[0].runs.load(Ordering::SeqCst), 1, "run once");
}

#[tokio::test]
async fn every_call_carries_a_deadline() {
    let store = Arc::new(MemoryStore::new());
    let replicas = cluster(1, &store).await;
    let resolver = StaticResolver::new(addrs(&replicas));
    let mut client = connect(&resolver, client_config()).await;
    let session = client.create_session("u1").await.unwrap().session_id;

    // The default: 120 s (the server's own limit here is 600 s).
    let mut call = client
        .run_default(run_request(&session, "d1"))
        .await
        .unwrap();
    while call.events.message().await.unwrap().is_some() {}
    // A chosen one.
    let mut call = client
        .run(run_request(&session, "d2"), Duration::from_secs(3))
        .await
        .unwrap();
    while call.events.message().await.unwrap().is_some() {}

    let seen = replicas[0].deadlines.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert!(
        seen[0] <= Duration::from_secs(120) && seen[0] > Duration::from_secs(100),
        "{:?}",
        seen[0]
    );
    assert!(seen[1] <= Duration::from_secs(3), "{:?}", seen[1]);
}

#[tokio::test]
async fn a_server_that_never_answers_is_cut_by_the_client_deadline() {
    let silent = common::Silent::start().await;
    let resolver = StaticResolver::new([silent.addr]);
    let mut client = connect_unwatched(&resolver).await;
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        client.run(
            run_request("00000000-0000-4000-8000-000000000000", "x"),
            Duration::from_millis(300),
        ),
    )
    .await
    .expect("the client gives up by itself");
    match result {
        Ok(_) => panic!("a silent server cannot start a run"),
        Err(s) => assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}"),
    }
}

#[tokio::test]
async fn the_cli_balances_over_a_dns_name() {
    let store = Arc::new(MemoryStore::new());
    let mut replicas = cluster(1, &store).await;
    // `localhost` goes through the system resolver.
    let server = format!("dns:///localhost:{}", replicas[0].addr.port());
    let cli = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
                .args(args)
                .output()
                .unwrap()
        })
    };
    let out = cli(vec![
        "session".into(),
        "create".into(),
        "--server".into(),
        server.clone(),
        "--user".into(),
        "u1".into(),
    ])
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let session = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let out = cli(vec![
        "run".into(),
        "--server".into(),
        server,
        "--resolve-interval".into(),
        "1s".into(),
        "--user".into(),
        "u1".into(),
        "--session".into(),
        session,
        "hello".into(),
    ])
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("replica-0"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    replicas[0].stop().await;
}
