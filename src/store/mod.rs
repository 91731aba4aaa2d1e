//! Storage behind one trait: sessions, the turn side table keyed by
//! (session_id, request_id), and the event log of every turn.
//!
//! Claiming a turn is the dedup point: [`Store::claim_turn`] is atomic, so two
//! callers racing on one request id cannot both be told [`Claim::New`].

pub mod a2a_tasks;
mod codec;
pub mod memory;
pub mod metered;
pub mod postgres;
mod session_cache;
mod sql;
pub mod sqlite;

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use thiserror::Error;

use crate::agent::{Event, PriorTurn};
use crate::domain::{RequestId, SessionId, TurnKey, UserId};

pub use codec::KindEncoding;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: SessionId,
    pub user_id: UserId,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

/// Where a turn is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnState {
    Running,
    Completed,
    Failed,
    Cancelled,
    DeadlineExceeded,
}

impl TurnState {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnState::Running => "running",
            TurnState::Completed => "completed",
            TurnState::Failed => "failed",
            TurnState::Cancelled => "cancelled",
            TurnState::DeadlineExceeded => "deadline_exceeded",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => TurnState::Running,
            "completed" => TurnState::Completed,
            "failed" => TurnState::Failed,
            "cancelled" => TurnState::Cancelled,
            "deadline_exceeded" => TurnState::DeadlineExceeded,
            _ => return None,
        })
    }

    pub fn is_terminal(self) -> bool {
        self != TurnState::Running
    }
}

/// How a turn ended: its state and the gRPC status a replay reproduces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnOutcome {
    pub state: TurnState,
    /// A `tonic::Code` as its number.
    pub code: i32,
    /// Already sanitised: safe to send to any caller.
    pub message: String,
}

/// One event of a turn's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqEvent {
    pub seq: u64,
    pub event: Event,
}

/// An event in the form it is stored in (see [`codec`]), encoded once, by
/// the turn's pump while the event is still in cache: the durable stores
/// write these bytes as they are (a batch is its events' encodings one after
/// another), and the in-memory store keeps them, decoding only on a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedEvent {
    pub seq: u64,
    bytes: bytes::Bytes,
}

/// Pumps encode into blocks of this many bytes at least, handed out one
/// event at a time: one allocation for many small events. A turn's first
/// events get smaller blocks, so short turns the in-memory store keeps do
/// not each hold a large one.
const ENCODE_BLOCK: usize = 4096;
const FIRST_BLOCK: usize = 512;
/// Events of a turn encoded into [`FIRST_BLOCK`]-sized blocks.
const FIRST_EVENTS: u64 = 8;

impl EncodedEvent {
    /// Encodes `event` as event `seq` into `buf`'s free space (growing it
    /// by a block when short) and splits the bytes off, its kind as the
    /// store asks ([`Store::kind_encoding`]).
    pub fn encode(seq: u64, event: &Event, kinds: KindEncoding, buf: &mut bytes::BytesMut) -> Self {
        let len = codec::event_len(seq, event, kinds);
        let n = codec::entry_len(len);
        if buf.capacity() - buf.len() < n {
            let block = if seq < FIRST_EVENTS {
                FIRST_BLOCK
            } else {
                ENCODE_BLOCK
            };
            buf.reserve(n.max(block));
        }
        codec::put_entry(buf, len, seq, event, kinds);
        Self {
            seq,
            bytes: buf.split().freeze(),
        }
    }

    /// The stored form of `e`, its kind by name (what every store reads),
    /// in an allocation of its own.
    pub fn of(e: &SeqEvent) -> Self {
        let kinds = KindEncoding::Name;
        let exact = codec::entry_len(codec::event_len(e.seq, &e.event, kinds));
        let mut buf = bytes::BytesMut::with_capacity(exact);
        Self::encode(e.seq, &e.event, kinds, &mut buf)
    }

    /// The encoded bytes: one entry of a stored batch.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The event back; `None` if the bytes are not one.
    pub fn decode(&self) -> Option<SeqEvent> {
        let mut one = codec::decode(&self.bytes)?;
        match one.as_slice() {
            [e] if e.seq == self.seq => one.pop(),
            _ => None,
        }
    }
}

/// A turn's final answer as its outcome records it beside the turn: the
/// text later turns get as history, and the final event's payload
/// ([`PriorTurn::answer_payload`]; empty for none). The turn engine keeps a
/// payload only within [`crate::agent::MAX_ANSWER_PAYLOAD_BYTES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FinalAnswer<'a> {
    pub text: &'a str,
    pub payload: &'a str,
}

impl<'a> From<&'a str> for FinalAnswer<'a> {
    /// An answer without a payload.
    fn from(text: &'a str) -> Self {
        Self { text, payload: "" }
    }
}

/// A row of the turn side table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    pub key: TurnKey,
    pub user_text: String,
    pub agent: String,
    pub state: TurnState,
    /// Set once the turn is terminal.
    pub outcome: Option<TurnOutcome>,
    /// The replica running it (meaningful while running).
    pub owner: String,
    pub lease_expires_at: SystemTime,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
}

/// The session a keyed CreateSession answers ([`Store::create_session_keyed`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Keyed {
    pub session: Session,
    /// Made by this call; false when an earlier call with the key made it.
    pub created: bool,
}

/// A turn listed with its text ([`Store::list_turn_texts`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnWithText {
    /// With its `user_text`.
    pub record: TurnRecord,
    /// The final answer's text; empty for none.
    pub answer: String,
    /// The final answer's payload (JSON); empty for none.
    pub answer_payload: String,
}

/// A page of turns with their text ([`Store::list_turn_texts`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnTexts {
    pub turns: Vec<TurnWithText>,
    /// Whether a turn follows the last of `turns`.
    pub more: bool,
}

impl TurnWithText {
    /// The bytes of its text ([`text_size`]).
    pub fn text_bytes(&self) -> usize {
        text_size(&self.record.user_text, &self.answer, &self.answer_payload)
    }
}

/// The bytes of a turn's text as a page counts them ([`text_page_len`]): its
/// question, its answer and the answer's payload. The SQL stores count the
/// same columns in `octet_length` (`TURN_TEXTS`).
pub fn text_size(question: &str, answer: &str, payload: &str) -> usize {
    question.len() + answer.len() + payload.len()
}

/// How many turns, of text sizes `sizes` in order, a page of at most
/// `limit` turns and about `bytes` of text holds: none after the one that
/// takes the text to `bytes` or more, and always the first (a turn larger
/// than `bytes` is a page of its own, not a page that never ends).
pub fn text_page_len(sizes: impl IntoIterator<Item = usize>, limit: usize, bytes: usize) -> usize {
    let mut total = 0;
    let mut n = 0;
    for size in sizes.into_iter().take(limit) {
        if n > 0 && total >= bytes {
            break;
        }
        total += size;
        n += 1;
    }
    n
}

/// What a claim asks for.
#[derive(Debug, Clone)]
pub struct NewTurn {
    pub key: TurnKey,
    pub user_text: String,
    pub agent: String,
    pub owner: String,
    pub lease: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller owns the turn now and must run it.
    New,
    /// Someone claimed it before; here is its row.
    Existing(TurnRecord),
}

#[derive(Debug, Error)]
pub enum StoreError {
    /// The backend cannot be reached right now; the caller may retry.
    #[error("the session store is unavailable")]
    Unavailable(#[source] anyhow::Error),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

/// See [`Store::hold_queues`]: the queues go on when this is dropped.
#[doc(hidden)]
pub struct QueuesHeld {
    pub(crate) _held: tokio::sync::OwnedRwLockWriteGuard<()>,
}

pub type StoreResult<T> = Result<T, StoreError>;

/// What [`Store::delete_session`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deletion {
    Deleted,
    /// There was no such session.
    NotFound,
    /// A turn of the session is running: nothing was deleted.
    Busy,
}

/// What a new Run reads before its claim ([`Store::session_for_run`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRead {
    pub session: Session,
    /// The session's last ended turns, oldest first: the agent's history.
    pub history: Vec<PriorTurn>,
    /// The Run's turn is stored already: its request id is a repeat. With
    /// a history remembered from a shared session (`remembered`), a turn
    /// another replica stored may be said not stored: the claim finds it.
    pub turn_stored: bool,
    /// The session's count of claims as the read found it, from a store
    /// that counts them (PostgreSQL), when none of its turns was running
    /// then: what lets the store keep the session in memory. `None`
    /// elsewhere.
    pub claims: Option<i64>,
    /// The history came from this replica's memory of a session that other
    /// replicas share: once the turn is claimed,
    /// [`Store::history_current`] says whether it still holds (no other
    /// replica claimed a turn in the session meanwhile). `None` for a
    /// history read from the database, or from a store only this process
    /// writes.
    pub remembered: Option<u64>,
}

/// Where the next page of [`Store::list_sessions`] starts: sessions are
/// listed oldest first, ordered by (created_at, id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCursor {
    pub created_at: SystemTime,
    pub id: SessionId,
}

impl PageCursor {
    /// The opaque `page_token` a caller sends back.
    pub fn encode(&self) -> String {
        format!("{}.{}", to_micros(self.created_at), self.id)
    }

    pub fn decode(token: &str) -> Option<Self> {
        let (micros, id) = token.split_once('.')?;
        Some(Self {
            created_at: from_micros(micros.parse().ok()?),
            id: SessionId::parse(id).ok()?,
        })
    }
}

/// Where a page of a session's turns starts: after this turn, in
/// (created_at, request_id) order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnCursor {
    pub created_at: SystemTime,
    pub request_id: RequestId,
}

impl TurnCursor {
    /// The cursor after `turn`.
    pub fn after(turn: &TurnRecord) -> Self {
        Self {
            created_at: turn.created_at,
            request_id: turn.key.request_id.clone(),
        }
    }

    /// The opaque `turn_page_token` a caller sends back.
    pub fn encode(&self) -> String {
        format!(
            "{}.{}",
            to_micros(self.created_at),
            self.request_id.as_str()
        )
    }

    pub fn decode(token: &str) -> Option<Self> {
        let (micros, request_id) = token.split_once('.')?;
        Some(Self {
            created_at: from_micros(micros.parse().ok()?),
            request_id: RequestId::parse(request_id).ok()?,
        })
    }

    /// (created_at in microseconds, request_id): the SQL stores' binds.
    pub(crate) fn key(after: Option<&TurnCursor>) -> (i64, &str) {
        after.map_or((i64::MIN, ""), |c| {
            (to_micros(c.created_at), c.request_id.as_str())
        })
    }
}

/// One page of a user's sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionPage {
    pub sessions: Vec<Session>,
    /// Set when more sessions follow.
    pub next: Option<PageCursor>,
}

/// Microseconds since the Unix epoch: how every store keeps time.
pub fn to_micros(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

pub fn from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_micros(us as u64)
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

/// Opens the store a `--store` URL names: `sqlite://PATH`, `postgres://...`
/// (or `postgresql://...`), or `memory:`. Migrations run here; an
/// unreachable database is an error (one line, no secrets from the URL).
/// Every call of the store returned is timed and its failures counted
/// (`agentd_store_*` metrics), and fails as unavailable past
/// [`DEFAULT_CALL_TIMEOUT`].
pub async fn open(url: &str) -> anyhow::Result<std::sync::Arc<dyn Store>> {
    open_bounded(url, Some(DEFAULT_CALL_TIMEOUT)).await
}

/// The longest a store call waits, queueing included, before it fails as
/// [`StoreError::Unavailable`], unless `--store-timeout` says otherwise:
/// twice the bound on a claim, commit or read group's statement, so a call
/// queued behind a slow group still gets its own.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A turn's writer with this many events queued is behind: its turn streams
/// faster than the store's commits come. The SQL stores hold a group of
/// events back up to 10 ms for more to share its commit, but never a batch
/// this large, nor one whose writer has this many waiting behind it
/// ([`Store::hurry`]): a writer hands over its next batch only once the
/// last one is committed, so such a turn would be held to a batch per wait
/// and soon wait for room in its writer's queue. The two cover every
/// writer: one that hands over fewer events took all it had queued, and
/// its queue then fills from empty past this mark. (One turn streaming flat
/// out on SQLite, `agentd bench`: about 0.3x the events/s with neither, 0.6x
/// with the batch's size alone.)
pub const WRITER_BEHIND: usize = 1024;

/// [`open`], with `call_timeout` as the bound on every call (`None`: no
/// bound).
pub async fn open_bounded(
    url: &str,
    call_timeout: Option<Duration>,
) -> anyhow::Result<std::sync::Arc<dyn Store>> {
    use anyhow::Context;
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or_default();
    let store: std::sync::Arc<dyn Store> = match scheme {
        "memory" => std::sync::Arc::new(memory::MemoryStore::new()),
        "sqlite" => std::sync::Arc::new(
            sqlite::SqliteStore::open(url)
                .await
                .map_err(|e| sqlite_open_error(url, e))?,
        ),
        "postgres" | "postgresql" => std::sync::Arc::new(
            postgres::PostgresStore::connect(url)
                .await
                .map_err(one_line)
                .with_context(|| {
                    format!("cannot open the PostgreSQL session store {}", redact(url))
                })?,
        ),
        _ => anyhow::bail!("--store must be sqlite://PATH, postgres://... or memory:"),
    };
    Ok(std::sync::Arc::new(metered::Metered::new(
        store,
        call_timeout,
    )))
}

/// The error of a SQLite store that did not open, on one line: where its
/// file was to be, as an absolute path (the default `sqlite://agentd.db` is
/// in the working directory, which nothing else in the message shows), and
/// why when its directory is missing or not writable, which SQLite reports
/// only as "unable to open database file".
fn sqlite_open_error(url: &str, e: anyhow::Error) -> anyhow::Error {
    use std::str::FromStr;
    let file = sqlx::sqlite::SqliteConnectOptions::from_str(url)
        .ok()
        .map(|o| o.get_filename().to_owned())
        .filter(|f| !f.as_os_str().is_empty() && f != std::path::Path::new(":memory:"))
        .map(|f| std::path::absolute(&f).unwrap_or(f));
    let Some(file) = file else {
        return anyhow::anyhow!("cannot open the SQLite session store {}: {e}", redact(url));
    };
    let dir = file.parent().unwrap_or(std::path::Path::new("/"));
    let why = match std::fs::metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => format!(
            "; its directory {} does not exist: create it, or point --store into a directory that exists (SQLite creates the file, not its directory)",
            dir.display()
        ),
        Err(e) => format!("; its directory {} cannot be read ({e})", dir.display()),
        Ok(m) if !m.is_dir() => format!("; {} is not a directory", dir.display()),
        Ok(_) => match writable(dir) {
            Ok(()) => String::new(),
            Err(e) => format!(
                "; its directory {} is not writable ({e}): point --store into a directory this user can write, such as a volume beside a read-only root file system (SQLite creates the file, its -wal and -shm files and the event log there)",
                dir.display()
            ),
        },
    };
    anyhow::anyhow!(
        "cannot open the SQLite session store {} (the file {}): {e}{why}",
        redact(url),
        file.display()
    )
}

/// Whether this process can create a file in `dir`: by creating one and
/// removing it (permissions alone do not tell: a read-only mount, an ACL,
/// root). Only on a failed open, so nothing is left where a store works.
fn writable(dir: &std::path::Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".agentd-write-check-{}", std::process::id()));
    std::fs::File::create_new(&probe)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// A store's migrations as they run at start-up. Migrations a later release
/// applied are left alone: that release's schema is a superset this one
/// runs on (each release adds only what the one before can ignore), so a
/// rollback, or an older replica started during a rollout, serves as before
/// instead of refusing to start.
fn migrator(mut m: sqlx::migrate::Migrator) -> sqlx::migrate::Migrator {
    m.set_ignore_missing(true);
    m
}

/// sqlx errors already name their cause; keep just that, once.
fn one_line(e: anyhow::Error) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// `url` with its secrets masked (`***`), for messages and logs: the
/// password of its user info, and the value of every query parameter whose
/// key, percent-decoded, contains `password` in any case (`password`,
/// `sslpassword`, `pass%77ord`: sqlx and libpq take several). The rest is
/// shown as written.
pub fn redact(url: &str) -> String {
    const MASK: &str = "***";
    // scheme://userinfo@host/path?query#fragment, split by hand so that what
    // is not a secret is shown exactly as given. The user info first, over
    // the whole URL: a password may hold an unescaped '/', '?', '#' or '@'
    // (sqlx refuses that URL, and its error quotes it), so it runs from the
    // first ':' after a user name to the URL's last '@' (which, if it is in
    // the query instead, masks more than the password: never less).
    let url = match url.split_once("://") {
        Some((scheme, rest)) => match (rest.find(':'), rest.rfind('@')) {
            (Some(colon), Some(at))
                if colon < at && !rest[..colon].contains(['/', '?', '#', '@']) =>
            {
                format!("{scheme}://{}:{MASK}@{}", &rest[..colon], &rest[at + 1..])
            }
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    };
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head.to_owned(), Some(query)),
        None => (url.clone(), None),
    };
    let Some(query) = query else {
        return head;
    };
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _value)) if names_a_password(key) => format!("{key}={MASK}"),
            _ => pair.to_owned(),
        })
        .collect();
    let mut shown = format!("{head}?{}", pairs.join("&"));
    if let Some(f) = fragment {
        shown.push('#');
        shown.push_str(f);
    }
    shown
}

/// Whether a URL query key, percent-decoded (and `+` a space, as sqlx reads
/// it), names a password.
fn names_a_password(key: &str) -> bool {
    form_urlencoded::parse(key.as_bytes())
        .next()
        .is_some_and(|(key, _)| key.to_lowercase().contains("password"))
}

/// Every store also keeps the A2A face's tasks ([`a2a_tasks`]).
#[async_trait]
pub trait Store: a2a_tasks::A2aTaskSource + Send + Sync + 'static {
    async fn create_session(&self, user_id: &UserId) -> StoreResult<Session>;
    /// The session of `user_id`'s CreateSession keyed `key`: the one the
    /// first call with that key made, while it exists, else a new one
    /// (`Keyed::created`). Calls racing on one key all answer the one
    /// session.
    async fn create_session_keyed(&self, user_id: &UserId, key: &RequestId) -> StoreResult<Keyed>;
    async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>>;

    /// Atomically claims `turn.key`: [`Claim::New`] for exactly one caller.
    async fn claim_turn(&self, turn: &NewTurn) -> StoreResult<Claim>;
    async fn get_turn(&self, key: &TurnKey) -> StoreResult<Option<TurnRecord>>;
    /// How the events handed to [`Store::append_encoded`] write their kind:
    /// by name unless every reader of this store's rows reads numbers.
    fn kind_encoding(&self) -> KindEncoding {
        KindEncoding::Name
    }
    /// A turn's writer has [`WRITER_BEHIND`] events waiting behind the
    /// batch it handed over ([`Store::append_encoded`]): a store that holds
    /// a group of events back for more to share its commit commits it now.
    /// Others have nothing to do.
    fn hurry(&self) {}
    /// For tests: holds this store's claim and commit queues back until
    /// the answer is dropped. A worker that took the first item waits, then
    /// takes everything queued meanwhile into the same group, as it does
    /// behind a statement in flight; a test so makes a group of exactly
    /// what it queued. `None` where nothing is queued (memory), or while
    /// another hold is on.
    #[doc(hidden)]
    fn hold_queues(&self) -> Option<QueuesHeld> {
        None
    }
    /// Appends events in seq order (a batch; the turn's writer calls it per
    /// group, with the events its pump encoded).
    async fn append_encoded(&self, key: &TurnKey, events: Vec<EncodedEvent>) -> StoreResult<()>;
    /// [`Store::append_encoded`] of events not yet encoded.
    async fn append_events(&self, key: &TurnKey, events: Vec<SeqEvent>) -> StoreResult<()> {
        self.append_encoded(key, events.iter().map(EncodedEvent::of).collect())
            .await
    }
    /// Records the outcome of a running turn, with its final answer (the
    /// text and payload later turns get as history): true. A turn that is
    /// no longer running (its lease expired and someone failed it) keeps
    /// its outcome: false, and its caller must not report another one.
    async fn finish_turn(
        &self,
        key: &TurnKey,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool>;
    /// A turn's last events and its outcome: [`Store::append_encoded`], then
    /// [`Store::finish_turn`] once the events are stored; when the events
    /// fail, the outcome is not recorded. The SQL stores write both in their
    /// committer's next group, beside other turns' writes. False as
    /// [`Store::finish_turn`]'s; events of a turn no longer running may be
    /// dropped (the SQL stores drop them: they would follow its outcome).
    async fn append_and_finish(
        &self,
        key: &TurnKey,
        events: Vec<EncodedEvent>,
        outcome: &TurnOutcome,
        answer: Option<FinalAnswer<'_>>,
    ) -> StoreResult<bool> {
        self.append_encoded(key, events).await?;
        self.finish_turn(key, outcome, answer).await
    }
    /// Events with seq greater than `after` (all with `None`), at most `limit`.
    async fn events_after(
        &self,
        key: &TurnKey,
        after: Option<u64>,
        limit: usize,
    ) -> StoreResult<Vec<SeqEvent>>;
    /// The session's terminal turns, oldest first, at most the last `limit`.
    async fn history(&self, session: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>>;
    /// The session `id` and its [`Store::history`], or `None` if there is no
    /// such session. The SQL stores read both in one statement: a Run's one
    /// read before its claim.
    async fn session_with_history(
        &self,
        id: SessionId,
        limit: usize,
    ) -> StoreResult<Option<(Session, Vec<PriorTurn>)>> {
        let (session, history) = tokio::join!(self.get_session(id), self.history(id, limit));
        match session? {
            Some(s) => Ok(Some((s, history?))),
            None => Ok(None),
        }
    }
    /// A new Run's one read before its claim: [`Store::session_with_history`]
    /// and whether the Run's turn (`turn`, its request id, when the client
    /// gave one) is stored already: a repeated request id, which the claim
    /// will find, so a model-backed Run does not call its model beside the
    /// claim. `None` if there is no such session.
    async fn session_for_run(
        &self,
        session: SessionId,
        turn: Option<&RequestId>,
        limit: usize,
    ) -> StoreResult<Option<RunRead>> {
        let key = turn.map(|rid| TurnKey {
            session_id: session,
            request_id: rid.clone(),
        });
        let stored = async {
            match &key {
                Some(key) => self.get_turn(key).await.map(|t| t.is_some()),
                None => StoreResult::Ok(false),
            }
        };
        let (read, stored) = tokio::join!(self.session_with_history(session, limit), stored);
        let Some((session, history)) = read? else {
            return Ok(None);
        };
        Ok(Some(RunRead {
            session,
            history,
            turn_stored: stored?,
            claims: None,
            remembered: None,
        }))
    }

    /// Whether a history [`Store::session_for_run`] gave from memory
    /// (`RunRead::remembered`) still holds now that the Run's turn is
    /// claimed: false when another replica claimed a turn in the session
    /// since (or the store let go of the session), and the Run reads it
    /// again. A store that never gives `remembered` keeps this default.
    fn history_current(&self, session: SessionId, remembered: u64) -> bool {
        let _ = (session, remembered);
        true
    }

    /// A user's sessions, oldest first, at most `limit`, after `after`.
    async fn list_sessions(
        &self,
        user_id: &UserId,
        limit: usize,
        after: Option<&PageCursor>,
    ) -> StoreResult<SessionPage>;
    /// Removes a session with its turns and events, unless one of its turns
    /// is running: checked in the delete's own transaction, so that a turn
    /// claimed while the delete runs is either seen (`Busy`) or refused by
    /// the session's absence, never deleted under its run. (SQLite deletes
    /// the event log, kept in a file of its own, after answering: no turn
    /// reads it any more.)
    async fn delete_session(&self, id: SessionId) -> StoreResult<Deletion>;
    /// A session's turns after `after` (from its first with `None`), oldest
    /// first by (created_at, request_id), at most `limit`. Their `user_text`
    /// is not read (left empty): a listing does not carry every question.
    async fn list_turns(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
    ) -> StoreResult<Vec<TurnRecord>>;
    /// As [`Store::list_turns`], each turn with its question (`user_text`)
    /// and its final answer as kept for later turns' history (empty while
    /// it runs, or when it ended without one); at most `limit` turns, and
    /// none after the one whose text takes theirs to `bytes` or more
    /// ([`text_page_len`]). Only those turns' text is read: the sizes that
    /// cut the page are the database's, not rows read and dropped.
    async fn list_turn_texts(
        &self,
        session: SessionId,
        after: Option<&TurnCursor>,
        limit: usize,
        bytes: usize,
    ) -> StoreResult<TurnTexts>;
    /// Extends the lease of a turn `owner` runs to `lease` from now, by the
    /// store's clock; false when the turn is no longer running under that
    /// owner.
    ///
    /// A lease is written (claim, renewal) and judged expired
    /// ([`Store::fail_expired`]) by one clock, the store's (the
    /// database's, where it is shared by replicas), so replicas whose
    /// clocks disagree never end a turn whose lease is live, nor keep one
    /// whose lease ran out.
    async fn renew_lease(&self, key: &TurnKey, owner: &str, lease: Duration) -> StoreResult<bool>;
    /// Ends every running turn whose lease expired, by the store's clock
    /// (see [`Store::renew_lease`]), with `outcome`; returns those turns
    /// (each is returned to one caller only). Such a turn is never run
    /// again.
    async fn fail_expired(&self, outcome: &TurnOutcome) -> StoreResult<Vec<TurnKey>>;
    /// Deletes at most `limit` of the terminal turns (and their events)
    /// last updated before `before`, oldest first; returns how many. A
    /// bounded batch keeps each call short: on SQLite the writer is held
    /// while it runs.
    async fn prune(&self, before: SystemTime, limit: usize) -> StoreResult<u64>;
    /// Deletes at most `limit` of the sessions that hold no turns (never
    /// used, or every turn pruned) and were last updated (created, or
    /// given a turn) before `before`, oldest first; returns how many.
    async fn prune_sessions(&self, before: SystemTime, limit: usize) -> StoreResult<u64>;
    /// Cheap round trip: is the backend reachable now?
    async fn ping(&self) -> StoreResult<()>;
    /// Tells every replica on this store that turn `key` was just recorded
    /// CANCELLED ([`Store::finish_turn`], for a CancelTurn), so that the one
    /// running it stops it now, not at its next lease renewal (which still
    /// stops it if the word is lost). A store only one process uses has no
    /// one to tell.
    async fn announce_cancel(&self, _key: &TurnKey) -> StoreResult<()> {
        Ok(())
    }
    /// The cancels announced on this store, by any replica (this one too),
    /// as they arrive; `None` where only one process uses the store. Those
    /// announced while the store's listening connection was down are
    /// missed.
    fn cancel_announcements(&self) -> Option<tokio::sync::broadcast::Receiver<TurnKey>> {
        None
    }
    /// Closes the store's connections at shutdown, once no run uses it:
    /// SQLite then copies its WAL into the file and removes it, and
    /// PostgreSQL sees its sessions end rather than drop. Later calls fail.
    async fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_token_round_trips_and_garbage_is_refused() {
        let c = PageCursor {
            created_at: from_micros(1_733_000_000_123_456),
            id: SessionId::generate(),
        };
        assert_eq!(PageCursor::decode(&c.encode()), Some(c));
        for bad in [
            "",
            "x",
            "12.not-a-uuid",
            "abc.00000000-0000-0000-0000-000000000000",
        ] {
            assert_eq!(PageCursor::decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn times_keep_microseconds_both_sides_of_the_epoch() {
        for us in [0, 1, 1_733_000_000_123_456, -5_000_000] {
            assert_eq!(to_micros(from_micros(us)), us);
        }
    }

    #[test]
    fn a_store_url_is_shown_without_its_password() {
        assert_eq!(
            redact("postgres://agentd:s3cret@db:5432/agentd"),
            "postgres://agentd:***@db:5432/agentd"
        );
        assert_eq!(redact("postgres://db/agentd"), "postgres://db/agentd");
        assert_eq!(redact("sqlite://agentd.db"), "sqlite://agentd.db");
        assert_eq!(redact("memory:"), "memory:");
        assert_eq!(
            redact("sqlite:///data/a@b.db?mode=rwc"),
            "sqlite:///data/a@b.db?mode=rwc"
        );
        assert_eq!(
            redact("postgres://agentd@db/agentd?password=s3cret&sslmode=require"),
            "postgres://agentd@db/agentd?password=***&sslmode=require"
        );
        assert_eq!(
            redact("postgres://db/agentd?user=agentd&password=s3cret"),
            "postgres://db/agentd?user=agentd&password=***"
        );
        assert_eq!(
            redact("postgres://agentd:s3cret@db/agentd?password=s3cret"),
            "postgres://agentd:***@db/agentd?password=***"
        );
        // A password holding what else splits a URL.
        for password in ["pa?ss", "pa/ss", "pa#ss", "p@ss", "pa?x=1&password"] {
            let shown = redact(&format!(
                "postgres://agentd:{password}@db/agentd?sslmode=require"
            ));
            assert_eq!(
                shown, "postgres://agentd:***@db/agentd?sslmode=require",
                "{password}"
            );
        }
        // Every key that names a password, however it is spelt or escaped.
        for (key, shown) in [
            ("sslpassword", "sslpassword"),
            ("PASSWORD", "PASSWORD"),
            ("pass%77ord", "pass%77ord"),
            ("%70%61%73%73%77%6F%72%64", "%70%61%73%73%77%6F%72%64"),
            ("ssl%50assword", "ssl%50assword"),
        ] {
            let url = format!("postgres://u@db/agentd?sslmode=require&{key}=s3cret&x=1");
            assert_eq!(
                redact(&url),
                format!("postgres://u@db/agentd?sslmode=require&{shown}=***&x=1"),
                "{key}"
            );
        }
        // A password holding unescaped '/' or '@', which sqlx refuses and
        // quotes in its error.
        for url in [
            "postgres://agentd:s3/cret@db/agentd",
            "postgres://agentd:s3@cret@db/agentd",
        ] {
            assert_eq!(redact(url), "postgres://agentd:***@db/agentd", "{url}");
        }
        // Malformed escapes are shown, not decoded.
        assert_eq!(
            redact("postgres://db/x?pass%7=a%"),
            "postgres://db/x?pass%7=a%"
        );
    }
}
