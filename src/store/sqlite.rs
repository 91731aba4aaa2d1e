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
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(opts.clone())
            .await?;
        sqlx::migrate!("migrations/sqlite").run(&write).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_with(opts.read_only(true))
            .await?;
        let a2a = Arc::new(super::a2a_tasks::SqliteTasks::new(
            read.clone(),
            write.clone(),
        ));
        let store = Self { read, write, a2a };
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

impl super::a2a_tasks::A2aTaskSource for SqliteStore {
    fn a2a_tasks(&self) -> Arc<dyn super::a2a_tasks::A2aTasks> {
        self.a2a.clone()
    }
}

super::sql::sql_store!(SqliteStore, sqlx::Sqlite);
