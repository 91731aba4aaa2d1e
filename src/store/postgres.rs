//! The shared store for several replicas (`--store postgres://...`): any
//! replica continues any session, and the turn side table is shared, so a
//! retried request_id that lands on another replica is still never run twice
//! (the claim is `INSERT ... ON CONFLICT DO NOTHING`). Replicas follow each
//! other's turns by short polling of the event log.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

/// The clock leases are written and judged by, in microseconds: the
/// database's, which every replica shares (their own may disagree).
/// `clock_timestamp()`, not `now()`: a transaction's start can be long past.
macro_rules! db_now {
    () => {
        "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::int8"
    };
}

/// How long a query waits for a connection: short, so that a lost database
/// turns into UNAVAILABLE quickly instead of a hanging call.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);
/// The statements' pool (reads, sessions, leases, A2A tasks); the claimers
/// and the committers have [`COMMITTERS`] connections each of their own,
/// and the listener one.
const MAX_CONNECTIONS: u32 = 8;
/// Event groups written at once: each waits for its commit's WAL flush.
const COMMITTERS: usize = 4;
/// A pooled connection idle for less than this is handed out without a
/// ping. sqlx pings every connection as it comes back to the pool (and
/// closes it if that fails), so such a connection answered moments ago;
/// pinging it again on the way out put a second round trip in front of
/// every statement under load. One idle for longer is pinged first, so a
/// connection the server dropped meanwhile (a restart, an idle timeout) is
/// replaced instead of failing a statement. (HikariCP skips its check the
/// same way, for connections used in the last 500 ms.)
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

pub struct PostgresStore {
    read: PgPool,
    /// The same pool as `read`: PostgreSQL serialises writers itself.
    write: PgPool,
    a2a: Arc<super::a2a_tasks::PostgresTasks>,
    /// The committer's queue: event batches are written through it.
    commits: tokio::sync::mpsc::Sender<super::sql::PendingBatch>,
    /// The committers' pace, which turns' writers hurry.
    pace: Arc<super::sql::Pace>,
    /// The claimers' queue: turns are claimed through it.
    claims: tokio::sync::mpsc::Sender<super::sql::PendingClaim>,
    /// Holds the claimers and the committers back, for tests.
    gate: super::sql::QueueGate,
    /// The sessions this replica created or read, kept with their count of
    /// claims: any replica changes any session, so a history served from
    /// here is checked once the Run's claim says whether another replica
    /// claimed a turn in the session since ([`SessionCache::shared`](super::session_cache::SessionCache::shared)).
    /// Always `Some`.
    sessions: Option<Arc<super::session_cache::SessionCache>>,
    /// The readers' queue: a Run's read of its session goes through it.
    reads: tokio::sync::mpsc::Sender<PendingRead>,
    /// Cancels announced on [`CANCEL_CHANNEL`], as [`listen_for_cancels`]
    /// hears them.
    cancels: tokio::sync::broadcast::Sender<crate::domain::TurnKey>,
    /// Stops [`listen_for_cancels`] (at close, or when the store goes).
    listening: tokio_util::sync::CancellationToken,
    _stop_listening: tokio_util::sync::DropGuard,
}

/// The PostgreSQL channel (`LISTEN`/`NOTIFY`) on which replicas announce
/// the turns CancelTurn recorded CANCELLED: `session id/request id`.
const CANCEL_CHANNEL: &str = "agentd_turn_cancelled";

/// How many announced cancels wait for the turn engine at most; past it the
/// oldest are dropped (their runs stop at their lease renewal instead).
const CANCELS_QUEUED: usize = 1024;

/// Listens on [`CANCEL_CHANNEL`] on a connection of its own and hands each
/// cancel heard to `cancels`, until `stop`. sqlx's listener connects again
/// when its connection drops (what is announced meanwhile is missed: the
/// runs it concerned stop at their lease renewal); while the database is
/// away, it tries again every second, saying so once.
fn listen_for_cancels(
    pool: PgPool,
    cancels: tokio::sync::broadcast::Sender<crate::domain::TurnKey>,
    stop: tokio_util::sync::CancellationToken,
) {
    use sqlx::postgres::PgListener;
    tokio::spawn(async move {
        let mut failing = false;
        let mut listener: Option<PgListener> = None;
        loop {
            let heard = async {
                let l = match &mut listener {
                    Some(l) => l,
                    None => {
                        let mut l = PgListener::connect_with(&pool).await?;
                        l.listen(CANCEL_CHANNEL).await?;
                        listener.insert(l)
                    }
                };
                l.recv().await
            };
            let heard = tokio::select! {
                _ = stop.cancelled() => break,
                heard = heard => heard,
            };
            match heard {
                Ok(n) => {
                    if failing {
                        failing = false;
                        tracing::info!("listening for cancels from other replicas again");
                    }
                    match parse_cancel(n.payload()) {
                        Some(key) => {
                            let _ = cancels.send(key);
                        }
                        None => tracing::warn!(
                            payload = n.payload(),
                            "ignored a malformed cancel announcement"
                        ),
                    }
                }
                Err(e) => {
                    if !failing {
                        failing = true;
                        tracing::warn!(error = %e, "cannot listen for cancels from other replicas; a turn cancelled elsewhere stops here at its next lease renewal until this is back");
                    }
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
        // The listener holds the pool's one connection: back first, or the
        // close would wait for it for ever.
        drop(listener);
        pool.close().await;
    });
}

/// The payload announcing `key`'s cancel (a session id has no `/`).
fn cancel_payload(key: &crate::domain::TurnKey) -> String {
    format!("{}/{}", key.session_id, key.request_id.as_str())
}

fn parse_cancel(payload: &str) -> Option<crate::domain::TurnKey> {
    let (sid, rid) = payload.split_once('/')?;
    Some(crate::domain::TurnKey {
        session_id: crate::domain::SessionId::parse(sid).ok()?,
        request_id: crate::domain::RequestId::parse(rid.to_owned()).ok()?,
    })
}

/// A Run's read of its session and its last `limit` ended turns, queued for
/// the store's readers.
struct PendingRead {
    id: String,
    limit: i64,
    /// The turn whose being stored the read tells.
    turn: Option<String>,
    done: tokio::sync::oneshot::Sender<Result<Found, super::sql::Failed>>,
}

/// A session and its history, if there is such a session.
type Found = Option<super::RunRead>;

/// Readers of sessions: each reads the sessions queued while it read the
/// previous ones in one statement.
const READERS: usize = 4;
/// Sessions a reader reads in one statement at most.
const READS_MAX: usize = 128;

impl PostgresStore {
    /// The event log is keyed by (session_id, request_id, first_seq), and
    /// its foreign key deletes a turn's events with it.
    const SQL: super::sql::Dialect = super::sql::Dialect {
        // From the batch that holds seq $3 on, found on the key (see the
        // SQLite store's).
        events_after: "SELECT events FROM event_batches WHERE session_id = $1 AND request_id = $2 \
             AND first_seq >= COALESCE((SELECT MAX(first_seq) FROM event_batches \
                 WHERE session_id = $1 AND request_id = $2 AND first_seq <= $3), 0) \
             AND last_seq > $3 ORDER BY first_seq LIMIT $4",
        session_events: None,
        lock_session: Some("SELECT 1 FROM sessions WHERE id = $1 FOR UPDATE"),
        prune_events: None,
        // Values over 2 kB go to TOAST, in chunks, whatever the row's size.
        row_bytes: super::sql::BATCH_ROW_BYTES,
        prune_turns: "DELETE FROM turns WHERE (session_id, request_id) IN \
             (SELECT session_id, request_id FROM turns WHERE state <> 'running' AND updated_at < $1 \
              ORDER BY updated_at LIMIT $2) \
             RETURNING updated_at",
        insert_moved_batch: "INSERT INTO event_batches (session_id, request_id, first_seq, last_seq, events) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT DO NOTHING",
        // Replicas of the release before kinds by number read these rows
        // during a rolling upgrade: names, until no release in use needs them.
        kinds: super::KindEncoding::Name,
        // A standby (or a primary demoted by a failover) answers reads but
        // refuses every write: not healthy for a server that must write.
        ping: "SELECT current_setting('transaction_read_only') = 'off'",
        // Turns whose rows another transaction holds are passed over, then
        // ended one at a time (`passed_over`): a committer storing a
        // turn's events share-locks its row (see `write_group`), a lease
        // renewal updates it. One statement waiting for them while holding
        // the rows it had already updated could deadlock with a committer
        // storing several of those turns, both kept a second
        // (`deadlock_timeout`) before one gave up.
        fail_expired: concat!(
            "UPDATE turns SET state = $1, status_code = $2, status_message = $3, updated_at = $4 \
             WHERE (session_id, request_id) IN (SELECT session_id, request_id FROM turns \
                 WHERE state = 'running' AND lease_expires_at < ",
            db_now!(),
            " FOR UPDATE SKIP LOCKED) RETURNING session_id, request_id"
        ),
        passed_over: Some(super::sql::PassedOver {
            expired: concat!(
                "SELECT session_id, request_id FROM turns WHERE state = 'running' AND lease_expires_at < ",
                db_now!()
            ),
            end_one: concat!(
                "UPDATE turns SET state = $1, status_code = $2, status_message = $3, updated_at = $4 \
                 WHERE session_id = $5 AND request_id = $6 AND state = 'running' AND lease_expires_at < ",
                db_now!(),
                " RETURNING session_id, request_id"
            ),
        }),
        renew_lease: concat!(
            "UPDATE turns SET lease_expires_at = ",
            db_now!(),
            " + $1 WHERE session_id = $2 AND request_id = $3 AND owner = $4 AND state = 'running'"
        ),
    };
}

impl PostgresStore {
    async fn close_pools(&self) {
        self.listening.cancel();
        self.write.close().await;
    }

    /// `NOTIFY`, which PostgreSQL delivers to every replica listening
    /// ([`listen_for_cancels`]).
    async fn announce(&self, key: &crate::domain::TurnKey) -> super::StoreResult<()> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CANCEL_CHANNEL)
            .bind(cancel_payload(key))
            .execute(&self.write)
            .await
            .map_err(super::sql::db_err)?;
        Ok(())
    }

    fn announcements(&self) -> Option<tokio::sync::broadcast::Receiver<crate::domain::TurnKey>> {
        Some(self.cancels.subscribe())
    }

    /// Connects to `url` and runs the migrations (one replica at a time:
    /// [`migrate`]).
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let opts = PgConnectOptions::from_str(url)?.application_name("agentd");
        // One direct connection first: its error says why (refused, auth,
        // unknown database), where the pool's would only say it timed out.
        let probe = tokio::time::timeout(
            ACQUIRE_TIMEOUT,
            <sqlx::PgConnection as sqlx::Connection>::connect_with(&opts),
        )
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {ACQUIRE_TIMEOUT:?}"))??;
        migrate(probe).await?;
        let pool = pool_options(MAX_CONNECTIONS)
            .connect_with(opts.clone())
            .await?;
        // A connection of its own, held while it listens, outside the pool
        // the statements share.
        let listening = tokio_util::sync::CancellationToken::new();
        let (cancels, _) = tokio::sync::broadcast::channel(CANCELS_QUEUED);
        listen_for_cancels(
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .max_lifetime(None)
                .idle_timeout(None)
                .connect_lazy_with(opts.clone()),
            cancels.clone(),
            listening.clone(),
        );
        let sessions = Arc::new(super::session_cache::SessionCache::shared());
        let gate = super::sql::QueueGate::default();
        let pace = Arc::new(super::sql::Pace::new());
        let store = Self {
            cancels,
            _stop_listening: listening.clone().drop_guard(),
            listening,
            commits: {
                let opts = opts.clone();
                Self::spawn_committer(
                    move || own_pool(opts),
                    COMMITTERS,
                    Some(sessions.clone()),
                    gate.clone(),
                    pace.clone(),
                )?
            },
            pace,
            claims: {
                let opts = opts.clone();
                Self::spawn_claimer(
                    move || own_pool(opts),
                    COMMITTERS,
                    Some(sessions.clone()),
                    gate.clone(),
                )?
            },
            gate,
            sessions: Some(sessions),
            reads: super::sql::spawn_queue(READERS, |rx| Self::read_groups(pool.clone(), rx)),
            read: pool.clone(),
            a2a: Arc::new(super::a2a_tasks::PostgresTasks::new(
                pool.clone(),
                pool.clone(),
            )),
            write: pool,
        };
        let moved = store.move_legacy_events().await?;
        if moved > 0 {
            tracing::info!(events = moved, "moved the event log to the batched layout");
        }
        Ok(store)
    }
}

/// Builds index `name` (on `on`, e.g. `sessions (updated_at)`) again when
/// a CONCURRENTLY build left it invalid: a build cut short (its process
/// killed, a start that took too long) leaves the index behind, never used,
/// and the migration's IF NOT EXISTS skips it when it runs again. Dropped
/// and built CONCURRENTLY again, writes to its table going on meanwhile (a
/// REINDEX would hold them). A build cut again is taken up at the next
/// start.
async fn rebuild_invalid_index(
    conn: &mut sqlx::PgConnection,
    name: &str,
    on: &str,
) -> anyhow::Result<()> {
    let invalid: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         WHERE c.relname = $1 AND c.relnamespace = current_schema()::regnamespace AND NOT i.indisvalid)",
    )
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    if !invalid {
        return Ok(());
    }
    tracing::warn!(
        index = name,
        "an index a cut-short build left invalid is built again"
    );
    sqlx::query(&format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"))
        .execute(&mut *conn)
        .await?;
    sqlx::query(&format!(
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {on}"
    ))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The advisory lock replicas of agentd take, one at a time, to migrate.
const MIGRATION_LOCK: i64 = 0x6167_656e_7464_0001;
/// How often a replica asks for [`MIGRATION_LOCK`] while another holds it.
const MIGRATION_LOCK_POLL: Duration = Duration::from_millis(100);

/// How long one migration waits for a table's lock. A migration that alters
/// a table (`ALTER TABLE turns ...`) waits for every transaction using it,
/// and every statement on the table after it waits behind it: without a
/// bound, one long transaction (a report, a backup, an idle session left in
/// a transaction) would stop every replica's Runs for as long as it lasts.
/// Bounded, the tables are held up at most this long per attempt.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(2);
/// The pause before the first attempt after one ran out of
/// [`MIGRATION_LOCK_WAIT`]; it doubles up to [`MIGRATION_RETRY_MAX`].
const MIGRATION_RETRY_FIRST: Duration = Duration::from_secs(1);
const MIGRATION_RETRY_MAX: Duration = Duration::from_secs(30);

/// PostgreSQL's `lock_not_available` (55P03): a lock not granted within
/// `lock_timeout`.
fn lock_not_available(e: &anyhow::Error) -> bool {
    e.chain().any(|c| match c.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(d)) => d.code().is_some_and(|code| code == "55P03"),
        _ => false,
    })
}

/// Sets how long the statements that follow on `conn` wait for a lock:
/// `None`, as long as it takes.
async fn set_lock_wait(
    conn: &mut sqlx::PgConnection,
    wait: Option<Duration>,
) -> anyhow::Result<()> {
    let ms = wait.map_or(0, |w| w.as_millis());
    sqlx::query(&format!("SET lock_timeout = {ms}"))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The indexes a cut-short build left invalid, then the migrations, one
/// at a time: those in a transaction (which take their tables' locks, as
/// `ALTER TABLE` does) wait at most [`MIGRATION_LOCK_WAIT`] for them; those
/// outside one (indexes built CONCURRENTLY, which hold no lock that blocks
/// the tables' users, but wait for every older transaction) wait as long
/// as it takes. All of it runs again after a wait ran out.
async fn run_migrations(conn: &mut sqlx::PgConnection) -> anyhow::Result<()> {
    use sqlx::migrate::{Migrate as _, Migrator};
    set_lock_wait(conn, None).await?;
    rebuild_invalid_index(conn, "sessions_by_update", "sessions (updated_at)").await?;
    rebuild_invalid_index(
        conn,
        "a2a_tasks_by_owner_update",
        "a2a_tasks (owner, updated_at, id)",
    )
    .await?;
    rebuild_invalid_index(
        conn,
        "a2a_tasks_ended",
        "a2a_tasks (updated_at) WHERE terminal = 1",
    )
    .await?;
    let all = super::migrator(sqlx::migrate!("migrations/postgres"));
    conn.ensure_migrations_table().await?;
    let applied: std::collections::HashSet<i64> = conn
        .list_applied_migrations()
        .await?
        .into_iter()
        .map(|m| m.version)
        .collect();
    for (i, m) in all.iter().enumerate() {
        if m.migration_type.is_down_migration() || applied.contains(&m.version) {
            continue;
        }
        set_lock_wait(conn, (!m.no_tx).then_some(MIGRATION_LOCK_WAIT)).await?;
        // sqlx's migrator, given the migrations up to this one: it checks
        // those applied and applies this one.
        let upto = Migrator {
            migrations: std::borrow::Cow::Owned(all.migrations[..=i].to_vec()),
            ..super::migrator(sqlx::migrate!("migrations/postgres"))
        };
        upto.run(&mut *conn).await?;
    }
    set_lock_wait(conn, None).await?;
    // Nothing left to apply: checks every applied migration.
    all.run(&mut *conn).await?;
    Ok(())
}

/// Runs the migrations on `conn`, one replica at a time, then closes it.
///
/// Replicas wait for the lock by asking again, not in `pg_advisory_lock`
/// (as sqlx's migrator does): an index built CONCURRENTLY waits for every
/// statement already running, a replica's wait for the lock among them,
/// while that wait is for the migrating replica. PostgreSQL ended that
/// cycle as a deadlock, failing the start of all but one of the replicas of
/// a new deployment. The migrator's own lock, taken inside this one, is
/// then never waited for.
async fn migrate(mut conn: sqlx::PgConnection) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    let mut said = false;
    loop {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(MIGRATION_LOCK)
            .fetch_one(&mut conn)
            .await?;
        if got {
            break;
        }
        if !said && started.elapsed() >= Duration::from_secs(5) {
            said = true;
            tracing::info!("waiting for another replica to migrate the database");
        }
        tokio::time::sleep(MIGRATION_LOCK_POLL).await;
    }
    let mut pause = MIGRATION_RETRY_FIRST;
    loop {
        match run_migrations(&mut conn).await {
            Ok(()) => break,
            Err(e) if lock_not_available(&e) => {
                tracing::warn!(
                    error = %e,
                    retry_in = ?pause,
                    "a migration waited {}s for a table another transaction holds (a long one, or a backup); it was rolled back so the replicas serving meanwhile are not held up behind it, and is tried again",
                    MIGRATION_LOCK_WAIT.as_secs()
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MIGRATION_RETRY_MAX);
            }
            Err(e) => return Err(e),
        }
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut conn)
        .await?;
    sqlx::Connection::close(conn).await?;
    Ok(())
}

impl PostgresStore {
    /// Writes a committer's group as one statement: every row of every
    /// batch as arrays, unnested by the server, and the outcomes of the
    /// turns that end with it, recorded in the same statement (and so
    /// atomically with the events). One round trip and one commit for the
    /// group, whatever its size.
    ///
    /// Only turns still running take events and an outcome: one failed
    /// under its writer (its lease ran out) or cancelled (`CancelTurn`,
    /// perhaps on another replica) keeps the log and the outcome its
    /// followers saw. The check share-locks each turn's row, so an end
    /// being written at that moment is waited for and then seen; read from
    /// the statement's snapshot alone, events could be stored after an end
    /// that committed first, which followers had already stopped at.
    /// Events of a turn that is not there fail the statement on the foreign
    /// key. Returns, per batch, whether its outcome (if any) was recorded.
    async fn write_group(
        pool: &PgPool,
        group: &[super::sql::PendingBatch],
    ) -> Result<Vec<bool>, super::sql::GroupError> {
        // A batch is one row unless it holds over a megabyte of events.
        let n = group.len();
        let (mut sid, mut rid) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut first, mut last, mut blob) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for p in group {
            for (f, l, events) in p.rows(Self::SQL.row_bytes) {
                sid.push(p.sid.as_str());
                rid.push(p.rid.as_str());
                first.push(f);
                last.push(l);
                blob.push(Blob(events));
            }
        }
        let outcomes = super::sql::group_outcomes(group);
        const INSERT: &str = "INSERT INTO event_batches (session_id, request_id, first_seq, last_seq, events) \
             SELECT b.* FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::int8[], $5::bytea[]) \
             AS b(session_id, request_id, first_seq, last_seq, events) \
             WHERE COALESCE((SELECT t.state = 'running' FROM turns t WHERE t.session_id = b.session_id \
                 AND t.request_id = b.request_id FOR SHARE), true)";
        if outcomes.is_empty() {
            sqlx::query(INSERT)
                .bind(&sid)
                .bind(&rid)
                .bind(&first)
                .bind(&last)
                .bind(&blob)
                .execute(pool)
                .await?;
            return Ok(vec![true; group.len()]);
        }
        let m = outcomes.len();
        let (mut o_sid, mut o_rid, mut state, mut code) = (
            Vec::with_capacity(m),
            Vec::with_capacity(m),
            Vec::with_capacity(m),
            Vec::with_capacity(m),
        );
        let (mut message, mut answer, mut payload, mut at) = (
            Vec::with_capacity(m),
            Vec::with_capacity(m),
            Vec::with_capacity(m),
            Vec::with_capacity(m),
        );
        for (p, o) in outcomes {
            o_sid.push(p.sid.as_str());
            o_rid.push(p.rid.as_str());
            state.push(o.state);
            code.push(o.code);
            message.push(o.message.as_str());
            answer.push(o.answer.as_deref());
            payload.push(o.answer_payload.as_deref());
            at.push(o.at);
        }
        // The insert runs whole before the update's rows are visible to
        // anyone: both commit together, or neither does. Neither sees the
        // other's changes (the update's rows are not the insert's), so a
        // turn's last events go in with its outcome; both see an end
        // another transaction committed during the statement (the insert
        // through its row lock, the update through its own).
        let recorded: Vec<(String, String)> = sqlx::query_as(&format!(
            "WITH stored AS ({INSERT}) \
             UPDATE turns t SET state = o.state, status_code = o.code, status_message = o.message, \
             answer = o.answer, answer_payload = o.payload, updated_at = o.at \
             FROM UNNEST($6::text[], $7::text[], $8::text[], $9::int8[], $10::text[], $11::text[], $12::text[], $13::int8[]) \
             AS o(session_id, request_id, state, code, message, answer, payload, at) \
             WHERE t.session_id = o.session_id AND t.request_id = o.request_id AND t.state = 'running' \
             RETURNING t.session_id, t.request_id"
        ))
        .bind(&sid)
        .bind(&rid)
        .bind(&first)
        .bind(&last)
        .bind(&blob)
        .bind(&o_sid)
        .bind(&o_rid)
        .bind(&state)
        .bind(&code)
        .bind(&message)
        .bind(&answer)
        .bind(&payload)
        .bind(&at)
        .fetch_all(pool)
        .await?;
        Ok(super::sql::outcomes_recorded(group, &recorded))
    }
}

impl PostgresStore {
    /// A session and its history, read with the other Runs' reads queued
    /// at the same moment: every Run starting reads its session, and one
    /// statement for all of them is one round trip and one plan, where a
    /// statement each put 64 of them on the server and on this process's
    /// core when 64 Runs started together. A lone read waits for nothing.
    async fn read_session(
        &self,
        id: crate::domain::SessionId,
        limit: usize,
        turn: Option<&str>,
    ) -> super::StoreResult<Found> {
        let gone = || super::StoreError::Unavailable(anyhow::anyhow!("the store is shutting down"));
        let (done, answer) = tokio::sync::oneshot::channel();
        let read = PendingRead {
            id: id.to_string(),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            turn: turn.map(str::to_owned),
            done,
        };
        self.reads.send(read).await.map_err(|_| gone())?;
        Ok(answer.await.map_err(|_| gone())??)
    }

    /// A reader: takes every read queued while it read the previous group,
    /// and reads them in one statement; if that fails for what it read, one
    /// at a time, so that only a bad one fails (the database away fails them
    /// all at once). Reads whose caller has gone are dropped
    /// unread. Ends when the store is dropped.
    async fn read_groups(
        pool: PgPool,
        rx: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<PendingRead>>>,
    ) {
        let mut group = Vec::with_capacity(READS_MAX);
        while rx.lock().await.recv_many(&mut group, READS_MAX).await > 0 {
            group.retain(|r| !r.done.is_closed());
            if group.is_empty() {
                continue;
            }
            let started = std::time::Instant::now();
            let read = super::sql::bounded(Self::read_sessions(&pool, &group))
                .await
                .map_err(super::sql::db_err)
                .and_then(|rows| Self::found(&group, &rows));
            crate::telemetry::metrics::store_group("read", group.len(), started.elapsed());
            match read {
                Ok(found) => {
                    for (r, f) in group.drain(..).zip(found) {
                        let _ = r.done.send(Ok(f));
                    }
                }
                // A read fails alone only for what it read (a bad row); the
                // database away fails every read of the group at once, and
                // the rest once one of them finds it away.
                Err(super::StoreError::Unexpected(_)) if group.len() > 1 => {
                    let mut away: Option<super::sql::Failed> = None;
                    for r in group.drain(..) {
                        if let Some(failed) = &away {
                            let _ = r.done.send(Err(failed.clone()));
                            continue;
                        }
                        let one = super::sql::bounded(Self::read_sessions(
                            &pool,
                            std::slice::from_ref(&r),
                        ))
                        .await
                        .map_err(|e| {
                            let gone = super::sql::gone(&e);
                            let failed = super::sql::Failed::from(super::sql::db_err(e));
                            if gone {
                                away = Some(failed.clone());
                            }
                            super::StoreError::from(failed)
                        })
                        .and_then(|rows| Self::found(std::slice::from_ref(&r), &rows))
                        .map(|mut found| found.pop().flatten())
                        .map_err(super::sql::Failed::from);
                        let _ = r.done.send(one);
                    }
                }
                Err(e) => {
                    let failed = super::sql::Failed::from(e);
                    for r in group.drain(..) {
                        let _ = r.done.send(Err(failed.clone()));
                    }
                }
            }
        }
    }

    /// Reads `reads` in one statement, whose rows [`found`](Self::found)
    /// sorts out. The statement is the single read's
    /// (`read_session_with_history`) with the sessions as an array. Each
    /// read's turn is looked up once, by its primary key (a join, where an
    /// `EXISTS` in the select list ran once per history row).
    async fn read_sessions(
        pool: &PgPool,
        reads: &[PendingRead],
    ) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
        sqlx::query(
            "SELECT q.ord, t.request_id IS NOT NULL AS turn_stored, s.id, s.user_id, s.created_at, s.updated_at, \
             CASE WHEN b.running IS NULL THEN s.claims END AS claims, \
             h.request_id AS h_request_id, h.agent AS h_agent, h.user_text AS h_user_text, h.answer AS h_answer, \
             h.answer_payload AS h_answer_payload \
             FROM UNNEST($1::text[], $2::int8[], $3::text[]) WITH ORDINALITY AS q(id, lim, turn, ord) \
             JOIN sessions s ON s.id = q.id \
             LEFT JOIN turns t ON t.session_id = q.id AND t.request_id = q.turn \
             LEFT JOIN LATERAL ( \
               SELECT 1 AS running FROM turns WHERE session_id = q.id AND state = 'running' LIMIT 1 \
             ) b ON true \
             LEFT JOIN LATERAL ( \
               SELECT request_id, agent, user_text, COALESCE(answer, '') AS answer, \
               COALESCE(answer_payload, '') AS answer_payload, created_at FROM turns \
               WHERE session_id = q.id AND state <> 'running' \
               ORDER BY created_at DESC, request_id DESC LIMIT q.lim \
             ) h ON true \
             ORDER BY q.ord, h.created_at, h.request_id",
        )
        .bind(reads.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
        .bind(reads.iter().map(|r| r.limit).collect::<Vec<_>>())
        .bind(reads.iter().map(|r| r.turn.as_deref()).collect::<Vec<_>>())
        .fetch_all(pool)
        .await
    }

    /// For each of `reads`, in order, from the rows of
    /// [`read_sessions`](Self::read_sessions): its session, its last
    /// `limit` ended turns, oldest first, and whether its turn is stored,
    /// or `None` where there is no such session.
    fn found(
        reads: &[PendingRead],
        rows: &[sqlx::postgres::PgRow],
    ) -> super::StoreResult<Vec<Found>> {
        let mut found: Vec<Found> = reads.iter().map(|_| None).collect();
        for r in rows {
            let ord: i64 = r.try_get("ord").map_err(super::sql::db_err)?;
            let slot = usize::try_from(ord - 1)
                .ok()
                .and_then(|i| found.get_mut(i))
                .ok_or_else(|| super::sql::bad_row("read order"))?;
            let read = match slot {
                Some(held) => held,
                None => slot.insert(super::RunRead {
                    session: session_from_row(r)?,
                    history: Vec::new(),
                    turn_stored: r.try_get("turn_stored").map_err(super::sql::db_err)?,
                    claims: r.try_get("claims").map_err(super::sql::db_err)?,
                    remembered: None,
                }),
            };
            let Some(request_id) = r
                .try_get::<Option<String>, _>("h_request_id")
                .map_err(super::sql::db_err)?
            else {
                continue;
            };
            read.history.push(crate::agent::PriorTurn {
                request_id,
                agent: r.try_get("h_agent").map_err(super::sql::db_err)?,
                user_text: r.try_get("h_user_text").map_err(super::sql::db_err)?,
                answer: r.try_get("h_answer").map_err(super::sql::db_err)?,
                answer_payload: r.try_get("h_answer_payload").map_err(super::sql::db_err)?,
            });
        }
        Ok(found)
    }
}

/// The claimers' (or the committers') own connections, one per worker,
/// opened on their thread as they are first needed
/// ([`super::sql::spawn_queue_on_thread`]). Kept while they work (a
/// connection idle for long is pinged before use), so the pool starts no
/// upkeep of its own on that thread.
fn own_pool(opts: PgConnectOptions) -> PgPool {
    pool_options(COMMITTERS as u32)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(opts)
}

/// A pool of `max` connections for statements: a connection idle for
/// [`PING_IF_IDLE_FOR`] or longer is pinged before it is handed out.
fn pool_options(max: u32) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

impl PostgresStore {
    /// Claims `claims` (distinct keys) in one statement; for each, whether
    /// it stored its turn, and its session's count of claims before the
    /// statement (read from the statement's snapshot; the insert's trigger
    /// counts the claims, and marks their sessions updated, once the
    /// statement is done). Race free across replicas: of two inserts of one
    /// key, one finds the other's row and does nothing.
    async fn insert_claims(
        pool: &PgPool,
        claims: &[super::sql::PendingClaim],
    ) -> Result<Vec<super::sql::ClaimWritten>, sqlx::Error> {
        // Rows are locked in the order they are bound (the turns' keys, the
        // sessions' rows): every group binds in key order, so two groups
        // sharing sessions never wait for each other in a cycle.
        let mut order: Vec<&super::sql::PendingClaim> = claims.iter().collect();
        order.sort_by(|a, b| (&a.sid, &a.rid).cmp(&(&b.sid, &b.rid)));
        let col = |f: fn(&super::sql::PendingClaim) -> &str| -> Vec<&str> {
            order.iter().map(|c| f(c)).collect()
        };
        let rows = sqlx::query(concat!(
            "WITH claimed AS ( \
               INSERT INTO turns (session_id, request_id, user_text, agent, state, owner, lease_expires_at, created_at, updated_at) \
               SELECT c.session_id, c.request_id, c.user_text, c.agent, 'running', c.owner, ",
            db_now!(),
            " + c.lease, c.at, c.at \
               FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int8[], $7::int8[]) \
               AS c(session_id, request_id, user_text, agent, owner, lease, at) \
               ON CONFLICT (session_id, request_id) DO NOTHING \
               RETURNING session_id, request_id \
             ) \
             SELECT c.session_id, c.request_id, s.claims FROM claimed c JOIN sessions s ON s.id = c.session_id",
        ))
        .bind(col(|c| &c.sid))
        .bind(col(|c| &c.rid))
        .bind(col(|c| &c.user_text))
        .bind(col(|c| &c.agent))
        .bind(col(|c| &c.owner))
        .bind(order.iter().map(|c| c.lease_micros()).collect::<Vec<_>>())
        .bind(order.iter().map(|c| c.at).collect::<Vec<_>>())
        .fetch_all(pool)
        .await?;
        super::sql::stored_claims(claims, &rows, true)
    }
}

/// A row's events bound as one `bytea`: their encodings written one after
/// another straight into the statement's buffer (the stored batch; see
/// `codec`), with no blob of their own in between.
struct Blob<'a>(&'a [super::EncodedEvent]);

impl sqlx::Type<sqlx::Postgres> for Blob<'_> {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <&[u8] as sqlx::Type<sqlx::Postgres>>::type_info()
    }
}

impl sqlx::postgres::PgHasArrayType for Blob<'_> {
    fn array_type_info() -> sqlx::postgres::PgTypeInfo {
        <&[u8] as sqlx::postgres::PgHasArrayType>::array_type_info()
    }
}

impl sqlx::Encode<'_, sqlx::Postgres> for Blob<'_> {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        for e in self.0 {
            buf.extend_from_slice(e.as_bytes());
        }
        Ok(sqlx::encode::IsNull::No)
    }

    fn size_hint(&self) -> usize {
        self.0.iter().map(|e| e.as_bytes().len()).sum()
    }
}

impl super::a2a_tasks::A2aTaskSource for PostgresStore {
    fn a2a_tasks(&self) -> Arc<dyn super::a2a_tasks::A2aTasks> {
        self.a2a.clone()
    }
}

super::sql::sql_store!(PostgresStore, sqlx::Postgres);

#[cfg(test)]
mod tests {
    use crate::domain::{RequestId, SessionId, TurnKey};

    /// A cancel's announcement names its turn whatever characters its
    /// request id holds, and a payload that names none is refused.
    #[test]
    fn a_cancel_announcement_names_its_turn_and_garbage_names_none() {
        let key = TurnKey {
            session_id: SessionId::generate(),
            request_id: RequestId::parse("retry-2:a.b@c_d").unwrap(),
        };
        assert_eq!(
            super::parse_cancel(&super::cancel_payload(&key)),
            Some(key.clone())
        );
        for bad in [
            "",
            "no-slash",
            "not-a-uuid/r1",
            &format!("{}/", key.session_id),
            &format!("{}/a/b", key.session_id),
        ] {
            assert_eq!(super::parse_cancel(bad), None, "{bad:?}");
        }
    }
}
