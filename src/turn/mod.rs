//! One turn, from claim to final status: dedup on the request id, the pump
//! that bridges an agent's event stream to a bounded channel, cancellation,
//! deadlines, the slow-consumer policy, and attaching to a turn in progress.
//!
//! ```text
//! Turns::start ─▶ store.claim_turn ─▶ New: spawn pump ─▶ bounded mpsc ─▶ RunStream
//!                                      │       └─▶ writer (group commit) ─▶ store
//!                                      └▶ Existing: spawn follower (store + live progress)
//! ```
//!
//! A model-backed agent's run starts beside the claim, up to its first
//! event, and goes to the pump if the claim is won; it is dropped if not.

mod follow;
mod pump;
mod stream;
mod upkeep;

/// How long a run may hold its stream past its deadline while its outcome
/// is stored (the start-up check of `--shutdown-grace` counts it).
pub(crate) use pump::OUTCOME_WAIT;

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use thiserror::Error;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use stream::RunStream;

use crate::agent::{AgentError, AgentRegistry, EventStream, PriorTurn, RunContext};
use crate::domain::{RequestId, RunInput, SessionId, TurnKey, UserId};
use crate::store::{Claim, Deletion, NewTurn, Session, Store, StoreError, TurnOutcome, TurnRecord};

/// What to do when a client does not read and the channel is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SlowConsumer {
    /// Back-pressure the agent until the client reads (or the deadline).
    Wait,
    /// End the call with RESOURCE_EXHAUSTED after `stall_timeout`, and
    /// cancel the run (a CONTINUE run goes on without the client).
    Fail,
}

impl SlowConsumer {
    /// Resolves when a reader that has not made room for `stall_timeout`
    /// is to be given up on: never under `Wait`.
    pub(crate) async fn given_up(self, stall_timeout: Duration) {
        match self {
            SlowConsumer::Fail => tokio::time::sleep(stall_timeout).await,
            SlowConsumer::Wait => std::future::pending().await,
        }
    }
}

/// The knobs of the bridge. See `config::ServeArgs` for what each means.
#[derive(Debug, Clone)]
pub struct TurnConfig {
    /// Events buffered per call between the agent and the client.
    pub channel_capacity: usize,
    pub slow_consumer: SlowConsumer,
    /// How long a full channel may stay full under `Fail`.
    pub stall_timeout: Duration,
    /// Upper bound of every run, whatever the client's deadline.
    pub max_run_duration: Duration,
    /// Agent runs in flight at once, process-wide.
    pub max_concurrent_runs: usize,
    /// Agent runs one user may have in flight at once, in this process;
    /// `None`: only `max_concurrent_runs` bounds them.
    pub max_runs_per_user: Option<usize>,
    /// Streams following a turn (replays, attaches, repeated request ids)
    /// at once, process-wide: each polls the store while its turn runs
    /// elsewhere.
    pub max_followers: usize,
    /// Names this process in the turn side table.
    pub replica_id: String,
    /// How many earlier turns an agent gets as conversation memory.
    pub history_turns: usize,
    /// The most bytes of questions, answers and answers' payloads in that
    /// memory; the oldest turns go first.
    pub history_bytes: usize,
    /// Start no agent before its turn is claimed, even one that could start
    /// beside the claim ([`crate::agent::Agent::starts_before_claim`]).
    pub claim_first: bool,
    /// How often a follower re-reads a turn that no live pump here feeds.
    pub follow_poll: Duration,
    /// How long a claimed turn stays ours without renewal. The owner renews
    /// it every third of this while the turn runs; once a lease has expired
    /// (the replica died) the turn is failed with UNAVAILABLE, never re-run.
    pub lease: Duration,
    /// Terminal turns older than this are pruned; `None` keeps them forever.
    pub retain_turns: Option<Duration>,
    /// Sessions with no turns, last updated longer ago than this, are
    /// deleted; `None` keeps them forever.
    pub retain_sessions: Option<Duration>,
    /// How often the store is pinged (health) and expired leases are swept.
    pub store_check: Duration,
}

impl Default for TurnConfig {
    fn default() -> Self {
        Self {
            channel_capacity: 256,
            slow_consumer: SlowConsumer::Fail,
            stall_timeout: Duration::from_secs(30),
            max_run_duration: Duration::from_secs(120),
            max_concurrent_runs: 1024,
            max_runs_per_user: None,
            max_followers: 4096,
            replica_id: "local".into(),
            history_turns: 20,
            history_bytes: 1024 * 1024,
            claim_first: false,
            follow_poll: Duration::from_millis(50),
            lease: Duration::from_secs(10),
            retain_turns: None,
            retain_sessions: None,
            store_check: Duration::from_secs(1),
        }
    }
}

/// The newest turns of `history` (oldest first) whose questions, answers
/// and answers' payloads fit in `budget` bytes together, oldest first.
fn newest_within(mut history: Vec<PriorTurn>, budget: usize) -> Vec<PriorTurn> {
    let mut used = 0usize;
    let keep = history
        .iter()
        .rev()
        .take_while(|t| {
            used = used.saturating_add(t.bytes());
            used <= budget
        })
        .count();
    let dropped = history.len() - keep;
    if dropped > 0 {
        tracing::debug!(
            dropped,
            budget,
            "older turns left out of the history: over --history-bytes"
        );
    }
    history.drain(..dropped);
    history
}

/// Runs in flight per user; a user with none has no entry.
type UserRuns = Mutex<HashMap<UserId, usize>>;

/// A run's place under the caps, held for the life of the run: the
/// process-wide permit and, with a per-user bound, its user's share.
pub(crate) struct RunSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    user: Option<(Arc<UserRuns>, UserId)>,
}

impl Drop for RunSlot {
    fn drop(&mut self) {
        if let Some((runs, user)) = self.user.take() {
            let mut runs = runs.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = runs.get_mut(&user) {
                *n -= 1;
                if *n == 0 {
                    runs.remove(&user);
                }
            }
        }
    }
}

/// The cause of a call refused without asking the store, because its last
/// health check failed. The outage is logged once, when the health check
/// first fails; a refusal for it is logged at debug only, not once per call
/// ([`crate::grpc::status::store`]), where a real store call that fails
/// keeps its warning.
#[derive(Debug, Error)]
#[error("the last store health check failed")]
pub struct StoreDown;

/// Why a Run was refused before its stream started. Nothing was run, and
/// nothing was stored, for any of these.
#[derive(Debug, Error)]
pub enum RunError {
    #[error("session not found")]
    SessionNotFound,
    #[error("unknown agent")]
    UnknownAgent,
    #[error("request_id was already used for a different message in this session")]
    RequestIdReused,
    #[error("too many runs in progress ({limit})")]
    Busy { limit: usize },
    #[error("too many runs in progress for this user ({limit})")]
    UserBusy { limit: usize },
    #[error("too many streams following turns ({limit})")]
    TooManyFollowers { limit: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("turn not found")]
    TurnNotFound,
    #[error("the session has a turn in progress")]
    SessionBusy,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How a stream ended other than with its final event.
#[derive(Debug, Error)]
pub enum Failure {
    #[error("deadline exceeded")]
    Deadline {
        /// True when the server's maximum run duration, not the client's
        /// deadline, cut the run.
        by_server: bool,
    },
    #[error("the client stopped reading")]
    SlowConsumer,
    #[error("the server shut down before the run finished")]
    Shutdown,
    #[error("the client went away")]
    ClientGone,
    #[error("agent failed: {0}")]
    Agent(#[from] AgentError),
    #[error("the agent ended without a final answer")]
    NoFinalAnswer,
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The stored outcome of a turn that ran earlier (replay).
    #[error("stored outcome {0:?}")]
    Stored(TurnOutcome),
    /// This replica's lease on the turn lapsed and the turn was marked
    /// failed (its replica taken for stopped): the run stops here too, so
    /// that nothing runs on for a turn whose callers were told it ended.
    #[error("the turn's lease was lost")]
    LeaseLost,
    /// CancelTurn ended the turn (its outcome is in the store already):
    /// served here, or on another replica and seen at the lease renewal.
    #[error("the turn was cancelled by CancelTurn")]
    CancelledByRequest,
    /// The turn a follower streamed was removed meanwhile (its session
    /// deleted, or pruned past the retention): nothing more can be told.
    #[error("the turn was removed while it was followed")]
    Removed,
    /// A follower (Attach, or a repeat that joined a running turn) stopped
    /// for a reason of its own (this server's shutdown, its call's deadline,
    /// its client): the turn goes on, or ends, where it runs, and nothing of
    /// this is recorded.
    #[error("stopped following the turn: {0}")]
    StoppedFollowing(Box<Failure>),
    /// The turn completed (its final event and outcome went to the store),
    /// but this call could not deliver its end: its reader stalled, went
    /// away or ran out of time, or the server was cut. Only this call ends
    /// so; the turn is recorded OK, and a repeat of its request id replays
    /// it.
    #[error("the final event was not delivered: {0}")]
    Undelivered(Box<Failure>),
}

impl Failure {
    /// Failures after which buffered events are not worth delivering: the
    /// caller is too slow or out of time, so the status goes out first.
    fn discards_buffer(&self) -> bool {
        match self {
            Failure::StoppedFollowing(f) | Failure::Undelivered(f) => f.discards_buffer(),
            f => matches!(f, Failure::SlowConsumer | Failure::Deadline { .. }),
        }
    }

    /// A follower's failure: its own reasons to stop are not the turn's.
    pub(crate) fn of_follower(self) -> Failure {
        match self {
            f @ (Failure::Shutdown
            | Failure::Deadline { .. }
            | Failure::ClientGone
            | Failure::SlowConsumer) => Failure::StoppedFollowing(Box::new(f)),
            f => f,
        }
    }
}

/// Whether a Run started a new turn or joined an existing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The agent runs now.
    New,
    /// The turn had ended: its stored events and status are replayed.
    Replay,
    /// The turn is running: events so far, then live.
    Attach,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::New => "new",
            Mode::Replay => "replay",
            Mode::Attach => "attach",
        }
    }
}

pub struct Started {
    pub request_id: RequestId,
    pub mode: Mode,
    pub stream: RunStream,
}

/// Progress of a running turn's event log, published by its writer so that
/// followers in this process wake as soon as events are stored.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    /// Every seq up to this one is in the store.
    stored_through: Option<u64>,
    /// The outcome is stored too.
    done: bool,
    /// A batch of events could not be stored: the log has a hole, so the
    /// run must end (UNAVAILABLE) rather than go on unrecorded.
    store_failed: bool,
    /// The outcome was not recorded: the turn had been failed under its
    /// writer (its lease ran out), and that outcome stands.
    superseded: bool,
    /// The outcome's write failed: the turn is still `running` in the
    /// store (until its lease ends it).
    outcome_failed: bool,
}

/// A turn whose pump runs in this process.
struct LiveTurn {
    /// Its writer's progress, for followers here.
    progress: watch::Receiver<Progress>,
    /// Stops its run, for CancelTurn.
    cancel: pump::CancelHandle,
}

/// The turns running in this process, and the ones CancelTurn ended here
/// between their claim and their pump's start.
#[derive(Default)]
struct LiveTurns {
    runs: HashMap<TurnKey, LiveTurn>,
    /// Turns claimed by this replica that CancelTurn ended before their
    /// pump was in `runs`: the pump, once started, stops at once. One whose
    /// pump never comes (it had ended already) is dropped after a lease.
    cancelled_early: HashMap<TurnKey, tokio::time::Instant>,
}

impl LiveTurns {
    /// Keeps `key` as cancelled before its pump started (the pump stops as
    /// it starts), dropping those kept longer than a `lease` ago.
    fn cancel_early(&mut self, key: &TurnKey, lease: Duration) {
        let now = tokio::time::Instant::now();
        self.cancelled_early
            .retain(|_, at| now.duration_since(*at) < lease);
        self.cancelled_early.insert(key.clone(), now);
    }
}

/// The turn engine one server owns.
pub struct Turns {
    store: Arc<dyn Store>,
    agents: AgentRegistry,
    cfg: TurnConfig,
    /// One permit per agent run in flight.
    permits: Arc<Semaphore>,
    /// Runs in flight per user ([`TurnConfig::max_runs_per_user`]).
    user_runs: Arc<UserRuns>,
    /// One permit per follower ([`TurnConfig::max_followers`]).
    followers: Arc<Semaphore>,
    /// Turns running in this process, so a repeated request id attaches
    /// live and CancelTurn stops the run at once.
    live: Mutex<LiveTurns>,
    /// Turns a Run of this process is claiming: a repeat sent meanwhile
    /// waits for the claim instead of calling the model beside it.
    claiming: Mutex<HashSet<TurnKey>>,
    /// Every pump, writer and follower, so shutdown can wait for them.
    tracker: TaskTracker,
    /// Fired when the shutdown grace is over: what still runs is cut.
    cut: CancellationToken,
    /// Set once shutdown stops accepting: new Runs are refused.
    draining: AtomicBool,
    /// Whether the store answered its last health check; while it did not,
    /// new Runs are refused with UNAVAILABLE without waiting on it.
    store_ok: watch::Sender<bool>,
    /// Turns this process ended because their replica stopped renewing
    /// them ([`Store::fail_expired`]), for what else must end with them
    /// ([`Turns::expired_turns`]).
    expired: tokio::sync::broadcast::Sender<TurnKey>,
}

/// Expired turns [`Turns::expired_turns`] holds for a listener that has not
/// read them yet; past that it is told how many it missed.
const EXPIRED_BACKLOG: usize = 4096;

impl Turns {
    pub fn new(store: Arc<dyn Store>, agents: AgentRegistry, cfg: TurnConfig) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(cfg.max_concurrent_runs)),
            user_runs: Arc::default(),
            followers: Arc::new(Semaphore::new(cfg.max_followers)),
            store,
            agents,
            cfg,
            live: Mutex::default(),
            claiming: Mutex::default(),
            tracker: TaskTracker::new(),
            cut: CancellationToken::new(),
            draining: AtomicBool::new(false),
            store_ok: watch::Sender::new(true),
            expired: tokio::sync::broadcast::Sender::new(EXPIRED_BACKLOG),
        })
    }

    /// The turns this process marks failed from now on because the replica
    /// running them stopped (its lease expired): the A2A face ends their
    /// tasks, which nobody else would.
    pub fn expired_turns(&self) -> tokio::sync::broadcast::Receiver<TurnKey> {
        self.expired.subscribe()
    }

    /// Ends every turn whose lease expired (by the store's clock) with "the
    /// serving replica stopped", and tells [`Self::expired_turns`] which.
    async fn fail_expired(&self) -> Result<usize, StoreError> {
        let failed = self
            .store
            .fail_expired(&crate::grpc::status::replica_stopped())
            .await?;
        for key in &failed {
            // No listener (the A2A face off) is not an error.
            let _ = self.expired.send(key.clone());
        }
        Ok(failed.len())
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn agents(&self) -> &AgentRegistry {
        &self.agents
    }

    pub fn config(&self) -> &TurnConfig {
        &self.cfg
    }

    /// Starts (or joins) the turn `input` names. `client_timeout` is the
    /// call's grpc-timeout, if it sent one.
    pub async fn start(
        self: &Arc<Self>,
        input: RunInput,
        client_timeout: Option<Duration>,
    ) -> Result<Started, RunError> {
        // Counted as in flight from here, before the drain check: a Run
        // admitted just before the drain began gets the shutdown grace too,
        // though its pump is spawned only after the awaits below.
        let _admitted = self.tracker.token();
        if self.draining.load(Ordering::SeqCst) {
            return Err(RunError::ShuttingDown);
        }
        // An agent not served (any more) still answers a repeat of a turn
        // it ran: that turn is looked up below, after the read that says
        // whether it is stored. A request id made here names no such turn.
        let agent = self.agents.get(input.agent.as_deref()).cloned();
        if agent.is_none() && input.generated_request_id {
            return Err(RunError::UnknownAgent);
        }
        self.check_store()?;
        let deadline = self.deadline(client_timeout);
        let key = input.key.clone();
        // One read before the claim: the session, its history, and whether
        // the turn is stored already (a repeated request id, which the claim
        // will find; a request id made here cannot be). Nothing read is used
        // unless the session is the caller's.
        let turn = (!input.generated_request_id).then_some(&key.request_id);
        let read = match self
            .store
            .session_for_run(key.session_id, turn, self.cfg.history_turns)
            .await?
        {
            Some(read) if read.session.user_id == input.user_id => read,
            _ => return Err(RunError::SessionNotFound),
        };
        // Where the read may not know (a history remembered by a replica
        // of several), the turn is looked up before a Run is refused.
        let maybe_stored = read.turn_stored || read.remembered.is_some();
        let Some(agent) = agent else {
            return match self.stored_turn(&key, maybe_stored).await? {
                Some(existing) => self.join(existing, &input, deadline),
                None => Err(RunError::UnknownAgent),
            };
        };
        let permit = match self.run_slot(&input.user_id) {
            Ok(slot) => slot,
            Err(refused) => {
                // At a cap, a repeated request id is still answered from the
                // turn it names; only a new turn is refused.
                return match self.stored_turn(&key, maybe_stored).await? {
                    Some(existing) => self.join(existing, &input, deadline),
                    None => Err(refused),
                };
            }
        };
        let claim = NewTurn {
            key: key.clone(),
            user_text: input.text.as_str().to_owned(),
            agent: agent.name().to_owned(),
            owner: self.cfg.replica_id.clone(),
            lease: self.cfg.lease,
        };
        let span = || {
            crate::telemetry::trace::run_span("new", agent.name(), &key.session_id, &key.request_id)
        };
        let cancel = CancellationToken::new();
        // Owned, so that a history read again after the claim (below) can
        // build its context on the pump's task.
        let context = {
            let (user_id, session_id) = (input.user_id.clone(), key.session_id);
            let (request_id, cancel) = (key.request_id.clone(), cancel.clone());
            let (at, history_bytes) = (deadline.at, self.cfg.history_bytes);
            move |history: Vec<PriorTurn>| RunContext {
                user_id: user_id.clone(),
                session_id,
                request_id: request_id.clone(),
                cancel: cancel.clone(),
                deadline: at,
                notes: history
                    .iter()
                    .map(|t| PriorTurn {
                        request_id: t.request_id.clone(),
                        agent: t.agent.clone(),
                        answer_payload: t.answer_payload.clone(),
                        ..PriorTurn::default()
                    })
                    .collect(),
                history: newest_within(history, history_bytes),
            }
        };
        let remembered = read.remembered;
        let ctx = context(read.history);
        // An agent that only calls its model before its first event starts
        // now, beside the claim (unless `claim_first`, or the turn is stored
        // already: a repeat, which will replay, attach or follow, and whose
        // model call would only be dropped); any other starts once the turn
        // is ours. So does a repeat sent while another Run of this process
        // claims its turn: it waits for its own claim, which finds the turn
        // (only a repeat sent to another replica at the same moment starts,
        // and is dropped when its claim finds the turn).
        let may_start_early =
            agent.starts_before_claim() && !self.cfg.claim_first && !read.turn_stored;
        let claiming = (may_start_early && !input.generated_request_id)
            .then(|| Claiming::enter(self, &key))
            .flatten();
        let early = may_start_early && (input.generated_request_id || claiming.is_some());
        let (claimed, run) = if early {
            let span = span();
            let mut events = agent.run(ctx, input.text.as_str().to_owned()).peekable();
            let claimed = {
                let claimed = self.store.claim_turn(&claim);
                tokio::pin!(claimed);
                let first = Pin::new(&mut events).peek().instrument(span.clone());
                tokio::select! {
                    biased;
                    c = &mut claimed => c,
                    _ = first => claimed.await,
                }
            };
            if matches!(claimed, Ok(Claim::Existing(_))) {
                tracing::debug!(parent: &span, "the turn was claimed before; the run started beside the claim is dropped");
            }
            (claimed, Ok((Box::pin(events) as EventStream, span)))
        } else {
            (self.store.claim_turn(&claim).await, Err(ctx))
        };
        let claimed = match claimed {
            Ok(c) => c,
            // The session deleted since it was read: the SQL stores' foreign
            // key refuses the claim. Reported as the missing session it is.
            Err(StoreError::Unexpected(e))
                if matches!(self.store.get_session(key.session_id).await, Ok(None)) =>
            {
                tracing::debug!(turn = %key, error = %format!("{e:#}"), "claim refused: the session was deleted");
                return Err(RunError::SessionNotFound);
            }
            Err(e) => return Err(e.into()),
        };
        match claimed {
            // A run started early is dropped here, its model call with it.
            Claim::Existing(existing) => {
                drop(permit);
                self.join(existing, &input, deadline)
            }
            Claim::New => {
                // A history this replica remembered of a session other
                // replicas share holds only if none of them claimed a turn
                // in it since: the claim just told. If one did, a run
                // started beside the claim with the old history is dropped
                // before its first event, and the agent starts once the
                // history is read again, on the pump's task (a client gone
                // meanwhile then cancels the turn as it would the run).
                let stale =
                    remembered.is_some_and(|r| !self.store.history_current(key.session_id, r));
                let (events, span) = match run {
                    Ok(early) if !stale => early,
                    Err(ctx) if !stale => (agent.run(ctx, input.text.as_str().to_owned()), span()),
                    _ => {
                        tracing::debug!(turn = %key, "another replica claimed a turn in the session since its history was kept here; reading it again");
                        (
                            self.history_again(
                                &key,
                                agent.clone(),
                                context,
                                input.text.as_str().to_owned(),
                            ),
                            span(),
                        )
                    }
                };
                let run = pump::AgentRun {
                    agent: agent.name().to_owned(),
                    events,
                    cancel,
                    span,
                };
                let stream = pump::spawn(self, run, &input, deadline, permit);
                // The turn is live here now: a repeat attaches to it.
                drop(claiming);
                Ok(Started {
                    request_id: key.request_id,
                    mode: Mode::New,
                    stream,
                })
            }
        }
    }

    /// The run of a claimed turn whose session's history, kept in memory,
    /// turned out stale: the history is read again from the store when the
    /// run is first polled, then `agent` runs with `context` of it; if that
    /// read fails, the run ends UNAVAILABLE (the turn is claimed: it must
    /// end).
    fn history_again(
        &self,
        key: &TurnKey,
        agent: Arc<dyn crate::agent::Agent>,
        context: impl FnOnce(Vec<PriorTurn>) -> RunContext + Send + 'static,
        text: String,
    ) -> EventStream {
        let (store, key, limit) = (self.store.clone(), key.clone(), self.cfg.history_turns);
        let run = async move {
            match store.session_for_run(key.session_id, None, limit).await {
                Ok(Some(read)) => agent.run(context(read.history), text),
                failed => {
                    let why = match failed {
                        Err(e) => format!("{e:#}"),
                        _ => "the session is gone".to_owned(),
                    };
                    tracing::warn!(turn = %key, error = %why, "could not read the session's history again after its claim; the turn ends UNAVAILABLE");
                    let failed: EventStream = Box::pin(futures::stream::once(async {
                        Err(crate::agent::AgentError::Unavailable {
                            message: "the session's history could not be read".to_owned(),
                            retry_after: None,
                        })
                    }));
                    failed
                }
            }
        };
        Box::pin(futures::StreamExt::flatten(futures::stream::once(run)))
    }

    /// Streams the events of a turn after `after` (all with `None`), then
    /// follows it live until it ends. Never runs the agent.
    pub async fn attach(
        self: &Arc<Self>,
        user_id: &UserId,
        key: TurnKey,
        after: Option<u64>,
        client_timeout: Option<Duration>,
    ) -> Result<Started, RunError> {
        let _admitted = self.tracker.token();
        if self.draining.load(Ordering::SeqCst) {
            return Err(RunError::ShuttingDown);
        }
        self.check_store()?;
        // Counted from the call's arrival, before the reads below.
        let deadline = self.deadline(client_timeout);
        self.owned_session(key.session_id, user_id).await?;
        let existing = self
            .store
            .get_turn(&key)
            .await?
            .ok_or(RunError::TurnNotFound)?;
        let mode = if existing.state.is_terminal() {
            Mode::Replay
        } else {
            Mode::Attach
        };
        let stream = follow::spawn(
            self,
            self.follower_permit()?,
            key.clone(),
            &existing.agent,
            after,
            deadline,
            mode,
        );
        Ok(Started {
            request_id: key.request_id,
            mode,
            stream,
        })
    }

    /// The session `id` if `user_id` owns it. A foreign session is reported
    /// exactly like a missing one.
    pub async fn owned_session(
        &self,
        id: SessionId,
        user_id: &UserId,
    ) -> Result<Session, RunError> {
        match self.store.get_session(id).await? {
            Some(s) if &s.user_id == user_id => Ok(s),
            _ => Err(RunError::SessionNotFound),
        }
    }

    /// Cancels turn `key` of a session `user_id` owns (CancelTurn): a
    /// running turn is recorded CANCELLED in the store (the store decides
    /// a race with the turn's own end: whichever is recorded first stands),
    /// and its run stops, here at once, elsewhere as soon as the store's
    /// announcement reaches its replica ([`Store::announce_cancel`]), or at
    /// that replica's next lease renewal ([`pump`]'s lease keeper) if it is
    /// lost. A turn that had ended is
    /// left as it is. Returns the turn as stored after the call, and
    /// whether this call ended it.
    pub async fn cancel_turn(
        &self,
        user_id: &UserId,
        key: &TurnKey,
    ) -> Result<(TurnRecord, bool), RunError> {
        self.check_store()?;
        self.owned_session(key.session_id, user_id).await?;
        let turn = self
            .store
            .get_turn(key)
            .await?
            .ok_or(RunError::TurnNotFound)?;
        if turn.state.is_terminal() {
            return Ok((turn, false));
        }
        let outcome = crate::grpc::status::cancelled_by_request();
        let ended = self.store.finish_turn(key, &outcome, None).await?;
        if ended {
            self.stop_cancelled(key, &turn.owner);
            if turn.owner != self.cfg.replica_id {
                // On the side: the cancel is done whether or not the word
                // reaches the owner, whose lease renewal finds it anyway.
                let (store, key) = (self.store.clone(), key.clone());
                tokio::spawn(async move {
                    if let Err(e) = store.announce_cancel(&key).await {
                        tracing::warn!(turn = %key, error = %format!("{e:#}"), "could not tell the replica running the turn that it was cancelled; it stops the run at its next lease renewal");
                    }
                });
            }
            // As stored; but a store that fails this read must not turn a
            // cancel that is done into UNAVAILABLE ("retry"), whose retry
            // would say the turn had ended already: then as it was written.
            let turn = match self.store.get_turn(key).await {
                Ok(Some(stored)) => stored,
                _ => {
                    let mut turn = turn;
                    turn.state = outcome.state;
                    turn.outcome = Some(outcome);
                    turn.updated_at = std::time::SystemTime::now();
                    turn
                }
            };
            return Ok((turn, true));
        }
        // The end that came first, as stored.
        let turn = self
            .store
            .get_turn(key)
            .await?
            .ok_or(RunError::TurnNotFound)?;
        Ok((turn, false))
    }

    /// Deletes a session the caller owns, unless one of its turns runs.
    pub async fn delete_session(&self, id: SessionId, user_id: &UserId) -> Result<(), RunError> {
        self.check_store()?;
        self.owned_session(id, user_id).await?;
        match self.store.delete_session(id).await? {
            Deletion::Busy => Err(RunError::SessionBusy),
            // NotFound: deleted by another call since it was read.
            Deletion::Deleted | Deletion::NotFound => Ok(()),
        }
    }

    /// Fails fast while the store's health check fails.
    fn check_store(&self) -> Result<(), RunError> {
        if *self.store_ok.borrow() {
            Ok(())
        } else {
            Err(RunError::Store(StoreError::Unavailable(StoreDown.into())))
        }
    }

    /// Follows the store's health: true while it answers.
    pub fn store_health(&self) -> watch::Receiver<bool> {
        self.store_ok.subscribe()
    }

    /// The background upkeep of this engine: store health checks, failing
    /// turns whose replica's lease expired, pruning past `retain_turns` and
    /// `retain_sessions`.
    /// Runs until dropped.
    pub fn upkeep(self: &Arc<Self>) -> impl std::future::Future<Output = ()> + Send + 'static {
        upkeep::run(self.clone())
    }

    fn deadline(&self, client_timeout: Option<Duration>) -> Deadline {
        let server = self.cfg.max_run_duration;
        let (after, by_server) = match client_timeout {
            Some(c) if c < server => (c, false),
            _ => (server, true),
        };
        Deadline {
            at: tokio::time::Instant::now() + after,
            by_server,
        }
    }

    /// A place for one more run of `user`, under the process-wide cap and
    /// the user's share.
    fn run_slot(&self, user: &UserId) -> Result<RunSlot, RunError> {
        let permit = self
            .permits
            .clone()
            .try_acquire_owned()
            .map_err(|_| RunError::Busy {
                limit: self.cfg.max_concurrent_runs,
            })?;
        let Some(limit) = self.cfg.max_runs_per_user else {
            return Ok(RunSlot {
                _permit: permit,
                user: None,
            });
        };
        {
            let mut runs = self.user_runs.lock().unwrap_or_else(|p| p.into_inner());
            let n = runs.entry(user.clone()).or_default();
            if *n >= limit {
                tracing::debug!(user = %user, limit, "run refused: the user is at --max-runs-per-user");
                return Err(RunError::UserBusy { limit });
            }
            *n += 1;
        }
        Ok(RunSlot {
            _permit: permit,
            user: Some((self.user_runs.clone(), user.clone())),
        })
    }

    /// A follower's place under [`TurnConfig::max_followers`].
    fn follower_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, RunError> {
        self.followers
            .clone()
            .try_acquire_owned()
            .map_err(|_| RunError::TooManyFollowers {
                limit: self.cfg.max_followers,
            })
    }

    /// The turn `key` names, when the read before its claim found it
    /// stored (without another store call when it did not).
    async fn stored_turn(
        &self,
        key: &TurnKey,
        stored: bool,
    ) -> Result<Option<TurnRecord>, RunError> {
        Ok(match stored {
            true => self.store.get_turn(key).await?,
            false => None,
        })
    }

    /// Replays or attaches to a turn someone else claimed. A repeat must
    /// be the same message: the same text and, when it names one, the same
    /// agent (one naming none asks for the default, whatever it was then).
    fn join(
        self: &Arc<Self>,
        existing: TurnRecord,
        input: &RunInput,
        deadline: Deadline,
    ) -> Result<Started, RunError> {
        let other_agent = input.agent.as_deref().is_some_and(|a| a != existing.agent);
        if existing.user_text != input.text.as_str() || other_agent {
            return Err(RunError::RequestIdReused);
        }
        let mode = if existing.state.is_terminal() {
            Mode::Replay
        } else {
            Mode::Attach
        };
        // A repeated request id answered without running the agent (an
        // Attach call, which names its turn, is not a repeat).
        let permit = self.follower_permit()?;
        crate::telemetry::metrics::dedup(mode);
        let stream = follow::spawn(
            self,
            permit,
            existing.key.clone(),
            &existing.agent,
            None,
            deadline,
            mode,
        );
        Ok(Started {
            request_id: existing.key.request_id,
            mode,
            stream,
        })
    }

    /// Refuse new Runs from now on (shutdown has stopped accepting).
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.tracker.close();
    }

    /// Whether [`Turns::begin_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Tasks of the engine: runs, their writers and lease keepers,
    /// followers. Zero when nothing runs; not a count of runs (see
    /// [`Turns::runs_in_flight`]).
    pub fn in_flight(&self) -> usize {
        self.tracker.len()
    }

    /// Agent runs in flight (each holds a `--max-concurrent-runs` permit
    /// until its stream ends).
    pub fn runs_in_flight(&self) -> usize {
        self.cfg.max_concurrent_runs - self.permits.available_permits()
    }

    /// Streams following a turn (Attach, repeats that joined one).
    pub fn followers_in_flight(&self) -> usize {
        self.cfg.max_followers - self.followers.available_permits()
    }

    /// Counts as a task of the engine until dropped: shutdown's wait for
    /// idle waits for it too. For work that must outlive a run's own
    /// tasks, as the A2A face's storing of a task's end does.
    pub fn hold(&self) -> tokio_util::task::task_tracker::TaskTrackerToken {
        self.tracker.token()
    }

    /// Resolves when every task has ended (after [`Turns::begin_drain`]).
    pub async fn wait_idle(&self) {
        self.tracker.wait().await
    }

    /// Cuts every run still in flight: each ends with UNAVAILABLE, recorded.
    pub fn cut_all(&self) {
        self.cut.cancel();
    }

    /// Resolves once [`Turns::cut_all`] was called.
    pub async fn cut_requested(&self) {
        self.cut.cancelled().await
    }

    fn live_progress(&self, key: &TurnKey) -> Option<watch::Receiver<Progress>> {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .runs
            .get(key)
            .map(|t| t.progress.clone())
    }

    /// Stops the run of `key`, which CancelTurn has just recorded
    /// cancelled, if it runs here (`owner` is the replica the store names):
    /// at once, or as soon as its pump starts. A run on another replica
    /// stops at its next lease renewal, which finds the turn ended.
    fn stop_cancelled(&self, key: &TurnKey, owner: &str) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(run) = live.runs.get(key) {
            run.cancel.fire();
            tracing::info!(turn = %key, "turn cancelled (CancelTurn); its run here is stopped");
        } else if owner == self.cfg.replica_id {
            // Claimed here, its pump not started yet (or ended already,
            // its outcome's write under way).
            live.cancel_early(key, self.cfg.lease);
            tracing::info!(turn = %key, "turn cancelled (CancelTurn); its run here stops as it starts");
        } else {
            tracing::info!(turn = %key, owner, "turn cancelled (CancelTurn); the replica running it is told to stop it, and stops it at its next lease renewal if the word is lost");
        }
    }

    /// A cancel another replica recorded and announced
    /// ([`Store::cancel_announcements`]): the run here, if the turn runs
    /// here and was not stopped already, stops now. A turn claimed here
    /// whose run has not started yet is kept as cancelled early (as
    /// [`Turns::stop_cancelled`] does), so its run stops as it starts;
    /// every replica hears every cancel, so most keys are of turns that run
    /// elsewhere, and are dropped after a lease like any other.
    fn stop_announced_cancel(&self, key: &TurnKey) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        match live.runs.get(key) {
            Some(run) if !run.cancel.fired() => {
                run.cancel.fire();
                tracing::info!(turn = %key, "the turn was cancelled elsewhere (CancelTurn); stopping its run");
            }
            Some(_) => {}
            None => live.cancel_early(key, self.cfg.lease),
        }
    }
}

/// A Run of this process claiming a turn, in [`Turns::claiming`] until
/// dropped.
struct Claiming {
    turns: Arc<Turns>,
    key: TurnKey,
}

impl Claiming {
    /// `None` when another Run of this process is claiming `key`.
    fn enter(turns: &Arc<Turns>, key: &TurnKey) -> Option<Self> {
        let entered = turns
            .claiming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone());
        entered.then(|| Claiming {
            turns: turns.clone(),
            key: key.clone(),
        })
    }
}

impl Drop for Claiming {
    fn drop(&mut self) {
        self.turns
            .claiming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

/// When a run must be over, and who set that bound.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: tokio::time::Instant,
    by_server: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(id: &str, question: usize, answer: usize) -> PriorTurn {
        PriorTurn {
            request_id: id.into(),
            user_text: "q".repeat(question),
            answer: "a".repeat(answer),
            ..PriorTurn::default()
        }
    }

    fn ids(h: &[PriorTurn]) -> Vec<&str> {
        h.iter().map(|t| t.request_id.as_str()).collect()
    }

    #[test]
    fn history_keeps_the_newest_turns_that_fit_the_byte_budget() {
        let history = vec![turn("r1", 10, 90), turn("r2", 10, 40), turn("r3", 10, 40)];
        assert_eq!(
            ids(&newest_within(history.clone(), 1000)),
            ["r1", "r2", "r3"]
        );
        assert_eq!(
            ids(&newest_within(history.clone(), 200)),
            ["r1", "r2", "r3"]
        );
        assert_eq!(ids(&newest_within(history.clone(), 199)), ["r2", "r3"]);
        assert_eq!(ids(&newest_within(history.clone(), 50)), ["r3"]);
        assert!(newest_within(history, 49).is_empty());
    }

    /// CancelTurn found the turn claimed by this replica, its pump not
    /// started yet (the moment between the claim's commit and the pump's
    /// start): the pump stops as it starts, before its agent is polled.
    #[tokio::test]
    async fn a_turn_cancelled_before_its_pump_started_stops_before_its_agent_runs() {
        cancelled_before_its_pump_started(|turns, key| {
            turns.stop_cancelled(key, &turns.cfg.replica_id)
        })
        .await;
    }

    /// The same, the cancel served by another replica and announced here
    /// between the claim and the pump's start.
    #[tokio::test]
    async fn a_turn_whose_cancel_is_announced_before_its_pump_started_stops_before_its_agent_runs()
    {
        cancelled_before_its_pump_started(|turns, key| turns.stop_announced_cancel(key)).await;
    }

    async fn cancelled_before_its_pump_started(cancel: impl FnOnce(&Turns, &TurnKey)) {
        use crate::domain::{OnDisconnect, UserText};
        let store: Arc<dyn Store> = Arc::new(crate::store::memory::MemoryStore::new());
        let helper = crate::agent::demo::OrderHelper::new(Duration::from_secs(60));
        let tool = helper.stats();
        let agents = AgentRegistry::new(vec![Arc::new(helper)], crate::agent::demo::NAME).unwrap();
        let turns = Turns::new(store.clone(), agents, TurnConfig::default());
        let user_id = UserId::parse("alice").unwrap();
        let session = store.create_session(&user_id).await.unwrap();
        let key = TurnKey {
            session_id: session.id,
            request_id: RequestId::parse("r1").unwrap(),
        };
        cancel(&turns, &key);
        let input = RunInput {
            user_id,
            key: key.clone(),
            generated_request_id: false,
            text: UserText::parse("Where is order 1187?".into(), 1024).unwrap(),
            agent: None,
            on_disconnect: OnDisconnect::Cancel,
        };
        let started = turns.start(input, None).await.unwrap();
        assert_eq!(started.mode, Mode::New);
        let ended =
            tokio::time::timeout(Duration::from_secs(5), started.stream.collect::<Vec<_>>())
                .await
                .expect("the run stops at once");
        assert!(
            matches!(ended.as_slice(), [Err(Failure::CancelledByRequest)]),
            "no event, then CANCELLED: {ended:?}"
        );
        assert_eq!(tool.started(), 0, "the tool never ran");
        let t = store.get_turn(&key).await.unwrap().unwrap();
        assert_eq!(t.outcome, Some(crate::grpc::status::cancelled_by_request()));
        assert!(turns.live.lock().unwrap().cancelled_early.is_empty());
    }

    #[test]
    fn an_answers_payload_counts_against_the_history_budget() {
        let with_payload = PriorTurn {
            answer_payload: "p".repeat(100),
            ..turn("r2", 10, 40)
        };
        let history = vec![turn("r1", 10, 40), with_payload];
        assert_eq!(ids(&newest_within(history.clone(), 200)), ["r1", "r2"]);
        assert_eq!(ids(&newest_within(history.clone(), 199)), ["r2"]);
        assert!(newest_within(history, 149).is_empty());
    }
}
