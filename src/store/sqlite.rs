//! The embedded default store: one SQLite file (`--store sqlite://agentd.db`)
//! that a single replica's sessions survive restarts in. WAL mode lets readers
//! run beside the writer; every write goes through one connection (one writer
//! path, so writers never fight over the lock), with a busy timeout for the
//! rare checkpoint contention.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

/// How long a statement waits for the database lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Concurrent readers (followers, replays, listings).
const READERS: u32 = 4;

pub struct SqliteStore {
    /// Readers: any number of them run beside the writer under WAL.
    read: SqlitePool,
    /// The one writer connection.
    write: SqlitePool,
    a2a: Arc<super::a2a_tasks::SqliteTasks>,
    /// The committer's queue: event batches are written through it.
    commits: tokio::sync::mpsc::Sender<super::sql::PendingBatch>,
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
            .foreign_keys(true);
        // No ping before each use: the connection is in this process, and a
        // ping is a round trip to its thread that doubled a statement's cost.
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(opts.clone())
            .await?;
        sqlx::migrate!("migrations/sqlite").run(&write).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .test_before_acquire(false)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(opts.read_only(true))
            .await?;
        let a2a = Arc::new(super::a2a_tasks::SqliteTasks::new(
            read.clone(),
            write.clone(),
        ));
        let commits = Self::spawn_committer(write.clone(), 1);
        let store = Self {
            read,
            write,
            a2a,
            commits,
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

/// The insert of one event-batch row, borrowing what it binds.
fn insert_row<'q>(
    p: &'q super::sql::PendingBatch,
    (first, last, blob): &'q (i64, i64, Vec<u8>),
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
    sqlx::query(
        "INSERT INTO event_batches (session_id, request_id, first_seq, last_seq, events) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(p.sid.as_str())
    .bind(p.rid.as_str())
    .bind(*first)
    .bind(*last)
    .bind(blob.as_slice())
}

/// The most rows one insert statement carries (5 binds each, far under
/// SQLite's 32,766 variables); a group with more is written in a
/// transaction.
const ROWS_PER_STATEMENT: usize = 256;

/// One insert statement for `rows`.
fn insert_rows<'q>(
    rows: &[(&'q super::sql::PendingBatch, &'q (i64, i64, Vec<u8>))],
) -> sqlx::QueryBuilder<'q, sqlx::Sqlite> {
    let mut q = sqlx::QueryBuilder::new(
        "INSERT INTO event_batches (session_id, request_id, first_seq, last_seq, events) ",
    );
    q.push_values(rows, |mut b, &(p, (first, last, blob))| {
        b.push_bind(p.sid.as_str())
            .push_bind(p.rid.as_str())
            .push_bind(*first)
            .push_bind(*last)
            .push_bind(blob.as_slice());
    });
    q
}

impl SqliteStore {
    /// Writes a committer's group, as one statement when it fits in one:
    /// each statement is a round trip to sqlx's SQLite thread, so a
    /// statement per row made a group of 64 turns 66 of them.
    async fn write_group(
        pool: &SqlitePool,
        group: &[super::sql::PendingBatch],
    ) -> Result<(), sqlx::Error> {
        let rows: Vec<_> = group
            .iter()
            .flat_map(|p| p.rows.iter().map(move |r| (p, r)))
            .collect();
        match rows.as_slice() {
            [] => {}
            [(p, row)] => {
                insert_row(p, row).execute(pool).await?;
            }
            few if few.len() <= ROWS_PER_STATEMENT => {
                // Not kept prepared: the text differs with the row count.
                insert_rows(few)
                    .build()
                    .persistent(false)
                    .execute(pool)
                    .await?;
            }
            many => {
                let mut tx = pool.begin().await?;
                for chunk in many.chunks(ROWS_PER_STATEMENT) {
                    insert_rows(chunk)
                        .build()
                        .persistent(false)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }
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

    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};

    use super::SqliteStore;
    use crate::domain::{RequestId, SessionId, TurnKey};
    use crate::store::Store;

    /// A file written by a build with the per-event layout (schema 0001)
    /// opens with its whole log, now in batches, and the answer in history.
    #[tokio::test]
    async fn an_event_log_in_the_per_event_layout_is_moved_into_batches_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let only_first = dir.path().join("migrations");
        std::fs::create_dir(&only_first).unwrap();
        let first = "0001_sessions_turns_events.sql";
        std::fs::copy(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations/sqlite")
                .join(first),
            only_first.join(first),
        )
        .unwrap();
        let url = format!("sqlite://{}", dir.path().join("old.db").display());
        let old = SqlitePool::connect_with(
            SqliteConnectOptions::from_str(&url)
                .unwrap()
                .create_if_missing(true),
        )
        .await
        .unwrap();
        sqlx::migrate::Migrator::new(only_first.as_path())
            .await
            .unwrap()
            .run(&old)
            .await
            .unwrap();
        let sid = SessionId::generate().to_string();
        sqlx::query("INSERT INTO sessions VALUES ($1, 'alice', 1, 1)")
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
        let key = TurnKey {
            session_id: SessionId::parse(&sid).unwrap(),
            request_id: RequestId::parse("r1").unwrap(),
        };
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
        use crate::store::{EncodedEvent, NewTurn, SeqEvent};

        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("g.db").display());
        let store = SqliteStore::open(&url).await.unwrap();
        let session = store
            .create_session(&crate::domain::UserId::parse("alice").unwrap())
            .await
            .unwrap();
        let key = TurnKey {
            session_id: session.id,
            request_id: RequestId::parse("r1").unwrap(),
        };
        store
            .claim_turn(&NewTurn {
                key: key.clone(),
                user_text: "hi".into(),
                agent: "echo".into(),
                owner: "a".into(),
                lease: std::time::Duration::from_secs(5),
            })
            .await
            .unwrap();
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
                crate::store::sql::PendingBatch::new(&key, &[e], tokio::sync::oneshot::channel().0)
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
}
