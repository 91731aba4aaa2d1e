//! The store as the server uses it: every call timed and its failures
//! counted (`agentd_store_call_seconds`, `agentd_store_errors_total`).
//!
//! A call's time is what its caller waited, queueing included: a claim's
//! wait for the claimer, a batch's wait for the committer's next group. The
//! groups themselves are measured where they are written ([`super::sql`]).
//!
//! Every call is bounded too (`--store-timeout`): past the bound its
//! caller gets UNAVAILABLE, whatever the database is doing. (The groups'
//! statements have a shorter bound of their own, so a hung statement does
//! not hold the queue behind it.)

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use a2a::{A2AError, ListTasksRequest, ListTasksResponse, Task};
use a2a_server::TaskStore;
use a2a_server::task_store::TaskVersion;
use async_trait::async_trait;

use super::Keyed;
use super::a2a_tasks::{A2aTaskSource, A2aTasks, Unfinished, UnfinishedKey};
use super::{
    Claim, Deletion, EncodedEvent, FinalAnswer, KindEncoding, NewTurn, PageCursor, RunRead,
    SeqEvent, Session, SessionPage, Store, StoreError, StoreResult, TurnCursor, TurnOutcome,
    TurnRecord, TurnTexts,
};
use crate::agent::PriorTurn;
use crate::domain::{RequestId, SessionId, TurnKey, UserId};
use crate::telemetry::metrics;

/// Declares [`Op`], the `op` label (one value per [`Store`] method), with
/// every value in `Op::ALL` and each one's label, from one list.
macro_rules! ops {
    ($($op:ident => $label:literal),* $(,)?) => {
        #[derive(Debug, Clone, Copy)]
        enum Op {
            $($op),*
        }

        impl Op {
            const ALL: &[Op] = &[$(Op::$op),*];

            fn name(self) -> &'static str {
                match self {
                    $(Op::$op => $label),*
                }
            }
        }
    };
}

ops! {
    CreateSession => "create_session",
    CreateSessionKeyed => "create_session_keyed",
    GetSession => "get_session",
    ClaimTurn => "claim_turn",
    GetTurn => "get_turn",
    Append => "append",
    FinishTurn => "finish_turn",
    AppendAndFinish => "append_and_finish",
    EventsAfter => "events_after",
    History => "history",
    SessionWithHistory => "session_with_history",
    SessionForRun => "session_for_run",
    ListSessions => "list_sessions",
    DeleteSession => "delete_session",
    ListTurns => "list_turns",
    ListTurnTexts => "list_turn_texts",
    RenewLease => "renew_lease",
    FailExpired => "fail_expired",
    Prune => "prune",
    PruneSessions => "prune_sessions",
    Ping => "ping",
    AnnounceCancel => "announce_cancel",
    A2aCreate => "a2a_create",
    A2aUpdate => "a2a_update",
    A2aGet => "a2a_get",
    A2aList => "a2a_list",
    A2aBeginCancel => "a2a_begin_cancel",
    A2aEnsureSession => "a2a_ensure_session",
    A2aOwner => "a2a_owner",
    A2aPruneEnded => "a2a_prune_ended",
    A2aUnfinished => "a2a_unfinished",
}

/// Wraps a store; see the module docs.
pub struct Metered {
    inner: Arc<dyn Store>,
    /// The inner store's A2A tasks, timed and bounded the same way.
    tasks: Arc<dyn A2aTasks>,
    timer: Timer,
}

/// What times and bounds the calls of a store and of its A2A tasks.
#[derive(Clone)]
struct Timer {
    /// One histogram per [`Op`], registered once.
    seconds: Arc<Vec<::metrics::Histogram>>,
    /// The longest any call may wait before it fails as unavailable.
    bound: Option<Duration>,
}

impl Metered {
    /// `bound`: the longest a call may wait, queueing included, before it
    /// fails as [`StoreError::Unavailable`] (a database that stopped
    /// answering on a connection already open would otherwise hold it until
    /// TCP gives up, minutes later); `None`, no bound.
    pub fn new(inner: Arc<dyn Store>, bound: Option<Duration>) -> Self {
        let seconds = Op::ALL
            .iter()
            .map(|op| metrics::store_call_histogram(op.name()))
            .collect();
        let timer = Timer {
            seconds: Arc::new(seconds),
            bound,
        };
        Self {
            tasks: Arc::new(MeteredTasks {
                inner: inner.a2a_tasks(),
                timer: timer.clone(),
            }),
            inner,
            timer,
        }
    }

    async fn timed<T>(&self, op: Op, call: impl Future<Output = StoreResult<T>>) -> StoreResult<T> {
        self.timer.timed(op, call).await
    }
}

impl Timer {
    async fn timed<T>(&self, op: Op, call: impl Future<Output = StoreResult<T>>) -> StoreResult<T> {
        let start = Instant::now();
        let result = match self.bound {
            None => call.await,
            Some(bound) => tokio::time::timeout(bound, call).await.unwrap_or_else(|_| {
                Err(StoreError::Unavailable(anyhow::anyhow!(
                    "the store did not answer within {bound:?}"
                )))
            }),
        };
        self.seconds[op as usize].record(start.elapsed());
        if let Err(e) = &result {
            metrics::store_error(op.name(), e);
        }
        result
    }

    /// [`Self::timed`] for a call of the A2A task store, whose failures
    /// come as A2A errors ([`super::a2a_tasks::store_failure`] tells them
    /// from its other answers).
    async fn timed_a2a<T>(
        &self,
        op: Op,
        call: impl Future<Output = Result<T, A2AError>>,
    ) -> Result<T, A2AError> {
        let start = Instant::now();
        let result = match self.bound {
            None => call.await,
            Some(bound) => match tokio::time::timeout(bound, call).await {
                Ok(r) => r,
                Err(_) => Err(super::a2a_tasks::a2a_err(StoreError::Unavailable(
                    anyhow::anyhow!("the task store did not answer within {bound:?}"),
                ))),
            },
        };
        self.seconds[op as usize].record(start.elapsed());
        if let Some(unavailable) = result
            .as_ref()
            .err()
            .and_then(super::a2a_tasks::store_failure)
        {
            metrics::store_error_kind(op.name(), unavailable);
        }
        result
    }
}

impl A2aTaskSource for Metered {
    fn a2a_tasks(&self) -> Arc<dyn A2aTasks> {
        self.tasks.clone()
    }
}

/// A store's A2A tasks, every call timed and bounded as the store's are.
struct MeteredTasks {
    inner: Arc<dyn A2aTasks>,
    timer: Timer,
}

#[async_trait]
impl TaskStore for MeteredTasks {
    async fn create(&self, task: Task) -> Result<TaskVersion, A2AError> {
        self.timer
            .timed_a2a(Op::A2aCreate, self.inner.create(task))
            .await
    }
    async fn update(&self, task: Task) -> Result<TaskVersion, A2AError> {
        self.timer
            .timed_a2a(Op::A2aUpdate, self.inner.update(task))
            .await
    }
    async fn get(&self, task_id: &str) -> Result<Option<Task>, A2AError> {
        self.timer
            .timed_a2a(Op::A2aGet, self.inner.get(task_id))
            .await
    }
    async fn list(&self, req: &ListTasksRequest) -> Result<ListTasksResponse, A2AError> {
        self.timer
            .timed_a2a(Op::A2aList, self.inner.list(req))
            .await
    }
    async fn begin_cancel(&self, task_id: &str) -> Result<Task, A2AError> {
        self.timer
            .timed_a2a(Op::A2aBeginCancel, self.inner.begin_cancel(task_id))
            .await
    }
}

#[async_trait]
impl A2aTasks for MeteredTasks {
    async fn ensure_session(&self, id: SessionId, user: &UserId) -> StoreResult<()> {
        self.timer
            .timed(Op::A2aEnsureSession, self.inner.ensure_session(id, user))
            .await
    }
    async fn create_for(&self, owner: &UserId, task: Task) -> Result<TaskVersion, A2AError> {
        self.timer
            .timed_a2a(Op::A2aCreate, self.inner.create_for(owner, task))
            .await
    }
    async fn list_for(
        &self,
        owner: &UserId,
        req: &ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError> {
        self.timer
            .timed_a2a(Op::A2aList, self.inner.list_for(owner, req))
            .await
    }
    async fn owner(&self, task_id: &str) -> Result<Option<UserId>, A2AError> {
        self.timer
            .timed_a2a(Op::A2aOwner, self.inner.owner(task_id))
            .await
    }
    async fn prune_ended(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        self.timer
            .timed(Op::A2aPruneEnded, self.inner.prune_ended(before, limit))
            .await
    }
    async fn unfinished(
        &self,
        before: SystemTime,
        after: Option<&UnfinishedKey>,
        limit: usize,
    ) -> StoreResult<Vec<Unfinished>> {
        self.timer
            .timed(
                Op::A2aUnfinished,
                self.inner.unfinished(before, after, limit),
            )
            .await
    }
}

#[async_trait]
impl Store for Metered {
    async fn create_session(&self, user_id: &UserId) -> StoreResult<Session> {
        self.timed(Op::CreateSession, self.inner.create_session(user_id))
            .await
    }

    async fn create_session_keyed(&self, user_id: &UserId, key: &RequestId) -> StoreResult<Keyed> {
        self.timed(
            Op::CreateSessionKeyed,
            self.inner.create_session_keyed(user_id, key),
        )
        .await
    }

    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>> {
        self.timed(Op::GetSession, self.inner.get_session(id)).await
    }

    async fn claim_turn(&self, turn: &NewTurn) -> StoreResult<Claim> {
        self.timed(Op::ClaimTurn, self.inner.claim_turn(turn)).await
    }

    async fn get_turn(&self, key: &TurnKey) -> StoreResult<Option<TurnRecord>> {
        self.timed(Op::GetTurn, self.inner.get_turn(key)).await
    }

    fn kind_encoding(&self) -> KindEncoding {
        self.inner.kind_encoding()
    }

    fn hurry(&self) {
        self.inner.hurry();
    }

    fn hold_queues(&self) -> Option<super::QueuesHeld> {
        self.inner.hold_queues()
    }

    async fn append_encoded(&self, key: &TurnKey, events: Vec<EncodedEvent>) -> StoreResult<()> {
        self.timed(Op::Append, self.inner.append_encoded(key, events))
            .await
    }

    async fn append_events(&self, key: &TurnKey, events: Vec<SeqEvent>) -> StoreResult<()> {
        self.timed(Op::Append, self.inner.append_events(key, events))
            .await
    }

    async fn finish_turn(
        &self,
        key: &TurnKey,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        self.timed(Op::FinishTurn, self.inner.finish_turn(key, outcome, answer))
            .await
    }

    async fn append_and_finish(
        &self,
        key: &TurnKey,
        events: Vec<EncodedEvent>,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        self.timed(
            Op::AppendAndFinish,
            self.inner.append_and_finish(key, events, outcome, answer),
        )
        .await
    }

    async fn events_after(
        &self,
        key: &TurnKey,
        after: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<SeqEvent>> {
        self.timed(Op::EventsAfter, self.inner.events_after(key, after, limit))
            .await
    }

    async fn history(&self, session: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>> {
        self.timed(Op::History, self.inner.history(session, limit))
            .await
    }

    async fn session_with_history(
        &self,
        id: SessionId,
        limit: usize,
    ) -> StoreResult<Option<(Session, Vec<PriorTurn>)>> {
        self.timed(
            Op::SessionWithHistory,
            self.inner.session_with_history(id, limit),
        )
        .await
    }

    async fn session_for_run(
        &self,
        session: SessionId,
        turn: Option<&RequestId>,
        limit: usize,
    ) -> StoreResult<Option<RunRead>> {
        self.timed(
            Op::SessionForRun,
            self.inner.session_for_run(session, turn, limit),
        )
        .await
    }

    fn history_current(&self, session: SessionId, remembered: u64) -> bool {
        self.inner.history_current(session, remembered)
    }

    async fn list_sessions(
        &self,
        user_id: &UserId,
        limit: usize,
        after: Option<&PageCursor>,
    ) -> StoreResult<SessionPage> {
        self.timed(
            Op::ListSessions,
            self.inner.list_sessions(user_id, limit, after),
        )
        .await
    }

    async fn delete_session(&self, id: SessionId) -> StoreResult<Deletion> {
        self.timed(Op::DeleteSession, self.inner.delete_session(id))
            .await
    }

    async fn list_turns(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
    ) -> StoreResult<Vec<TurnRecord>> {
        self.timed(Op::ListTurns, self.inner.list_turns(session, after, limit))
            .await
    }

    async fn list_turn_texts(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        bytes: usize,
    ) -> StoreResult<TurnTexts> {
        self.timed(
            Op::ListTurnTexts,
            self.inner.list_turn_texts(session, after, limit, bytes),
        )
        .await
    }

    async fn renew_lease(&self, key: &TurnKey, owner: &str, lease: Duration) -> StoreResult<bool> {
        self.timed(Op::RenewLease, self.inner.renew_lease(key, owner, lease))
            .await
    }

    async fn fail_expired(&self, outcome: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
        self.timed(Op::FailExpired, self.inner.fail_expired(outcome))
            .await
    }

    async fn prune(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        self.timed(Op::Prune, self.inner.prune(before, limit)).await
    }

    async fn prune_sessions(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        self.timed(Op::PruneSessions, self.inner.prune_sessions(before, limit))
            .await
    }

    async fn ping(&self) -> StoreResult<()> {
        self.timed(Op::Ping, self.inner.ping()).await
    }

    async fn announce_cancel(&self, key: &TurnKey) -> StoreResult<()> {
        self.timed(Op::AnnounceCancel, self.inner.announce_cancel(key))
            .await
    }

    fn cancel_announcements(&self) -> Option<tokio::sync::broadcast::Receiver<TurnKey>> {
        self.inner.cancel_announcements()
    }

    async fn close(&self) {
        self.inner.close().await
    }
}
