//! The sessions this process created, with their history, kept in memory
//! so that a Run reads its session and conversation history without a
//! database read. On PostgreSQL other replicas change sessions too: see
//! [`SessionCache::shared`] for how their claims are found out. SQLite's
//! store is the only writer of its file,
//! so every change to a session's history passes through it: the claimer
//! tells the cache of each turn it stores, the committer of each outcome it
//! records, pruning removes the turns it deletes, and the rarer changes (a
//! lease that ran out, a deleted session) drop what they touch. Whatever the cache does not know for
//! sure it forgets; a session it does not hold is read from the database.
//!
//! A session is held from its creation here, or from a Run's read of it
//! in the database ([`SessionCache::mark`], then [`SessionCache::offer`]),
//! which is taken only if nothing changed the session's stripe of change
//! counters between the two: every change to a session's turns passes its
//! counter after the database has it. The oldest sessions are dropped
//! first past [`SESSIONS_CAP`] sessions or [`BYTES_CAP`] bytes of text.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use super::{Session, from_micros};
use crate::agent::PriorTurn;
use crate::domain::SessionId;

/// Sessions held at most.
pub(super) const SESSIONS_CAP: usize = 100_000;
/// Bytes of turn text (questions and answers) held at most.
pub(super) const BYTES_CAP: usize = 64 << 20;
/// Ended turns held per session: a Run asking for more history than this
/// of a longer session reads it from the database.
pub(super) const HISTORY_CAP: usize = 64;
/// Change counters, each shared by the sessions whose ids hash to it.
const STRIPES: usize = 256;

#[derive(Default)]
pub(super) struct SessionCache {
    inner: Mutex<Inner>,
    /// The database is shared with other replicas (PostgreSQL), which
    /// claim and end turns this cache never hears of. A session is then
    /// held with its count of claims, which every claim made here checks
    /// ([`SessionCache::claimed`]): a count other than the one held
    /// says another replica claimed a turn in it since, and the session is
    /// forgotten. A history served from memory is checked after the Run's
    /// claim ([`SessionCache::current`]), and read again if its session was
    /// forgotten meanwhile. A session is taken from a read only while none
    /// of its turns runs (one that ended elsewhere would go unseen); which
    /// turns are stored is never answered "no" (another replica may have
    /// stored it); and a prune by another replica reaches this one's memory
    /// at this replica's own next prune.
    shared: bool,
}

struct Inner {
    entries: HashMap<String, Entry>,
    /// Bumped by every change to a session of the stripe, held or not;
    /// `generation` by every change to all of them.
    changes: Vec<u64>,
    generation: u64,
    /// Session ids oldest first; an id whose entry is gone is skipped.
    order: VecDeque<String>,
    bytes: usize,
    /// The last entry's [`Entry::epoch`].
    epochs: u64,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
            changes: vec![0; STRIPES],
            generation: 0,
            order: VecDeque::new(),
            bytes: 0,
            epochs: 0,
        }
    }
}

/// Where a session's changes stood before a database read of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mark {
    generation: u64,
    changes: u64,
}

/// Memory a dropped turn's hashed request id is counted as.
const DROPPED_BYTES: usize = 16;

fn rid_hash(rid: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(rid)
}

fn stripe(sid: &str) -> usize {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(sid) as usize % STRIPES
}

struct Entry {
    session: Session,
    /// Ended turns, in the database's history order: by claim time, then
    /// request id.
    history: VecDeque<Ended>,
    /// Older ended turns were dropped past [`HISTORY_CAP`].
    truncated: bool,
    /// The request ids of those dropped turns, hashed ([`rid_hash`]): the
    /// cache still knows which turns are stored.
    dropped: HashSet<u64>,
    /// Turns claimed and not yet ended: request id → what the claim
    /// stored of it.
    running: HashMap<String, Claimed>,
    /// In a shared cache, the session's count of claims as of what is
    /// held; `None` in one that is not shared.
    claims: Option<i64>,
    /// Which holding of the session this is: a session forgotten and held
    /// again is held under another.
    epoch: u64,
    /// Taken from a database read: when its turns ended is not known, so
    /// any prune forgets it.
    from_read: bool,
    bytes: usize,
}

/// A turn claimed and not yet ended.
struct Claimed {
    /// When it was claimed, in microseconds.
    at: i64,
    user_text: String,
    agent: String,
}

impl Claimed {
    fn bytes(&self, rid: &str) -> usize {
        rid.len() + self.user_text.len() + self.agent.len()
    }
}

struct Ended {
    /// When it was claimed (the history's order) and when it ended
    /// (`updated_at`, what pruning goes by), in microseconds.
    at: i64,
    ended_at: i64,
    turn: PriorTurn,
}

impl Ended {
    fn bytes(&self) -> usize {
        self.turn.request_id.len() + self.turn.agent.len() + self.turn.bytes()
    }
}

impl SessionCache {
    /// A cache of sessions other replicas share ([`SessionCache::shared`]).
    pub fn shared() -> Self {
        Self {
            shared: true,
            ..Self::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A session was just created: it has no turns.
    pub fn created(&self, session: &Session) {
        let mut inner = self.lock();
        let id = session.id.to_string();
        inner.order.push_back(id.clone());
        let epoch = inner.next_epoch();
        inner.entries.insert(
            id,
            Entry {
                session: session.clone(),
                history: VecDeque::new(),
                truncated: false,
                dropped: HashSet::new(),
                running: HashMap::new(),
                claims: self.shared.then_some(0),
                epoch,
                from_read: false,
                bytes: 0,
            },
        );
        inner.evict();
    }

    /// A claim stored turn `rid` of session `sid` at `at` (microseconds),
    /// for `agent`; the claim also marks the session updated then. Called
    /// in the order the claims were written. `counted` is what the claim's
    /// statement said of its session's count of claims, in a store that
    /// counts them: the count before the statement, and how many turns the
    /// statement stored in the session. A shared cache keeps the session
    /// only if that count is the one it held and the claim was the
    /// statement's only one there.
    pub fn claimed(
        &self,
        sid: &str,
        rid: &str,
        at: i64,
        user_text: &str,
        agent: &str,
        counted: Option<(i64, i64)>,
    ) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.changed(sid);
        let Some(e) = inner.entries.get_mut(sid) else {
            return;
        };
        if let Some(held) = e.claims {
            match counted {
                Some((before, 1)) if before == held => e.claims = Some(held + 1),
                _ => {
                    inner.forget(sid);
                    return;
                }
            }
        }
        e.session.updated_at = from_micros(at);
        let claimed = Claimed {
            at,
            user_text: user_text.to_owned(),
            agent: agent.to_owned(),
        };
        let added = claimed.bytes(rid);
        if e.running.insert(rid.to_owned(), claimed).is_some() {
            // A turn claimed twice cannot be: the cache is wrong somewhere.
            inner.forget(sid);
            return;
        }
        e.bytes += added;
        inner.bytes += added;
        inner.evict();
    }

    /// Turn `rid` of session `sid` ended at `ended_at` (microseconds; its
    /// outcome is stored), with its final answer and that answer's payload
    /// if it gave them.
    pub fn ended(
        &self,
        sid: &str,
        rid: &str,
        answer: Option<&str>,
        payload: Option<&str>,
        ended_at: i64,
    ) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.changed(sid);
        let Some(e) = inner.entries.get_mut(sid) else {
            return;
        };
        let Some(claimed) = e.running.remove(rid) else {
            // Claimed before the cache knew the session, or ended before:
            // what its history is now, the database knows.
            inner.forget(sid);
            return;
        };
        let mut delta = -(claimed.bytes(rid) as isize);
        let ended = Ended {
            at: claimed.at,
            ended_at,
            turn: PriorTurn {
                request_id: rid.to_owned(),
                agent: claimed.agent,
                user_text: claimed.user_text,
                answer: answer.unwrap_or_default().to_owned(),
                answer_payload: payload.unwrap_or_default().to_owned(),
            },
        };
        delta += ended.bytes() as isize;
        let key = (ended.at, ended.turn.request_id.as_str());
        let pos = e
            .history
            .iter()
            .rposition(|h| (h.at, h.turn.request_id.as_str()) <= key)
            .map_or(0, |i| i + 1);
        if pos == 0 && e.truncated && !e.history.is_empty() {
            // Older than the oldest turn held: it belongs among the dropped.
            delta -= ended.bytes() as isize;
            e.drop_turn(rid, &mut delta);
        } else {
            e.history.insert(pos, ended);
            while e.history.len() > HISTORY_CAP {
                let dropped = e.history.pop_front().expect("over the cap");
                delta -= dropped.bytes() as isize;
                e.drop_turn(&dropped.turn.request_id, &mut delta);
                e.truncated = true;
            }
        }
        e.bytes = e.bytes.saturating_add_signed(delta);
        inner.bytes = inner.bytes.saturating_add_signed(delta);
        inner.evict();
    }

    /// Drops what is held of session `sid`: it was deleted, or one of its
    /// turns changed in a way the cache does not follow.
    pub fn forget(&self, sid: &str) {
        self.lock().forget(sid);
    }

    /// Pruning deleted the ended turns last updated before `before`
    /// (microseconds). A session that had dropped older turns past
    /// [`HISTORY_CAP`] is forgotten if any of its held ones went: one of
    /// the dropped, ended later, may now be among its last.
    pub fn pruned(&self, before: i64) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.generation += 1;
        let mut lost = Vec::new();
        let mut freed = 0;
        for (sid, e) in inner.entries.iter_mut() {
            if !e.from_read && !e.history.iter().any(|h| h.ended_at < before) {
                continue;
            }
            if e.truncated || e.from_read {
                lost.push(sid.clone());
                continue;
            }
            let was = e.bytes;
            e.history.retain(|h| {
                let keep = h.ended_at >= before;
                if !keep {
                    e.bytes -= h.bytes();
                }
                keep
            });
            freed += was - e.bytes;
        }
        inner.bytes -= freed;
        for sid in lost {
            inner.forget(&sid);
        }
    }

    /// Drops everything (turns ended by lease expiry).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.generation += 1;
        inner.entries.clear();
        inner.order.clear();
        inner.bytes = 0;
    }

    /// Session `id` and its last `limit` ended turns, oldest first, and in
    /// a shared cache the holding the answer came from, for
    /// [`SessionCache::current`] to check once the Run's turn is claimed;
    /// `None` when the cache cannot answer (the database must).
    pub fn get(
        &self,
        id: SessionId,
        limit: usize,
    ) -> Option<(Session, Vec<PriorTurn>, Option<u64>)> {
        let inner = self.lock();
        let e = inner.entries.get(&id.to_string())?;
        if e.truncated && limit > e.history.len() {
            return None;
        }
        let skip = e.history.len().saturating_sub(limit);
        let history = e
            .history
            .iter()
            .skip(skip)
            .map(|h| h.turn.clone())
            .collect();
        Some((e.session.clone(), history, self.shared.then_some(e.epoch)))
    }

    /// Whether session `sid` is still held as it was when
    /// [`SessionCache::get`] answered with `epoch`: no claim made
    /// here since found another replica's claim between, and nothing else
    /// made the cache forget it.
    pub fn current(&self, sid: &str, epoch: u64) -> bool {
        self.lock()
            .entries
            .get(sid)
            .is_some_and(|e| e.epoch == epoch)
    }

    /// Whether turn `rid` of session `id` is stored: `None` when the cache
    /// cannot tell. It knows every turn of a session it holds from its
    /// creation here (those dropped past [`HISTORY_CAP`] by their hashed
    /// request ids; a pruned one may still count as stored); of one taken
    /// from a read, only those it holds.
    pub fn stored(&self, id: SessionId, rid: &str) -> Option<bool> {
        let inner = self.lock();
        let e = inner.entries.get(&id.to_string())?;
        if e.running.contains_key(rid)
            || e.history.iter().any(|h| h.turn.request_id == rid)
            || e.dropped.contains(&rid_hash(rid))
        {
            return Some(true);
        }
        (!e.from_read && !self.shared).then_some(false)
    }

    /// Where session `sid`'s changes stand, taken before reading it from
    /// the database for [`SessionCache::offer`].
    pub fn mark(&self, sid: &str) -> Mark {
        let inner = self.lock();
        Mark {
            generation: inner.generation,
            changes: inner.changes[stripe(sid)],
        }
    }

    /// A session as the database read it after `mark`, with its last
    /// ended turns (at most `HISTORY_CAP + 1`, oldest first: one more than
    /// is held says older ones exist). Held unless something changed the
    /// session's stripe since `mark`, or it is held already. Its running
    /// turns are unknown: when one ends, the session is forgotten. `claims`
    /// is the session's count of claims as the read found it, in a store
    /// that counts them: a shared cache holds the session only with its
    /// count, which a read gives only when none of the session's turns was
    /// running.
    pub fn offer(&self, mark: Mark, session: &Session, history: &[PriorTurn], claims: Option<i64>) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let sid = session.id.to_string();
        if inner.mark_of(&sid) != mark
            || inner.entries.contains_key(&sid)
            || (self.shared && claims.is_none())
        {
            return;
        }
        let truncated = history.len() > HISTORY_CAP;
        let held: VecDeque<Ended> = history[history.len().saturating_sub(HISTORY_CAP)..]
            .iter()
            .map(|t| Ended {
                // Their order is the database's, and every turn claimed
                // from now on comes after them. When they ended the read
                // did not bring: the next prune forgets the session.
                at: i64::MIN,
                ended_at: i64::MIN,
                turn: t.clone(),
            })
            .collect();
        let bytes = held.iter().map(Ended::bytes).sum();
        inner.order.push_back(sid.clone());
        let epoch = inner.next_epoch();
        inner.entries.insert(
            sid,
            Entry {
                session: session.clone(),
                history: held,
                truncated,
                dropped: HashSet::new(),
                running: HashMap::new(),
                claims: if self.shared { claims } else { None },
                epoch,
                from_read: true,
                bytes,
            },
        );
        inner.bytes += bytes;
        inner.evict();
    }

    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.entries.len(), inner.bytes)
    }
}

impl Entry {
    /// Counts ended turn `rid`, no longer held, among the dropped.
    fn drop_turn(&mut self, rid: &str, delta: &mut isize) {
        if self.dropped.insert(rid_hash(rid)) {
            *delta += DROPPED_BYTES as isize;
        }
    }
}

impl Inner {
    /// A new holding's [`Entry::epoch`].
    fn next_epoch(&mut self) -> u64 {
        self.epochs += 1;
        self.epochs
    }

    fn changed(&mut self, sid: &str) {
        self.changes[stripe(sid)] += 1;
    }

    fn mark_of(&self, sid: &str) -> Mark {
        Mark {
            generation: self.generation,
            changes: self.changes[stripe(sid)],
        }
    }

    fn forget(&mut self, sid: &str) {
        self.changed(sid);
        if let Some(e) = self.entries.remove(sid) {
            self.bytes -= e.bytes;
        }
        // Ids of forgotten sessions wait in `order` until they come up;
        // when they are most of it, it is rebuilt.
        if self.order.len() > 2 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.order.retain(|id| entries.contains_key(id));
        }
    }

    /// Drops the oldest sessions while over a cap.
    fn evict(&mut self) {
        while self.entries.len() > SESSIONS_CAP || self.bytes > BYTES_CAP {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.bytes;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::domain::UserId;

    fn session() -> Session {
        let now = from_micros(super::super::to_micros(SystemTime::now()));
        Session {
            id: SessionId::generate(),
            user_id: UserId::parse("alice").unwrap(),
            created_at: now,
            updated_at: now,
        }
    }

    fn ids(h: &[PriorTurn]) -> Vec<&str> {
        h.iter().map(|t| t.request_id.as_str()).collect()
    }

    #[test]
    fn turns_ending_out_of_order_are_held_in_claim_order_with_their_answers() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        assert_eq!(c.get(s.id, 20).unwrap().1, vec![]);
        c.claimed(&sid, "r1", 10, "q1", "x", None);
        c.claimed(&sid, "r2", 20, "q2", "x", None);
        c.claimed(&sid, "r3", 20, "q3", "y", None);
        assert!(
            c.get(s.id, 20).unwrap().1.is_empty(),
            "running turns are no history"
        );
        c.ended(&sid, "r3", Some("a3"), Some("{}"), 100);
        c.ended(&sid, "r1", None, None, 100);
        c.ended(&sid, "r2", Some("a2"), None, 100);
        let (got, history, _) = c.get(s.id, 20).unwrap();
        assert_eq!(ids(&history), ["r1", "r2", "r3"]);
        assert_eq!(history[0].answer, "", "a turn without an answer");
        assert_eq!(
            (history[2].user_text.as_str(), history[2].answer.as_str()),
            ("q3", "a3")
        );
        assert_eq!(
            (
                history[2].agent.as_str(),
                history[2].answer_payload.as_str()
            ),
            ("y", "{}")
        );
        assert_eq!(
            (
                history[1].agent.as_str(),
                history[1].answer_payload.as_str()
            ),
            ("x", "")
        );
        // Each held turn counts its request id, agent, question, answer and
        // payload.
        assert_eq!(c.held(), (1, (2 + 1 + 2) * 3 + 2 + 2 + 2));
        assert_eq!(
            got.updated_at,
            from_micros(20),
            "the last claim marks the session"
        );
        assert_eq!(ids(&c.get(s.id, 2).unwrap().1), ["r2", "r3"]);
        assert!(c.get(s.id, 0).unwrap().1.is_empty());
    }

    #[test]
    fn what_the_cache_cannot_follow_it_forgets() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        c.ended(&sid, "unknown", Some("a"), None, 100);
        assert!(c.get(s.id, 5).is_none(), "a turn it never saw claimed");
        // Not held again once forgotten, not even by a claim.
        c.claimed(&sid, "r1", 1, "q", "", None);
        assert!(c.get(s.id, 5).is_none());
        let other = session();
        assert!(
            c.get(other.id, 5).is_none(),
            "a session it never saw created"
        );
        c.created(&other);
        c.claimed(&other.id.to_string(), "r1", 1, "q", "", None);
        c.clear();
        assert!(c.get(other.id, 5).is_none());
        assert_eq!(c.held(), (0, 0));
    }

    #[test]
    fn a_long_session_keeps_its_last_turns_and_sends_longer_asks_to_the_database() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        let n = HISTORY_CAP + 6;
        for i in 0..n {
            let rid = format!("r{i:03}");
            c.claimed(&sid, &rid, i as i64, "q", "", None);
            c.ended(&sid, &rid, Some("a"), None, 100);
        }
        let (_, last, _) = c.get(s.id, 3).unwrap();
        assert_eq!(ids(&last), ["r067", "r068", "r069"]);
        assert_eq!(c.get(s.id, HISTORY_CAP).unwrap().1.len(), HISTORY_CAP);
        assert!(c.get(s.id, HISTORY_CAP + 1).is_none());
        // A turn claimed before the oldest held, ending now, is among the
        // dropped ones.
        c.claimed(&sid, "r000x", 0, "q", "", None);
        c.ended(&sid, "r000x", Some("a"), None, 100);
        assert_eq!(c.get(s.id, HISTORY_CAP).unwrap().1[0].request_id, "r006");
        let per_turn = "r000".len() + 2;
        // The 7 dropped are counted by their hashed ids.
        assert_eq!(c.held(), (1, HISTORY_CAP * per_turn + 7 * DROPPED_BYTES));
    }

    #[test]
    fn pruning_removes_the_turns_that_ended_before_its_bound() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        // Claimed in order; r1 ends last.
        for (rid, at) in [("r1", 1), ("r2", 2), ("r3", 3)] {
            c.claimed(&sid, rid, at, "q", "", None);
        }
        c.ended(&sid, "r2", Some("a"), None, 20);
        c.ended(&sid, "r3", Some("a"), None, 30);
        c.ended(&sid, "r1", Some("a"), None, 40);
        c.pruned(30);
        assert_eq!(ids(&c.get(s.id, 5).unwrap().1), ["r1", "r3"]);
        assert_eq!(c.held(), (1, 2 * ("r1".len() + 2)));
        c.pruned(41);
        assert!(c.get(s.id, 5).unwrap().1.is_empty());
        assert_eq!(c.held(), (1, 0));

        // A session past the cap loses a held turn: it is forgotten.
        let long = session();
        let lid = long.id.to_string();
        c.created(&long);
        for i in 0..HISTORY_CAP + 1 {
            let rid = format!("r{i:03}");
            c.claimed(&lid, &rid, i as i64, "q", "", None);
            c.ended(&lid, &rid, Some("a"), None, 100 + i as i64);
        }
        c.pruned(101);
        assert!(c.get(long.id, 5).is_some(), "nothing held was pruned");
        c.pruned(102);
        assert!(c.get(long.id, 5).is_none());
    }

    fn prior(rid: &str) -> PriorTurn {
        PriorTurn {
            request_id: rid.into(),
            user_text: "q".into(),
            answer: "a".into(),
            ..PriorTurn::default()
        }
    }

    #[test]
    fn a_session_read_from_the_database_is_held_unless_it_changed_meanwhile() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        let read = [prior("r1"), prior("r2")];

        let mark = c.mark(&sid);
        c.offer(mark, &s, &read, None);
        assert_eq!(ids(&c.get(s.id, 5).unwrap().1), ["r1", "r2"]);
        // A turn claimed from now on comes after them.
        c.claimed(&sid, "r3", 5, "q", "", None);
        c.ended(&sid, "r3", Some("a"), None, 6);
        assert_eq!(ids(&c.get(s.id, 5).unwrap().1), ["r1", "r2", "r3"]);
        // A turn that was running at the read ends: unknown, forgotten.
        c.ended(&sid, "r0", Some("a"), None, 7);
        assert!(c.get(s.id, 5).is_none());

        // Any change to the session between the mark and the offer, or to
        // all of them, and the read is not taken.
        for change in 0..4 {
            let mark = c.mark(&sid);
            match change {
                0 => c.claimed(&sid, "r9", 9, "q", "", None),
                1 => c.ended(&sid, "r9", None, None, 9),
                2 => c.pruned(9),
                _ => c.forget(&sid),
            }
            c.offer(mark, &s, &read, None);
            assert!(c.get(s.id, 5).is_none(), "change {change}");
        }
        c.offer(c.mark(&sid), &s, &read, None);
        assert!(c.get(s.id, 5).is_some());
        // Any prune forgets it: when its turns ended is not known.
        c.pruned(i64::MIN + 1);
        assert!(c.get(s.id, 5).is_none());

        // More turns than held: the longest asks go to the database.
        let long: Vec<PriorTurn> = (0..=HISTORY_CAP)
            .map(|i| prior(&format!("r{i:03}")))
            .collect();
        c.offer(c.mark(&sid), &s, &long, None);
        assert_eq!(c.get(s.id, HISTORY_CAP).unwrap().1[0].request_id, "r001");
        assert!(c.get(s.id, HISTORY_CAP + 1).is_none());
    }

    #[test]
    fn it_knows_every_turn_of_a_session_created_here_and_only_the_held_of_one_read() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        assert_eq!(c.stored(s.id, "r000"), Some(false));
        // Past the cap, in order and out of it: the dropped are still known.
        for i in 0..HISTORY_CAP + 3 {
            c.claimed(&sid, &format!("r{i:03}"), i as i64, "q", "", None);
        }
        for i in (1..HISTORY_CAP + 3).chain([0]) {
            assert_eq!(
                c.stored(s.id, &format!("r{i:03}")),
                Some(true),
                "r{i:03} running"
            );
            c.ended(&sid, &format!("r{i:03}"), Some("a"), None, 100);
        }
        assert!(
            c.get(s.id, HISTORY_CAP + 1).is_none(),
            "dropped past the cap"
        );
        for i in 0..HISTORY_CAP + 3 {
            assert_eq!(c.stored(s.id, &format!("r{i:03}")), Some(true), "r{i:03}");
        }
        assert_eq!(c.stored(s.id, "r999"), Some(false));
        let (_, bytes) = c.held();
        assert_eq!(
            bytes,
            HISTORY_CAP * 6 + 3 * DROPPED_BYTES,
            "held turns and dropped ids"
        );

        // Read from the database: only what it holds.
        let other = session();
        c.offer(c.mark(&other.id.to_string()), &other, &[prior("r1")], None);
        assert_eq!(c.stored(other.id, "r1"), Some(true));
        assert_eq!(c.stored(other.id, "r2"), None);
        assert_eq!(c.stored(session().id, "r1"), None, "not held");
    }

    #[test]
    fn the_oldest_sessions_go_first_past_the_byte_cap() {
        let c = SessionCache::default();
        let old = session();
        let new = session();
        c.created(&old);
        c.created(&new);
        let big = "x".repeat(BYTES_CAP / 2 + 1);
        c.claimed(&old.id.to_string(), "r1", 1, &big, "", None);
        assert!(c.get(old.id, 1).is_some());
        c.claimed(&new.id.to_string(), "r1", 2, &big, "", None);
        assert!(c.get(old.id, 1).is_none(), "the older session is dropped");
        assert!(c.get(new.id, 1).is_some());
        assert_eq!(c.held(), (1, big.len() + 2));
    }

    /// Shared with other replicas (PostgreSQL): a session is kept only
    /// while every claim made here finds the count of claims it held, a
    /// history served from memory is checked by [`SessionCache::current`]
    /// once the Run's turn is claimed, and which turns are stored is never
    /// answered "no".
    #[test]
    fn a_shared_cache_keeps_a_session_only_while_its_claims_are_all_its_own() {
        let c = SessionCache::shared();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        let (_, history, held) = c.get(s.id, 5).unwrap();
        assert!(history.is_empty());
        let held = held.expect("a shared cache says which holding answered");
        assert_eq!(c.stored(s.id, "r9"), None, "another replica may have it");
        // The first claim finds the count at 0, as held.
        c.claimed(&sid, "r1", 1, "q1", "x", Some((0, 1)));
        assert!(c.current(&sid, held));
        c.ended(&sid, "r1", Some("a1"), None, 2);
        assert_eq!(c.stored(s.id, "r1"), Some(true));
        let (_, history, again) = c.get(s.id, 5).unwrap();
        assert_eq!(ids(&history), ["r1"]);
        assert_eq!(again, Some(held), "the same holding");
        // Another replica claimed a turn meanwhile: the count is 2, not 1.
        c.claimed(&sid, "r3", 3, "q3", "x", Some((2, 1)));
        assert!(!c.current(&sid, held), "the history served is stale");
        assert!(c.get(s.id, 5).is_none(), "forgotten");

        // Read again, with a count: held under another holding.
        c.offer(c.mark(&sid), &s, &[prior("r1"), prior("r2")], Some(3));
        let (_, history, next) = c.get(s.id, 5).unwrap();
        assert_eq!(ids(&history), ["r1", "r2"]);
        assert_ne!(next, Some(held));
        assert!(!c.current(&sid, held));
        // Two claims of the session in one statement: not followed.
        c.claimed(&sid, "r4", 4, "q4", "x", Some((3, 2)));
        assert!(c.get(s.id, 5).is_none());
        // A count not known (a claim's statement that does not count) is
        // not followed either.
        c.offer(c.mark(&sid), &s, &[], Some(5));
        assert!(c.get(s.id, 5).is_some());
        c.claimed(&sid, "r5", 5, "q5", "x", None);
        assert!(c.get(s.id, 5).is_none());
        // A read made while one of the session's turns ran (no count) is
        // not held.
        c.offer(c.mark(&sid), &s, &[], None);
        assert!(c.get(s.id, 5).is_none());
    }

    /// A cache only this process writes through ignores counts and says
    /// nothing to check.
    #[test]
    fn a_cache_not_shared_needs_no_check() {
        let c = SessionCache::default();
        let s = session();
        let sid = s.id.to_string();
        c.created(&s);
        assert_eq!(c.get(s.id, 5).unwrap().2, None);
        c.claimed(&sid, "r1", 1, "q1", "x", None);
        c.ended(&sid, "r1", Some("a1"), None, 2);
        assert_eq!(ids(&c.get(s.id, 5).unwrap().1), ["r1"]);
        assert_eq!(c.stored(s.id, "r2"), Some(false));
        let other = session();
        c.offer(c.mark(&other.id.to_string()), &other, &[], None);
        assert!(c.get(other.id, 5).is_some(), "held without a count");
    }
}
