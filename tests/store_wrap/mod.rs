//! A store that is another store but for what a test changes in it: the
//! outcome writes, the event appends, or the A2A task store ([`Hooks`]).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use agentd::agent::PriorTurn;
use agentd::domain::{RequestId, SessionId, TurnKey, UserId};
use agentd::store::a2a_tasks::{A2aTaskSource, A2aTasks};
use agentd::store::{
    Claim, Deletion, EncodedEvent, FinalAnswer, Keyed, NewTurn, PageCursor, RunRead, SeqEvent,
    Session, SessionPage, Store, StoreResult, TurnCursor, TurnOutcome, TurnRecord, TurnTexts,
};

/// What a test changes; each defaults to the inner store's own.
#[async_trait::async_trait]
pub trait Hooks: Send + Sync + 'static {
    async fn append_encoded(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        e: Vec<EncodedEvent>,
    ) -> StoreResult<()> {
        inner.append_encoded(k, e).await
    }
    async fn finish_turn(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        o: &TurnOutcome,
        a: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        inner.finish_turn(k, o, a).await
    }
    async fn append_and_finish(
        &self,
        inner: &dyn Store,
        k: &TurnKey,
        e: Vec<EncodedEvent>,
        o: &TurnOutcome,
        a: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        inner.append_and_finish(k, e, o, a).await
    }
    fn a2a_tasks(&self, inner: &dyn Store) -> Arc<dyn A2aTasks> {
        inner.a2a_tasks()
    }
    async fn fail_expired(&self, inner: &dyn Store, o: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
        inner.fail_expired(o).await
    }
    async fn ping(&self, inner: &dyn Store) -> StoreResult<()> {
        inner.ping().await
    }
    async fn get_turn(&self, inner: &dyn Store, k: &TurnKey) -> StoreResult<Option<TurnRecord>> {
        inner.get_turn(k).await
    }
    async fn announce_cancel(&self, inner: &dyn Store, k: &TurnKey) -> StoreResult<()> {
        inner.announce_cancel(k).await
    }
    async fn session_for_run(
        &self,
        inner: &dyn Store,
        s: SessionId,
        t: Option<&RequestId>,
        limit: usize,
    ) -> StoreResult<Option<RunRead>> {
        inner.session_for_run(s, t, limit).await
    }
    async fn list_turn_texts(
        &self,
        inner: &dyn Store,
        s: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        bytes: usize,
    ) -> StoreResult<TurnTexts> {
        inner.list_turn_texts(s, after, limit, bytes).await
    }
}

pub struct Wrapped {
    pub inner: Arc<dyn Store>,
    pub hooks: Arc<dyn Hooks>,
}

impl A2aTaskSource for Wrapped {
    fn a2a_tasks(&self) -> Arc<dyn A2aTasks> {
        self.hooks.a2a_tasks(&*self.inner)
    }
}

#[async_trait::async_trait]
impl Store for Wrapped {
    fn hurry(&self) {
        self.inner.hurry();
    }
    async fn create_session(&self, u: &UserId) -> StoreResult<Session> {
        self.inner.create_session(u).await
    }
    async fn create_session_keyed(&self, u: &UserId, key: &RequestId) -> StoreResult<Keyed> {
        self.inner.create_session_keyed(u, key).await
    }
    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>> {
        self.inner.get_session(id).await
    }
    async fn claim_turn(&self, t: &NewTurn) -> StoreResult<Claim> {
        self.inner.claim_turn(t).await
    }
    async fn session_for_run(
        &self,
        s: SessionId,
        t: Option<&RequestId>,
        limit: usize,
    ) -> StoreResult<Option<RunRead>> {
        self.hooks.session_for_run(&*self.inner, s, t, limit).await
    }
    fn history_current(&self, s: SessionId, remembered: u64) -> bool {
        self.inner.history_current(s, remembered)
    }
    async fn get_turn(&self, k: &TurnKey) -> StoreResult<Option<TurnRecord>> {
        self.hooks.get_turn(&*self.inner, k).await
    }
    async fn append_encoded(&self, k: &TurnKey, e: Vec<EncodedEvent>) -> StoreResult<()> {
        self.hooks.append_encoded(&*self.inner, k, e).await
    }
    async fn finish_turn(
        &self,
        k: &TurnKey,
        o: &TurnOutcome,
        a: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        self.hooks.finish_turn(&*self.inner, k, o, a).await
    }
    async fn append_and_finish(
        &self,
        k: &TurnKey,
        e: Vec<EncodedEvent>,
        o: &TurnOutcome,
        a: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        self.hooks.append_and_finish(&*self.inner, k, e, o, a).await
    }
    async fn events_after(
        &self,
        k: &TurnKey,
        after: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<SeqEvent>> {
        self.inner.events_after(k, after, limit).await
    }
    async fn history(&self, s: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>> {
        self.inner.history(s, limit).await
    }
    async fn list_sessions(
        &self,
        u: &UserId,
        limit: usize,
        after: Option<&PageCursor>,
    ) -> StoreResult<SessionPage> {
        self.inner.list_sessions(u, limit, after).await
    }
    async fn delete_session(&self, id: SessionId) -> StoreResult<Deletion> {
        self.inner.delete_session(id).await
    }
    async fn list_turns(
        &self,
        s: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
    ) -> StoreResult<Vec<TurnRecord>> {
        self.inner.list_turns(s, after, limit).await
    }
    async fn list_turn_texts(
        &self,
        s: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        bytes: usize,
    ) -> StoreResult<TurnTexts> {
        self.hooks
            .list_turn_texts(&*self.inner, s, after, limit, bytes)
            .await
    }
    async fn renew_lease(&self, k: &TurnKey, owner: &str, lease: Duration) -> StoreResult<bool> {
        self.inner.renew_lease(k, owner, lease).await
    }
    async fn fail_expired(&self, o: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
        self.hooks.fail_expired(&*self.inner, o).await
    }
    async fn prune(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        self.inner.prune(before, limit).await
    }
    async fn prune_sessions(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        self.inner.prune_sessions(before, limit).await
    }
    async fn ping(&self) -> StoreResult<()> {
        self.hooks.ping(&*self.inner).await
    }
    async fn announce_cancel(&self, k: &TurnKey) -> StoreResult<()> {
        self.hooks.announce_cancel(&*self.inner, k).await
    }
    fn cancel_announcements(&self) -> Option<tokio::sync::broadcast::Receiver<TurnKey>> {
        self.inner.cancel_announcements()
    }
}
