//! The embedded default store: a SQLite file (`--store sqlite://agentd.db`)
//! that a single replica's sessions survive restarts in, and its event log
//! beside it (`agentd.db-events`, attached to every connection as `ev`). The
//! database runs in WAL mode, so readers run beside the writer; every write
//! goes through one connection (one writer path, so writers never fight over
//! the lock), with a busy timeout for the rare contention.
//!
//! The event log has a file of its own for its page size and its journal.
//! It is written in large appends, where 64 KiB pages cost a sixteenth of
//! the system calls of 4 KiB pages; the sessions and turns are small rows
//! changed one at a time, where a large page would make every commit write
//! 64 KiB. Statements name the table unqualified (`event_log` is found in
//! `ev`).
//!
//! The event log keeps a rollback journal (`PERSIST`), not a WAL: a commit
//! that appends writes its new pages once, into the file, and journals only
//! the few existing pages it changes (the last leaf and the pages above
//! it). Under WAL every byte was written twice (the WAL, then the
//! checkpoint's copy) and read once more by the checkpoint, and that was
//! most of what the store cost the server's core ([`EVENT_LOG_JOURNAL`]).
//! Each commit of the log is synced to disk before it is acknowledged (the
//! database's own commits, claims and outcomes, are not: WAL with
//! `synchronous = NORMAL`). Readers of the log (replays, and followers:
//! Attach and repeated Runs, which read it after every stored batch) and
//! its writer now wait for each other, in the busy handler, where under WAL
//! neither did; with one or two followers on every one of 64 streams this
//! measured the same as WAL for the streams and 0.91-1.00× for the
//! followers (BENCHMARKS.md).
//!
//! The log is keyed by the turn's number (`turns.turn_no`, given in claim
//! order), not by its session and request ids: the turns running at one
//! moment then have their index entries side by side, and a group commit
//! rewrites one or two index pages instead of one per turn.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

/// The clock leases are written and judged by, in microseconds: SQLite's,
/// the machine's (the one replica's) own.
macro_rules! db_now {
    () => {
        "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
    };
}

/// The most bytes of events one row of the event log holds: a little under
/// an eighth of its 64 KiB page. A row of 32 to 64 KiB (a busy turn's share
/// of one group commit) fits one to a page, and the rest of the page,
/// empty, was written to disk all the same: with commits of
/// 50 KB per turn the log took 1.31 bytes of disk per byte of events, 1.13
/// with rows of at most this size (in `bench/store.sh`, 1.44 and 1.07).
/// Smaller rows pack a little better but cost more than they save (rows of
/// 4,000 bytes: 1.07 in the test, and 4% fewer events/s; this size: 2% more
/// than rows of up to 1 MB).
const EVENT_LOG_ROW_BYTES: usize = 8_000;

/// How long a statement waits for the database lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Concurrent readers (followers, replays, listings).
const READERS: u32 = 4;
/// The event log's page size (SQLite's largest), as [`attach_event_log`]
/// sets it.
#[cfg(test)]
const EVENT_LOG_PAGE_SIZE: i64 = 65536;

/// The event log's file: the database's path with `-events` appended.
pub fn event_log_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push("-events");
    PathBuf::from(name)
}

/// The event log's journal mode: a rollback journal kept between commits
/// (its header zeroed, not the file deleted). Measured against WAL
/// (`agentd bench`, SQLite, 64 streams, builds interleaved round by round):
/// 1.04-1.17× the events/s bursty (median 1.135×, five rounds) and
/// 0.99-1.13× one at a time (median 1.06×, four rounds); see BENCHMARKS.md.
const EVENT_LOG_JOURNAL: &str = "persist";

/// The most bytes the event log's journal keeps on disk between commits. A
/// commit journals only the pages it changes, a few 64 KiB pages; a large
/// delete (a prune, a session's deletion) journals more, and the file is cut
/// back to this size after it.
const EVENT_LOG_JOURNAL_LIMIT: i64 = 4 * 1024 * 1024;

/// Attaches the event log as `ev` to a new connection; for the writer,
/// also sets its page size (kept by a file that already has one) and its
/// journal mode, which are settings of that file, not of the connection.
///
/// A log a release before [`EVENT_LOG_JOURNAL`] left in WAL mode is moved
/// to it here: SQLite copies what its WAL holds (after a kill, too) into
/// the file first. That needs the file to itself, which the writer, the
/// store's first connection, has; the mode is checked, not assumed.
async fn attach_event_log(
    conn: &mut sqlx::SqliteConnection,
    path: Arc<str>,
    writer: bool,
) -> Result<(), sqlx::Error> {
    use sqlx::Executor as _;
    let attach = format!("ATTACH DATABASE '{}' AS ev;", path.replace('\'', "''"));
    conn.execute(attach.as_str()).await?;
    if writer {
        conn.execute(
            format!(
                "PRAGMA ev.page_size = 65536; PRAGMA ev.synchronous = NORMAL; \
                 PRAGMA ev.journal_size_limit = {EVENT_LOG_JOURNAL_LIMIT};"
            )
            .as_str(),
        )
        .await?;
        let mode: String =
            sqlx::query_scalar(&format!("PRAGMA ev.journal_mode = {EVENT_LOG_JOURNAL}"))
                .fetch_one(&mut *conn)
                .await?;
        if !mode.eq_ignore_ascii_case(EVENT_LOG_JOURNAL) {
            return Err(sqlx::Error::Configuration(
                format!("the event log {path} stays in {mode} mode: another process has it open")
                    .into(),
            ));
        }
    }
    Ok(())
}

pub struct SqliteStore {
    /// Readers: any number of them run beside the writer (the database
    /// under WAL; the event log between its commits).
    read: SqlitePool,
    /// The one writer connection.
    write: SqlitePool,
    a2a: Arc<super::a2a_tasks::SqliteTasks>,
    /// The committer's queue: event batches are written through it.
    commits: tokio::sync::mpsc::Sender<super::sql::PendingBatch>,
    /// The committer's pace, which turns' writers hurry.
    pace: Arc<super::sql::Pace>,
    /// The claimer's queue: turns are claimed through it.
    claims: tokio::sync::mpsc::Sender<super::sql::PendingClaim>,
    /// Holds the claimers and the committer back, for tests.
    gate: super::sql::QueueGate,
    /// The sessions created since start-up, with their history: a Run
    /// reads them without a database read ([`super::session_cache`]).
    sessions: Option<Arc<super::session_cache::SessionCache>>,
    /// The checkpointer's connection (closed by [`Store::close`]).
    checkpoints: SqlitePool,
    /// Held while the store lives; the checkpointer stops when it goes.
    _alive: Arc<()>,
}

/// How often the checkpointer copies what the database's WAL holds into
/// its file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(250);

/// The WAL size, in pages, at which the writer checkpoints after a commit
/// (SQLite's automatic checkpoint; its default is 1,000): 16 MB of the
/// database's 4 KiB pages.
///
/// A WAL starts again from its beginning only once a checkpoint has copied
/// all of it, and under a steady stream of commits only the writer's own
/// checkpoint, run between two of its commits, ever finds it all copied:
/// the background one always finds newer pages. So the WAL grows to this
/// size whatever the checkpointer does, and the writer then checkpoints,
/// which costs little copying (the checkpointer did that) but two disk
/// syncs that hold every turn's next commit back. At 1,000 pages that was
/// several times a second at full load, and the server's core sat idle 4%
/// of the time (when the event log, too, had a WAL).
const WRITER_CHECKPOINT_PAGES: u32 = 4000;

/// Checkpoints the database's WAL every [`CHECKPOINT_EVERY`] on a connection of its
/// own, until the store is dropped. A checkpoint copies the WAL's pages into
/// the database file and syncs both; done by the writer, it holds every
/// turn's next commit back while the disk syncs. PASSIVE checkpoints run
/// beside the writer and never wait for it, so the writer's own checkpoint
/// ([`WRITER_CHECKPOINT_PAGES`]) has little left to copy.
fn spawn_checkpointer(pool: SqlitePool, alive: std::sync::Weak<()>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            if alive.strong_count() == 0 {
                break;
            }
            let done = sqlx::raw_sql("PRAGMA main.wal_checkpoint(PASSIVE);")
                .execute(&pool)
                .await;
            match done {
                Ok(_) if failing => {
                    tracing::info!("SQLite checkpoints work again");
                    failing = false;
                }
                Ok(_) => {}
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "SQLite checkpoint failed; the writer checkpoints when its WAL reaches 4,000 pages");
                    failing = true;
                }
                Err(_) => {}
            }
        }
        pool.close().await;
    });
}

impl SqliteStore {
    /// Opens (creating if missing) the database `url` names and migrates it.
    /// A turn still `running` in the file belonged to a process that is gone
    /// (one process per file): it is failed with UNAVAILABLE at once.
    pub async fn open(url: &str) -> anyhow::Result<Self> {
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true)
            .pragma("wal_autocheckpoint", WRITER_CHECKPOINT_PAGES.to_string());
        let events = event_log_path(opts.get_filename());
        let events_at: Arc<str> = events
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("the database path is not valid UTF-8"))?
            .into();
        let at = events_at.clone();
        // No ping before each use: the connection is in this process, and a
        // ping is a round trip to its thread that doubled a statement's cost.
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(BUSY_TIMEOUT)
            .after_connect(move |conn, _| {
                let at = at.clone();
                Box::pin(async move { attach_event_log(conn, at, true).await })
            })
            .connect_with(opts.clone())
            .await?;
        Self::check_event_log_is_ours(&write, &events).await?;
        if let Err(e) = super::migrator(sqlx::migrate!("migrations/sqlite"))
            .run(&write)
            .await
        {
            // Two processes opening a new file at once both migrate it, and
            // the later fails on the earlier's tables.
            let hint = if e.to_string().contains("already exists") {
                " (a table it creates is already there: another process is opening the same file, which SQLite's store does not allow, or the file holds another application's tables)"
            } else {
                ""
            };
            anyhow::bail!("{e}{hint}");
        }
        let has_log: bool = sqlx::query_scalar(
            "SELECT COUNT(*) > 0 FROM ev.sqlite_schema WHERE type = 'table' AND name = 'event_log'",
        )
        .fetch_one(&write)
        .await?;
        if !has_log {
            anyhow::bail!(
                "the event log {} is missing or is not this database's (it was moved or deleted; restore it beside the database)",
                events.display()
            );
        }
        let at = events_at.clone();
        let checkpoints = SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(BUSY_TIMEOUT)
            .after_connect(move |conn, _| {
                let at = at.clone();
                Box::pin(async move { attach_event_log(conn, at, false).await })
            })
            .connect_with(opts.clone())
            .await?;
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .test_before_acquire(false)
            .acquire_timeout(BUSY_TIMEOUT)
            .after_connect(move |conn, _| {
                let at = events_at.clone();
                Box::pin(async move { attach_event_log(conn, at, false).await })
            })
            .connect_with(opts.read_only(true))
            .await?;
        let a2a = Arc::new(super::a2a_tasks::SqliteTasks::new(
            read.clone(),
            write.clone(),
        ));
        let sessions = Arc::new(super::session_cache::SessionCache::default());
        let gate = super::sql::QueueGate::default();
        let pace = Arc::new(super::sql::Pace::new());
        let commits = {
            let write = write.clone();
            Self::spawn_committer(
                move || write,
                1,
                Some(sessions.clone()),
                gate.clone(),
                pace.clone(),
            )?
        };
        let claims = {
            let write = write.clone();
            Self::spawn_claimer(move || write, 1, Some(sessions.clone()), gate.clone())?
        };
        let alive = Arc::new(());
        spawn_checkpointer(checkpoints.clone(), Arc::downgrade(&alive));
        let store = Self {
            read,
            write,
            checkpoints,
            a2a,
            commits,
            pace,
            claims,
            gate,
            sessions: Some(sessions),
            _alive: alive,
        };
        let moved = store.move_legacy_events().await?;
        if moved > 0 {
            tracing::info!(events = moved, "moved the event log to the batched layout");
        }
        let outcome = crate::grpc::status::replica_stopped();
        let orphans = sqlx::query(
            "UPDATE turns SET state = $1, status_code = $2, status_message = $3, updated_at = $4 WHERE state = 'running'",
        )
        .bind(outcome.state.as_str())
        .bind(outcome.code as i64)
        .bind(&outcome.message)
        .bind(crate::store::to_micros(std::time::SystemTime::now()))
        .execute(&store.write)
        .await?
        .rows_affected();
        if orphans > 0 {
            tracing::warn!(
                turns = orphans,
                "turns interrupted by the previous process were marked failed (UNAVAILABLE)"
            );
        }
        // The two files commit one after the other: a delete or prune cut
        // between them (an I/O error, a kill) leaves events of turns that
        // are gone. Numbers are never reused (claims count the event log's
        // too), so nothing reads them; they are dropped here.
        let dropped = sqlx::query(
            "DELETE FROM event_log WHERE turn_no NOT IN (SELECT turn_no FROM turns WHERE turn_no IS NOT NULL)",
        )
        .execute(&store.write)
        .await?
        .rows_affected();
        if dropped > 0 {
            tracing::warn!(
                rows = dropped,
                "event log rows of turns deleted by an interrupted commit were dropped"
            );
        }
        let tasks = store.a2a.fail_unfinished(&outcome.message).await?;
        if tasks > 0 {
            tracing::warn!(
                tasks,
                "A2A tasks interrupted by the previous process were marked failed"
            );
        }
        Ok(store)
    }
}

/// One row of a group: its batch's ids, its first and last seq, and its
/// blob, built for the statement and moved into it. sqlx hands a statement
/// to SQLite's thread as owned values, so a borrowed blob would be copied
/// once more on the way.
type GroupRow<'q> = (&'q super::sql::PendingBatch, i64, i64, Vec<u8>);

/// The rows of `group`, in order.
fn group_rows(group: &[super::sql::PendingBatch]) -> Vec<GroupRow<'_>> {
    group
        .iter()
        .flat_map(|p| {
            p.rows(SqliteStore::SQL.row_bytes)
                .map(move |(first, last, events)| (p, first, last, super::sql::blob(events)))
        })
        .collect()
}

/// The insert of one event-batch row.
///
/// The row takes its turn's number from the turn's row: the event log is
/// in another file, beyond a foreign key's reach, and a turn that was never
/// claimed (or was deleted) leaves the number NULL, which fails the
/// statement, whole, on the column's NOT NULL, as a foreign key would. A
/// turn no longer running (failed under its writer when its lease ran out)
/// takes no more events: they would follow the outcome its followers saw.
fn insert_row(
    (p, first, last, blob): GroupRow<'_>,
) -> sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'_>> {
    sqlx::query(
        "INSERT INTO event_log (turn_no, first_seq, last_seq, events) \
         SELECT t.turn_no, $3, $4, $5 \
         FROM (SELECT 1) LEFT JOIN turns t ON t.session_id = $1 AND t.request_id = $2 \
         WHERE t.turn_no IS NULL OR t.state = 'running'",
    )
    .bind(p.sid.as_str())
    .bind(p.rid.as_str())
    .bind(first)
    .bind(last)
    .bind(blob)
}

/// The most rows one insert statement carries (5 binds each, far under
/// SQLite's 32,766 variables); a group with more is written in a
/// transaction.
const ROWS_PER_STATEMENT: usize = 256;

/// One insert statement for `rows`, each row's turn checked as in
/// [`insert_row`], [`padded`]: one of nine statements. Built for the exact
/// count, every group's statement was parsed and planned anew, a few
/// percent of the core under a full load of streaming turns.
fn insert_rows<'q>(
    rows: impl ExactSizeIterator<Item = GroupRow<'q>>,
) -> sqlx::QueryBuilder<'q, sqlx::Sqlite> {
    let mut q = sqlx::QueryBuilder::new(
        "INSERT INTO event_log (turn_no, first_seq, last_seq, events) \
         SELECT t.turn_no, v.column3, v.column4, v.column5 FROM (",
    );
    q.push_values(padded(rows), |mut b, row| match row {
        Some((p, first, last, blob)) => {
            b.push_bind(p.sid.as_str())
                .push_bind(p.rid.as_str())
                .push_bind(first)
                .push_bind(last)
                .push_bind(blob);
        }
        None => {
            b.push_bind(None::<&str>)
                .push_bind(None::<&str>)
                .push_bind(None::<i64>)
                .push_bind(None::<i64>)
                .push_bind(None::<Vec<u8>>);
        }
    });
    q.push(
        ") AS v LEFT JOIN turns t ON t.session_id = v.column1 AND t.request_id = v.column2 \
         WHERE v.column1 IS NOT NULL AND (t.turn_no IS NULL OR t.state = 'running')",
    );
    q
}

/// `rows`, then rows of `None` up to the next power of two: a group's
/// statement, whose text differs with its row count, is then one of a few,
/// each kept prepared on the writer connection (in sqlx's cache). Built
/// for the exact count, a statement was parsed and planned anew for every
/// group of more than four rows (4% of SQLite's thread, `model_overhead`).
/// Each statement drops the rows of `None` (`v.column1 IS NOT NULL`).
fn padded<T>(rows: impl ExactSizeIterator<Item = T>) -> impl Iterator<Item = Option<T>> {
    let padding = rows.len().next_power_of_two() - rows.len();
    rows.map(Some)
        .chain(std::iter::repeat_with(|| None).take(padding))
}

/// One statement recording the outcomes of `turns`, each only while its
/// turn is still running (as [`Store::finish_turn`](super::Store::finish_turn)).
fn update_outcomes<'q>(
    turns: &'q [(&'q super::sql::PendingBatch, &'q super::sql::PendingOutcome)],
) -> sqlx::QueryBuilder<'q, sqlx::Sqlite> {
    let mut q = sqlx::QueryBuilder::new(
        "UPDATE turns SET state = v.column3, status_code = v.column4, status_message = v.column5, \
         answer = v.column6, answer_payload = v.column7, updated_at = v.column8 FROM (",
    );
    q.push_values(padded(turns.iter()), |mut b, turn| match turn {
        Some((p, o)) => {
            b.push_bind(p.sid.as_str())
                .push_bind(p.rid.as_str())
                .push_bind(o.state)
                .push_bind(o.code)
                .push_bind(o.message.as_str())
                .push_bind(o.answer.as_deref())
                .push_bind(o.answer_payload.as_deref())
                .push_bind(o.at);
        }
        None => {
            b.push_bind(None::<&str>)
                .push_bind(None::<&str>)
                .push_bind(None::<&str>)
                .push_bind(None::<i64>)
                .push_bind(None::<&str>)
                .push_bind(None::<&str>)
                .push_bind(None::<&str>)
                .push_bind(None::<i64>);
        }
    });
    q.push(
        ") AS v WHERE v.column1 IS NOT NULL AND turns.session_id = v.column1 \
         AND turns.request_id = v.column2 \
         AND turns.state = 'running' RETURNING turns.session_id, turns.request_id",
    );
    q
}

impl SqliteStore {
    /// A session and its history from the database, when the session cache
    /// does not serve it: local readers, one statement each.
    async fn read_session(
        &self,
        id: crate::domain::SessionId,
        limit: usize,
        turn: Option<&str>,
    ) -> super::StoreResult<Option<super::RunRead>> {
        self.read_session_with_history(id, limit, turn).await
    }

    /// One process per file: no other replica to tell of a cancel.
    async fn announce(&self, _key: &crate::domain::TurnKey) -> super::StoreResult<()> {
        Ok(())
    }

    fn announcements(&self) -> Option<tokio::sync::broadcast::Receiver<crate::domain::TurnKey>> {
        None
    }

    /// Readers first, the writer last: the last connection to close copies
    /// the database's WAL into its file and removes it, which a read-only
    /// one cannot do.
    async fn close_pools(&self) {
        self.read.close().await;
        self.checkpoints.close().await;
        self.write.close().await;
    }
}

impl SqliteStore {
    /// Writes a committer's group: its events, then its outcomes. Each is
    /// one statement, and one commit, for the whole group (see
    /// [`write_events`](Self::write_events)).
    ///
    /// Two commits, not one transaction: the event log is another file,
    /// and SQLite commits a transaction over a WAL file and another file
    /// one file at a time, the main one (the outcomes) first. A process killed between the
    /// two would keep an outcome whose last events are gone. In this order
    /// it can only keep events of a turn still `running`, which the next
    /// start fails with UNAVAILABLE.
    /// Returns, per batch, whether its outcome (if any) was recorded: a
    /// turn no longer running keeps the one it has.
    async fn write_group(
        pool: &SqlitePool,
        group: &[super::sql::PendingBatch],
    ) -> Result<Vec<bool>, super::sql::GroupError> {
        Self::write_events(pool, group).await?;
        let outcomes = super::sql::group_outcomes(group);
        if outcomes.is_empty() {
            return Ok(vec![true; group.len()]);
        }
        let mut stored = 0;
        let mut recorded = Vec::with_capacity(outcomes.len());
        while stored < outcomes.len() {
            let chunk = &outcomes[stored..outcomes.len().min(stored + ROWS_PER_STATEMENT)];
            let rows: Vec<(String, String)> = update_outcomes(chunk)
                .build_query_as()
                .persistent(true)
                .fetch_all(pool)
                .await
                .map_err(|error| super::sql::GroupError {
                    error,
                    events_stored: true,
                })?;
            recorded.extend(rows);
            stored += chunk.len();
        }
        Ok(super::sql::outcomes_recorded(group, &recorded))
    }

    /// Writes a group's events, as one statement when it fits in one:
    /// each statement is a round trip to sqlx's SQLite thread, so a
    /// statement per row made a group of 64 turns 66 of them.
    async fn write_events(
        pool: &SqlitePool,
        group: &[super::sql::PendingBatch],
    ) -> Result<(), sqlx::Error> {
        let mut rows = group_rows(group);
        match rows.len() {
            0 => {}
            1 => {
                insert_row(rows.remove(0)).execute(pool).await?;
            }
            n if n <= ROWS_PER_STATEMENT => {
                insert_rows(rows.into_iter()).build().execute(pool).await?;
            }
            _ => {
                let mut tx = pool.begin().await?;
                let mut rows = rows.into_iter().peekable();
                while rows.peek().is_some() {
                    let chunk: Vec<_> = rows.by_ref().take(ROWS_PER_STATEMENT).collect();
                    insert_rows(chunk.into_iter())
                        .build()
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }
}

impl SqliteStore {
    /// Refuses an event log file that holds a log before this database has
    /// moved its own there (migration 4): one left behind by a database
    /// that was deleted, or copied in from another. Migrating would fail on
    /// its table; the operator is told which file to move away instead.
    async fn check_event_log_is_ours(write: &SqlitePool, events: &Path) -> anyhow::Result<()> {
        let log_there: bool = sqlx::query_scalar(
            "SELECT COUNT(*) > 0 FROM ev.sqlite_schema WHERE type = 'table' AND name IN ('event_batches', 'event_log')",
        )
        .fetch_one(write)
        .await?;
        if !log_there {
            return Ok(());
        }
        let migrated: bool = sqlx::query_scalar(
            "SELECT COUNT(*) > 0 FROM main.sqlite_schema WHERE type = 'table' AND name = '_sqlx_migrations'",
        )
        .fetch_one(write)
        .await?;
        let moved: bool = migrated
            && sqlx::query_scalar(
                "SELECT COUNT(*) > 0 FROM _sqlx_migrations WHERE version = 4 AND success",
            )
            .fetch_one(write)
            .await?;
        if !moved {
            anyhow::bail!(
                "the event log {} holds events this database never wrote (the database is new, or it was replaced): move that file (and its -wal or -journal file) away, or restore the database it belongs to",
                events.display()
            );
        }
        Ok(())
    }

    /// Claims `claims` (distinct keys) in one statement; for each, whether
    /// it stored its turn. Turns get the next numbers, in claim order (the
    /// select reads the table it inserts into, so SQLite computes it whole,
    /// numbers included, before the first row goes in). The session's
    /// `updated_at` follows by trigger (migration 6).
    async fn insert_claims(
        pool: &SqlitePool,
        claims: &[super::sql::PendingClaim],
    ) -> Result<Vec<super::sql::ClaimWritten>, sqlx::Error> {
        let mut q = sqlx::QueryBuilder::new(concat!(
            "INSERT INTO turns (session_id, request_id, user_text, agent, state, owner, lease_expires_at, \
             created_at, updated_at, turn_no) \
             SELECT v.column1, v.column2, v.column3, v.column4, 'running', v.column5, ",
            db_now!(),
            " + v.column6, v.column7, v.column7, \
             MAX(IFNULL((SELECT MAX(turn_no) FROM turns), 0), IFNULL((SELECT MAX(turn_no) FROM event_log), 0)) \
             + ROW_NUMBER() OVER () FROM (",
        ));
        q.push_values(padded(claims.iter()), |mut b, c| match c {
            Some(c) => {
                b.push_bind(c.sid.as_str())
                    .push_bind(c.rid.as_str())
                    .push_bind(c.user_text.as_str())
                    .push_bind(c.agent.as_str())
                    .push_bind(c.owner.as_str())
                    .push_bind(c.lease_micros())
                    .push_bind(c.at);
            }
            None => {
                b.push_bind(None::<&str>)
                    .push_bind(None::<&str>)
                    .push_bind(None::<&str>)
                    .push_bind(None::<&str>)
                    .push_bind(None::<&str>)
                    .push_bind(None::<i64>)
                    .push_bind(None::<i64>);
            }
        });
        // A WHERE clause is needed here: without one SQLite would read ON
        // CONFLICT as a join's. Turn numbers count the rows it keeps.
        q.push(
            ") AS v WHERE v.column1 IS NOT NULL ON CONFLICT (session_id, request_id) DO NOTHING \
             RETURNING session_id, request_id",
        );
        let rows = q.build().persistent(true).fetch_all(pool).await?;
        super::sql::stored_claims(claims, &rows, false)
    }

    /// The statements that differ from PostgreSQL's: the event log, keyed
    /// by the turn's number in another file (where no foreign key reaches),
    /// is found through the turn's row and deleted with it by hand.
    const SQL: super::sql::Dialect = super::sql::Dialect {
        // From the batch that holds seq $3 on (batches are contiguous: every
        // one before it ends before $3), found on the key, so a follower
        // deep into a long turn does not walk its first batches again on
        // every read.
        events_after: "SELECT events FROM event_log \
             WHERE turn_no = (SELECT turn_no FROM turns WHERE session_id = $1 AND request_id = $2) \
             AND first_seq >= COALESCE((SELECT MAX(first_seq) FROM event_log \
                 WHERE turn_no = (SELECT turn_no FROM turns WHERE session_id = $1 AND request_id = $2) \
                 AND first_seq <= $3), 0) \
             AND last_seq > $3 ORDER BY first_seq LIMIT $4",
        // Every write goes through the one writer connection, which this
        // transaction holds.
        lock_session: None,
        session_events: Some(super::sql::SessionEvents {
            turn_numbers: "SELECT turn_no FROM turns WHERE session_id = $1 AND turn_no IS NOT NULL",
            // A number the session's turns had may name a new turn by now
            // (one of them had the highest number and no events): its rows
            // are that turn's.
            delete_rows: "DELETE FROM event_log WHERE rowid IN (SELECT rowid FROM event_log \
                 WHERE turn_no IN (SELECT value FROM json_each($1)) \
                 AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.turn_no = event_log.turn_no) LIMIT $2)",
        }),
        prune_events: Some(
            "DELETE FROM event_log WHERE turn_no IN \
             (SELECT turn_no FROM turns WHERE state <> 'running' AND updated_at < $1 \
              ORDER BY updated_at, turn_no LIMIT $2)",
        ),
        prune_turns: "DELETE FROM turns WHERE turn_no IN \
             (SELECT turn_no FROM turns WHERE state <> 'running' AND updated_at < $1 \
              ORDER BY updated_at, turn_no LIMIT $2) \
             RETURNING updated_at",
        row_bytes: EVENT_LOG_ROW_BYTES,
        insert_moved_batch: "INSERT INTO event_log (turn_no, first_seq, last_seq, events) \
             SELECT turn_no, $3, $4, $5 FROM turns WHERE session_id = $1 AND request_id = $2 \
             ON CONFLICT DO NOTHING",
        // Only this process reads the file; a release before kinds by number
        // started on it cannot replay the turns stored since (see README).
        kinds: super::KindEncoding::Code,
        ping: "SELECT 1 = 1",
        renew_lease: concat!(
            "UPDATE turns SET lease_expires_at = ",
            db_now!(),
            " + $1 WHERE session_id = $2 AND request_id = $3 AND owner = $4 AND state = 'running'"
        ),
        fail_expired: concat!(
            "UPDATE turns SET state = $1, status_code = $2, status_message = $3, updated_at = $4 \
             WHERE state = 'running' AND lease_expires_at < ",
            db_now!(),
            " RETURNING session_id, request_id"
        ),
        // The one writer connection never waits for another's row lock.
        passed_over: None,
    };
}

impl super::a2a_tasks::A2aTaskSource for SqliteStore {
    fn a2a_tasks(&self) -> Arc<dyn super::a2a_tasks::A2aTasks> {
        self.a2a.clone()
    }
}

super::sql::sql_store!(SqliteStore, sqlx::Sqlite);

#[cfg(test)]
mod tests {
    use std::str::FromStr;
    use std::sync::Arc;

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

    use super::{SqliteStore, attach_event_log, event_log_path};
    use crate::domain::{RequestId, SessionId, TurnKey};
    use crate::store::Store;

    /// A database at `dir/old.db` migrated by `migrations` only (as an older
    /// build left it), with alice's session holding completed turn `r1`:
    /// its URL, a pool on it and the session id.
    async fn older_database(
        dir: &tempfile::TempDir,
        migrations: &[&str],
    ) -> (String, SqlitePool, String) {
        let some = dir.path().join("migrations");
        std::fs::create_dir(&some).unwrap();
        for m in migrations {
            std::fs::copy(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("migrations/sqlite")
                    .join(m),
                some.join(m),
            )
            .unwrap();
        }
        let url = format!("sqlite://{}", dir.path().join("old.db").display());
        // With the event log attached, as an older build (schema 0004 on)
        // had it.
        let at: Arc<str> = event_log_path(&dir.path().join("old.db"))
            .to_str()
            .unwrap()
            .into();
        let old = SqlitePoolOptions::new()
            .max_connections(1)
            .after_connect(move |conn, _| {
                let at = at.clone();
                Box::pin(async move { attach_event_log(conn, at, true).await })
            })
            .connect_with(
                SqliteConnectOptions::from_str(&url)
                    .unwrap()
                    .create_if_missing(true),
            )
            .await
            .unwrap();
        sqlx::migrate::Migrator::new(some.as_path())
            .await
            .unwrap()
            .run(&old)
            .await
            .unwrap();
        let sid = SessionId::generate().to_string();
        sqlx::query(
            "INSERT INTO sessions (id, user_id, created_at, updated_at) VALUES ($1, 'alice', 1, 1)",
        )
        .bind(&sid)
        .execute(&old)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO turns (session_id, request_id, user_text, agent, state, owner, lease_expires_at, \
             status_code, status_message, created_at, updated_at) \
             VALUES ($1, 'r1', 'hi', 'echo', 'completed', 'a', 0, 0, '', 1, 1)",
        )
        .bind(&sid)
        .execute(&old)
        .await
        .unwrap();
        (url, old, sid)
    }

    /// A file written by a build with the per-event layout (schema 0001)
    /// opens with its whole log, now in batches, and the answer in history.
    #[tokio::test]
    async fn an_event_log_in_the_per_event_layout_is_moved_into_batches_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let (url, old, sid) = older_database(&dir, &["0001_sessions_turns_events.sql"]).await;
        for (seq, kind, text) in [
            (0, "partial_text", "Hel"),
            (1, "partial_text", "lo"),
            (2, "final_answer", "Hello"),
        ] {
            sqlx::query("INSERT INTO events VALUES ($1, 'r1', $2, $3, 'echo', $4, '', '', '', 7)")
                .bind(&sid)
                .bind(seq)
                .bind(kind)
                .bind(text)
                .execute(&old)
                .await
                .unwrap();
        }
        old.close().await;

        let store = SqliteStore::open(&url).await.unwrap();
        let key = r1_of(&sid);
        let events = store.events_after(&key, None, 10).await.unwrap();
        let texts: Vec<_> = events
            .iter()
            .map(|e| (e.seq, e.event.text.as_str()))
            .collect();
        assert_eq!(texts, [(0, "Hel"), (1, "lo"), (2, "Hello")]);
        let history = store.history(key.session_id, 10).await.unwrap();
        assert_eq!(history[0].answer, "Hello");
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM events")
            .fetch_one(&store.read)
            .await
            .unwrap();
        assert_eq!(left, 0, "the old rows are gone");
    }

    /// A group with more rows than one statement carries is written in
    /// several statements of one transaction, every row in place.
    #[tokio::test]
    async fn a_group_larger_than_one_statement_is_written_whole() {
        use crate::agent::{Event, EventKind};
        use crate::store::{EncodedEvent, SeqEvent};

        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("g.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let key = claimed_turn(&store, "r1").await;
        let n = super::ROWS_PER_STATEMENT as u64 * 2 + 3;
        let group: Vec<_> = (0..n)
            .map(|seq| {
                let e = EncodedEvent::of(&SeqEvent {
                    seq,
                    event: Event {
                        kind: EventKind::PartialText,
                        author: "echo".into(),
                        text: format!("t{seq}"),
                        tool_name: String::new(),
                        tool_call_id: String::new(),
                        payload_json: String::new(),
                        created_unix_nanos: 1,
                    },
                });
                crate::store::sql::PendingBatch::new(
                    &key,
                    vec![e],
                    tokio::sync::oneshot::channel().0,
                )
            })
            .collect();
        SqliteStore::write_group(&store.write, &group)
            .await
            .unwrap();
        let events = store
            .events_after(&key, None, n as usize + 10)
            .await
            .unwrap();
        let texts: Vec<_> = events.iter().map(|e| e.event.text.clone()).collect();
        let want: Vec<_> = (0..n).map(|s| format!("t{s}")).collect();
        assert_eq!(texts, want);
    }

    async fn count(pool: &SqlitePool, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    /// Waits (10 s at most) until `sql` counts `want`: a deleted session's
    /// event log goes after the delete has answered.
    async fn count_comes_to(pool: &SqlitePool, sql: &str, want: i64) {
        let mut last = 0;
        for _ in 0..1000 {
            last = count(pool, sql).await;
            if last == want {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("{sql}: {last}, not {want}");
    }

    /// A running turn `rid` of a new session of alice's.
    async fn claimed_turn(store: &SqliteStore, rid: &str) -> TurnKey {
        let session = store
            .create_session(&crate::domain::UserId::parse("alice").unwrap())
            .await
            .unwrap();
        let key = TurnKey {
            session_id: session.id,
            request_id: RequestId::parse(rid).unwrap(),
        };
        store
            .claim_turn(&crate::store::NewTurn {
                key: key.clone(),
                user_text: "hi".into(),
                agent: "echo".into(),
                owner: "a".into(),
                lease: std::time::Duration::from_secs(5),
            })
            .await
            .unwrap();
        key
    }

    /// Appends `n` events to a new turn `rid` of a new session of alice's.
    async fn turn_with_events(store: &SqliteStore, rid: &str, n: u64) -> TurnKey {
        use crate::agent::Event;
        use crate::store::SeqEvent;
        let key = claimed_turn(store, rid).await;
        let events: Vec<_> = (0..n)
            .map(|seq| SeqEvent {
                seq,
                event: Event::partial("echo", format!("t{seq}")),
            })
            .collect();
        store.append_events(&key, events).await.unwrap();
        key
    }

    /// A Run's read of a session this store created, and of its history,
    /// comes from memory: a change made behind the store's back (by another
    /// connection, which the store does not allow in use) does not show
    /// there, while the database reads see it. A session the store did not
    /// create is read from the database once, then held too.
    #[tokio::test]
    async fn a_runs_read_of_a_session_created_here_is_served_from_memory() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let key = claimed_turn(&store, "r1").await;
        let done = crate::store::TurnOutcome {
            state: crate::store::TurnState::Completed,
            code: 0,
            message: String::new(),
        };
        store
            .finish_turn(&key, &done, Some("cached".into()))
            .await
            .unwrap();
        let other = SqlitePool::connect(&url).await.unwrap();
        sqlx::query("UPDATE turns SET answer = 'changed'")
            .execute(&other)
            .await
            .unwrap();
        let outside = SessionId::generate().to_string();
        sqlx::query(
            "INSERT INTO sessions (id, user_id, created_at, updated_at) VALUES ($1, 'bob', 1, 1)",
        )
        .bind(&outside)
        .execute(&other)
        .await
        .unwrap();

        let (_, held) = store
            .session_with_history(key.session_id, 5)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(held[0].answer, "cached");
        let read = store.history(key.session_id, 5).await.unwrap();
        assert_eq!(read[0].answer, "changed");
        let outside = SessionId::parse(&outside).unwrap();
        let (s, _) = store
            .session_with_history(outside, 5)
            .await
            .unwrap()
            .expect("read from the database");
        assert_eq!(s.user_id.as_str(), "bob");
        sqlx::query("UPDATE sessions SET user_id = 'carol'")
            .execute(&other)
            .await
            .unwrap();
        let (s, _) = store
            .session_with_history(outside, 5)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(s.user_id.as_str(), "bob", "held since the first read");
    }

    /// A full disk (here, the event log held to its size) fails a commit
    /// as unavailable, not as a bug: the caller is told to retry, its turn
    /// ends UNAVAILABLE, and once there is room again commits go on. The
    /// failed commit stored nothing.
    #[tokio::test]
    async fn a_full_disk_fails_commits_as_unavailable_until_there_is_room() {
        use crate::agent::Event;
        use crate::store::{SeqEvent, StoreError};
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let key = claimed_turn(&store, "r1").await;
        let batch = |from: u64| -> Vec<SeqEvent> {
            (from..from + 100)
                .map(|seq| SeqEvent {
                    seq,
                    event: Event::partial("echo", "x".repeat(1000)),
                })
                .collect()
        };
        store.append_events(&key, batch(0)).await.unwrap();
        let pages = count(&store.write, "PRAGMA ev.page_count").await;
        sqlx::query(&format!("PRAGMA ev.max_page_count = {pages}"))
            .execute(&store.write)
            .await
            .unwrap();
        let full = store.append_events(&key, batch(100)).await;
        assert!(matches!(full, Err(StoreError::Unavailable(_))), "{full:?}");
        assert_eq!(
            count(&store.read, "SELECT MAX(last_seq) FROM ev.event_log").await,
            99,
            "nothing of the failed commit stored"
        );
        sqlx::query("PRAGMA ev.max_page_count = 1073741823")
            .execute(&store.write)
            .await
            .unwrap();
        store.append_events(&key, batch(100)).await.unwrap();
        assert_eq!(
            count(&store.read, "SELECT MAX(last_seq) FROM ev.event_log").await,
            199
        );
    }

    /// Commits of 50 KB of one turn's events each (a busy turn's share of
    /// a group commit) are stored in rows that pack the event log's pages:
    /// the file holds at most 1.2 bytes per byte of events (1.31 with a row
    /// per commit, one to a page).
    #[tokio::test]
    async fn the_event_log_packs_its_pages_whatever_the_size_of_a_commit() {
        use crate::agent::Event;
        use crate::store::SeqEvent;
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("a.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let key = claimed_turn(&store, "r1").await;
        let mut seq = 0;
        for _ in 0..150 {
            let events: Vec<_> = (0..400)
                .map(|_| {
                    seq += 1;
                    SeqEvent {
                        seq: seq - 1,
                        event: Event::partial("echo", "x".repeat(90)),
                    }
                })
                .collect();
            store.append_events(&key, events).await.unwrap();
        }
        let stored = count(
            &store.read,
            "SELECT SUM(last_seq - first_seq + 1) FROM ev.event_log",
        )
        .await;
        assert_eq!(stored, 60_000);
        let data = count(&store.read, "SELECT SUM(LENGTH(events)) FROM ev.event_log").await;
        let file = count(&store.write, "PRAGMA ev.page_count").await * super::EVENT_LOG_PAGE_SIZE;
        let per_byte = file as f64 / data as f64;
        assert!(
            per_byte <= 1.2,
            "{per_byte:.2} bytes of file per byte of events"
        );
    }

    /// The event log is its own file beside the database, with 64 KiB
    /// pages, while the database keeps SQLite's default 4 KiB pages; the
    /// events are written there and read back from there.
    #[tokio::test]
    async fn the_event_log_is_a_file_of_its_own_with_large_pages() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("a.db");
        let store = SqliteStore::open(&format!("sqlite://{}", db.display()))
            .await
            .unwrap();
        assert!(dir.path().join("a.db-events").is_file());
        assert_eq!(super::event_log_path(&db), dir.path().join("a.db-events"));
        assert_eq!(
            count(&store.write, "PRAGMA ev.page_size").await,
            super::EVENT_LOG_PAGE_SIZE
        );
        assert_eq!(count(&store.write, "PRAGMA main.page_size").await, 4096);
        let mode: String = sqlx::query_scalar("PRAGMA ev.journal_mode")
            .fetch_one(&store.write)
            .await
            .unwrap();
        assert_eq!(mode, "persist");
        let mode: String = sqlx::query_scalar("PRAGMA main.journal_mode")
            .fetch_one(&store.write)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        assert_eq!(
            count(
                &store.read,
                "SELECT COUNT(*) FROM main.sqlite_schema WHERE name = 'event_batches'"
            )
            .await,
            0,
            "no event table left in the database file"
        );
        let key = turn_with_events(&store, "r1", 5).await;
        assert_eq!(
            count(&store.read, "SELECT COUNT(*) FROM ev.event_log").await,
            1
        );
        let got = store.events_after(&key, Some(1), 10).await.unwrap();
        assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3, 4]);
    }

    /// Deleting a session or pruning its turns deletes their batches from
    /// the event log too (no foreign key reaches across the files); a
    /// running turn's events stay.
    #[tokio::test]
    async fn deleted_and_pruned_turns_leave_nothing_in_the_event_log() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("d.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let done = crate::store::TurnOutcome {
            state: crate::store::TurnState::Completed,
            code: 0,
            message: String::new(),
        };
        let deleted = turn_with_events(&store, "r1", 3).await;
        let pruned = turn_with_events(&store, "r2", 3).await;
        let running = turn_with_events(&store, "r3", 3).await;
        for k in [&deleted, &pruned] {
            store
                .finish_turn(k, &done, Some("ok".into()))
                .await
                .unwrap();
        }
        let batches = "SELECT COUNT(*) FROM ev.event_log";
        assert_eq!(count(&store.read, batches).await, 3);
        assert_eq!(
            store.delete_session(deleted.session_id).await.unwrap(),
            super::super::Deletion::Deleted
        );
        count_comes_to(&store.read, batches, 2).await;
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        assert_eq!(store.prune(later, 10).await.unwrap(), 1);
        assert_eq!(count(&store.read, batches).await, 1);
        assert_eq!(
            store.events_after(&running, None, 10).await.unwrap().len(),
            3
        );
        assert!(
            store
                .events_after(&pruned, None, 10)
                .await
                .unwrap()
                .is_empty()
        );
    }

    /// Stores turn `r1` of session `sid` as two batches of two events in
    /// `table`, an older schema's `event_batches`; returns the events.
    async fn older_batches(
        old: &SqlitePool,
        sid: &str,
        table: &str,
    ) -> Vec<crate::store::SeqEvent> {
        let events: Vec<_> = (0..4u64)
            .map(|seq| crate::store::SeqEvent {
                seq,
                event: crate::agent::Event::partial("echo", format!("t{seq}")),
            })
            .collect();
        for (first, rows) in [(0i64, &events[..2]), (2, &events[2..])] {
            sqlx::query(&format!(
                "INSERT INTO {table} VALUES ($1, 'r1', $2, $3, $4)"
            ))
            .bind(sid)
            .bind(first)
            .bind(first + 1)
            .bind(crate::store::codec::encode(
                rows,
                crate::store::KindEncoding::Name,
            ))
            .execute(old)
            .await
            .unwrap();
        }
        events
    }

    /// A database at the schema of the first `migrations` migrations, with
    /// turn `r1` stored as two batches in that schema's `table`
    /// ([`older_batches`]), opened by this build: the store, the turn's key
    /// and its events.
    async fn opened_with_batches_of(
        dir: &tempfile::TempDir,
        migrations: usize,
        table: &str,
    ) -> (SqliteStore, TurnKey, Vec<crate::store::SeqEvent>) {
        const ALL: [&str; 4] = [
            "0001_sessions_turns_events.sql",
            "0002_event_batches.sql",
            "0003_a2a_tasks.sql",
            "0004_event_log_file.sql",
        ];
        let (url, old, sid) = older_database(dir, &ALL[..migrations]).await;
        let events = older_batches(&old, &sid, table).await;
        old.close().await;
        let store = SqliteStore::open(&url).await.unwrap();
        (store, r1_of(&sid), events)
    }

    /// The key of turn `r1` of session `sid`.
    fn r1_of(sid: &str) -> TurnKey {
        TurnKey {
            session_id: SessionId::parse(sid).unwrap(),
            request_id: RequestId::parse("r1").unwrap(),
        }
    }

    /// A database whose event log is still in the database file (schema
    /// 0002) opens with its log moved to the event log file, every event
    /// readable.
    #[tokio::test]
    async fn an_event_log_inside_the_database_file_is_moved_to_its_own_file_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let (store, key, events) = opened_with_batches_of(&dir, 3, "event_batches").await;
        assert_eq!(store.events_after(&key, None, 10).await.unwrap(), events);
        assert_eq!(
            count(&store.read, "SELECT COUNT(*) FROM ev.event_log").await,
            2
        );
    }

    /// A database whose event log is keyed by session and request (schema
    /// 0004) opens with every batch keyed by its turn's number, readable as
    /// before; turns claimed after it are numbered after the old ones, in
    /// claim order, and their batches go under their numbers.
    #[tokio::test]
    async fn an_event_log_keyed_by_session_and_request_is_keyed_by_turn_number_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let (store, key, events) = opened_with_batches_of(&dir, 4, "ev.event_batches").await;
        assert_eq!(
            store.events_after(&key, Some(0), 10).await.unwrap(),
            events[1..]
        );
        assert_eq!(
            count(
                &store.read,
                "SELECT COUNT(*) FROM ev.sqlite_schema WHERE name = 'event_batches'"
            )
            .await,
            0
        );
        let old_no = count(
            &store.read,
            "SELECT turn_no FROM turns WHERE request_id = 'r1'",
        )
        .await;
        assert_eq!(
            count(&store.read, "SELECT COUNT(*) FROM ev.event_log WHERE turn_no = (SELECT turn_no FROM turns WHERE request_id = 'r1')").await,
            2
        );
        let a = turn_with_events(&store, "r2", 3).await;
        let b = turn_with_events(&store, "r3", 3).await;
        let no = |k: &TurnKey| {
            format!(
                "SELECT turn_no FROM turns WHERE session_id = '{}' AND request_id = '{}'",
                k.session_id,
                k.request_id.as_str()
            )
        };
        let (a_no, b_no) = (
            count(&store.read, &no(&a)).await,
            count(&store.read, &no(&b)).await,
        );
        assert!(old_no < a_no && a_no < b_no, "{old_no} {a_no} {b_no}");
        assert_eq!(
            count(
                &store.read,
                &format!(
                    "SELECT COUNT(*) FROM ev.event_log WHERE turn_no = ({})",
                    no(&b)
                )
            )
            .await,
            1
        );
        assert_eq!(store.events_after(&b, None, 10).await.unwrap().len(), 3);
        assert_eq!(store.events_after(&key, None, 10).await.unwrap(), events);
    }

    /// Opens `dir/name` and stores a turn's events in it, closes it,
    /// deletes the files named in `gone` and opens it again: the error.
    async fn reopened_without(dir: &tempfile::TempDir, name: &str, gone: &[&str]) -> String {
        let url = format!("sqlite://{}", dir.path().join(name).display());
        let store = SqliteStore::open(&url).await.unwrap();
        turn_with_events(&store, "r1", 2).await;
        store.write.close().await;
        store.read.close().await;
        drop(store);
        for f in gone {
            let _ = std::fs::remove_file(dir.path().join(f));
        }
        match SqliteStore::open(&url).await {
            Ok(_) => panic!("opened {name} without {gone:?}"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// A database whose event log file is gone does not open as if its
    /// turns had no events: the error names the file.
    #[tokio::test]
    async fn a_missing_event_log_fails_the_open_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let gone = ["m.db-events", "m.db-events-wal", "m.db-events-shm"];
        let err = reopened_without(&dir, "m.db", &gone).await;
        assert!(err.contains("m.db-events"), "{err}");
        assert!(err.contains("missing"), "{err}");
    }

    /// A new database beside an event log left by a deleted one does not
    /// start (it would mix the old log into the new turns' keys): the
    /// error names the file to move away.
    #[tokio::test]
    async fn an_event_log_left_by_a_deleted_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = reopened_without(&dir, "n.db", &["n.db", "n.db-wal", "n.db-shm"]).await;
        assert!(err.contains("n.db-events"), "{err}");
        assert!(err.contains("never wrote"), "{err}");
    }

    /// The writer checkpoints the database at its raised bound, not
    /// SQLite's 1,000 pages, and the event log's journal keeps at most
    /// 4 MiB on disk between commits.
    #[tokio::test]
    async fn the_writer_checkpoints_at_its_raised_bound() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("w.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let pages: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&store.write)
            .await
            .unwrap();
        assert_eq!(pages, i64::from(super::WRITER_CHECKPOINT_PAGES));
        let limit: i64 = sqlx::query_scalar("PRAGMA ev.journal_size_limit")
            .fetch_one(&store.write)
            .await
            .unwrap();
        assert_eq!(limit, 4 * 1024 * 1024);
    }

    /// A commit writes the event log's new pages into its file, once, and
    /// leaves no WAL beside it: by the time `append_events` returns, the
    /// file holds the events.
    #[tokio::test]
    async fn a_commit_writes_the_event_log_into_its_file() {
        use crate::agent::Event;
        use crate::store::SeqEvent;
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("c.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let key = turn_with_events(&store, "r1", 0).await;
        let file = dir.path().join("c.db-events");
        let before = std::fs::metadata(&file).unwrap().len();
        // About 2 MB: 32 of the log's pages.
        let events: Vec<_> = (0..2048u64)
            .map(|seq| SeqEvent {
                seq,
                event: Event::partial("echo", "x".repeat(1000)),
            })
            .collect();
        store.append_events(&key, events).await.unwrap();
        // At least half of it: the file can reuse a few free pages (those of
        // the table migration 0005 replaced).
        let size = std::fs::metadata(&file).unwrap().len();
        assert!(
            size >= before + 1024 * 1024,
            "the event log file is {size} bytes"
        );
        assert!(!dir.path().join("c.db-events-wal").exists());
        assert_eq!(
            store
                .events_after(&key, Some(2000), 100)
                .await
                .unwrap()
                .len(),
            47
        );
    }

    /// An event log a release before the rollback journal left in WAL mode,
    /// with events only in its WAL (the process was killed), opens in the
    /// journal's mode with those events in the file and the WAL gone.
    #[tokio::test]
    async fn an_event_log_left_in_wal_mode_is_moved_to_the_journal_with_its_events() {
        use sqlx::ConnectOptions as _;
        let (old, new) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let url = |d: &tempfile::TempDir| format!("sqlite://{}", d.path().join("k.db").display());
        let store = SqliteStore::open(&url(&old)).await.unwrap();
        let key = turn_with_events(&store, "r1", 3).await;
        store.close().await;
        drop(store);
        // The previous release's mode, and three more events that only its
        // WAL holds when the files are copied: a process killed mid-run.
        let events = old.path().join("k.db-events");
        let mut log = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&events)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            .connect()
            .await
            .unwrap();
        let later: Vec<_> = (3..6u64)
            .map(|seq| crate::store::SeqEvent {
                seq,
                event: crate::agent::Event::partial("echo", format!("t{seq}")),
            })
            .collect();
        sqlx::query(
            "INSERT INTO event_log (turn_no, first_seq, last_seq, events) \
             SELECT turn_no, 3, 5, $1 FROM event_log LIMIT 1",
        )
        .bind(super::super::codec::encode(
            &later,
            super::super::codec::KindEncoding::Code,
        ))
        .execute(&mut log)
        .await
        .unwrap();
        assert!(old.path().join("k.db-events-wal").exists());
        for name in ["k.db", "k.db-events", "k.db-events-wal", "k.db-events-shm"] {
            std::fs::copy(old.path().join(name), new.path().join(name)).unwrap();
        }
        drop(log);
        let store = SqliteStore::open(&url(&new)).await.unwrap();
        let mode: String = sqlx::query_scalar("PRAGMA ev.journal_mode")
            .fetch_one(&store.write)
            .await
            .unwrap();
        assert_eq!(mode, "persist");
        assert!(!new.path().join("k.db-events-wal").exists());
        let texts: Vec<_> = store
            .events_after(&key, None, 100)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event.text)
            .collect();
        assert_eq!(texts, ["t0", "t1", "t2", "t3", "t4", "t5"]);
    }

    /// A file whose tables are there without their migrations recorded (a
    /// second process opening a new file at the same moment, or another
    /// application's file) is refused with what to look for.
    #[tokio::test]
    async fn a_migration_that_finds_its_tables_already_there_says_why_that_may_be() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        let other = SqlitePool::connect_with(
            SqliteConnectOptions::from_str(&url)
                .unwrap()
                .create_if_missing(true),
        )
        .await
        .unwrap();
        sqlx::query("CREATE TABLE sessions (id TEXT)")
            .execute(&other)
            .await
            .unwrap();
        other.close().await;
        let err = match SqliteStore::open(&url).await {
            Ok(_) => panic!("migrated over a table it did not create"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains("already exists"), "{err}");
        assert!(
            err.contains("another process is opening the same file"),
            "{err}"
        );
    }

    /// A2A tasks stored before tasks had owners belong, once migrated, to
    /// the user of their session, or to the anonymous A2A user when they
    /// never named one; each user lists only its own.
    #[tokio::test]
    async fn a2a_tasks_stored_before_owners_belong_to_their_sessions_user() {
        use crate::domain::UserId;
        use crate::store::a2a_tasks::A2A_USER;
        let dir = tempfile::tempdir().unwrap();
        const BEFORE_OWNERS: [&str; 6] = [
            "0001_sessions_turns_events.sql",
            "0002_event_batches.sql",
            "0003_a2a_tasks.sql",
            "0004_event_log_file.sql",
            "0005_event_log_by_turn_number.sql",
            "0006_claim_touches_session.sql",
        ];
        let (url, old, sid) = older_database(&dir, &BEFORE_OWNERS).await;
        for (id, session) in [("t-alice", Some(sid.as_str())), ("t-refused", None)] {
            let task = serde_json::json!({
                "id": id, "contextId": "c", "status": {"state": "TASK_STATE_COMPLETED"}
            });
            sqlx::query(
                "INSERT INTO a2a_tasks (id, context_id, session_id, state, terminal, status_at, task_json, version, created_at, updated_at) \
                 VALUES ($1, 'c', $2, 'TASK_STATE_COMPLETED', 1, 1, $3, 1, 1, 1)",
            )
            .bind(id)
            .bind(session)
            .bind(task.to_string())
            .execute(&old)
            .await
            .unwrap();
        }
        old.close().await;
        let store = SqliteStore::open(&url).await.unwrap();
        let tasks = crate::store::a2a_tasks::A2aTaskSource::a2a_tasks(&store);
        let (alice, anonymous) = (
            UserId::parse("alice").unwrap(),
            UserId::parse(A2A_USER).unwrap(),
        );
        assert_eq!(tasks.owner("t-alice").await.unwrap(), Some(alice.clone()));
        assert_eq!(
            tasks.owner("t-refused").await.unwrap(),
            Some(anonymous.clone())
        );
        assert_eq!(tasks.owner("t-none").await.unwrap(), None);
        let req = a2a::ListTasksRequest {
            context_id: None,
            status: None,
            page_size: None,
            page_token: None,
            history_length: None,
            status_timestamp_after: None,
            include_artifacts: None,
            tenant: None,
        };
        for (user, id) in [(&alice, "t-alice"), (&anonymous, "t-refused")] {
            let page = tasks.list_for(user, &req).await.unwrap();
            let ids: Vec<_> = page.tasks.iter().map(|t| t.id.as_str()).collect();
            assert_eq!((ids, page.total_size), (vec![id], 1), "{user}");
        }
        // A row written without an owner (by an older release, during a
        // rolling upgrade of replicas sharing a database) is its session's
        // user's.
        sqlx::query(
            "INSERT INTO a2a_tasks (id, context_id, session_id, state, terminal, status_at, task_json, version, created_at, updated_at) \
             VALUES ('t-older', 'c', $1, 'TASK_STATE_WORKING', 0, 2, $2, 1, 2, 2)",
        )
        .bind(&sid)
        .bind(
            serde_json::json!({"id": "t-older", "contextId": "c", "status": {"state": "TASK_STATE_WORKING"}})
                .to_string(),
        )
        .execute(&store.write)
        .await
        .unwrap();
        assert_eq!(tasks.owner("t-older").await.unwrap(), Some(alice.clone()));
        let page = tasks.list_for(&alice, &req).await.unwrap();
        let ids: Vec<_> = page.tasks.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["t-older", "t-alice"]);
        assert_eq!(
            tasks.list_for(&anonymous, &req).await.unwrap().total_size,
            1
        );
    }

    /// Holds writes to the main file of the database at `url` (a
    /// transaction of another connection) until the connection is rolled
    /// back; the event log's file stays writable.
    async fn hold_main(url: &str) -> sqlx::SqliteConnection {
        use sqlx::Connection as _;
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut c)
            .await
            .unwrap();
        c
    }

    /// Log lines kept in memory, for what the store logs.
    #[derive(Clone, Default)]
    struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Logs {
        /// Captures the logs at info and above of everything this thread
        /// runs for as long as the guard lives.
        fn capture(&self) -> tracing::subscriber::DefaultGuard {
            let logs = self.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .with_writer(move || logs.clone())
                .finish();
            tracing::subscriber::set_default(subscriber)
        }

        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
        }
    }

    /// A new session of alice's and turn r1 in it, not yet claimed.
    async fn new_turn_of_alice(store: &SqliteStore) -> crate::store::NewTurn {
        let session = store
            .create_session(&crate::domain::UserId::parse("alice").unwrap())
            .await
            .unwrap();
        crate::store::NewTurn {
            key: TurnKey {
                session_id: session.id,
                request_id: RequestId::parse("r1").unwrap(),
            },
            user_text: "hi".into(),
            agent: "echo".into(),
            owner: "a".into(),
            lease: std::time::Duration::from_secs(60),
        }
    }

    /// The store's claimer runs on a thread of its own: a claim is made
    /// and answered while the runtime that opened the store is busy (here,
    /// its one thread blocked), as the server's is with its streams.
    #[tokio::test(flavor = "current_thread")]
    async fn a_claim_is_answered_while_the_runtime_that_opened_the_store_is_busy() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("busy.db").display());
        let store = Arc::new(SqliteStore::open(&url).await.unwrap());
        // A connection goes back to its pool on the runtime that used it:
        // what opening the store did here gives the writer back first.
        for _ in 0..500 {
            if store.write.num_idle() == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(store.write.num_idle(), 1, "the writer is back in its pool");
        let (answer, answered) = std::sync::mpsc::channel();
        // The caller has a runtime of its own (a connection it used goes
        // back to the pool on its runtime).
        let caller = {
            let store = store.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                answer
                    .send(rt.block_on(async {
                        let turn = new_turn_of_alice(&store).await;
                        store.claim_turn(&turn).await
                    }))
                    .unwrap();
            })
        };
        // This runtime's one thread waits here, running none of its tasks.
        let claim = answered
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the claim is answered while the store's runtime is blocked");
        assert_eq!(claim.unwrap(), crate::store::Claim::New);
        caller.join().unwrap();
    }

    /// A claim whose statement was cut off by the group timeout (the
    /// database slow to answer) but that SQLite's thread wrote all the same
    /// is withdrawn: its caller was told UNAVAILABLE, retry with the same
    /// request id, and the retry claims the turn afresh instead of finding
    /// a running turn nobody runs, to follow until its lease ends it.
    #[tokio::test]
    async fn a_claim_cut_off_by_the_group_timeout_but_written_is_withdrawn() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("cut.db").display());
        // The claimer runs on a thread of its own, started with the store:
        // it logs under this capture, and its statement is cut off well
        // within SQLite's busy timeout (both taken from this thread then).
        let logs = Logs::default();
        let _capture = logs.capture();
        crate::store::sql::GROUP_TIMEOUT_HERE.set(Some(std::time::Duration::from_secs(2)));
        let store = SqliteStore::open(&url).await.unwrap();
        let turn = new_turn_of_alice(&store).await;
        let mut held = hold_main(&url).await;
        let cut = store.claim_turn(&turn).await;
        assert!(
            matches!(cut, Err(crate::store::StoreError::Unavailable(_))),
            "{cut:?}"
        );
        // SQLite's thread writes the claim once the lock is free, and the
        // withdrawal deletes it. (The row is absent before the write too:
        // only the withdrawal's log line says it was written and deleted.)
        sqlx::query("ROLLBACK").execute(&mut held).await.unwrap();
        let withdrawal = "a claim whose statement was cut off was written all the same; \
                          the claim is released for a retry";
        let mut withdrawn = false;
        for _ in 0..500 {
            if logs.text().contains(withdrawal) {
                withdrawn = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(
            withdrawn,
            "the claim written after it was cut off is withdrawn: {}",
            logs.text()
        );
        assert!(store.get_turn(&turn.key).await.unwrap().is_none());
        assert_eq!(count(&store.write, "SELECT COUNT(*) FROM turns").await, 0);
        assert_eq!(
            store.claim_turn(&turn).await.unwrap(),
            crate::store::Claim::New,
            "the retry claims the turn afresh"
        );
    }

    /// Writes `rows` empty event rows for turn number `turn_no`.
    async fn fill_event_log(store: &SqliteStore, turn_no: i64, rows: i64) {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < $2) \
             INSERT INTO event_log (turn_no, first_seq, last_seq, events) SELECT $1, i, i, x'' FROM n",
        )
        .bind(turn_no)
        .bind(rows)
        .execute(&store.write)
        .await
        .unwrap();
    }

    /// A turn that takes the number of a deleted session's turn (one with
    /// no events, the highest) while that session's log is still being
    /// deleted keeps its events: the chunks skip numbers that name a turn.
    #[tokio::test]
    async fn a_turn_numbered_like_a_deleted_one_keeps_its_events_through_the_delete() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("reuse.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        // A session whose first turn has a long log, and whose second (the
        // highest number) has none: once the session's turns are deleted,
        // the next claim anywhere takes that second turn's number, while
        // the first's log is still being deleted.
        let big = turn_with_events(&store, "r1", 1).await;
        let second = TurnKey {
            session_id: big.session_id,
            request_id: RequestId::parse("r2").unwrap(),
        };
        store
            .claim_turn(&crate::store::NewTurn {
                key: second.clone(),
                user_text: "hi".into(),
                agent: "echo".into(),
                owner: "a".into(),
                lease: std::time::Duration::from_secs(60),
            })
            .await
            .unwrap();
        let first_no = count(
            &store.write,
            &format!(
                "SELECT turn_no FROM turns WHERE session_id = '{}' AND request_id = 'r1'",
                big.session_id
            ),
        )
        .await;
        let rows = 16 * super::super::sql::DELETE_EVENT_ROWS as i64;
        fill_event_log(&store, first_no, rows).await;
        // The second turn's end cancels nothing: the delete refuses a
        // running turn.
        let done = crate::store::TurnOutcome {
            state: crate::store::TurnState::Completed,
            code: 0,
            message: String::new(),
        };
        assert!(
            store
                .finish_turn(&big, &done, Some("a".into()))
                .await
                .unwrap()
        );
        assert!(
            store
                .finish_turn(&second, &done, Some("b".into()))
                .await
                .unwrap()
        );

        let mut delete = Box::pin(store.delete_session(big.session_id));
        assert!(futures::poll!(delete.as_mut()).is_pending());
        let newcomer = async {
            let key = claimed_turn(&store, "r9").await;
            let events: Vec<_> = (0..3)
                .map(|seq| crate::store::SeqEvent {
                    seq,
                    event: crate::agent::Event::partial("echo", format!("n{seq}")),
                })
                .collect();
            store.append_events(&key, events).await.unwrap();
            key
        };
        let (deleted, newcomer) = tokio::join!(delete, newcomer);
        assert_eq!(deleted.unwrap(), crate::store::Deletion::Deleted);
        assert_eq!(
            store.events_after(&newcomer, None, 10).await.unwrap().len(),
            3,
            "the new turn's events outlive the delete of the turn that had its number"
        );
    }

    /// A session's event log is deleted after the session, a chunk of
    /// rows at a time, each its own transaction: a claim waiting for the
    /// one writer meanwhile is written between them, not after the whole
    /// log is gone (which held the writer for seconds on a large session,
    /// failing every claim and commit waiting for it). The session, its
    /// turns and their log are all gone at the end.
    #[tokio::test]
    async fn a_sessions_event_log_is_deleted_in_chunks_that_let_other_writes_in() {
        use crate::store::Deletion;
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("del.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let big = turn_with_events(&store, "r1", 1).await;
        let done = crate::store::TurnOutcome {
            state: crate::store::TurnState::Completed,
            code: 0,
            message: String::new(),
        };
        assert!(
            store
                .finish_turn(&big, &done, Some("a".into()))
                .await
                .unwrap()
        );
        let no = count(
            &store.write,
            &format!(
                "SELECT turn_no FROM turns WHERE session_id = '{}'",
                big.session_id
            ),
        )
        .await;
        let rows = 4 * super::super::sql::DELETE_EVENT_ROWS as i64;
        fill_event_log(&store, no, rows).await;
        // What is left of the session's log as each turn is claimed (the
        // writer's one connection keeps these temporary objects).
        sqlx::raw_sql(&format!(
            "CREATE TEMP TABLE left_at_claim (n INTEGER); \
             CREATE TEMP TRIGGER count_left AFTER INSERT ON main.turns BEGIN \
               INSERT INTO left_at_claim SELECT COUNT(*) FROM event_log WHERE turn_no = {no}; END;"
        ))
        .execute(&store.write)
        .await
        .unwrap();
        let other = store
            .create_session(&crate::domain::UserId::parse("bob").unwrap())
            .await
            .unwrap();
        let claim = crate::store::NewTurn {
            key: TurnKey {
                session_id: other.id,
                request_id: RequestId::parse("r1").unwrap(),
            },
            user_text: "hi".into(),
            agent: "echo".into(),
            owner: "a".into(),
            lease: std::time::Duration::from_secs(60),
        };
        let mut delete = Box::pin(store.delete_session(big.session_id));
        assert!(futures::poll!(delete.as_mut()).is_pending());
        let (deleted, other) = tokio::join!(delete, store.claim_turn(&claim));
        assert_eq!(deleted.unwrap(), Deletion::Deleted);
        assert_eq!(other.unwrap(), crate::store::Claim::New);
        let left = count(&store.write, "SELECT n FROM temp.left_at_claim").await;
        assert!(
            left > 0,
            "the claim was written before the log was all gone"
        );
        count_comes_to(&store.write, "SELECT COUNT(*) FROM event_log", 0).await;
        assert!(store.get_session(big.session_id).await.unwrap().is_none());
        assert!(store.get_turn(&big).await.unwrap().is_none());
    }
}
