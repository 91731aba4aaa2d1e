//! A2A tasks in our stores: an `a2a_server::TaskStore` on SQLite and
//! PostgreSQL (table `a2a_tasks`, migration 0003), and one in memory.
//!
//! A row holds the serialized task (its A2A JSON) with the columns ListTasks
//! filters and pages on (context, state, status time, creation order), its
//! owner and a version for optimistic updates. Every task belongs to the
//! session of its context ([`context_session`]): creating a task creates that
//! session when it is missing, and deleting the session (DeleteSession)
//! deletes its tasks (`ON DELETE CASCADE`). With `--retain-turns`, tasks
//! that ended are pruned as turns are ([`A2aTasks::prune_ended`]); the
//! in-memory store keeps them for the life of the process.
//!
//! Every task is owned by the user who created it (the authenticated
//! caller, or [`A2A_USER`] without authentication), and a caller sees its own
//! tasks only. The A2A handler (`a2a::follow`) checks the owner
//! ([`A2aTasks::owner`]) before a task is read, cancelled, followed or
//! continued, and runs every call as its caller ([`as_caller`]): the
//! `TaskStore` face creates a task for that caller and lists only that
//! caller's tasks, and refuses to do either outside a call.
//!
//! The session of a context is derived, not looked up: a name-based UUID of
//! (user, contextId). Every replica computes the same id, and creating it is
//! `INSERT … ON CONFLICT DO NOTHING`, so two replicas racing on a new context
//! end up in one session.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use a2a::{A2AError, ListTasksRequest, ListTasksResponse, Task, TaskState};
use a2a_server::TaskStore;
use a2a_server::task_store::TaskVersion;
use async_trait::async_trait;

use super::{StoreError, StoreResult};
use crate::domain::{SessionId, UserId};

/// The user A2A tasks run as, and belong to, when authentication is off
/// (with it on, a task runs as and belongs to its authenticated caller).
pub const A2A_USER: &str = "a2a-anonymous";

tokio::task_local! {
    /// The user an A2A call is made by, while the handler serves it.
    static CALLER: UserId;
}

/// Runs `f`, one A2A call of `caller`: the tasks it creates are
/// `caller`'s, and it lists `caller`'s tasks only.
pub async fn as_caller<F: std::future::Future>(caller: UserId, f: F) -> F::Output {
    CALLER.scope(caller, f).await
}

/// The caller of the A2A call being served; outside one, an error (a task
/// is never created or listed for nobody).
fn caller() -> Result<UserId, A2AError> {
    CALLER.try_with(UserId::clone).map_err(|_| {
        tracing::error!("an A2A task was created or listed outside a caller's call");
        A2AError::internal("the task store was used without a caller")
    })
}

/// Optimistic retries of a CancelTask racing other writes to one task.
const CANCEL_ATTEMPTS: usize = 16;

/// The session of (`user`, `context_id`): the same on every replica and
/// across restarts, never equal to a generated (v4) session id.
pub fn context_session(user: &UserId, context_id: &str) -> SessionId {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"agentd.a2a.context\0");
    h.update(user.as_str().as_bytes());
    h.update([0u8]);
    h.update(context_id.as_bytes());
    let digest = h.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    // RFC 9562 version 8 (custom, here SHA-256 name-based), RFC variant.
    let uuid = uuid::Builder::from_custom_bytes(bytes).into_uuid();
    SessionId::parse(&uuid.to_string()).expect("a UUID")
}

/// Task metadata key holding the id of the session the task's turns run in
/// (set by the executor, which knows the caller).
pub const SESSION_METADATA_KEY: &str = "agentd.session";

/// The session of `task`: the one its metadata names, else the anonymous
/// session of its context.
pub fn task_session(task: &Task) -> SessionId {
    named_session(task).unwrap_or_else(|| context_session(&a2a_user(), &task.context_id))
}

/// The session `task`'s metadata names, if any. The handler stores a task
/// before its executor runs; the executor's first snapshot names it.
pub(crate) fn named_session(task: &Task) -> Option<SessionId> {
    task.metadata
        .as_ref()
        .and_then(|m| m.get(SESSION_METADATA_KEY))
        .and_then(|v| v.as_str())
        .and_then(|s| SessionId::parse(s).ok())
}

fn a2a_user() -> UserId {
    UserId::parse(A2A_USER).expect("a valid user id")
}

/// What the A2A face needs from a store beyond the task store itself. Its
/// `TaskStore::create` and `TaskStore::list` are [`Self::create_for`] and
/// [`Self::list_for`] for the caller of the call being served
/// ([`as_caller`]); `get`, `update` and `begin_cancel` are not scoped (the
/// handler checks [`Self::owner`] first; a run's own writes have no caller).
#[async_trait]
pub trait A2aTasks: TaskStore {
    /// Creates session `id` for `user` unless it exists. Race-free: any
    /// number of replicas may call it at once.
    async fn ensure_session(&self, id: SessionId, user: &UserId) -> StoreResult<()>;

    /// Stores the new `task`, owned by `owner`.
    async fn create_for(&self, owner: &UserId, task: Task) -> Result<TaskVersion, A2AError>;

    /// ListTasks over `owner`'s tasks.
    async fn list_for(
        &self,
        owner: &UserId,
        req: &ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError>;

    /// The owner of task `task_id`; `None` when there is no such task (or,
    /// for a task an older release stored, no owner can be told yet).
    async fn owner(&self, task_id: &str) -> Result<Option<UserId>, A2AError>;

    /// Deletes at most `limit` of the tasks that ended (a terminal state)
    /// and were last updated before `before`, oldest first; returns how
    /// many. The in-memory store keeps its tasks (they go with the process).
    async fn prune_ended(&self, before: std::time::SystemTime, limit: usize) -> StoreResult<u64> {
        let _ = (before, limit);
        Ok(0)
    }

    /// At most `limit` of the tasks still SUBMITTED or WORKING that were
    /// last updated before `before`, in (last update, id) order from just
    /// after `after` (a previous page's last [`Unfinished::key`]). For
    /// finding tasks whose run ended without their end being stored. The
    /// in-memory store has none to find: its tasks die with the process
    /// that runs them.
    async fn unfinished(
        &self,
        before: std::time::SystemTime,
        after: Option<&UnfinishedKey>,
        limit: usize,
    ) -> StoreResult<Vec<Unfinished>> {
        let _ = (before, after, limit);
        Ok(Vec::new())
    }
}

/// Where a task stands in [`A2aTasks::unfinished`]'s order: its last
/// update (microseconds since the Unix epoch) and its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnfinishedKey(pub i64, pub String);

/// A task [`A2aTasks::unfinished`] found.
#[derive(Debug, Clone)]
pub struct Unfinished {
    pub key: UnfinishedKey,
    pub task: Task,
}

/// Gives a store's A2A task store. A supertrait of
/// [`Store`](super::Store), implemented beside each store.
pub trait A2aTaskSource {
    fn a2a_tasks(&self) -> Arc<dyn A2aTasks>;
}

/// A store's A2A task store as the `impl TaskStore` the handler takes.
#[derive(Clone)]
pub struct SharedTasks(pub Arc<dyn A2aTasks>);

#[async_trait]
impl TaskStore for SharedTasks {
    async fn create(&self, task: Task) -> Result<TaskVersion, A2AError> {
        self.0.create(task).await
    }
    async fn update(&self, task: Task) -> Result<TaskVersion, A2AError> {
        self.0.update(task).await
    }
    async fn get(&self, task_id: &str) -> Result<Option<Task>, A2AError> {
        self.0.get(task_id).await
    }
    async fn list(&self, req: &ListTasksRequest) -> Result<ListTasksResponse, A2AError> {
        self.0.list(req).await
    }
    async fn begin_cancel(&self, task_id: &str) -> Result<Task, A2AError> {
        self.0.begin_cancel(task_id).await
    }
}

/// A store failure as an A2A error: the cause goes to the log, the caller
/// gets a fixed message.
pub(crate) fn a2a_err(e: StoreError) -> A2AError {
    match &e {
        StoreError::Unavailable(cause) => {
            tracing::warn!(error = %cause, "a2a task store unavailable");
            unavailable()
        }
        StoreError::Unexpected(cause) => {
            tracing::error!(error = %cause, "a2a task store failed");
            A2AError::internal("the task store failed")
        }
    }
}

/// What a caller is told when the task store cannot be reached.
const UNAVAILABLE: &str = "the task store is unavailable; retry later";

/// The answer to a call the task store cannot serve now: its database is
/// away (a failed call, or the store's health check failing).
pub(crate) fn unavailable() -> A2AError {
    A2AError::internal(UNAVAILABLE)
}

/// Whether `e` is a failure of the task store (as [`a2a_err`] makes them):
/// `Some(true)` when it could not be reached, `Some(false)` for any other
/// failure of it, `None` for an answer that is not a failure of the store
/// (a refusal of an update to an ended task, say).
pub(crate) fn store_failure(e: &A2AError) -> Option<bool> {
    (e.code == a2a::error_code::INTERNAL_ERROR).then(|| e.message == UNAVAILABLE)
}

fn state_name(state: &TaskState) -> String {
    match serde_json::to_value(state) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{state:?}"),
    }
}

fn status_micros(task: &Task) -> Option<i64> {
    task.status.timestamp.map(|t| t.timestamp_micros())
}

fn encode(task: &Task) -> Result<String, A2AError> {
    serde_json::to_string(task).map_err(|e| {
        tracing::error!(error = %e, "an A2A task does not serialize");
        A2AError::internal("the task could not be stored")
    })
}

fn decode(json: &str) -> Result<Task, A2AError> {
    serde_json::from_str(json).map_err(|e| {
        tracing::error!(error = %e, "the store holds a malformed A2A task");
        A2AError::internal("the task store holds a malformed task")
    })
}

/// ListTasks pages most recently updated first, as the spec requires, by
/// (updated_at, id); the token is the last row's key. A task updated while
/// a client pages moves to the front, so that client's later pages do not
/// show it again (or, if it had not been shown yet, at all). The token
/// starts with `u`: one of a release that paged by creation (digits first)
/// is refused, not read as a time of another kind.
fn encode_cursor(updated_at: i64, id: &str) -> String {
    format!("u{updated_at}.{id}")
}

fn decode_cursor(token: &str) -> Result<(i64, String), A2AError> {
    let bad = || A2AError::invalid_params("invalid page token");
    let token = token.strip_prefix('u').ok_or_else(bad)?;
    let (micros, id) = token.split_once('.').ok_or_else(bad)?;
    let micros = micros.parse::<i64>().map_err(|_| bad())?;
    if id.is_empty() {
        return Err(bad());
    }
    Ok((micros, id.to_owned()))
}

/// What a listed task shows: artifacts only on request (the spec's default
/// is without).
fn listed(mut task: Task, req: &ListTasksRequest) -> Task {
    if req.include_artifacts != Some(true) {
        task.artifacts = None;
    }
    task
}

/// A task's move to `next` is allowed unless it is terminal already; the
/// same terminal state may be written again (idempotent re-emission).
fn update_refused(task_id: &str, current: &TaskState, next: &TaskState) -> A2AError {
    A2AError::invalid_request(format!(
        "{REFUSED_PREFIX}{task_id}{REFUSED_INFIX}{current:?} and cannot transition to {next:?}"
    ))
}

const REFUSED_PREFIX: &str = "task ";
const REFUSED_INFIX: &str = " is in terminal state ";

/// The task whose update was refused because it is terminal already (the
/// run of a task another replica cancelled, writing its next update), if
/// `e` is that refusal.
pub fn refused_task_id(e: &A2AError) -> Option<&str> {
    if e.code != a2a::error_code::INVALID_REQUEST {
        return None;
    }
    e.message
        .strip_prefix(REFUSED_PREFIX)?
        .split_once(REFUSED_INFIX)
        .map(|(id, _)| id)
        .filter(|id| !id.is_empty())
}

macro_rules! sql_task_store {
    ($name:ident, $db:ty) => {
        /// The A2A task store on this database (see the module docs).
        pub struct $name {
            read: sqlx::Pool<$db>,
            write: sqlx::Pool<$db>,
        }

        impl $name {
            pub fn new(read: sqlx::Pool<$db>, write: sqlx::Pool<$db>) -> Self {
                Self { read, write }
            }

            /// Marks every task that is not terminal FAILED: for a store one
            /// process owns, at start-up, when such a task's run is gone.
            pub async fn fail_unfinished(&self, why: &str) -> anyhow::Result<u64> {
                use sqlx::Row as _;
                let rows = sqlx::query("SELECT id FROM a2a_tasks WHERE terminal = 0")
                    .fetch_all(&self.write)
                    .await?;
                let mut n = 0;
                for r in rows {
                    let id: String = r.try_get("id")?;
                    let Some(mut task) = TaskStore::get(self, &id).await.map_err(|e| anyhow::anyhow!(e.message))? else {
                        continue;
                    };
                    task.status = a2a::TaskStatus {
                        state: TaskState::Failed,
                        message: Some(a2a::Message {
                            context_id: Some(task.context_id.clone()),
                            task_id: Some(task.id.clone()),
                            ..a2a::Message::new(a2a::Role::Agent, vec![a2a::Part::text(why)])
                        }),
                        timestamp: Some(chrono::Utc::now()),
                    };
                    if TaskStore::update(self, task).await.is_ok() {
                        n += 1;
                    }
                }
                Ok(n)
            }

            async fn ensure_session_on<'e, E>(exec: E, id: SessionId, user: &UserId) -> StoreResult<()>
            where
                E: sqlx::Executor<'e, Database = $db>,
            {
                // An existing session is touched, as a claim touches it: a
                // task about to be made in it keeps it from retention's
                // deletion of sessions left empty (which checks the time
                // again on the row it deletes).
                let now = super::to_micros(std::time::SystemTime::now());
                sqlx::query(
                    "INSERT INTO sessions (id, user_id, created_at, updated_at) VALUES ($1, $2, $3, $3) \
                     ON CONFLICT (id) DO UPDATE SET updated_at = CASE WHEN sessions.updated_at > EXCLUDED.updated_at \
                     THEN sessions.updated_at ELSE EXCLUDED.updated_at END",
                )
                .bind(id.to_string())
                .bind(user.as_str())
                .bind(now)
                .execute(exec)
                .await
                .map_err(super::sql::db_err)?;
                Ok(())
            }
        }

        #[async_trait]
        impl A2aTasks for $name {
            async fn ensure_session(&self, id: SessionId, user: &UserId) -> StoreResult<()> {
                Self::ensure_session_on(&self.write, id, user).await
            }

            async fn prune_ended(&self, before: std::time::SystemTime, limit: usize) -> StoreResult<u64> {
                let done = sqlx::query(
                    "DELETE FROM a2a_tasks WHERE id IN \
                     (SELECT id FROM a2a_tasks WHERE terminal = 1 AND updated_at < $1 ORDER BY updated_at LIMIT $2)",
                )
                .bind(super::to_micros(before))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .execute(&self.write)
                .await
                .map_err(super::sql::db_err)?;
                Ok(done.rows_affected())
            }

            async fn unfinished(
                &self,
                before: std::time::SystemTime,
                after: Option<&UnfinishedKey>,
                limit: usize,
            ) -> StoreResult<Vec<Unfinished>> {
                use sqlx::Row as _;
                let rows = sqlx::query(
                    "SELECT id, updated_at, task_json FROM a2a_tasks \
                     WHERE terminal = 0 AND state IN ($1, $2) AND updated_at < $3 \
                     AND (updated_at > $4 OR (updated_at = $4 AND id > $5)) \
                     ORDER BY updated_at, id LIMIT $6",
                )
                .bind(state_name(&TaskState::Submitted))
                .bind(state_name(&TaskState::Working))
                .bind(super::to_micros(before))
                .bind(after.map_or(i64::MIN, |k| k.0))
                .bind(after.map_or("", |k| k.1.as_str()))
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                .fetch_all(&self.read)
                .await
                .map_err(super::sql::db_err)?;
                let mut found = Vec::with_capacity(rows.len());
                for r in rows {
                    let id: String = r.try_get("id").map_err(super::sql::db_err)?;
                    let updated: i64 = r.try_get("updated_at").map_err(super::sql::db_err)?;
                    let json: String = r.try_get("task_json").map_err(super::sql::db_err)?;
                    // A row that does not decode is skipped (and logged by
                    // `decode`): the rest of the page is still worth settling.
                    if let Ok(task) = decode(&json) {
                        found.push(Unfinished { key: UnfinishedKey(updated, id), task });
                    }
                }
                Ok(found)
            }

            async fn create_for(&self, owner: &UserId, task: Task) -> Result<TaskVersion, A2AError> {
                let json = encode(&task)?;
                // The session is the executor's to create (it knows the
                // caller); the task is tied to it by the first update that
                // names it.
                let session = named_session(&task).map(|s| s.to_string());
                let now = super::to_micros(std::time::SystemTime::now());
                let mut tx = self.write.begin().await.map_err(super::sql::db_err).map_err(a2a_err)?;
                let done = sqlx::query(
                    "INSERT INTO a2a_tasks (id, context_id, session_id, state, terminal, status_at, task_json, version, created_at, updated_at, owner) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, 1, $8, $8, $9) ON CONFLICT (id) DO NOTHING",
                )
                .bind(&task.id)
                .bind(&task.context_id)
                .bind(session)
                .bind(state_name(&task.status.state))
                .bind(i64::from(task.status.state.is_terminal()))
                .bind(status_micros(&task))
                .bind(json)
                .bind(now)
                .bind(owner.as_str())
                .execute(&mut *tx)
                .await
                .map_err(super::sql::db_err)
                .map_err(a2a_err)?;
                if done.rows_affected() == 0 {
                    return Err(A2AError::internal("task already exists"));
                }
                tx.commit().await.map_err(super::sql::db_err).map_err(a2a_err)?;
                Ok(1)
            }

            async fn owner(&self, task_id: &str) -> Result<Option<UserId>, A2AError> {
                use sqlx::Row as _;
                // A row an older release wrote during a rolling upgrade has
                // no owner: its session's user is.
                let row = sqlx::query(
                    "SELECT COALESCE(t.owner, s.user_id) AS owner FROM a2a_tasks t \
                     LEFT JOIN sessions s ON s.id = t.session_id WHERE t.id = $1",
                )
                .bind(task_id)
                .fetch_optional(&self.read)
                .await
                .map_err(super::sql::db_err)
                .map_err(a2a_err)?;
                let Some(row) = row else {
                    return Ok(None);
                };
                let owner: Option<String> = row.try_get("owner").map_err(super::sql::db_err).map_err(a2a_err)?;
                Ok(owner.and_then(|o| UserId::parse(o).ok()))
            }

            async fn list_for(&self, owner: &UserId, req: &ListTasksRequest) -> Result<ListTasksResponse, A2AError> {
                use sqlx::Row as _;
                let page_size = a2a_server::pagination::resolve_page_size(req.page_size);
                let cursor = match req.page_token.as_deref().filter(|t| !t.is_empty()) {
                    Some(t) => Some(decode_cursor(t)?),
                    None => None,
                };
                let context = req.context_id.as_deref().filter(|c| !c.is_empty());
                let state = req
                    .status
                    .as_ref()
                    .filter(|s| **s != TaskState::Unspecified)
                    .map(state_name);
                let after = req.status_timestamp_after.map(|t| t.timestamp_micros());
                // The owner's tasks; a row an older release wrote during a
                // rolling upgrade has no owner, and is its session's user's.
                const FILTER: &str = "(owner = $1 OR (owner IS NULL AND session_id IN (SELECT id FROM sessions WHERE user_id = $1))) \
                    AND ($2 IS NULL OR context_id = $2) AND ($3 IS NULL OR state = $3) AND ($4 IS NULL OR status_at >= $4)";
                let total: i64 = sqlx::query(&format!("SELECT COUNT(*) AS n FROM a2a_tasks WHERE {FILTER}"))
                    .bind(owner.as_str())
                    .bind(context)
                    .bind(state.as_deref())
                    .bind(after)
                    .fetch_one(&self.read)
                    .await
                    .and_then(|r| r.try_get("n"))
                    .map_err(super::sql::db_err)
                    .map_err(a2a_err)?;
                let rows = sqlx::query(&format!(
                    "SELECT id, updated_at, task_json FROM a2a_tasks WHERE {FILTER} \
                     AND ($5 IS NULL OR updated_at < $5 OR (updated_at = $5 AND id < $6)) \
                     ORDER BY updated_at DESC, id DESC LIMIT $7"
                ))
                .bind(owner.as_str())
                .bind(context)
                .bind(state.as_deref())
                .bind(after)
                .bind(cursor.as_ref().map(|c| c.0))
                .bind(cursor.as_ref().map(|c| c.1.as_str()).unwrap_or(""))
                .bind(page_size as i64 + 1)
                .fetch_all(&self.read)
                .await
                .map_err(super::sql::db_err)
                .map_err(a2a_err)?;
                let more = rows.len() > page_size;
                let mut tasks = Vec::with_capacity(page_size);
                let mut last = None;
                for r in rows.iter().take(page_size) {
                    let json: String = r.try_get("task_json").map_err(super::sql::db_err).map_err(a2a_err)?;
                    let id: String = r.try_get("id").map_err(super::sql::db_err).map_err(a2a_err)?;
                    let updated: i64 = r.try_get("updated_at").map_err(super::sql::db_err).map_err(a2a_err)?;
                    tasks.push(listed(decode(&json)?, req));
                    last = Some((updated, id));
                }
                let next_page_token = match (more, last) {
                    (true, Some((c, id))) => encode_cursor(c, &id),
                    _ => String::new(),
                };
                Ok(ListTasksResponse {
                    tasks,
                    next_page_token,
                    page_size: page_size as i32,
                    total_size: i32::try_from(total).unwrap_or(i32::MAX),
                })
            }
        }

        #[async_trait]
        impl TaskStore for $name {
            async fn create(&self, task: Task) -> Result<TaskVersion, A2AError> {
                self.create_for(&caller()?, task).await
            }

            async fn list(&self, req: &ListTasksRequest) -> Result<ListTasksResponse, A2AError> {
                self.list_for(&caller()?, req).await
            }

            async fn update(&self, task: Task) -> Result<TaskVersion, A2AError> {
                use sqlx::Row as _;
                let json = encode(&task)?;
                let state = state_name(&task.status.state);
                let row = sqlx::query(
                    "UPDATE a2a_tasks SET task_json = $2, state = $3, terminal = $4, status_at = $5, version = version + 1, updated_at = $6, \
                     session_id = COALESCE($7, session_id) \
                     WHERE id = $1 AND (terminal = 0 OR state = $3) RETURNING version",
                )
                .bind(&task.id)
                .bind(json)
                .bind(&state)
                .bind(i64::from(task.status.state.is_terminal()))
                .bind(status_micros(&task))
                .bind(super::to_micros(std::time::SystemTime::now()))
                .bind(named_session(&task).map(|s| s.to_string()))
                .fetch_optional(&self.write)
                .await
                .map_err(super::sql::db_err)
                .map_err(a2a_err)?;
                if let Some(row) = row {
                    let v: i64 = row.try_get("version").map_err(super::sql::db_err).map_err(a2a_err)?;
                    return Ok(v as TaskVersion);
                }
                match TaskStore::get(self, &task.id).await? {
                    None => Err(A2AError::task_not_found(&task.id)),
                    Some(current) => Err(update_refused(&task.id, &current.status.state, &task.status.state)),
                }
            }

            async fn get(&self, task_id: &str) -> Result<Option<Task>, A2AError> {
                use sqlx::Row as _;
                let row = sqlx::query("SELECT task_json FROM a2a_tasks WHERE id = $1")
                    .bind(task_id)
                    .fetch_optional(&self.read)
                    .await
                    .map_err(super::sql::db_err)
                    .map_err(a2a_err)?;
                match row {
                    None => Ok(None),
                    Some(r) => {
                        let json: String = r.try_get("task_json").map_err(super::sql::db_err).map_err(a2a_err)?;
                        decode(&json).map(Some)
                    }
                }
            }

            async fn begin_cancel(&self, task_id: &str) -> Result<Task, A2AError> {
                use sqlx::Row as _;
                for _ in 0..CANCEL_ATTEMPTS {
                    let row = sqlx::query("SELECT task_json, version FROM a2a_tasks WHERE id = $1")
                        .bind(task_id)
                        .fetch_optional(&self.write)
                        .await
                        .map_err(super::sql::db_err)
                        .map_err(a2a_err)?
                        .ok_or_else(|| A2AError::task_not_found(task_id))?;
                    let json: String = row.try_get("task_json").map_err(super::sql::db_err).map_err(a2a_err)?;
                    let version: i64 = row.try_get("version").map_err(super::sql::db_err).map_err(a2a_err)?;
                    let mut task = decode(&json)?;
                    if task.status.state.is_terminal() {
                        return Err(A2AError::task_not_cancelable(task_id));
                    }
                    task.status.state = TaskState::Canceled;
                    task.status.timestamp = Some(chrono::Utc::now());
                    // Compare-and-set on the version: a write in between
                    // (the run's next update, another cancel) makes us re-read.
                    let done = sqlx::query(
                        "UPDATE a2a_tasks SET task_json = $3, state = $4, terminal = 1, status_at = $5, version = version + 1, updated_at = $6 \
                         WHERE id = $1 AND version = $2",
                    )
                    .bind(task_id)
                    .bind(version)
                    .bind(encode(&task)?)
                    .bind(state_name(&TaskState::Canceled))
                    .bind(status_micros(&task))
                    .bind(super::to_micros(std::time::SystemTime::now()))
                    .execute(&self.write)
                    .await
                    .map_err(super::sql::db_err)
                    .map_err(a2a_err)?;
                    if done.rows_affected() == 1 {
                        return Ok(task);
                    }
                }
                Err(A2AError::internal("the task changed too often to cancel; retry"))
            }
        }
    };
}

sql_task_store!(SqliteTasks, sqlx::Sqlite);
sql_task_store!(PostgresTasks, sqlx::Postgres);

/// The in-memory store's A2A tasks: one of the crate's in-memory task
/// stores per owner (so each lists and pages its owner's tasks only), with
/// sessions created in the memory store.
pub struct MemoryTasks {
    /// Each owner's tasks.
    by_owner: Mutex<HashMap<UserId, Arc<a2a_server::InMemoryTaskStore>>>,
    /// The owner of each task.
    owners: Mutex<HashMap<String, UserId>>,
    ensure: Box<EnsureSession>,
}

/// Creates a session in the memory store unless it exists.
type EnsureSession = dyn Fn(SessionId, &UserId) + Send + Sync;

impl MemoryTasks {
    /// `ensure` creates a session in the memory store unless it exists.
    pub fn new(ensure: impl Fn(SessionId, &UserId) + Send + Sync + 'static) -> Self {
        Self {
            by_owner: Mutex::default(),
            owners: Mutex::default(),
            ensure: Box::new(ensure),
        }
    }

    /// The store of `owner`'s tasks, created on first use when `create`.
    fn store_of(&self, owner: &UserId, create: bool) -> Option<Arc<a2a_server::InMemoryTaskStore>> {
        let mut by_owner = self.by_owner.lock().unwrap_or_else(|e| e.into_inner());
        if create {
            return Some(by_owner.entry(owner.clone()).or_default().clone());
        }
        by_owner.get(owner).cloned()
    }

    /// The store holding task `task_id`.
    fn store_with(&self, task_id: &str) -> Option<Arc<a2a_server::InMemoryTaskStore>> {
        let owner = self
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(task_id)
            .cloned()?;
        self.store_of(&owner, false)
    }
}

#[async_trait]
impl A2aTasks for MemoryTasks {
    async fn ensure_session(&self, id: SessionId, user: &UserId) -> StoreResult<()> {
        (self.ensure)(id, user);
        Ok(())
    }

    async fn create_for(&self, owner: &UserId, task: Task) -> Result<TaskVersion, A2AError> {
        let id = task.id.clone();
        if self.store_with(&id).is_some() {
            return Err(A2AError::internal("task already exists"));
        }
        let store = self.store_of(owner, true).expect("created");
        let version = store.create(task).await?;
        self.owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, owner.clone());
        Ok(version)
    }

    async fn list_for(
        &self,
        owner: &UserId,
        req: &ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError> {
        let store = self
            .store_of(owner, false)
            .unwrap_or_else(|| Arc::new(a2a_server::InMemoryTaskStore::new()));
        let mut page = store.list(req).await?;
        page.tasks = page.tasks.into_iter().map(|t| listed(t, req)).collect();
        Ok(page)
    }

    async fn owner(&self, task_id: &str) -> Result<Option<UserId>, A2AError> {
        Ok(self
            .owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(task_id)
            .cloned())
    }
}

#[async_trait]
impl TaskStore for MemoryTasks {
    async fn create(&self, task: Task) -> Result<TaskVersion, A2AError> {
        self.create_for(&caller()?, task).await
    }
    async fn update(&self, task: Task) -> Result<TaskVersion, A2AError> {
        match self.store_with(&task.id) {
            Some(store) => store.update(task).await,
            None => Err(A2AError::task_not_found(&task.id)),
        }
    }
    async fn get(&self, task_id: &str) -> Result<Option<Task>, A2AError> {
        match self.store_with(task_id) {
            Some(store) => store.get(task_id).await,
            None => Ok(None),
        }
    }
    async fn list(&self, req: &ListTasksRequest) -> Result<ListTasksResponse, A2AError> {
        self.list_for(&caller()?, req).await
    }
    async fn begin_cancel(&self, task_id: &str) -> Result<Task, A2AError> {
        match self.store_with(task_id) {
            Some(store) => store.begin_cancel(task_id).await,
            None => Err(A2AError::task_not_found(task_id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_maps_to_one_session_per_user() {
        let (alice, bob) = (
            UserId::parse("alice").unwrap(),
            UserId::parse("bob").unwrap(),
        );
        assert_eq!(context_session(&alice, "c1"), context_session(&alice, "c1"));
        assert_ne!(context_session(&alice, "c1"), context_session(&alice, "c2"));
        assert_ne!(context_session(&alice, "c1"), context_session(&bob, "c1"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        let (ab, a) = (UserId::parse("ab").unwrap(), UserId::parse("a").unwrap());
        assert_ne!(context_session(&ab, "c"), context_session(&a, "bc"));
        assert_eq!(context_session(&alice, "c1").as_uuid().get_version_num(), 8);
    }

    #[test]
    fn a_refused_update_names_its_task() {
        let e = update_refused("t-1", &TaskState::Canceled, &TaskState::Working);
        assert_eq!(refused_task_id(&e), Some("t-1"));
        assert_eq!(refused_task_id(&A2AError::invalid_request("task x")), None);
        assert_eq!(refused_task_id(&A2AError::task_not_found("t-1")), None);
    }

    #[test]
    fn a_page_token_round_trips_and_garbage_is_refused() {
        assert_eq!(
            decode_cursor(&encode_cursor(17, "t.1")).unwrap(),
            (17, "t.1".to_owned())
        );
        // The last is a token of the release that paged by creation.
        for bad in ["", "x", "12.", "x.y", ".t", "u12.", "u.t", "17.t.1"] {
            assert!(decode_cursor(bad).is_err(), "{bad}");
        }
    }
}
