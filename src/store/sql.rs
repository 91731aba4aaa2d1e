//! What the SQL stores share: the queries (one dialect: both SQLite and
//! PostgreSQL accept `$N` parameters, `ON CONFLICT DO NOTHING` and partial
//! indexes), row decoding, and which driver errors mean "unavailable".
//!
//! [`sql_store!`] implements [`Store`](super::Store) for a type with a
//! `read` and a `write` pool of one sqlx database; SQLite gives its writes a
//! single connection (one writer path), PostgreSQL uses one pool for both.

use super::StoreError;

/// Sorts a driver error into "retry later" and "a bug or bad data".
pub(super) fn db_err(e: sqlx::Error) -> StoreError {
    if unavailable(&e) {
        StoreError::Unavailable(e.into())
    } else {
        StoreError::Unexpected(e.into())
    }
}

/// Whether a driver error says the database cannot be reached or cannot
/// take the statement now (retry later), not that the statement is bad.
/// A group that fails so fails whole: written again one item at a time,
/// each would wait as long again (a connection attempt, up to the pool's
/// acquire timeout) for the same answer.
pub(super) fn unavailable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => match d.try_downcast_ref::<sqlx::sqlite::SqliteError>() {
            // SQLite gives extended result codes: the primary code is the
            // low byte (517, SQLITE_BUSY_SNAPSHOT, is a BUSY).
            Some(_) => d
                .code()
                .and_then(|c| c.parse::<i32>().ok())
                .is_some_and(|c| sqlite_unavailable(c & 0xff)),
            // PostgreSQL: class 08 connection exception, 57 operator
            // intervention (57014: a statement cancelled by its
            // statement_timeout or by an operator; 57P0x: shutdown, cannot
            // connect now), 53 insufficient resources (53100: disk full),
            // 25006 read-only transaction (a connection left on a primary
            // that failed over and is now a standby), 55P03 lock not
            // available (lock_timeout), 40001 and 40P01 (a serialization
            // failure, a deadlock: the transaction may pass if run again).
            None => d.code().is_some_and(|c| {
                c.starts_with("08")
                    || c.starts_with("57")
                    || c.starts_with("53")
                    || matches!(&*c, "25006" | "55P03" | "40001" | "40P01")
            }),
        },
        _ => false,
    }
}

/// A PostgreSQL deadlock or serialization failure: one transaction of the
/// cycle was rolled back, and a group so failed is written again one item
/// at a time (each may pass), where a database away fails it whole.
pub(crate) fn conflict(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => d.code().is_some_and(|c| matches!(&*c, "40001" | "40P01")),
        _ => false,
    }
}

/// SQLite's primary result codes that say the file cannot take the
/// statement now, not that the statement is bad: BUSY and LOCKED (after the
/// busy timeout), NOMEM, READONLY (the file or its folder no longer
/// writable), IOERR, FULL (the disk), CANTOPEN (a WAL or lock file),
/// PROTOCOL (a WAL lock race). An operator's fix, or time, makes them go.
fn sqlite_unavailable(primary: i32) -> bool {
    matches!(primary, 5 | 6 | 7 | 8 | 10 | 13 | 14 | 15)
}

/// How long a group's statement (a claim, commit or read group) may take
/// before its callers are told the store is unavailable: longer than
/// SQLite's busy timeout and PostgreSQL's connection wait, so only a
/// database that stopped answering meets it (a network cut without a
/// reset leaves an open connection waiting for minutes). A statement cut
/// off may still have been carried out: a claim so written is ended by its
/// lease, a commit is what a retry replays.
pub(super) const GROUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

#[cfg(test)]
thread_local! {
    /// A shorter [`GROUP_TIMEOUT`] for the tasks this thread runs (a unit
    /// test on a current-thread runtime, whose store's tasks run there too).
    pub(super) static GROUP_TIMEOUT_HERE: std::cell::Cell<Option<std::time::Duration>> =
        const { std::cell::Cell::new(None) };
}

/// [`GROUP_TIMEOUT`] (in unit tests, [`GROUP_TIMEOUT_HERE`] where set).
fn group_timeout() -> std::time::Duration {
    #[cfg(test)]
    if let Some(t) = GROUP_TIMEOUT_HERE.get() {
        return t;
    }
    GROUP_TIMEOUT
}

/// `statement`, failed as the database not answering after [`GROUP_TIMEOUT`].
pub(super) async fn bounded<T, E: From<sqlx::Error>>(
    statement: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let limit = group_timeout();
    match tokio::time::timeout(limit, statement).await {
        Ok(r) => r,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the database did not answer within {limit:?}"),
        ))
        .into()),
    }
}

/// Whether a statement that failed so may have been carried out all the
/// same: it was cut off ([`bounded`]) or its connection lost after it was
/// sent, where the database, or SQLite's thread, may still commit it. An
/// error the database answered with (a lock timeout, BUSY, a constraint)
/// says it was not.
pub(super) fn maybe_done(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed
    )
}

/// Whether, after a statement failed so, the next one should not be tried
/// at all: the database is away (not a conflict, which the next may pass).
pub(super) fn gone(e: &sqlx::Error) -> bool {
    unavailable(e) && !conflict(e)
}

pub(super) fn bad_row(what: &str) -> StoreError {
    StoreError::Unexpected(anyhow::anyhow!("the store holds a malformed {what}"))
}

/// The most encoded bytes one batch row holds unless its backend says
/// less ([`Dialect::row_bytes`]), so no row approaches the backends' value
/// limits (1 GB) whatever the batch; a single event larger than a row's
/// limit gets a row of its own.
pub(super) const BATCH_ROW_BYTES: usize = 1 << 20;

/// Splits a commit's events into rows of at most `row_bytes` (but at least
/// one event each).
pub(super) fn split_batch(
    events: &[super::EncodedEvent],
    row_bytes: usize,
) -> Vec<&[super::EncodedEvent]> {
    let mut rows = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, e) in events.iter().enumerate() {
        let size = e.as_bytes().len();
        if i > start && bytes + size > row_bytes {
            rows.push(&events[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < events.len() {
        rows.push(&events[start..]);
    }
    rows
}

/// The rows of `events`: (first_seq, last_seq, the row's events), split
/// by [`split_batch`].
pub(super) fn batch_rows(
    events: &[super::EncodedEvent],
    row_bytes: usize,
) -> impl Iterator<Item = (i64, i64, &[super::EncodedEvent])> {
    split_batch(events, row_bytes).into_iter().map(|chunk| {
        let first = chunk.first().map_or(0, |e| e.seq as i64);
        let last = chunk.last().map_or(0, |e| e.seq as i64);
        (first, last, chunk)
    })
}

/// A row's blob: its events' encodings one after another (a stored batch;
/// see `codec`), in one allocation of the exact size.
pub(super) fn blob(events: &[super::EncodedEvent]) -> Vec<u8> {
    let mut blob = Vec::with_capacity(events.iter().map(|e| e.as_bytes().len()).sum());
    for e in events {
        blob.extend_from_slice(e.as_bytes());
    }
    blob
}

/// How long a group of events waits, at most, to share a commit with what
/// follows it, counted from when the committers last began one ([`Pace`]):
/// a commit costs about the same whatever it holds, so the fewer the
/// better, as long as no one waits for them.
///
/// On SQLite a commit rewrites the event log's first page (its change
/// counter), the table's root page and its last leaf, each 64 KiB, and
/// journals all three first: some 400 KB written and four `fsync`s,
/// whatever the group holds. Turns streaming a model's tokens hand their
/// writers a few events at a time: at 2 ms, 64 of them streaming 16 events
/// each had the server write about 100 times their bytes to disk
/// (`model_overhead`, `store=sqlite`: 15 MB a round; 9 MB at 10 ms), and
/// that work, on the server's core, held up every stream: time to last
/// token 1.58x direct at 2 ms, 1.27-1.35x at 10 ms, no better at 25 ms.
/// Turns streaming flat out made groups of some 85 KB each, committed back
/// to back, 570 a second (`agentd bench`, bursty, 64 streams): waiting
/// 10 ms for more took SQLite from 0.6x the in-memory store's events/s to
/// about 0.8x. Events still reach the client at once; only their storage
/// (and followers reading it) waits. A turn's last events, which go with
/// its outcome, never wait, nor do the batches of a turn streaming faster
/// than commits come ([`WRITER_BEHIND`](super::WRITER_BEHIND)).
pub(super) const LINGER: std::time::Duration = std::time::Duration::from_millis(10);

/// A group holding at least this many bytes of events is committed at once:
/// past it, a commit's own cost is small beside its events'.
const LINGER_BELOW: usize = 4 << 20;

/// When a queue's committers last began a commit: a group that may wait
/// for more waits until [`LINGER`] after it, unless a turn's writer asks
/// for its commit sooner ([`Pace::hurry`]). The claimers keep one too,
/// with [`CLAIM_LINGER`]. Shared by all of the queue's
/// workers, so that several (PostgreSQL's) space their commits as one
/// does. With a clock each, a worker whose own last commit was long ago
/// committed at once whatever it found, and four committers made a commit
/// every 2-3 ms of turns streaming a model's tokens (`model_overhead`, 64
/// runs: some 60 statements a round, 8 rows a turn).
pub(super) struct Pace {
    last: std::sync::Mutex<tokio::time::Instant>,
    /// How long after the last group began the next may wait.
    linger: std::time::Duration,
    hurry: tokio::sync::Notify,
}

impl Pace {
    /// The committers' pace ([`LINGER`]).
    pub(super) fn new() -> Self {
        Self::lingering(LINGER)
    }

    /// A pace whose groups wait up to `linger` after the last began.
    pub(super) fn lingering(linger: std::time::Duration) -> Self {
        Self {
            last: std::sync::Mutex::new(tokio::time::Instant::now()),
            linger,
            hurry: tokio::sync::Notify::new(),
        }
    }

    /// Until when a group may wait for more.
    fn until(&self) -> tokio::time::Instant {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) + self.linger
    }

    /// A group begins its commit now: the next one waits from here.
    fn begin(&self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = now;
        now
    }

    /// A turn's writer is behind, its batch waiting in a group for more
    /// ([`Store::hurry`](super::Store::hurry)): that group is committed
    /// now (or, when none waits, the next one is).
    pub(super) fn hurry(&self) {
        self.hurry.notify_one();
    }
}

/// A committer's next group, into `group` (empty): what `carried` holds
/// (the rest of a group past [`GROUP_MAX_BYTES`]), else what the queue
/// holds once something is there, a small group of events waiting for
/// more as [`Pace`] says. Returns when the group's commit begins, and
/// `None` once the queue is closed and empty. The queue is held until the
/// shared pace is set, so the next worker to take from it sees this
/// commit's.
pub(super) async fn next_group(
    rx: &tokio::sync::Mutex<tokio::sync::mpsc::Receiver<PendingBatch>>,
    group: &mut Vec<PendingBatch>,
    carried: &mut Vec<PendingBatch>,
    gate: &tokio::sync::RwLock<()>,
    pace: &Pace,
) -> Option<tokio::time::Instant> {
    if !carried.is_empty() {
        group.append(carried);
        *carried = split_over(group, GROUP_MAX_BYTES, PendingBatch::bytes);
        return Some(pace.begin());
    }
    let mut queue = rx.lock().await;
    if queue.recv_many(group, GROUP_MAX).await == 0 {
        return None;
    }
    held_back(gate, &mut queue, group, GROUP_MAX).await;
    // Events alone, with the last commit moments ago: they wait out the
    // rest of the interval, joined by what comes meanwhile ([`Gathered`]).
    let until = pace.until();
    let mut gathered = Gathered::default();
    gathered.add(group);
    while group.len() < GROUP_MAX && gathered.lingers() {
        let (room, had) = (GROUP_MAX - group.len(), group.len());
        let more = tokio::time::timeout_at(until, async {
            tokio::select! {
                biased;
                n = queue.recv_many(group, room) => n,
                () = pace.hurry.notified() => 0,
            }
        });
        if !matches!(more.await, Ok(n) if n > 0) {
            break;
        }
        gathered.add(&group[had..]);
    }
    *carried = split_over(group, GROUP_MAX_BYTES, PendingBatch::bytes);
    Some(pace.begin())
}

/// A claimer's next group, into `group` (empty): what the queue holds once
/// something is there; when the last group began less than
/// [`CLAIM_LINGER`] ago, also what comes until then ([`Pace`]). False once
/// the queue is closed and empty. The queue is held until the shared pace
/// is set, so the next worker to take from it sees this group's.
pub(super) async fn next_claims(
    rx: &tokio::sync::Mutex<tokio::sync::mpsc::Receiver<PendingClaim>>,
    group: &mut Vec<PendingClaim>,
    gate: &tokio::sync::RwLock<()>,
    pace: &Pace,
) -> bool {
    let mut queue = rx.lock().await;
    if queue.recv_many(group, CLAIMS_MAX).await == 0 {
        return false;
    }
    held_back(gate, &mut queue, group, CLAIMS_MAX).await;
    let until = pace.until();
    while group.len() < CLAIMS_MAX {
        let room = CLAIMS_MAX - group.len();
        match tokio::time::timeout_at(until, queue.recv_many(group, room)).await {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    pace.begin();
    true
}

/// What a group being gathered holds, added to as its batches come: whether
/// it may wait for more ([`LINGER`]).
#[derive(Debug, Default)]
struct Gathered {
    bytes: usize,
    /// An outcome, or a batch of a writer that is behind, is in the group.
    urgent: bool,
}

impl Gathered {
    fn add(&mut self, batches: &[PendingBatch]) {
        for p in batches {
            self.urgent |= p.outcome.is_some() || p.events.len() >= super::WRITER_BEHIND;
            self.bytes += p.bytes();
        }
    }

    /// The group may wait for more: it holds only events (an outcome, a
    /// turn's end, is never kept waiting, nor is anything queued with one),
    /// none of them a batch of [`WRITER_BEHIND`](super::WRITER_BEHIND)
    /// events or more, and under [`LINGER_BELOW`] bytes of them.
    fn lingers(&self) -> bool {
        !self.urgent && self.bytes < LINGER_BELOW
    }
}

/// A queue shared by `workers` tasks, each running `work` on it (the
/// committers, the claimers): each takes what queued while it was busy.
pub(super) fn spawn_queue<T, W, F>(workers: usize, work: W) -> tokio::sync::mpsc::Sender<T>
where
    T: Send + 'static,
    W: Fn(std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<T>>>) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    spawn_queue_joined(workers, work).0
}

/// [`spawn_queue`], with the workers' handles.
fn spawn_queue_joined<T, W, F>(
    workers: usize,
    work: W,
) -> (
    tokio::sync::mpsc::Sender<T>,
    Vec<tokio::task::JoinHandle<()>>,
)
where
    T: Send + 'static,
    W: Fn(std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<T>>>) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(GROUP_QUEUE);
    let rx = std::sync::Arc::new(tokio::sync::Mutex::new(rx));
    let handles = (0..workers)
        .map(|_| tokio::spawn(work(rx.clone())))
        .collect();
    (tx, handles)
}

/// [`spawn_queue`] on a thread of its own, with a runtime of its own: the
/// queue's workers (and the connections they open there, whose readiness
/// that runtime's own driver reports) wait for no task of the server's.
/// Under load the server's runtime has hundreds of streams ready to run,
/// and a worker woken by its database's answer would queue behind them,
/// its callers with it. `setup` runs on the new thread, inside its runtime
/// (a pool made there opens its connections there), and gives the work.
/// The thread logs where the thread that started it logs. It ends when
/// the queue's senders are all gone and its workers have ended, giving
/// what they started on the side (a claim's withdrawal) up to
/// [`GROUP_TIMEOUT`] to end too.
pub(super) fn spawn_queue_on_thread<T, S, W, F>(
    name: &str,
    workers: usize,
    setup: S,
) -> std::io::Result<tokio::sync::mpsc::Sender<T>>
where
    T: Send + 'static,
    S: FnOnce() -> W + Send + 'static,
    W: Fn(std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<T>>>) -> F,
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let logs = tracing::dispatcher::get_default(|d| d.clone());
    #[cfg(test)]
    let timeout_here = GROUP_TIMEOUT_HERE.get();
    let (started, tx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _logs = tracing::dispatcher::set_default(&logs);
            #[cfg(test)]
            GROUP_TIMEOUT_HERE.set(timeout_here);
            runtime.block_on(async move {
                let (tx, handles) = spawn_queue_joined(workers, setup());
                let _ = started.send(tx);
                for h in handles {
                    let _ = h.await;
                }
                let metrics = tokio::runtime::Handle::current().metrics();
                let _ = tokio::time::timeout(GROUP_TIMEOUT, async {
                    while metrics.num_alive_tasks() > 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                })
                .await;
            })
        })?;
    tx.recv()
        .map_err(|_| std::io::Error::other("the queue's thread stopped as it started"))
}

/// A store's hold on its claim and commit queues, for tests
/// ([`crate::store::Store::hold_queues`]): workers read it after taking
/// their first items, so while a test holds it for writing they wait.
pub(super) type QueueGate = std::sync::Arc<tokio::sync::RwLock<()>>;

/// While `gate` is held, waits for it, then takes into `group` everything
/// queued meanwhile (up to `max`): what a test queued while holding the
/// queues forms one group, as it would behind a busy worker.
pub(super) async fn held_back<T>(
    gate: &tokio::sync::RwLock<()>,
    queue: &mut tokio::sync::mpsc::Receiver<T>,
    group: &mut Vec<T>,
    max: usize,
) {
    if gate.try_read().is_ok() {
        return;
    }
    let _open = gate.read().await;
    while group.len() < max {
        match queue.try_recv() {
            Ok(item) => group.push(item),
            Err(_) => break,
        }
    }
}

/// Batches the committer takes into one transaction at most.
pub(super) const GROUP_MAX: usize = 256;
/// Encoded event bytes one group's statement carries at most; the rest of
/// the group goes in the next ([`split_over`]). A group's events are bound
/// together (PostgreSQL: one array), and PostgreSQL refuses a message of a
/// gigabyte or more, closing the connection: every batch of the group
/// would have failed as if the database were away.
pub(super) const GROUP_MAX_BYTES: usize = 256 << 20;

/// Splits off the end of `group` past `max` bytes (each item's `size`),
/// keeping at least its first item: the part one statement takes, and the
/// rest, for the next.
pub(super) fn split_over<T>(group: &mut Vec<T>, max: usize, size: impl Fn(&T) -> usize) -> Vec<T> {
    let mut total = 0usize;
    let cut = group
        .iter()
        .position(|t| {
            total = total.saturating_add(size(t));
            total > max
        })
        .map_or(group.len(), |i| i.max(1));
    group.split_off(cut)
}
/// Batches waiting for the committer; a full queue holds turn writers back.
pub(super) const GROUP_QUEUE: usize = 1024;

/// One turn writer's batch, queued for the store's committer.
pub(super) struct PendingBatch {
    pub sid: String,
    pub rid: String,
    /// The batch's events, kept (shared, not copied) until it is committed:
    /// each backend copies them once, straight into what it binds, and a
    /// group that fails is written again one batch at a time from them.
    pub events: Vec<super::EncodedEvent>,
    /// The turn's outcome, stored after its events (after the whole
    /// group's): a turn's last batch and its outcome, and the outcomes of
    /// every turn that ends at about the same moment, share the commits of
    /// one group instead of taking one commit each.
    pub outcome: Option<PendingOutcome>,
    /// Whether the outcome was recorded: true without one; false when the
    /// turn was no longer running (its lease ran out and it was failed).
    pub done: tokio::sync::oneshot::Sender<Result<bool, Failed>>,
}

impl PendingBatch {
    /// Its events' encoded bytes.
    pub fn bytes(&self) -> usize {
        self.events.iter().map(|e| e.as_bytes().len()).sum()
    }
}

/// A turn's outcome as the committer writes it (`finish_turn`'s binds).
pub(super) struct PendingOutcome {
    pub state: &'static str,
    pub code: i64,
    pub message: String,
    pub answer: Option<String>,
    /// The final answer's payload; `None` (NULL) for none.
    pub answer_payload: Option<String>,
    /// When it was recorded, in microseconds (`updated_at`).
    pub at: i64,
}

impl PendingOutcome {
    pub fn new(outcome: &super::TurnOutcome, answer: Option<super::FinalAnswer<'_>>) -> Self {
        Self {
            state: outcome.state.as_str(),
            code: outcome.code as i64,
            message: outcome.message.clone(),
            answer: answer.map(|a| a.text.to_owned()),
            answer_payload: answer
                .map(|a| a.payload)
                .filter(|p| !p.is_empty())
                .map(str::to_owned),
            at: super::to_micros(std::time::SystemTime::now()),
        }
    }
}

impl PendingBatch {
    /// `events` for `key`.
    pub fn new(
        key: &crate::domain::TurnKey,
        events: Vec<super::EncodedEvent>,
        done: tokio::sync::oneshot::Sender<Result<bool, Failed>>,
    ) -> Self {
        Self {
            sid: key.session_id.to_string(),
            rid: key.request_id.as_str().to_owned(),
            events,
            outcome: None,
            done,
        }
    }

    /// The batch's rows, each of at most `row_bytes` (or one event):
    /// (first_seq, last_seq, the row's events).
    pub fn rows(
        &self,
        row_bytes: usize,
    ) -> impl Iterator<Item = (i64, i64, &[super::EncodedEvent])> {
        batch_rows(&self.events, row_bytes)
    }
}

/// A claim queued for the store's claimer, which writes the claims queued
/// while it wrote the previous ones in one statement: one commit for every
/// turn that starts at about the same moment.
pub(super) struct PendingClaim {
    pub sid: String,
    pub rid: String,
    pub user_text: String,
    pub agent: String,
    pub owner: String,
    /// How long the lease lasts from the claim's write: the statement adds
    /// it to the database's clock as it inserts the row (after any wait for
    /// a lock), so a claim that waited longer than its lease, queued or
    /// locked out, is not stored expired.
    pub lease: std::time::Duration,
    /// The claim's time, in microseconds.
    pub at: i64,
    /// Whether this claim stored the turn; false when the turn was there.
    pub done: tokio::sync::oneshot::Sender<Result<bool, Failed>>,
}

/// A claim's answer, awaited by its caller. The claimer removes a claim
/// whose caller left before the answer could be handed over; this covers a
/// caller that leaves after it was handed over but before it was read (its
/// future dropped between the two): nobody will run the turn it claimed, so
/// `release` removes it the same way.
pub(super) struct ClaimAnswer {
    rx: Option<tokio::sync::oneshot::Receiver<Result<bool, Failed>>>,
    release: Option<Box<dyn FnOnce() + Send>>,
}

impl ClaimAnswer {
    pub fn new(
        rx: tokio::sync::oneshot::Receiver<Result<bool, Failed>>,
        release: Box<dyn FnOnce() + Send>,
    ) -> Self {
        Self {
            rx: Some(rx),
            release: Some(release),
        }
    }

    pub async fn recv(
        &mut self,
    ) -> Result<Result<bool, Failed>, tokio::sync::oneshot::error::RecvError> {
        let answer = self.rx.as_mut().expect("received once").await;
        self.rx = None;
        answer
    }
}

impl Drop for ClaimAnswer {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take()
            && matches!(rx.try_recv(), Ok(Ok(true)))
            && let Some(release) = self.release.take()
        {
            release();
        }
    }
}

impl PendingClaim {
    /// The lease, in microseconds (the claim statements' bind).
    pub fn lease_micros(&self) -> i64 {
        i64::try_from(self.lease.as_micros()).unwrap_or(i64::MAX)
    }
}

/// What a claim statement did with one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ClaimWritten {
    /// It stored its turn (else another claim's row was there).
    pub stored: bool,
    /// For a stored turn, where its session's count of claims stood before
    /// the statement, in a store that counts them (PostgreSQL, whose
    /// replicas share sessions: [`SessionCache`](super::session_cache::SessionCache)).
    pub claims_before: Option<i64>,
}

/// What the claim statement did with each of `claims`, from the
/// (session_id, request_id) rows it returned for the turns it inserted,
/// each followed by its session's count of claims when `counted`.
pub(super) fn stored_claims<R>(
    claims: &[PendingClaim],
    rows: &[R],
    counted: bool,
) -> Result<Vec<ClaimWritten>, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    String: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: for<'r> sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let stored: std::collections::HashMap<(String, String), Option<i64>> = rows
        .iter()
        .map(|r| {
            let before = if counted { Some(r.try_get(2)?) } else { None };
            Ok(((r.try_get(0)?, r.try_get(1)?), before))
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(claims
        .iter()
        .map(|c| match stored.get(&(c.sid.clone(), c.rid.clone())) {
            Some(&claims_before) => ClaimWritten {
                stored: true,
                claims_before,
            },
            None => ClaimWritten {
                stored: false,
                claims_before: None,
            },
        })
        .collect())
}

/// The outcomes `group` records: each turn's first. A turn can have two in
/// one group (its writer's call timed out while queued, and the writer then
/// recorded another): one statement given both would record either, and
/// tell both they were; the later one is answered not recorded
/// ([`outcomes_recorded`]), as it would be in a later group.
pub(super) fn group_outcomes(group: &[PendingBatch]) -> Vec<(&PendingBatch, &PendingOutcome)> {
    let mut outcomes: Vec<_> = group
        .iter()
        .filter_map(|p| Some((p, p.outcome.as_ref()?)))
        .collect();
    if outcomes.len() > 1 {
        let mut seen = std::collections::HashSet::with_capacity(outcomes.len());
        outcomes.retain(|(p, _)| seen.insert((p.sid.as_str(), p.rid.as_str())));
    }
    outcomes
}

/// Per batch of `group`, whether its outcome was recorded (true for one
/// without), given the (session_id, request_id) of the turns whose outcome
/// the statement recorded: only a turn's first outcome in the group
/// ([`group_outcomes`]) was.
pub(super) fn outcomes_recorded(
    group: &[PendingBatch],
    recorded: &[(String, String)],
) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    group
        .iter()
        .map(|p| {
            p.outcome.is_none()
                || (seen.insert((p.sid.as_str(), p.rid.as_str()))
                    && recorded.iter().any(|(s, r)| *s == p.sid && *r == p.rid))
        })
        .collect()
}

/// A claim to withdraw (nobody will run its turn): its session, request,
/// owner and claim time, which tell the row it wrote from any other.
pub(super) type Withdrawn = (String, String, String, i64);

/// Claims the claimer writes in one statement at most.
pub(super) const CLAIMS_MAX: usize = 128;

/// A claim that comes within this long of the last claim group's start
/// waits out the rest of it, joined by the claims that come meanwhile
/// ([`Pace`]); one that comes later is written at once (tokio's timers
/// round the wait up to a whole millisecond). Runs arriving together (64
/// model-backed Runs started at once, `model_overhead`) made groups of
/// about three claims, each a commit (SQLite) or a round trip (PostgreSQL)
/// of its own, while the models' first tokens waited for the server's
/// core: with this wait, groups of about sixteen, and time to first token
/// through agentd 1-2 ms sooner on either store (BENCHMARKS.md). A
/// model-backed Run's model call starts beside its claim, so the wait
/// hides behind the model's own time to its first token; a Run whose
/// agent starts once the turn is claimed waits it out, up to a
/// millisecond, when it comes in such a burst.
pub(super) const CLAIM_LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// Why a committer's group was not written.
#[derive(Debug)]
pub(super) struct GroupError {
    pub error: sqlx::Error,
    /// The group's events were committed; its outcomes were not.
    pub events_stored: bool,
}

impl From<sqlx::Error> for GroupError {
    fn from(error: sqlx::Error) -> Self {
        Self {
            error,
            events_stored: false,
        }
    }
}

/// A [`StoreError`] carried to every turn writer of a failed group.
#[derive(Debug, Clone)]
pub(super) enum Failed {
    Unavailable(String),
    Unexpected(String),
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(cause) => Failed::Unavailable(format!("{cause:#}")),
            StoreError::Unexpected(cause) => Failed::Unexpected(format!("{cause:#}")),
        }
    }
}

impl From<Failed> for StoreError {
    fn from(f: Failed) -> Self {
        match f {
            Failed::Unavailable(m) => StoreError::Unavailable(anyhow::anyhow!(m)),
            Failed::Unexpected(m) => StoreError::Unexpected(anyhow::anyhow!(m)),
        }
    }
}

/// The statements in which the backends' schemas differ; each store has
/// its own as `Self::SQL`. The binds are the same on both.
pub(super) struct Dialect {
    /// A turn's batches ending after a seq: ($1 session, $2 request,
    /// $3 seq, $4 limit), selecting `events`, in order.
    pub events_after: &'static str,
    /// Where no foreign key deletes a session's event log with it: how it
    /// is deleted after the session, a bounded chunk at a time.
    pub session_events: Option<SessionEvents>,
    /// Locks a session's row ($1 session) for the rest of its transaction,
    /// where writers other than the store's one connection could claim a
    /// turn in it meanwhile.
    pub lock_session: Option<&'static str>,
    /// Deletes the event batches of the turns [`Dialect::prune_turns`]
    /// deletes ($1 before, $2 limit), where no foreign key does it with the
    /// turns; run first, in the same transaction.
    pub prune_events: Option<&'static str>,
    /// Deletes at most $2 of the ended turns last updated before $1, oldest
    /// first, returning each one's `updated_at`.
    pub prune_turns: &'static str,
    /// The most encoded bytes of events one row of the event log holds
    /// (a single larger event gets a row of its own).
    pub row_bytes: usize,
    /// Stores one batch of a turn moved from the per-event table: ($1
    /// session, $2 request, $3 first seq, $4 last seq, $5 blob).
    pub insert_moved_batch: &'static str,
    /// How the event log's rows write an event's kind.
    pub kinds: super::KindEncoding,
    /// The health check: one boolean, whether the database takes writes.
    pub ping: &'static str,
    /// Sets the lease of the turn ($2 session, $3 request) its owner ($4)
    /// runs to $1 microseconds from now by the database's clock, if it is
    /// still running. Leases are written and judged by that one clock
    /// (claims and [`Dialect::fail_expired`] read it too), so that replicas
    /// whose clocks disagree agree on which leases ran out.
    pub renew_lease: &'static str,
    /// Ends the running turns whose lease ran out by the database's clock
    /// with ($1 state, $2 code, $3 message, $4 updated_at), returning each
    /// one's key.
    pub fail_expired: &'static str,
    /// Where [`Dialect::fail_expired`] passes over turns whose rows another
    /// transaction holds: how those are then ended, one at a time.
    pub passed_over: Option<PassedOver>,
}

/// The lease sweep's second pass ([`Dialect::passed_over`]).
pub(super) struct PassedOver {
    /// The running turns whose lease ran out (no binds): session and
    /// request of each.
    pub expired: &'static str,
    /// Ends one of them ($5 session, $6 request, with
    /// [`Dialect::fail_expired`]'s binds), returning its key if it did.
    pub end_one: &'static str,
}

/// How long the lease sweep waits for a turn's row another transaction
/// holds (PostgreSQL, [`Dialect::passed_over`]).
pub(super) const SWEEP_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '1s'";

/// A session's event log deleted after the session, in chunks: a large
/// session's log deleted in the session's transaction held SQLite's one
/// writer for seconds, and every claim and commit waiting for it failed.
pub(super) struct SessionEvents {
    /// The numbers of a session's turns ($1 session), read in the
    /// transaction that deletes them.
    pub turn_numbers: &'static str,
    /// Deletes at most $2 event rows of the turns whose numbers $1 (a JSON
    /// array) holds.
    pub delete_rows: &'static str,
}

/// Event rows one statement of a session's delete removes at most.
pub(super) const DELETE_EVENT_ROWS: usize = 512;
/// Turns whose event rows one such statement looks for.
pub(super) const DELETE_EVENT_TURNS: usize = 256;

pub(super) const TURN_COLUMNS: &str = "session_id, request_id, user_text, agent, state, owner, lease_expires_at, \
     status_code, status_message, created_at, updated_at";

/// [`TURN_COLUMNS`] without the question (up to `--max-input-bytes` each),
/// for listings.
pub(super) const TURN_INFO_COLUMNS: &str = "session_id, request_id, '' AS user_text, agent, state, owner, lease_expires_at, \
     status_code, status_message, created_at, updated_at";

/// A page of a session's turns with their text ([`Store::list_turn_texts`]):
/// the turns after the cursor ($2, $3), at most $4, each with `with_text`
/// true while the text of the turns before it is under $5 bytes, and only
/// those with their text (the [`TURN_COLUMNS`], and `answer_text`,
/// `answer_payload_text`). The sizes come from `octet_length`, which
/// SQLite and PostgreSQL answer from the value's header, without reading
/// the value; a turn past the cut costs its metadata, not its text.
///
/// [`Store::list_turn_texts`]: super::Store::list_turn_texts
pub(super) const TURN_TEXTS: &str = "WITH page AS (\
       SELECT created_at AS p_at, request_id AS p_rid, octet_length(user_text) \
         + COALESCE(octet_length(answer), 0) + COALESCE(octet_length(answer_payload), 0) AS p_bytes \
       FROM turns WHERE session_id = $1 \
         AND (created_at > $2 OR (created_at = $2 AND request_id > $3)) \
       ORDER BY created_at, request_id LIMIT $4), \
     sized AS (\
       SELECT p_at, p_rid, COALESCE(SUM(p_bytes) OVER (ORDER BY p_at, p_rid \
         ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) < $5 AS with_text \
       FROM page) \
     SELECT session_id, request_id, CASE WHEN with_text THEN user_text ELSE '' END AS user_text, \
       agent, state, owner, lease_expires_at, status_code, status_message, created_at, updated_at, \
       with_text, CASE WHEN with_text THEN COALESCE(answer, '') ELSE '' END AS answer_text, \
       CASE WHEN with_text THEN COALESCE(answer_payload, '') ELSE '' END AS answer_payload_text \
     FROM sized JOIN turns ON session_id = $1 AND created_at = p_at AND request_id = p_rid \
     ORDER BY p_at, p_rid";

macro_rules! sql_store {
    ($store:ty, $db:ty) => {
        use sqlx::Row as _;

        use $crate::agent::{Event, EventKind, PriorTurn};
        use $crate::domain::{RequestId, SessionId, TurnKey, UserId};
        use $crate::store::sql::{TURN_COLUMNS, TURN_INFO_COLUMNS, TURN_TEXTS, bad_row, db_err};
        use $crate::store::*;

        type DbRow = <$db as sqlx::Database>::Row;

        fn session_from_row(r: &DbRow) -> StoreResult<Session> {
            let id: String = r.try_get("id").map_err(db_err)?;
            let user: String = r.try_get("user_id").map_err(db_err)?;
            Ok(Session {
                id: SessionId::parse(&id).map_err(|_| bad_row("session id"))?,
                user_id: UserId::parse(user).map_err(|_| bad_row("user id"))?,
                created_at: from_micros(r.try_get("created_at").map_err(db_err)?),
                updated_at: from_micros(r.try_get("updated_at").map_err(db_err)?),
            })
        }

        fn turn_from_row(r: &DbRow) -> StoreResult<TurnRecord> {
            let sid: String = r.try_get("session_id").map_err(db_err)?;
            let rid: String = r.try_get("request_id").map_err(db_err)?;
            let state: String = r.try_get("state").map_err(db_err)?;
            let state = TurnState::parse(&state).ok_or_else(|| bad_row("turn state"))?;
            let code: Option<i64> = r.try_get("status_code").map_err(db_err)?;
            let message: Option<String> = r.try_get("status_message").map_err(db_err)?;
            let outcome = match (state.is_terminal(), code) {
                (true, Some(code)) => Some(TurnOutcome { state, code: code as i32, message: message.unwrap_or_default() }),
                _ => None,
            };
            Ok(TurnRecord {
                key: TurnKey {
                    session_id: SessionId::parse(&sid).map_err(|_| bad_row("session id"))?,
                    request_id: RequestId::parse(rid).map_err(|_| bad_row("request id"))?,
                },
                user_text: r.try_get("user_text").map_err(db_err)?,
                agent: r.try_get("agent").map_err(db_err)?,
                state,
                outcome,
                owner: r.try_get("owner").map_err(db_err)?,
                lease_expires_at: from_micros(r.try_get("lease_expires_at").map_err(db_err)?),
                created_at: from_micros(r.try_get("created_at").map_err(db_err)?),
                updated_at: from_micros(r.try_get("updated_at").map_err(db_err)?),
            })
        }

        fn event_from_row(r: &DbRow) -> StoreResult<SeqEvent> {
            let seq: i64 = r.try_get("seq").map_err(db_err)?;
            let kind: String = r.try_get("kind").map_err(db_err)?;
            Ok(SeqEvent {
                seq: seq as u64,
                event: Event {
                    kind: EventKind::parse(&kind).ok_or_else(|| bad_row("event kind"))?,
                    author: r.try_get("author").map_err(db_err)?,
                    text: r.try_get("text").map_err(db_err)?,
                    tool_name: r.try_get("tool_name").map_err(db_err)?,
                    tool_call_id: r.try_get("tool_call_id").map_err(db_err)?,
                    payload_json: r.try_get("payload_json").map_err(db_err)?,
                    created_unix_nanos: r.try_get("created_unix_nanos").map_err(db_err)?,
                },
            })
        }

        impl $store {
            /// Starts the store's committer: every turn writer's batch goes
            /// through it, and the batches queued while one transaction is
            /// written go into the next one together (group commit across
            /// turns: one commit, and one rewrite of the table's last pages,
            /// for all of them). Each backend writes a group in its own
            /// `write_group`. Ends when the store is dropped.
            ///
            /// `committers` groups are written at once (each turn still has
            /// one batch in flight at a time, so its rows stay in order): a
            /// server that waits for a disk flush per commit takes the next
            /// group meanwhile.
            ///
            /// A Run's stream ends once its outcome is stored, so the
            /// committers too run on a thread of their own, with the pool
            /// `pool` makes there (as the claimers do).
            fn spawn_committer(
                pool: impl FnOnce() -> sqlx::Pool<$db> + Send + 'static,
                committers: usize,
                sessions: Option<std::sync::Arc<$crate::store::session_cache::SessionCache>>,
                gate: $crate::store::sql::QueueGate,
                pace: std::sync::Arc<$crate::store::sql::Pace>,
            ) -> std::io::Result<tokio::sync::mpsc::Sender<$crate::store::sql::PendingBatch>> {
                $crate::store::sql::spawn_queue_on_thread("agentd-commits", committers, move || {
                    let pool = pool();
                    move |rx| Self::commit_groups(pool.clone(), rx, sessions.clone(), gate.clone(), pace.clone())
                })
            }

            /// Starts the store's claimers: a claim waits for the one in
            /// flight, then goes into one statement with every claim that
            /// queued meanwhile (each backend's `insert_claims`). A key
            /// claimed twice in one group is written once; the later claims
            /// find it there. Ends when the store is dropped.
            ///
            /// A Run's first event waits for its claim, so the claimers run
            /// on a thread of their own ([`spawn_queue_on_thread`](crate::store::sql::spawn_queue_on_thread)),
            /// with the pool `pool` makes there.
            fn spawn_claimer(
                pool: impl FnOnce() -> sqlx::Pool<$db> + Send + 'static,
                claimers: usize,
                sessions: Option<std::sync::Arc<$crate::store::session_cache::SessionCache>>,
                gate: $crate::store::sql::QueueGate,
            ) -> std::io::Result<tokio::sync::mpsc::Sender<$crate::store::sql::PendingClaim>> {
                $crate::store::sql::spawn_queue_on_thread("agentd-claims", claimers, move || {
                    let pool = pool();
                    let pace = std::sync::Arc::new($crate::store::sql::Pace::lingering($crate::store::sql::CLAIM_LINGER));
                    move |rx| Self::claim_groups(pool.clone(), rx, sessions.clone(), gate.clone(), pace.clone())
                })
            }

            async fn claim_groups(
                pool: sqlx::Pool<$db>,
                rx: std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<$crate::store::sql::PendingClaim>>>,
                sessions: Option<std::sync::Arc<$crate::store::session_cache::SessionCache>>,
                gate: $crate::store::sql::QueueGate,
                pace: std::sync::Arc<$crate::store::sql::Pace>,
            ) {
                use $crate::store::sql::Failed;
                let mut group = Vec::with_capacity($crate::store::sql::CLAIMS_MAX);
                loop {
                    if !$crate::store::sql::next_claims(&rx, &mut group, &gate, &pace).await {
                        break;
                    }
                    // A caller gone while its claim waited (it cancelled, or
                    // its store call timed out and it was told to retry):
                    // nothing is stored for it.
                    group.retain(|c| !c.done.is_closed());
                    if group.is_empty() {
                        continue;
                    }
                    let mut seen = std::collections::HashSet::with_capacity(group.len());
                    let (first, repeats): (Vec<_>, Vec<_>) =
                        group.drain(..).partition(|c| seen.insert((c.sid.clone(), c.rid.clone())));
                    let started = std::time::Instant::now();
                    let written = $crate::store::sql::bounded(Self::insert_claims(&pool, &first)).await;
                    $crate::telemetry::metrics::store_group("claim", first.len(), started.elapsed());
                    // Claims whose statement failed but may have been
                    // written (cut off, or its connection lost): their
                    // callers are told to retry, and would find a turn
                    // nobody runs.
                    let withdrawn = |c: &$crate::store::sql::PendingClaim| (c.sid.clone(), c.rid.clone(), c.owner.clone(), c.at);
                    let mut cut = Vec::new();
                    let results: Vec<Result<$crate::store::sql::ClaimWritten, Failed>> = match written {
                        Ok(stored) => stored.into_iter().map(Ok).collect(),
                        // One claim at a time, so that only a bad one fails
                        // (the database away fails them all at once, and
                        // the rest once one of them finds it away).
                        Err(e) if first.len() > 1 && (!$crate::store::sql::unavailable(&e) || $crate::store::sql::conflict(&e)) => {
                            let mut results = Vec::with_capacity(first.len());
                            let mut away: Option<Failed> = None;
                            for c in &first {
                                if let Some(f) = &away {
                                    results.push(Err(f.clone()));
                                    continue;
                                }
                                let r = $crate::store::sql::bounded(Self::insert_claims(&pool, std::slice::from_ref(c))).await;
                                results.push(r.map(|s| s[0]).map_err(|e| {
                                    if $crate::store::sql::maybe_done(&e) {
                                        cut.push(withdrawn(c));
                                    }
                                    let gone = $crate::store::sql::gone(&e);
                                    let failed = Failed::from(db_err(e));
                                    if gone {
                                        away = Some(failed.clone());
                                    }
                                    failed
                                }));
                            }
                            results
                        }
                        Err(e) => {
                            if $crate::store::sql::maybe_done(&e) {
                                cut.extend(first.iter().map(withdrawn));
                            }
                            let failed = Failed::from(db_err(e));
                            first.iter().map(|_| Err(failed.clone())).collect()
                        }
                    };
                    // Withdrawn before their callers hear to retry, on the
                    // side: the database may not answer this either.
                    if !cut.is_empty() {
                        let (pool, sessions) = (pool.clone(), sessions.clone());
                        tokio::spawn(async move {
                            Self::withdraw_claims(&pool, &cut, sessions.as_deref(), "a claim whose statement was cut off was written all the same").await;
                        });
                    }
                    // A repeated key fails with its first claim, or finds
                    // the turn that claim stored (or found).
                    let repeat_results: Vec<Result<bool, Failed>> = repeats
                        .iter()
                        .map(|c| {
                            first
                                .iter()
                                .zip(&results)
                                .find(|(f, _)| f.sid == c.sid && f.rid == c.rid)
                                .map_or(Ok(false), |(_, r)| r.clone().map(|_| false))
                        })
                        .collect();
                    // How many turns the group stored in each session: a
                    // session that took two at once is one whose count the
                    // cache cannot follow claim by claim.
                    let mut per_session: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
                    for (c, r) in first.iter().zip(&results) {
                        if matches!(r, Ok(w) if w.stored) {
                            *per_session.entry(c.sid.as_str()).or_default() += 1;
                        }
                    }
                    // Each claim's (count before, claims in its session), in
                    // `first`'s order.
                    let counted: Vec<Option<(i64, i64)>> = first
                        .iter()
                        .zip(&results)
                        .map(|(c, r)| {
                            let before = r.as_ref().ok()?.claims_before?;
                            Some((before, per_session.get(c.sid.as_str()).copied().unwrap_or(1)))
                        })
                        .collect();
                    let mut abandoned = Vec::new();
                    for ((c, r), counted) in first.into_iter().zip(results).zip(counted) {
                        let stored = matches!(r, Ok(w) if w.stored);
                        // Known to the cache before the claimant can run
                        // (and end) the turn. A claim that failed may have
                        // failed for its session (deleted): the cache lets
                        // go of it.
                        if let Some(cache) = &sessions {
                            match &r {
                                Ok(w) if w.stored => cache.claimed(&c.sid, &c.rid, c.at, &c.user_text, &c.agent, counted),
                                Ok(_) => {}
                                Err(_) => cache.forget(&c.sid),
                            }
                        }
                        let r = r.map(|w| w.stored);
                        let $crate::store::sql::PendingClaim { sid, rid, owner, at, done, .. } = c;
                        if done.send(r).is_err() && stored {
                            abandoned.push((sid, rid, owner, at));
                        }
                    }
                    for (c, r) in repeats.into_iter().zip(repeat_results) {
                        let _ = c.done.send(r);
                    }
                    Self::withdraw_claims(&pool, &abandoned, sessions.as_deref(), "the caller went away while its turn was claimed").await;
                }
            }

            /// Removes claims nobody will run, `why` (said in the log):
            /// their claimant went away while they were written (the client
            /// cancelled or its deadline passed, or its store call timed out
            /// and it was told to retry), or their statement failed in a way
            /// that may have written them (its caller, told to retry, would
            /// follow a turn nobody runs). A retry with the same request id
            /// then claims the turn afresh and runs it (had the claim been
            /// recorded cancelled, it would replay a cancel its caller never
            /// asked for). Left alone, a claim stays `running` until its
            /// lease ends it UNAVAILABLE. Only the row the claim wrote goes
            /// (its owner and claim time), and only while it runs.
            async fn withdraw_claims(
                pool: &sqlx::Pool<$db>,
                claims: &[$crate::store::sql::Withdrawn],
                sessions: Option<&$crate::store::session_cache::SessionCache>,
                why: &str,
            ) {
                for (i, (sid, rid, owner, at)) in claims.iter().enumerate() {
                    // Forgotten before and after: see `delete_session`.
                    let forget = || {
                        if let Some(cache) = sessions {
                            cache.forget(sid);
                        }
                    };
                    forget();
                    let done = $crate::store::sql::bounded(
                        sqlx::query(
                            "DELETE FROM turns WHERE session_id = $1 AND request_id = $2 AND owner = $3 \
                             AND state = 'running' AND created_at = $4",
                        )
                        .bind(sid)
                        .bind(rid)
                        .bind(owner)
                        .bind(at)
                        .execute(pool),
                    )
                    .await;
                    forget();
                    match done {
                        Ok(d) if d.rows_affected() > 0 => {
                            tracing::info!(session = %sid, request_id = %rid, "{why}; the claim is released for a retry")
                        }
                        Ok(_) => {}
                        Err(e) => {
                            let left = claims.len() - i - 1;
                            tracing::warn!(session = %sid, request_id = %rid, error = %e, left, "{why}, and could not be released; its lease will end it");
                            // The rest would wait as long for the same answer.
                            if $crate::store::sql::gone(&e) {
                                break;
                            }
                        }
                    }
                }
            }

            /// Queues a turn's events and outcome for the committer and
            /// waits until they are committed; false when the outcome was
            /// not recorded, the turn no longer running.
            async fn commit(
                &self,
                key: &TurnKey,
                events: Vec<EncodedEvent>,
                outcome: Option<$crate::store::sql::PendingOutcome>,
            ) -> StoreResult<bool> {
                let (done, committed) = tokio::sync::oneshot::channel();
                let mut batch = $crate::store::sql::PendingBatch::new(key, events, done);
                batch.outcome = outcome;
                let stopped = || StoreError::Unavailable(anyhow::anyhow!("the store's committer stopped"));
                self.commits.send(batch).await.map_err(|_| stopped())?;
                committed.await.map_err(|_| stopped())?.map_err(StoreError::from)
            }

            async fn commit_groups(
                pool: sqlx::Pool<$db>,
                rx: std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<$crate::store::sql::PendingBatch>>>,
                sessions: Option<std::sync::Arc<$crate::store::session_cache::SessionCache>>,
                gate: $crate::store::sql::QueueGate,
                pace: std::sync::Arc<$crate::store::sql::Pace>,
            ) {
                    use $crate::store::sql::{Failed, GROUP_MAX, PendingBatch};
                    // A turn's end reaches the cache before its writer hears
                    // the outcome is stored (and a follow-up Run can come).
                    // An outcome not recorded, or not known to be, leaves
                    // the cache not knowing how the turn ended (a write
                    // whose answer was lost may have recorded it; another
                    // did, or a lease ran out): it forgets the session.
                    let answer = |p: PendingBatch, r: Result<bool, Failed>| {
                        if let (Some(cache), Some(o)) = (&sessions, &p.outcome) {
                            match r {
                                Ok(true) => cache.ended(&p.sid, &p.rid, o.answer.as_deref(), o.answer_payload.as_deref(), o.at),
                                _ => cache.forget(&p.sid),
                            }
                        }
                        let _ = p.done.send(r);
                    };
                    let mut group = Vec::with_capacity(GROUP_MAX);
                    // What a group past GROUP_MAX_BYTES left for the next.
                    let mut carried: Vec<PendingBatch> = Vec::new();
                    while let Some(began) = $crate::store::sql::next_group(&rx, &mut group, &mut carried, &gate, &pace).await {
                        let written = $crate::store::sql::bounded(Self::write_group(&pool, &group)).await;
                        $crate::telemetry::metrics::store_group("commit", group.len(), began.elapsed());
                        let e = match written {
                            Ok(recorded) => {
                                for (p, recorded) in group.drain(..).zip(recorded) {
                                    answer(p, Ok(recorded));
                                }
                                continue;
                            }
                            Err(e) => e,
                        };
                        // One batch at a time, so that only a bad one fails
                        // (the database away fails them all at once, and the
                        // rest once one of them finds it away). With the
                        // group's events stored, only its outcomes are left
                        // to write (a batch without one is stored).
                        let one_by_one = group.len() > 1
                            && (!$crate::store::sql::unavailable(&e.error) || $crate::store::sql::conflict(&e.error));
                        let events_stored = e.events_stored;
                        let mut away = (!one_by_one).then(|| Failed::from(db_err(e.error)));
                        for mut p in group.drain(..) {
                            if events_stored {
                                if p.outcome.is_none() {
                                    answer(p, Ok(true));
                                    continue;
                                }
                                p.events.clear();
                            }
                            let r = match &away {
                                Some(failed) => Err(failed.clone()),
                                None => match $crate::store::sql::bounded(Self::write_group(&pool, std::slice::from_ref(&p))).await {
                                    Ok(recorded) => Ok(recorded.first().copied().unwrap_or(true)),
                                    Err(e) => {
                                        let gone = $crate::store::sql::gone(&e.error);
                                        let failed = Failed::from(db_err(e.error));
                                        if gone {
                                            away = Some(failed.clone());
                                        }
                                        Err(failed)
                                    }
                                },
                            };
                            answer(p, r);
                        }
                    }
            }
        }

        #[async_trait::async_trait]
        impl Store for $store {
            async fn create_session(&self, user_id: &UserId) -> StoreResult<Session> {
                let now = std::time::SystemTime::now();
                let s = Session { id: SessionId::generate(), user_id: user_id.clone(), created_at: now, updated_at: now };
                sqlx::query("INSERT INTO sessions (id, user_id, created_at, updated_at) VALUES ($1, $2, $3, $3)")
                    .bind(s.id.to_string())
                    .bind(user_id.as_str())
                    .bind(to_micros(now))
                    .execute(&self.write)
                    .await
                    .map_err(db_err)?;
                // Reading back what was stored keeps the times at the
                // store's precision (microseconds).
                let s = Session { created_at: from_micros(to_micros(now)), updated_at: from_micros(to_micros(now)), ..s };
                if let Some(cache) = &self.sessions {
                    cache.created(&s);
                }
                Ok(s)
            }

            async fn create_session_keyed(&self, user_id: &UserId, key: &RequestId) -> StoreResult<Keyed> {
                // Twice at most: the session found under the key may be
                // deleted before it is read.
                for _ in 0..2 {
                    let now = std::time::SystemTime::now();
                    let s = Session { id: SessionId::generate(), user_id: user_id.clone(), created_at: now, updated_at: now };
                    let made = sqlx::query(
                        "INSERT INTO sessions (id, user_id, created_at, updated_at, request_id) VALUES ($1, $2, $3, $3, $4) \
                         ON CONFLICT (user_id, request_id) WHERE request_id IS NOT NULL DO NOTHING",
                    )
                    .bind(s.id.to_string())
                    .bind(user_id.as_str())
                    .bind(to_micros(now))
                    .bind(key.as_str())
                    .execute(&self.write)
                    .await
                    .map_err(db_err)?;
                    if made.rows_affected() == 1 {
                        let s = Session { created_at: from_micros(to_micros(now)), updated_at: from_micros(to_micros(now)), ..s };
                        if let Some(cache) = &self.sessions {
                            cache.created(&s);
                        }
                        return Ok(Keyed { session: s, created: true });
                    }
                    // Read where it was written: on SQLite's writer the
                    // winner's row is committed.
                    let row = sqlx::query("SELECT id, user_id, created_at, updated_at FROM sessions WHERE user_id = $1 AND request_id = $2")
                        .bind(user_id.as_str())
                        .bind(key.as_str())
                        .fetch_optional(&self.write)
                        .await
                        .map_err(db_err)?;
                    if let Some(row) = row {
                        return Ok(Keyed { session: session_from_row(&row)?, created: false });
                    }
                }
                Err(StoreError::Unavailable(anyhow::anyhow!(
                    "the session made under this request id was deleted as it was read, twice"
                )))
            }

            async fn get_session(&self, id: SessionId) -> StoreResult<Option<Session>> {
                let row = sqlx::query("SELECT id, user_id, created_at, updated_at FROM sessions WHERE id = $1")
                    .bind(id.to_string())
                    .fetch_optional(&self.read)
                    .await
                    .map_err(db_err)?;
                row.as_ref().map(session_from_row).transpose()
            }

            async fn claim_turn(&self, t: &NewTurn) -> StoreResult<Claim> {
                // A claim that conflicted with a row gone by the time it is
                // read (another caller's claim, withdrawn because that
                // caller left while it was written) is made again.
                for _ in 0..3 {
                    if let Some(claim) = self.claim_once(t).await? {
                        return Ok(claim);
                    }
                }
                Err(StoreError::Unavailable(anyhow::anyhow!("turn {} conflicted but is not stored", t.key)))
            }

            async fn get_turn(&self, key: &TurnKey) -> StoreResult<Option<TurnRecord>> {
                let row = sqlx::query(&format!("SELECT {TURN_COLUMNS} FROM turns WHERE session_id = $1 AND request_id = $2"))
                    .bind(key.session_id.to_string())
                    .bind(key.request_id.as_str())
                    .fetch_optional(&self.read)
                    .await
                    .map_err(db_err)?;
                row.as_ref().map(turn_from_row).transpose()
            }

            fn hurry(&self) {
                self.pace.hurry();
            }

            fn hold_queues(&self) -> Option<$crate::store::QueuesHeld> {
                self.gate.clone().try_write_owned().ok().map(|held| $crate::store::QueuesHeld { _held: held })
            }

            fn kind_encoding(&self) -> KindEncoding {
                Self::SQL.kinds
            }

            async fn append_encoded(&self, key: &TurnKey, events: Vec<EncodedEvent>) -> StoreResult<()> {
                if events.is_empty() {
                    return Ok(());
                }
                self.commit(key, events, None).await.map(drop)
            }

            async fn finish_turn(&self, key: &TurnKey, outcome: &TurnOutcome, answer: Option<FinalAnswer<'_>>) -> StoreResult<bool> {
                self.append_and_finish(key, Vec::new(), outcome, answer).await
            }

            async fn append_and_finish(
                &self,
                key: &TurnKey,
                events: Vec<EncodedEvent>,
                outcome: &TurnOutcome,
                answer: Option<FinalAnswer<'_>>,
            ) -> StoreResult<bool> {
                self.commit(key, events, Some($crate::store::sql::PendingOutcome::new(outcome, answer))).await
            }

            async fn events_after(&self, key: &TurnKey, after: Option<u64>, limit: usize) -> StoreResult<Vec<SeqEvent>> {
                // Batches are contiguous in seq: read the ones that end past
                // the cursor, a few at a time, until `limit` events are in.
                const BATCHES: i64 = 4;
                let mut out = Vec::new();
                let mut cursor = after.map_or(-1, |a| i64::try_from(a).unwrap_or(i64::MAX));
                while out.len() < limit {
                    let rows = sqlx::query(Self::SQL.events_after)
                    .bind(key.session_id.to_string())
                    .bind(key.request_id.as_str())
                    .bind(cursor)
                    .bind(BATCHES)
                    .fetch_all(&self.read)
                    .await
                    .map_err(db_err)?;
                    let complete = (rows.len() as i64) < BATCHES;
                    for r in &rows {
                        let blob: Vec<u8> = r.try_get("events").map_err(db_err)?;
                        let batch = $crate::store::codec::decode(&blob).ok_or_else(|| bad_row("event batch"))?;
                        for e in batch {
                            if (e.seq as i64) > cursor && out.len() < limit {
                                cursor = e.seq as i64;
                                out.push(e);
                            }
                        }
                    }
                    if complete {
                        break;
                    }
                }
                Ok(out)
            }

            async fn history(&self, session: SessionId, limit: usize) -> StoreResult<Vec<PriorTurn>> {
                let rows = sqlx::query(
                    "SELECT request_id, agent, user_text, COALESCE(answer, '') AS answer, \
                     COALESCE(answer_payload, '') AS answer_payload \
                     FROM turns WHERE session_id = $1 AND state <> 'running' \
                     ORDER BY created_at DESC, request_id DESC LIMIT $2",
                )
                .bind(session.to_string())
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.read)
                .await
                .map_err(db_err)?;
                let mut turns = rows
                    .iter()
                    .map(|r| {
                        Ok(PriorTurn {
                            request_id: r.try_get("request_id").map_err(db_err)?,
                            agent: r.try_get("agent").map_err(db_err)?,
                            user_text: r.try_get("user_text").map_err(db_err)?,
                            answer: r.try_get("answer").map_err(db_err)?,
                            answer_payload: r.try_get("answer_payload").map_err(db_err)?,
                        })
                    })
                    .collect::<StoreResult<Vec<_>>>()?;
                turns.reverse();
                Ok(turns)
            }

            async fn session_with_history(&self, id: SessionId, limit: usize) -> StoreResult<Option<(Session, Vec<PriorTurn>)>> {
                Ok(self.read_for_run(id, limit, None).await?.map(|r| (r.session, r.history)))
            }

            async fn session_for_run(&self, session: SessionId, turn: Option<&RequestId>, limit: usize) -> StoreResult<Option<RunRead>> {
                self.read_for_run(session, limit, turn.map(RequestId::as_str)).await
            }

            fn history_current(&self, session: SessionId, remembered: u64) -> bool {
                self.sessions.as_ref().is_none_or(|cache| cache.current(&session.to_string(), remembered))
            }

            async fn list_sessions(&self, user_id: &UserId, limit: usize, after: Option<&PageCursor>) -> StoreResult<SessionPage> {
                let (after_at, after_id) = match after {
                    Some(c) => (to_micros(c.created_at), c.id.to_string()),
                    None => (i64::MIN, String::new()),
                };
                let rows = sqlx::query(
                    "SELECT id, user_id, created_at, updated_at FROM sessions \
                     WHERE user_id = $1 AND (created_at > $2 OR (created_at = $2 AND id > $3)) \
                     ORDER BY created_at, id LIMIT $4",
                )
                .bind(user_id.as_str())
                .bind(after_at)
                .bind(after_id)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX - 1) + 1)
                .fetch_all(&self.read)
                .await
                .map_err(db_err)?;
                let mut sessions = rows.iter().map(session_from_row).collect::<StoreResult<Vec<_>>>()?;
                let more = sessions.len() > limit;
                sessions.truncate(limit);
                let next = if more { sessions.last().map(|s| PageCursor { created_at: s.created_at, id: s.id }) } else { None };
                Ok(SessionPage { sessions, next })
            }

            async fn delete_session(&self, id: SessionId) -> StoreResult<Deletion> {
                // Forgotten before (no Run finds it held meanwhile) and
                // after (a read that saw it before the delete is not taken).
                if let Some(cache) = &self.sessions {
                    cache.forget(&id.to_string());
                }
                let mut tx = self.write.begin().await.map_err(db_err)?;
                // The session's row locked where other writers could claim
                // a turn meanwhile (PostgreSQL: a claim's foreign key check
                // shares the lock): a claim in flight commits first and is
                // seen below; one after waits, then finds no session.
                if let Some(sql) = Self::SQL.lock_session {
                    sqlx::query(sql)
                        .bind(id.to_string())
                        .execute(&mut *tx)
                        .await
                        .map_err(db_err)?;
                }
                let running = sqlx::query("SELECT 1 FROM turns WHERE session_id = $1 AND state = 'running' LIMIT 1")
                    .bind(id.to_string())
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(db_err)?;
                if running.is_some() {
                    tx.rollback().await.map_err(db_err)?;
                    return Ok(Deletion::Busy);
                }
                let numbers: Vec<i64> = match &Self::SQL.session_events {
                    Some(events) => sqlx::query_scalar(events.turn_numbers)
                        .bind(id.to_string())
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(db_err)?,
                    None => Vec::new(),
                };
                let done = sqlx::query("DELETE FROM sessions WHERE id = $1")
                    .bind(id.to_string())
                    .execute(&mut *tx)
                    .await
                    .map_err(db_err)?;
                let committed = tx.commit().await.map_err(db_err);
                if let Some(cache) = &self.sessions {
                    cache.forget(&id.to_string());
                }
                committed?;
                // The deleted turns' event log goes on the side: nothing
                // reads it any more, and a large session's would keep the
                // caller waiting, past its deadline or the store's call
                // bound, for a deletion that is done.
                if Self::SQL.session_events.is_some() && !numbers.is_empty() {
                    let pool = self.write.clone();
                    tokio::spawn(async move {
                        if let Some(events) = &Self::SQL.session_events {
                            Self::delete_turn_events(&pool, events, &numbers).await;
                        }
                    });
                }
                Ok(if done.rows_affected() > 0 { Deletion::Deleted } else { Deletion::NotFound })
            }

            async fn list_turns(
                &self,
                session: SessionId,
                after: Option<&$crate::store::TurnCursor>,
                limit: usize,
            ) -> StoreResult<Vec<TurnRecord>> {
                let (at, rid) = $crate::store::TurnCursor::key(after);
                let rows = sqlx::query(&format!(
                    "SELECT {TURN_INFO_COLUMNS} FROM turns WHERE session_id = $1 \
                     AND (created_at > $2 OR (created_at = $2 AND request_id > $3)) \
                     ORDER BY created_at, request_id LIMIT $4"
                ))
                .bind(session.to_string())
                .bind(at)
                .bind(rid)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.read)
                .await
                .map_err(db_err)?;
                rows.iter().map(turn_from_row).collect()
            }

            async fn list_turn_texts(
                &self,
                session: SessionId,
                after: Option<&$crate::store::TurnCursor>,
                limit: usize,
                bytes: usize,
            ) -> StoreResult<TurnTexts> {
                let (at, rid) = $crate::store::TurnCursor::key(after);
                // One row past the page (without its text) tells whether
                // another follows. At least a byte, so the first turn is
                // always the page's (`text_page_len`).
                let rows = sqlx::query(TURN_TEXTS)
                    .bind(session.to_string())
                    .bind(at)
                    .bind(rid)
                    .bind(i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX))
                    .bind(i64::try_from(bytes.max(1)).unwrap_or(i64::MAX))
                    .fetch_all(&self.read)
                    .await
                    .map_err(db_err)?;
                let mut turns = Vec::new();
                for r in &rows {
                    if turns.len() == limit || !r.try_get::<bool, _>("with_text").map_err(db_err)? {
                        break;
                    }
                    turns.push(TurnWithText {
                        record: turn_from_row(r)?,
                        answer: r.try_get("answer_text").map_err(db_err)?,
                        answer_payload: r.try_get("answer_payload_text").map_err(db_err)?,
                    });
                }
                let more = rows.len() > turns.len();
                Ok(TurnTexts { turns, more })
            }

            async fn renew_lease(&self, key: &TurnKey, owner: &str, lease: std::time::Duration) -> StoreResult<bool> {
                let done = sqlx::query(Self::SQL.renew_lease)
                .bind(i64::try_from(lease.as_micros()).unwrap_or(i64::MAX))
                .bind(key.session_id.to_string())
                .bind(key.request_id.as_str())
                .bind(owner)
                .execute(&self.write)
                .await
                .map_err(db_err)?;
                Ok(done.rows_affected() == 1)
            }

            async fn fail_expired(&self, outcome: &TurnOutcome) -> StoreResult<Vec<TurnKey>> {
                let now = std::time::SystemTime::now();
                let update = {
                    let (pool, outcome) = (self.write.clone(), outcome.clone());
                    async move {
                        let mut rows = sqlx::query(Self::SQL.fail_expired)
                        .bind(outcome.state.as_str())
                        .bind(outcome.code as i64)
                        .bind(&outcome.message)
                        .bind(to_micros(now))
                        .fetch_all(&pool)
                        .await?;
                        let Some(rest) = Self::SQL.passed_over else {
                            return Ok(rows);
                        };
                        // The turns passed over, one at a time: each waits
                        // for the one row it ends (a commit's moment),
                        // holding no other, so no wait can close a cycle;
                        // and no longer than `lock_timeout` (a row held by a
                        // long transaction is left to the next sweep), so
                        // the turns ended so far are answered. So is a
                        // failure here: those are ended all the same.
                        let left: Vec<(String, String)> = match sqlx::query_as(rest.expired)
                            .fetch_all(&pool)
                            .await
                        {
                            Ok(left) => left,
                            Err(e) => {
                                tracing::warn!(error = %e, "lease sweep: cannot read the expired turns left; the next sweep ends them");
                                return Ok(rows);
                            }
                        };
                        for (sid, rid) in left {
                            let ended = async {
                                let mut tx = pool.begin().await?;
                                sqlx::query($crate::store::sql::SWEEP_LOCK_TIMEOUT).execute(&mut *tx).await?;
                                let row = sqlx::query(rest.end_one)
                                    .bind(outcome.state.as_str())
                                    .bind(outcome.code as i64)
                                    .bind(&outcome.message)
                                    .bind(to_micros(now))
                                    .bind(&sid)
                                    .bind(&rid)
                                    .fetch_optional(&mut *tx)
                                    .await?;
                                tx.commit().await?;
                                Ok::<_, sqlx::Error>(row)
                            };
                            match ended.await {
                                Ok(row) => rows.extend(row),
                                Err(e) => {
                                    tracing::warn!(session = %sid, request = %rid, error = %e, "lease sweep: cannot end an expired turn another transaction holds; the next sweep tries again");
                                }
                            }
                        }
                        Ok(rows)
                    }
                };
                let rows = match &self.sessions {
                    None => update.await,
                    // The cache lets go of the turns the update ended once
                    // it is done, whether or not this call is still there
                    // to hear of it (its caller's timeout may drop it while
                    // SQLite's thread commits it): the update runs on its
                    // own. One that failed may have been carried out.
                    Some(cache) => {
                        let cache = cache.clone();
                        tokio::spawn(async move {
                            let rows = $crate::store::sql::bounded(update).await;
                            if !rows.as_ref().is_ok_and(Vec::is_empty) {
                                cache.clear();
                            }
                            rows
                        })
                        .await
                        .map_err(|e| StoreError::Unexpected(anyhow::anyhow!("the expiry of leases stopped: {e}")))?
                    }
                }
                .map_err(db_err)?;
                rows.iter()
                    .map(|r| {
                        let sid: String = r.try_get("session_id").map_err(db_err)?;
                        let rid: String = r.try_get("request_id").map_err(db_err)?;
                        Ok(TurnKey {
                            session_id: SessionId::parse(&sid).map_err(|_| bad_row("session id"))?,
                            request_id: RequestId::parse(rid).map_err(|_| bad_row("request id"))?,
                        })
                    })
                    .collect()
            }

            async fn prune(&self, before: std::time::SystemTime, limit: usize) -> StoreResult<u64> {
                let limit = i64::try_from(limit).unwrap_or(i64::MAX);
                let mut tx = self.write.begin().await.map_err(db_err)?;
                if let Some(sql) = Self::SQL.prune_events {
                    sqlx::query(sql)
                    .bind(to_micros(before))
                    .bind(limit)
                    .execute(&mut *tx)
                    .await
                    .map_err(db_err)?;
                }
                let ended: Vec<i64> = sqlx::query_scalar(Self::SQL.prune_turns)
                    .bind(to_micros(before))
                    .bind(limit)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_err)?;
                tx.commit().await.map_err(db_err)?;
                if let Some(cache) = &self.sessions {
                    // A batch cut short by `limit` may leave turns that
                    // ended at `last` itself: the cache lets go of the turns
                    // ended before it, which are all gone. A batch that is
                    // not full (an empty one too) took every turn ended
                    // before `before`.
                    let full = ended.len() as i64 == limit;
                    match ended.iter().max() {
                        Some(&last) if full => cache.pruned(last),
                        _ => cache.pruned(to_micros(before)),
                    }
                }
                Ok(ended.len() as u64)
            }

            async fn prune_sessions(&self, before: std::time::SystemTime, limit: usize) -> StoreResult<u64> {
                // The search for sessions with no turns and no A2A task (an
                // index walk that may pass many sessions that have some)
                // runs on a reader, off SQLite's one writer; the delete
                // checks all of it again on the rows it deletes. A turn
                // claimed, or a task made, meanwhile (on PostgreSQL by
                // another replica, after the delete's snapshot) touched
                // `updated_at`, which the delete reads as the row is then.
                const EMPTY: &str = "NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id = sessions.id) \
                     AND NOT EXISTS (SELECT 1 FROM a2a_tasks a WHERE a.session_id = sessions.id)";
                let found: Vec<String> = sqlx::query_scalar(&format!(
                    "SELECT id FROM sessions WHERE updated_at < $1 AND {EMPTY} ORDER BY updated_at LIMIT $2"
                ))
                .bind(to_micros(before))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.read)
                .await
                .map_err(db_err)?;
                if found.is_empty() {
                    return Ok(0);
                }
                let mut q = sqlx::QueryBuilder::<$db>::new("DELETE FROM sessions WHERE updated_at < ");
                q.push_bind(to_micros(before));
                q.push(format!(" AND {EMPTY} AND id IN ("));
                let mut ids = q.separated(", ");
                for id in &found {
                    ids.push_bind(id.as_str());
                }
                q.push(") RETURNING id");
                let gone: Vec<String> = q
                    .build_query_scalar()
                    .fetch_all(&self.write)
                    .await
                    .map_err(db_err)?;
                if let Some(cache) = &self.sessions {
                    for id in &gone {
                        cache.forget(id);
                    }
                }
                Ok(gone.len() as u64)
            }

            async fn ping(&self) -> StoreResult<()> {
                let writable: bool = sqlx::query_scalar(Self::SQL.ping)
                    .fetch_one(&self.read)
                    .await
                    .map_err(db_err)?;
                if !writable {
                    return Err(StoreError::Unavailable(anyhow::anyhow!(
                        "the database takes no writes (a read-only standby, or read-only by setting)"
                    )));
                }
                Ok(())
            }

            async fn announce_cancel(&self, key: &TurnKey) -> StoreResult<()> {
                self.announce(key).await
            }

            fn cancel_announcements(&self) -> Option<tokio::sync::broadcast::Receiver<TurnKey>> {
                self.announcements()
            }

            async fn close(&self) {
                self.close_pools().await;
            }
        }

        impl $store {
            /// One claim: `None` when it conflicted with a row that is gone
            /// by the time it is read.
            async fn claim_once(&self, t: &NewTurn) -> StoreResult<Option<Claim>> {
                let now = std::time::SystemTime::now();
                let (done, stored) = tokio::sync::oneshot::channel();
                let claim = $crate::store::sql::PendingClaim {
                    sid: t.key.session_id.to_string(),
                    rid: t.key.request_id.as_str().to_owned(),
                    user_text: t.user_text.clone(),
                    agent: t.agent.clone(),
                    owner: t.owner.clone(),
                    lease: t.lease,
                    at: to_micros(now),
                    done,
                };
                let release: Box<dyn FnOnce() + Send> = {
                    let (pool, sessions) = (self.write.clone(), self.sessions.clone());
                    let abandoned = (claim.sid.clone(), claim.rid.clone(), claim.owner.clone(), claim.at);
                    Box::new(move || {
                        if let Ok(rt) = tokio::runtime::Handle::try_current() {
                            rt.spawn(async move {
                                Self::withdraw_claims(&pool, &[abandoned], sessions.as_deref(), "the caller went away before it read its claim's answer").await;
                            });
                        }
                    })
                };
                let mut stored = $crate::store::sql::ClaimAnswer::new(stored, release);
                let stopped = || StoreError::Unavailable(anyhow::anyhow!("the store's claimer stopped"));
                self.claims.send(claim).await.map_err(|_| stopped())?;
                if stored.recv().await.map_err(|_| stopped())?.map_err(StoreError::from)? {
                    return Ok(Some(Claim::New));
                }
                // Read on the writer: the winner's row is committed there.
                let row = sqlx::query(&format!("SELECT {TURN_COLUMNS} FROM turns WHERE session_id = $1 AND request_id = $2"))
                    .bind(t.key.session_id.to_string())
                    .bind(t.key.request_id.as_str())
                    .fetch_optional(&self.write)
                    .await
                    .map_err(db_err)?;
                match row {
                    Some(r) => Ok(Some(Claim::Existing(turn_from_row(&r)?))),
                    None => Ok(None),
                }
            }

            /// The session, its last `limit` ended turns and whether turn
            /// `turn` (if given) is stored: from the session cache where it
            /// holds the session (asking the database whether the turn is
            /// stored only where the cache cannot tell), else from the
            /// database in one statement, offered to the cache.
            async fn read_for_run(&self, id: SessionId, limit: usize, turn: Option<&str>) -> StoreResult<Option<RunRead>> {
                let Some(cache) = &self.sessions else {
                    return self.read_session(id, limit, turn).await;
                };
                if let Some((session, history, remembered)) = cache.get(id, limit) {
                    // A turn the memory of a shared session does not know
                    // may be stored by another replica: said not stored
                    // here, and the claim finds it (see `RunRead`).
                    let turn_stored = match turn {
                        None => false,
                        Some(rid) => match cache.stored(id, rid) {
                            Some(known) => known,
                            None if remembered.is_some() => false,
                            None => self.turn_stored(id, rid).await?,
                        },
                    };
                    return Ok(Some(RunRead { session, history, turn_stored, claims: None, remembered }));
                }
                // Read with enough history to hold, and offered to the cache.
                let sid = id.to_string();
                let mark = cache.mark(&sid);
                let cap = $crate::store::session_cache::HISTORY_CAP + 1;
                let Some(mut read) = self.read_session(id, limit.max(cap), turn).await? else {
                    return Ok(None);
                };
                cache.offer(mark, &read.session, &read.history[read.history.len().saturating_sub(cap)..], read.claims);
                read.history.drain(..read.history.len().saturating_sub(limit));
                Ok(Some(read))
            }

            /// Deletes the event log of the turns numbered `numbers`, whose
            /// session was just deleted (on its own task, after the delete
            /// has answered): a bounded chunk of rows per
            /// statement, each its own transaction, so that the claims and
            /// commits waiting for SQLite's one writer are written between
            /// them. What is left by an error, or a crash, is never read (no
            /// turn has those numbers, and none will get them) and goes at
            /// the next start.
            async fn delete_turn_events(pool: &sqlx::Pool<$db>, sql: &$crate::store::sql::SessionEvents, numbers: &[i64]) {
                use $crate::store::sql::{DELETE_EVENT_ROWS, DELETE_EVENT_TURNS};
                for turns in numbers.chunks(DELETE_EVENT_TURNS) {
                    let list = format!("[{}]", turns.iter().map(i64::to_string).collect::<Vec<_>>().join(","));
                    // Ends: the turns are gone, so their log takes no rows.
                    loop {
                        let done = sqlx::query(sql.delete_rows)
                            .bind(&list)
                            .bind(DELETE_EVENT_ROWS as i64)
                            .execute(pool)
                            .await;
                        match done {
                            Ok(d) if d.rows_affected() < DELETE_EVENT_ROWS as u64 => break,
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "could not delete the event log of a deleted session; it is never read, and goes at the next start");
                                return;
                            }
                        }
                    }
                }
            }

            /// Whether turn `rid` of session `id` is stored.
            async fn turn_stored(&self, id: SessionId, rid: &str) -> StoreResult<bool> {
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM turns WHERE session_id = $1 AND request_id = $2)")
                    .bind(id.to_string())
                    .bind(rid)
                    .fetch_one(&self.read)
                    .await
                    .map_err(db_err)
            }

            /// The session, its last `limit` ended turns and whether turn
            /// `turn` is stored (false if `None`), from the database, in one
            /// statement.
            #[allow(dead_code)] // PostgreSQL reads through its own batched readers.
            async fn read_session_with_history(&self, id: SessionId, limit: usize, turn: Option<&str>) -> StoreResult<Option<RunRead>> {
                // One row per history turn, each with the session's columns
                // (one row of NULL turn columns when it has none); no row at
                // all when there is no such session.
                let rows = sqlx::query(
                    "SELECT s.id, s.user_id, s.created_at, s.updated_at, \
                     h.request_id AS h_request_id, h.agent AS h_agent, h.user_text AS h_user_text, h.answer AS h_answer, \
                     h.answer_payload AS h_answer_payload, \
                     EXISTS (SELECT 1 FROM turns t WHERE t.session_id = $1 AND t.request_id = $3) AS turn_stored \
                     FROM sessions s LEFT JOIN ( \
                       SELECT request_id, agent, user_text, COALESCE(answer, '') AS answer, \
                       COALESCE(answer_payload, '') AS answer_payload, created_at FROM turns \
                       WHERE session_id = $1 AND state <> 'running' \
                       ORDER BY created_at DESC, request_id DESC LIMIT $2 \
                     ) h ON true \
                     WHERE s.id = $1 \
                     ORDER BY h.created_at, h.request_id",
                )
                .bind(id.to_string())
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .bind(turn)
                .fetch_all(&self.read)
                .await
                .map_err(db_err)?;
                let Some(first) = rows.first() else {
                    return Ok(None);
                };
                let session = session_from_row(first)?;
                let turn_stored = first.try_get("turn_stored").map_err(db_err)?;
                let mut history = Vec::with_capacity(rows.len());
                for r in &rows {
                    let Some(request_id) = r.try_get::<Option<String>, _>("h_request_id").map_err(db_err)? else {
                        continue;
                    };
                    history.push(PriorTurn {
                        request_id,
                        agent: r.try_get("h_agent").map_err(db_err)?,
                        user_text: r.try_get("h_user_text").map_err(db_err)?,
                        answer: r.try_get("h_answer").map_err(db_err)?,
                        answer_payload: r.try_get("h_answer_payload").map_err(db_err)?,
                    });
                }
                Ok(Some(RunRead { session, history, turn_stored, claims: None, remembered: None }))
            }


            /// Moves rows of the per-event table (schema 0001) into batches,
            /// one turn per transaction; returns how many events moved.
            /// Replicas starting together do not collide: a turn's rows are
            /// deleted in the transaction that stores its batches.
            pub(super) async fn move_legacy_events(&self) -> StoreResult<u64> {
                let mut moved = 0;
                loop {
                    let mut tx = self.write.begin().await.map_err(db_err)?;
                    let Some(turn) = sqlx::query("SELECT session_id, request_id FROM events LIMIT 1")
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(db_err)?
                    else {
                        return Ok(moved);
                    };
                    let sid: String = turn.try_get("session_id").map_err(db_err)?;
                    let rid: String = turn.try_get("request_id").map_err(db_err)?;
                    let rows = sqlx::query(
                        "DELETE FROM events WHERE session_id = $1 AND request_id = $2 \
                         RETURNING seq, kind, author, text, tool_name, tool_call_id, payload_json, created_unix_nanos",
                    )
                    .bind(&sid)
                    .bind(&rid)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db_err)?;
                    let mut events = rows.iter().map(event_from_row).collect::<StoreResult<Vec<_>>>()?;
                    events.sort_by_key(|e| e.seq);
                    moved += events.len() as u64;
                    let encoded: Vec<_> = events.iter().map(EncodedEvent::of).collect();
                    for (first, last, row) in $crate::store::sql::batch_rows(&encoded, Self::SQL.row_bytes) {
                        sqlx::query(Self::SQL.insert_moved_batch)
                        .bind(&sid)
                        .bind(&rid)
                        .bind(first)
                        .bind(last)
                        .bind($crate::store::sql::blob(row))
                        .execute(&mut *tx)
                        .await
                        .map_err(db_err)?;
                    }
                    tx.commit().await.map_err(db_err)?;
                }
            }
        }
    };
}

pub(super) use sql_store;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{Event, EventKind};
    use crate::store::{EncodedEvent, KindEncoding, SeqEvent};

    fn event(seq: u64, text_len: usize) -> EncodedEvent {
        EncodedEvent::of(&SeqEvent {
            seq,
            event: Event {
                kind: EventKind::PartialText,
                author: String::new(),
                text: "x".repeat(text_len),
                tool_name: String::new(),
                tool_call_id: String::new(),
                payload_json: String::new(),
                created_unix_nanos: 0,
            },
        })
    }

    /// While a test holds the gate, a worker that took the first item waits
    /// and then takes everything queued meanwhile into the same group;
    /// with the gate open it takes only what it found.
    #[tokio::test]
    async fn a_held_gate_makes_one_group_of_what_queued_meanwhile() {
        let gate = QueueGate::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let held = gate.clone().try_write_owned().unwrap();
        let worker = {
            let gate = gate.clone();
            tokio::spawn(async move {
                let mut group = Vec::new();
                rx.recv_many(&mut group, 8).await;
                held_back(&gate, &mut rx, &mut group, 8).await;
                let first = group.clone();
                next_group(&mut rx, &mut group).await;
                (first, group)
            })
        };
        async fn next_group(rx: &mut tokio::sync::mpsc::Receiver<u32>, group: &mut Vec<u32>) {
            group.clear();
            rx.recv_many(group, 8).await;
        }
        tx.send(1).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        tx.send(2).await.unwrap();
        tx.send(3).await.unwrap();
        drop(held);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        tx.send(4).await.unwrap();
        let (first, next) = worker.await.unwrap();
        assert_eq!(first, [1, 2, 3]);
        assert_eq!(next, [4]);
    }

    /// A committers' queue as the stores' `spawn_committer` makes one: a
    /// turn's key for its batches, the queue's two ends, its gate and its
    /// pace.
    #[allow(clippy::type_complexity)]
    fn committers_queue() -> (
        crate::domain::TurnKey,
        tokio::sync::mpsc::Sender<PendingBatch>,
        std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<PendingBatch>>>,
        QueueGate,
        std::sync::Arc<Pace>,
    ) {
        let key = crate::domain::TurnKey {
            session_id: crate::domain::SessionId::generate(),
            request_id: crate::domain::RequestId::parse("r1").unwrap(),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(GROUP_QUEUE);
        let rx = std::sync::Arc::new(tokio::sync::Mutex::new(rx));
        (
            key,
            tx,
            rx,
            QueueGate::default(),
            std::sync::Arc::new(Pace::new()),
        )
    }

    /// A queue's committers share one pace: a small group waits out the
    /// linger counted from the last commit any of them began, so two
    /// committers taking turns make a commit per [`LINGER`] of events that
    /// trickle in, not one per event (each worker with a clock of its own
    /// found its last commit long past and committed at once).
    #[tokio::test(start_paused = true)]
    async fn committers_share_one_pace_for_small_groups() {
        let (key, tx, rx, gate, pace) = committers_queue();
        let began = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let start = tokio::time::Instant::now();
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let (rx, gate, pace, began) =
                    (rx.clone(), gate.clone(), pace.clone(), began.clone());
                tokio::spawn(async move {
                    let (mut group, mut carried) = (Vec::new(), Vec::new());
                    while let Some(at) =
                        next_group(&rx, &mut group, &mut carried, &gate, &pace).await
                    {
                        began.lock().unwrap().push((at - start, group.len()));
                        // The commit.
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        group.clear();
                    }
                })
            })
            .collect();
        // 40 small batches, one a millisecond.
        for seq in 0..40 {
            let batch = PendingBatch::new(
                &key,
                vec![event(seq, 10)],
                tokio::sync::oneshot::channel().0,
            );
            assert!(tx.send(batch).await.is_ok());
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        tokio::time::sleep(LINGER * 2).await;
        drop(tx);
        for w in workers {
            w.await.unwrap();
        }
        let began = began.lock().unwrap().clone();
        assert_eq!(began.iter().map(|(_, n)| n).sum::<usize>(), 40, "{began:?}");
        assert!(
            began.len() <= 6,
            "a commit per {LINGER:?} at most: {began:?}"
        );
        for pair in began.windows(2).skip(1) {
            assert!(pair[1].0 - pair[0].0 >= LINGER, "{began:?}");
        }
    }

    /// A queue on a thread of its own serves its items while the runtime
    /// that made it is busy (here, its only thread blocked): on the
    /// server's runtime the worker would never run.
    #[tokio::test(flavor = "current_thread")]
    async fn a_queue_on_its_own_thread_serves_while_the_runtime_that_made_it_is_busy() {
        let (seen, answers) = std::sync::mpsc::channel::<(u32, Option<String>)>();
        let queue = spawn_queue_on_thread("agentd-test-queue", 1, move || {
            move |rx: std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<u32>>>| {
                let seen = seen.clone();
                async move {
                    while let Some(n) = rx.lock().await.recv().await {
                        let thread = std::thread::current().name().map(str::to_owned);
                        seen.send((n, thread)).unwrap();
                    }
                }
            }
        })
        .unwrap();
        queue.try_send(7).unwrap();
        // Blocks this runtime's one thread until the answer comes.
        let (n, thread) = answers
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the worker ran while the runtime that made it was blocked");
        assert_eq!(n, 7);
        assert_eq!(thread.as_deref(), Some("agentd-test-queue"));
    }

    /// The thread ends once the queue's senders are gone and its workers
    /// have ended, and what they left running on the side first ends too
    /// (within the bound).
    #[tokio::test]
    async fn a_queue_on_its_own_thread_ends_with_its_senders_after_its_side_tasks() {
        let (ended, ends) = std::sync::mpsc::channel::<&'static str>();
        let queue = spawn_queue_on_thread("agentd-test-queue", 2, move || {
            move |rx: std::sync::Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<()>>>| {
                let ended = ended.clone();
                async move {
                    while rx.lock().await.recv().await.is_some() {
                        let ended = ended.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                            ended.send("side task").unwrap();
                        });
                    }
                    ended.send("worker").unwrap();
                }
            }
        })
        .unwrap();
        queue.send(()).await.unwrap();
        drop(queue);
        let order: Vec<_> = (0..3)
            .map(|_| {
                ends.recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap()
            })
            .collect();
        assert_eq!(order, ["worker", "worker", "side task"]);
        // Every sender of `ended` is gone, and so is the thread (Linux
        // keeps a thread's name to 15 bytes).
        assert_eq!(
            ends.recv_timeout(std::time::Duration::from_secs(10)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
        let running = || {
            std::fs::read_dir("/proc/self/task")
                .unwrap()
                .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .any(|name| name.trim_end() == "agentd-test-que")
        };
        for _ in 0..500 {
            if !running() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("the queue's thread is still running");
    }

    /// A group past its bytes is cut before the item that crosses them,
    /// keeping at least one; the rest goes to the next statement, in order.
    #[test]
    fn a_group_past_its_bytes_is_split_in_order() {
        let mut group = vec![10, 20, 30, 40];
        assert_eq!(split_over(&mut group, 35, |n| *n), vec![30, 40]);
        assert_eq!(group, vec![10, 20]);
        let mut group = vec![100, 1];
        assert_eq!(split_over(&mut group, 35, |n| *n), vec![1]);
        assert_eq!(group, vec![100], "one item over the limit goes alone");
        let mut group = vec![10, 20];
        assert!(split_over(&mut group, 30, |n| *n).is_empty());
        assert_eq!(group, vec![10, 20]);
        let mut group: Vec<usize> = vec![];
        assert!(split_over(&mut group, 30, |n| *n).is_empty());
    }

    #[test]
    fn a_batch_is_split_into_rows_under_the_size_limit_in_order_and_an_oversized_event_gets_its_own()
     {
        let third = BATCH_ROW_BYTES / 3;
        let events = vec![
            event(0, 10),
            event(1, third),
            event(2, third),
            event(3, third),
            event(4, BATCH_ROW_BYTES * 2),
            event(5, 10),
        ];
        let rows = split_batch(&events, BATCH_ROW_BYTES);
        let seqs: Vec<Vec<u64>> = rows
            .iter()
            .map(|r| r.iter().map(|e| e.seq).collect())
            .collect();
        assert_eq!(seqs, vec![vec![0, 1, 2], vec![3], vec![4], vec![5]]);
        assert!(split_batch(&[], BATCH_ROW_BYTES).is_empty());
        assert_eq!(split_batch(&events[..1], BATCH_ROW_BYTES).len(), 1);
    }

    /// Groups of events alone wait for more; a group with an outcome, with
    /// a batch of a writer that is behind, or with [`LINGER_BELOW`] bytes of events, is
    /// committed at once.
    #[test]
    fn only_groups_of_events_that_no_one_waits_for_linger() {
        let key = crate::domain::TurnKey {
            session_id: crate::domain::SessionId::generate(),
            request_id: crate::domain::RequestId::parse("r1").unwrap(),
        };
        let batch = |sizes: &[usize]| {
            let events = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| event(i as u64, n))
                .collect();
            PendingBatch::new(&key, events, tokio::sync::oneshot::channel().0)
        };
        let lingers = |group: &[PendingBatch]| {
            let mut g = Gathered::default();
            g.add(group);
            g.lingers()
        };
        assert!(lingers(&[]));
        assert!(lingers(&[batch(&[10, 10]), batch(&[100])]));
        // 64 streams going flat out: large, and still waited for.
        assert!(lingers(&[batch(&[10]), batch(&[64 * 1024, 64 * 1024])]));
        assert!(!lingers(&[
            batch(&[10]),
            batch(&[LINGER_BELOW / 2, LINGER_BELOW / 2])
        ]));
        // A batch of a writer that is behind.
        let behind = crate::store::WRITER_BEHIND;
        assert!(!lingers(&[batch(&[10]), batch(&vec![1; behind])]));
        assert!(lingers(&[batch(&vec![1; behind - 1])]));
        let mut ending = batch(&[10]);
        ending.outcome = Some(PendingOutcome::new(
            &crate::store::TurnOutcome {
                state: crate::store::TurnState::Completed,
                code: 0,
                message: String::new(),
            },
            None,
        ));
        assert!(!lingers(&[batch(&[10]), ending]));
        let mut alone = batch(&[]);
        alone.outcome = Some(PendingOutcome::new(
            &crate::store::TurnOutcome {
                state: crate::store::TurnState::Failed,
                code: 14,
                message: "gone".into(),
            },
            None,
        ));
        assert!(!lingers(&[alone]));
        // Counted as the batches come, as one look at the whole group.
        let mut g = Gathered::default();
        g.add(&[batch(&[LINGER_BELOW / 2])]);
        assert!(g.lingers());
        g.add(&[batch(&[10]), batch(&[LINGER_BELOW / 2])]);
        assert!(!g.lingers());
    }

    /// Under [`next_group`]: a large group of events (streams going flat
    /// out) waits for more until [`LINGER`] after the last commit began,
    /// where it was committed at once; a batch of a writer that is behind
    /// is committed at once, whatever came before it, and so is a group
    /// waiting when a writer hurries it ([`Pace::hurry`]).
    #[tokio::test(start_paused = true)]
    async fn large_groups_wait_for_more_but_not_for_a_writer_that_is_behind() {
        let (key, tx, rx, gate, pace) = committers_queue();
        let start = tokio::time::Instant::now();
        let worker = tokio::spawn({
            let pace = pace.clone();
            async move {
                let (mut group, mut carried, mut began) = (Vec::new(), Vec::new(), Vec::new());
                while let Some(at) = next_group(&rx, &mut group, &mut carried, &gate, &pace).await {
                    let sizes: Vec<usize> = group.iter().map(|p| p.events.len()).collect();
                    began.push((at - start, sizes));
                    // The commit.
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    group.clear();
                }
                began
            }
        });
        let ms = std::time::Duration::from_millis;
        let send = |events: Vec<EncodedEvent>| {
            let tx = tx.clone();
            let batch = PendingBatch::new(&key, events, tokio::sync::oneshot::channel().0);
            async move { assert!(tx.send(batch).await.is_ok()) }
        };
        // 100 KiB of events, then a few more 2 ms later: one group.
        send(vec![event(0, 50 * 1024), event(1, 50 * 1024)]).await;
        tokio::time::sleep(ms(2)).await;
        send(vec![event(2, 10)]).await;
        // A large batch 5 ms after that group began: not held to 10 ms.
        tokio::time::sleep(ms(13)).await;
        let full = crate::store::WRITER_BEHIND as u64;
        send((3..3 + full).map(|seq| event(seq, 10)).collect()).await;
        tokio::time::sleep(ms(1)).await;
        send(vec![event(3 + full, 10)]).await;
        // A few events, and 2 ms later their writer is behind.
        tokio::time::sleep(ms(12)).await;
        send(vec![event(4 + full, 10)]).await;
        tokio::time::sleep(ms(2)).await;
        pace.hurry();
        tokio::time::sleep(LINGER * 2).await;
        drop(tx);
        let began = worker.await.unwrap();
        let sizes: Vec<_> = began.iter().map(|(_, s)| s.clone()).collect();
        assert_eq!(
            sizes,
            [
                vec![2, 1],
                vec![crate::store::WRITER_BEHIND],
                vec![1],
                vec![1]
            ],
            "{began:?}"
        );
        assert_eq!(began[0].0, LINGER, "{began:?}");
        assert_eq!(began[1].0, ms(15), "{began:?}");
        assert_eq!(began[2].0, ms(15) + LINGER, "{began:?}");
        assert_eq!(began[3].0, ms(30), "{began:?}");
    }

    /// A claim with no claim group begun within the linger is taken at
    /// once; the claims that come within it of a group's start wait out the
    /// rest and go together; one that comes after it does not wait. (Tokio's
    /// timers count whole milliseconds, so the test lingers 10 ms where the
    /// claimers linger [`CLAIM_LINGER`].)
    #[tokio::test(start_paused = true)]
    async fn claims_close_behind_a_group_wait_for_one_another_and_a_lone_one_does_not() {
        let ms = std::time::Duration::from_millis;
        let (tx, rx) = tokio::sync::mpsc::channel(GROUP_QUEUE);
        let rx = std::sync::Arc::new(tokio::sync::Mutex::new(rx));
        let (gate, pace) = (QueueGate::default(), Pace::lingering(ms(10)));
        let start = tokio::time::Instant::now();
        let worker = tokio::spawn(async move {
            let (mut group, mut began) = (Vec::new(), Vec::new());
            while next_claims(&rx, &mut group, &gate, &pace).await {
                let rids: Vec<String> = group.drain(..).map(|c: PendingClaim| c.rid).collect();
                began.push((tokio::time::Instant::now() - start, rids));
                // The claims' statement.
                tokio::time::sleep(ms(1)).await;
            }
            began
        });
        let send = |rid: &str| {
            let claim = PendingClaim {
                sid: "s".into(),
                rid: rid.into(),
                user_text: String::new(),
                agent: String::new(),
                owner: String::new(),
                lease: std::time::Duration::from_secs(1),
                at: 0,
                done: tokio::sync::oneshot::channel().0,
            };
            let tx = tx.clone();
            async move { assert!(tx.send(claim).await.is_ok()) }
        };
        // Long after any group: at once.
        tokio::time::sleep(ms(50)).await;
        send("a").await;
        // Three more, close behind it: one group, when the linger is out.
        tokio::time::sleep(ms(2)).await;
        send("b").await;
        tokio::time::sleep(ms(3)).await;
        send("c").await;
        send("d").await;
        // Long after: at once again.
        tokio::time::sleep(ms(45)).await;
        send("e").await;
        tokio::time::sleep(ms(20)).await;
        drop(tx);
        let began = worker.await.unwrap();
        let rids: Vec<Vec<&str>> = began
            .iter()
            .map(|(_, r)| r.iter().map(String::as_str).collect())
            .collect();
        assert_eq!(
            rids,
            [vec!["a"], vec!["b", "c", "d"], vec!["e"]],
            "{began:?}"
        );
        let at: Vec<_> = began.iter().map(|(t, _)| *t).collect();
        assert_eq!(at, [ms(50), ms(60), ms(100)], "{began:?}");
    }

    /// A row's blob is the batch encoding of its events: the same bytes the
    /// batch encoder writes, decoding to the events in order.
    #[test]
    fn a_row_of_encoded_events_is_the_batch_encoding_of_those_events() {
        let events: Vec<SeqEvent> = (3..8)
            .map(|seq| SeqEvent {
                seq,
                event: Event {
                    kind: EventKind::PartialText,
                    author: "a".into(),
                    text: format!("t{seq}"),
                    tool_name: String::new(),
                    tool_call_id: String::new(),
                    payload_json: String::new(),
                    created_unix_nanos: seq as i64,
                },
            })
            .collect();
        let mut buf = bytes::BytesMut::new();
        let encoded: Vec<_> = events
            .iter()
            .map(|e| EncodedEvent::encode(e.seq, &e.event, KindEncoding::Code, &mut buf))
            .collect();
        assert_eq!(encoded[2].decode().as_ref(), Some(&events[2]));
        let rows: Vec<_> = batch_rows(&encoded, BATCH_ROW_BYTES).collect();
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].0, rows[0].1), (3, 7));
        let blob = blob(rows[0].2);
        assert_eq!(
            blob,
            crate::store::codec::encode(&events, KindEncoding::Code)
        );
        assert_eq!(crate::store::codec::decode(&blob), Some(events));
    }
}
