//! An in-process store: nothing survives a restart. Used by tests and as the
//! reference behaviour the durable stores must match.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::*;

#[derive(Default)]
struct Turn {
    record: Option<TurnRecord>,
    /// As the pump encoded them; decoded when read.
    events: Vec<EncodedEvent>,
    /// The final answer `finish_turn` recorded, and its payload, for
    /// history.
    answer: Option<String>,
    answer_payload: String,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<SessionId, Session>,
    turns: HashMap<TurnKey, Turn>,
    /// Each session's turns in the order they were claimed, so history and
    /// listings read one session's turns, not every turn of every session.
    by_session: HashMap<SessionId, Vec<TurnKey>>,
    /// The sessions keyed CreateSessions made (a key whose session is gone
    /// makes a new one).
    session_keys: HashMap<(UserId, RequestId), SessionId>,
}

impl Inner {
    /// `session`'s turns, oldest first.
    fn session_turns(&self, session: SessionId) -> impl DoubleEndedIterator<Item = &Turn> {
        self.by_session
            .get(&session)
            .into_iter()
            .flatten()
            .filter_map(|k| self.turns.get(k))
    }

    /// Drops index entries whose turn is gone.
    fn reindex(&mut self) {
        let turns = &self.turns;
        self.by_session.retain(|_, keys| {
            keys.retain(|k| turns.contains_key(k));
            !keys.is_empty()
        });
    }
}

/// Everything in one mutex: every operation is short and never awaits.
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    /// A2A tasks (not removed with their session here).
    a2a: Arc<a2a_tasks::MemoryTasks>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        let inner: Arc<Mutex<Inner>> = Arc::default();
        let sessions = inner.clone();
        let a2a = Arc::new(a2a_tasks::MemoryTasks::new(move |id, user| {
            let now = from_micros(to_micros(SystemTime::now()));
            sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .sessions
                .entry(id)
                .or_insert_with(|| Session {
                    id,
                    user_id: user.clone(),
                    created_at: now,
                    updated_at: now,
                });
        }));
        Self { inner, a2a }
    }

    /// The sessions `user`'s A2A tasks name (`a2a_tasks::named_session`),
    /// the tasks a session of theirs can have.
    async fn task_sessions(&self, user: &UserId) -> StoreResult<Vec<SessionId>> {
        use a2a_tasks::A2aTasks as _;
        let mut req = a2a::ListTasksRequest {
            context_id: None,
            status: None,
            page_size: None,
            page_token: None,
            history_length: Some(0),
            status_timestamp_after: None,
            include_artifacts: None,
            tenant: None,
        };
        let mut named = Vec::new();
        // Ends: each page starts past the last, in a list that is finite.
        loop {
            let page = self.a2a.list_for(user, &req).await.map_err(|e| {
                StoreError::Unexpected(anyhow::anyhow!("cannot list A2A tasks: {e}"))
            })?;
            named.extend(page.tasks.iter().filter_map(a2a_tasks::named_session));
            if page.next_page_token.is_empty() || page.tasks.is_empty() {
                return Ok(named);
            }
            req.page_token = Some(page.next_page_token);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written row:
        // every mutation below is a single insert or push.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl a2a_tasks::A2aTaskSource for MemoryStore {
    fn a2a_tasks(&self) -> Arc<dyn a2a_tasks::A2aTasks> {
        self.a2a.clone()
    }
}

impl MemoryStore {
    /// A session's turns after `after`, oldest first by (created_at,
    /// request_id) at the cursor's precision (microseconds, as stored by the
    /// SQL stores), at most `limit`: without their text for `None`; for
    /// `Some(bytes)` with it, the page cut as [`super::text_page_len`] says.
    /// Only the page's turns are copied, and their text only when asked for.
    fn turns_page(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        text: Option<usize>,
    ) -> TurnTexts {
        fn key(r: &TurnRecord) -> (i64, &str) {
            (to_micros(r.created_at), r.key.request_id.as_str())
        }
        let inner = self.lock();
        let mut page: Vec<(&TurnRecord, &Turn)> = inner
            .session_turns(session)
            .filter_map(|t| Some((t.record.as_ref()?, t)))
            .filter(|(r, _)| {
                after.is_none_or(|c| key(r) > (to_micros(c.created_at), c.request_id.as_str()))
            })
            .collect();
        page.sort_by(|(a, _), (b, _)| key(a).cmp(&key(b)));
        let len = match text {
            None => limit.min(page.len()),
            Some(bytes) => super::text_page_len(
                page.iter().map(|(r, t)| {
                    super::text_size(
                        &r.user_text,
                        t.answer.as_deref().unwrap_or(""),
                        &t.answer_payload,
                    )
                }),
                limit,
                bytes,
            ),
        };
        let more = page.len() > len;
        page.truncate(len);
        let turns = page
            .into_iter()
            .map(|(r, t)| match text {
                Some(_) => TurnWithText {
                    record: r.clone(),
                    answer: t.answer.clone().unwrap_or_default(),
                    answer_payload: t.answer_payload.clone(),
                },
                None => TurnWithText {
                    record: TurnRecord {
                        user_text: String::new(),
                        ..r.clone()
                    },
                    answer: String::new(),
                    answer_payload: String::new(),
                },
            })
            .collect();
        TurnTexts { turns, more }
    }
}

/// A new session of `user_id`, its times at the precision of the durable
/// stores and of page tokens.
fn new_session(user_id: &UserId) -> Session {
    let now = from_micros(to_micros(SystemTime::now()));
    Session {
        id: SessionId::generate(),
        user_id: user_id.clone(),
        created_at: now,
        updated_at: now,
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn create_session(&self, user_id: &UserId) -> StoreResult<Session> {
        let s = new_session(user_id);
        self.lock().sessions.insert(s.id, s.clone());
        Ok(s)
    }

    async fn create_session_keyed(&self, user_id: &UserId, key: &RequestId) -> StoreResult<Keyed> {
        let mut inner = self.lock();
        let keyed = (user_id.clone(), key.clone());
        if let Some(s) = inner
            .session_keys
            .get(&keyed)
            .and_then(|id| inner.sessions.get(id))
        {
            return Ok(Keyed {
                session: s.clone(),
                created: false,
            });
        }
        let s = new_session(user_id);
        inner.sessions.insert(s.id, s.clone());
        inner.session_keys.insert(keyed, s.id);
        Ok(Keyed {
            session: s,
            created: true,
        })
    }

    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>> {
        Ok(self.lock().sessions.get(&id).cloned())
    }

    async fn claim_turn(&self, t: &NewTurn) -> StoreResult<Claim> {
        let mut inner = self.lock();
        if let Some(existing) = inner.turns.get(&t.key).and_then(|x| x.record.clone()) {
            return Ok(Claim::Existing(existing));
        }
        if !inner.sessions.contains_key(&t.key.session_id) {
            // As the SQL stores' foreign key refuses it.
            return Err(StoreError::Unexpected(anyhow::anyhow!(
                "claim of {} in a session that does not exist",
                t.key
            )));
        }
        let now = SystemTime::now();
        inner
            .by_session
            .entry(t.key.session_id)
            .or_default()
            .push(t.key.clone());
        inner.turns.insert(
            t.key.clone(),
            Turn {
                record: Some(TurnRecord {
                    key: t.key.clone(),
                    user_text: t.user_text.clone(),
                    agent: t.agent.clone(),
                    state: TurnState::Running,
                    outcome: None,
                    owner: t.owner.clone(),
                    lease_expires_at: now + t.lease,
                    created_at: now,
                    updated_at: now,
                }),
                events: Vec::new(),
                answer: None,
                answer_payload: String::new(),
            },
        );
        if let Some(s) = inner.sessions.get_mut(&t.key.session_id) {
            s.updated_at = now;
        }
        Ok(Claim::New)
    }

    async fn get_turn(&self, key: &TurnKey) -> StoreResult<Option<TurnRecord>> {
        Ok(self.lock().turns.get(key).and_then(|t| t.record.clone()))
    }

    /// Nothing outlives the process: no older release reads these events.
    fn kind_encoding(&self) -> KindEncoding {
        KindEncoding::Code
    }

    async fn append_encoded(&self, key: &TurnKey, events: Vec<EncodedEvent>) -> StoreResult<()> {
        let mut inner = self.lock();
        let turn = inner
            .turns
            .get_mut(key)
            .ok_or_else(|| anyhow::anyhow!("append to an unclaimed turn {key}"))?;
        // A turn failed under its writer (its lease ran out) takes no more.
        if turn
            .record
            .as_ref()
            .is_none_or(|r| r.state == TurnState::Running)
        {
            turn.events.extend(events);
        }
        Ok(())
    }

    async fn finish_turn(
        &self,
        key: &TurnKey,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        let mut inner = self.lock();
        let turn = inner
            .turns
            .get_mut(key)
            .filter(|t| t.record.is_some())
            .ok_or_else(|| anyhow::anyhow!("finish of an unclaimed turn {key}"))?;
        let rec = turn.record.as_mut().expect("checked above");
        if rec.state == TurnState::Running {
            rec.state = outcome.state;
            rec.outcome = Some(outcome.clone());
            rec.updated_at = SystemTime::now();
            turn.answer = answer.map(|a| a.text.to_owned());
            turn.answer_payload = answer.map(|a| a.payload.to_owned()).unwrap_or_default();
            return Ok(true);
        }
        Ok(false)
    }

    async fn events_after(
        &self,
        key: &TurnKey,
        after: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<SeqEvent>> {
        let inner = self.lock();
        let Some(turn) = inner.turns.get(key) else {
            return Ok(Vec::new());
        };
        let start = after.map_or(0, |a| {
            usize::try_from(a).map_or(usize::MAX, |a| a.saturating_add(1))
        });
        turn.events
            .iter()
            .skip(start)
            .take(limit)
            .map(|e| {
                e.decode()
                    .ok_or_else(|| anyhow::anyhow!("a malformed event in turn {key}").into())
            })
            .collect()
    }

    async fn history(&self, session: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>> {
        let inner = self.lock();
        let mut turns: Vec<&Turn> = inner
            .session_turns(session)
            .rev()
            .filter(|t| t.record.as_ref().is_some_and(|r| r.state.is_terminal()))
            .take(limit)
            .collect();
        turns.reverse();
        Ok(turns
            .into_iter()
            .filter_map(|t| {
                let r = t.record.as_ref()?;
                Some(PriorTurn {
                    request_id: r.key.request_id.to_string(),
                    agent: r.agent.clone(),
                    user_text: r.user_text.clone(),
                    answer: t.answer.clone().unwrap_or_default(),
                    answer_payload: t.answer_payload.clone(),
                })
            })
            .collect())
    }

    async fn list_sessions(
        &self,
        user_id: &UserId,
        limit: usize,
        after: Option<&PageCursor>,
    ) -> StoreResult<SessionPage> {
        let inner = self.lock();
        let mut mine: Vec<&Session> = inner
            .sessions
            .values()
            .filter(|s| &s.user_id == user_id)
            .filter(|s| after.is_none_or(|c| (s.created_at, s.id) > (c.created_at, c.id)))
            .collect();
        mine.sort_by_key(|s| (s.created_at, s.id));
        let more = mine.len() > limit;
        let sessions: Vec<Session> = mine.into_iter().take(limit).cloned().collect();
        let next = more
            .then(|| {
                sessions.last().map(|s| PageCursor {
                    created_at: s.created_at,
                    id: s.id,
                })
            })
            .flatten();
        Ok(SessionPage { sessions, next })
    }

    async fn delete_session(&self, id: SessionId) -> StoreResult<Deletion> {
        let mut inner = self.lock();
        if !inner.sessions.contains_key(&id) {
            return Ok(Deletion::NotFound);
        }
        if inner.session_turns(id).any(|t| {
            t.record
                .as_ref()
                .is_some_and(|r| r.state == TurnState::Running)
        }) {
            return Ok(Deletion::Busy);
        }
        for k in inner.by_session.remove(&id).unwrap_or_default() {
            inner.turns.remove(&k);
        }
        inner.sessions.remove(&id);
        inner.session_keys.retain(|_, s| *s != id);
        Ok(Deletion::Deleted)
    }

    async fn list_turns(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
    ) -> StoreResult<Vec<TurnRecord>> {
        Ok(self
            .turns_page(session, after, limit, None)
            .turns
            .into_iter()
            .map(|t| t.record)
            .collect())
    }

    async fn list_turn_texts(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        bytes: usize,
    ) -> StoreResult<TurnTexts> {
        Ok(self.turns_page(session, after, limit, Some(bytes)))
    }

    async fn renew_lease(&self, key: &TurnKey, owner: &str, lease: Duration) -> StoreResult<bool> {
        let mut inner = self.lock();
        match inner.turns.get_mut(key).and_then(|t| t.record.as_mut()) {
            Some(r) if r.state == TurnState::Running && r.owner == owner => {
                r.lease_expires_at = SystemTime::now() + lease;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn fail_expired(&self, outcome: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
        let now = SystemTime::now();
        let mut inner = self.lock();
        let mut failed = Vec::new();
        for r in inner.turns.values_mut().filter_map(|t| t.record.as_mut()) {
            if r.state == TurnState::Running && r.lease_expires_at < now {
                r.state = outcome.state;
                r.outcome = Some(outcome.clone());
                r.updated_at = now;
                failed.push(r.key.clone());
            }
        }
        Ok(failed)
    }

    async fn prune(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        let mut inner = self.lock();
        let mut old: Vec<(SystemTime, TurnKey)> = inner
            .turns
            .iter()
            .filter_map(|(key, t)| {
                let r = t.record.as_ref()?;
                (r.state.is_terminal() && r.updated_at < before)
                    .then(|| (r.updated_at, key.clone()))
            })
            .collect();
        old.sort_by_key(|(at, _)| *at);
        old.truncate(limit);
        for (_, key) in &old {
            inner.turns.remove(key);
        }
        if !old.is_empty() {
            inner.reindex();
        }
        Ok(old.len() as u64)
    }

    async fn prune_sessions(&self, before: SystemTime, limit: usize) -> StoreResult<u64> {
        let pruned = |inner: &Inner, s: &Session| {
            s.updated_at < before && inner.by_session.get(&s.id).is_none_or(|k| k.is_empty())
        };
        let found: Vec<(SystemTime, SessionId, UserId)> = {
            let inner = self.lock();
            let mut found: Vec<_> = inner
                .sessions
                .values()
                .filter(|s| pruned(&inner, s))
                .map(|s| (s.updated_at, s.id, s.user_id.clone()))
                .collect();
            found.sort_by_key(|(at, id, _)| (*at, *id));
            found
        };
        if found.is_empty() {
            return Ok(0);
        }
        // A session an A2A task names stays, as the SQL stores keep it: the
        // task reads it.
        let mut users: Vec<&UserId> = found.iter().map(|(_, _, u)| u).collect();
        users.sort();
        users.dedup();
        let mut tasked = std::collections::HashSet::new();
        for user in users {
            tasked.extend(self.task_sessions(user).await?);
        }
        let mut inner = self.lock();
        let mut gone = 0;
        for (_, id, _) in &found {
            if gone == limit {
                break;
            }
            // Checked again: a turn claimed meanwhile keeps it.
            if tasked.contains(id) || !inner.sessions.get(id).is_some_and(|s| pruned(&inner, s)) {
                continue;
            }
            inner.sessions.remove(id);
            inner.by_session.remove(id);
            gone += 1;
        }
        if gone > 0 {
            let Inner {
                sessions,
                session_keys,
                ..
            } = &mut *inner;
            session_keys.retain(|_, s| sessions.contains_key(s));
        }
        Ok(gone as u64)
    }

    async fn ping(&self) -> StoreResult<()> {
        Ok(())
    }
}
