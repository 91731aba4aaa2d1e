//! Our A2A client against our own server, in-process over its gRPC face.

mod a2a_support;
mod store_wrap;

use std::sync::Arc;
use std::time::Duration;

use a2a::{PartContent, StreamResponse, TaskState};
use agentd::client::a2a::{CallError, CallOptions, CallState, Control, Outcome, parts_text};

fn opts() -> CallOptions {
    CallOptions {
        idle_timeout: Duration::from_secs(10),
        deadline: Duration::from_secs(30),
        ..CallOptions::default()
    }
}

#[tokio::test]
async fn our_client_gets_the_worked_trace_from_our_server_as_a2a() {
    let (client, tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    let mut tools = Vec::new();
    let mut watch = |ev: &StreamResponse, _: &CallState| {
        if let StreamResponse::StatusUpdate(u) = ev {
            for p in u.status.message.iter().flat_map(|m| &m.parts) {
                if let PartContent::Data(d) = &p.content {
                    tools.push(d.as_object().unwrap().keys().next().unwrap().clone());
                }
            }
        }
        Control::Continue
    };
    let out = client
        .send_text("Where is order 1187?", None, &opts(), Some(&mut watch))
        .await
        .unwrap();
    let Outcome::Completed {
        task_id,
        artifacts,
        incomplete,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(tools, ["toolCall", "toolResult"]);
    assert_eq!(artifacts.len(), 1);
    assert!(
        parts_text(&artifacts[0].parts).contains("1187"),
        "{artifacts:?}"
    );
    assert!(!incomplete);
    assert_eq!(tool.completed(), 1);
    assert_eq!(
        client.get_task(&task_id).await.unwrap().status.state,
        TaskState::Completed
    );

    let agent = Some(
        [("agent".to_owned(), serde_json::json!("stream"))]
            .into_iter()
            .collect(),
    );
    let out = client
        .send_text("n=3 size=2", agent, &opts(), None)
        .await
        .unwrap();
    let Outcome::Completed { artifacts, .. } = out else {
        panic!("{out:?}")
    };
    // The stream agent's final answer is not its streamed text: it replaces it.
    assert_eq!(parts_text(&artifacts[0].parts), "sent 3 events");

    let agent = Some(
        [("agent".to_owned(), serde_json::json!("nobody"))]
            .into_iter()
            .collect(),
    );
    let err = client
        .send_text("hi", agent, &opts(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CallError::Refused(e) if e.code == a2a::error_code::INVALID_PARAMS && e.message.contains("no such agent")),
        "{err:?}"
    );
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_client_deadline_cancels_our_run_through_the_drop_path() {
    let (client, tool, stop, handle) = a2a_support::in_process(Duration::from_secs(30)).await;
    let o = CallOptions {
        deadline: Duration::from_secs(1),
        ..opts()
    };
    let err = client
        .send_text("Where is order 1187?", None, &o, None)
        .await
        .unwrap_err();
    let CallError::Deadline {
        task_id: Some(task_id),
        ..
    } = err
    else {
        panic!("{err:?}")
    };
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while tool.cancelled() == 0 {
        assert!(
            tokio::time::Instant::now() < until,
            "the slow tool was not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(tool.completed(), 0);
    assert_eq!(
        client.get_task(&task_id).await.unwrap().status.state,
        TaskState::Canceled
    );
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

/// A message part our agents cannot read is ContentTypeNotSupported before
/// any task is made (a data part declares no media type, which the
/// handler's own check lets through); bytes declared text/plain are read
/// as text, and text/plain is so with a charset parameter and in any case.
#[tokio::test]
async fn parts_the_agents_cannot_read_are_content_type_not_supported_and_no_task() {
    use a2a::{Part, SendMessageResponse};
    let (client, _tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    let send = |parts: Vec<Part>| a2a_support::echo_request(parts);
    for parts in [
        vec![Part::data(serde_json::json!({"order": 1187}))],
        vec![
            Part::text("see this"),
            Part::url("https://example.com/x.png"),
        ],
        vec![Part::raw(vec![0xff, 0xfe]).with_media_type("text/plain")],
        vec![Part::raw(b"hello".to_vec()).with_media_type("image/png")],
        vec![Part::text("{}").with_media_type("application/json")],
        vec![Part::text("hi").with_media_type("text/plainer")],
    ] {
        let err = client
            .raw()
            .send_message(&send(parts.clone()))
            .await
            .unwrap_err();
        assert_eq!(
            err.code,
            a2a::error_code::CONTENT_TYPE_NOT_SUPPORTED,
            "{parts:?}: {err:?}"
        );
    }
    let listed = client
        .raw()
        .list_tasks(&a2a_support::all_tasks())
        .await
        .unwrap();
    assert!(listed.tasks.is_empty(), "{:?}", listed.tasks);

    let text = Part::raw(b"hello as bytes".to_vec()).with_media_type("text/plain");
    let SendMessageResponse::Task(t) = client.raw().send_message(&send(vec![text])).await.unwrap()
    else {
        panic!("not a task")
    };
    assert_eq!(t.status.state, TaskState::Completed);
    assert_eq!(a2a_support::answer_of(&t), "hello as bytes");
    for media_type in [
        "text/plain; charset=utf-8",
        "TEXT/PLAIN",
        "Text/Plain;charset=UTF-8",
    ] {
        for part in [
            Part::text("hello, declared").with_media_type(media_type),
            Part::raw(b"hello, declared".to_vec()).with_media_type(media_type),
        ] {
            let SendMessageResponse::Task(t) = client
                .raw()
                .send_message(&send(vec![part.clone()]))
                .await
                .unwrap_or_else(|e| panic!("{part:?}: {e:?}"))
            else {
                panic!("not a task")
            };
            assert_eq!(t.status.state, TaskState::Completed, "{part:?}");
            assert_eq!(a2a_support::answer_of(&t), "hello, declared");
        }
    }
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

/// A message is bounded outside its text too (its metadata, extensions,
/// referenceTaskIds, the parts' metadata): one past 64 KiB of that is
/// InvalidParams, and nothing is stored; text up to `--max-input-bytes`
/// beside small metadata runs.
#[tokio::test]
async fn a_message_with_too_much_besides_its_text_is_invalid_params_and_no_task() {
    use a2a::{Part, SendMessageResponse};
    let (client, _tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    let blob = serde_json::json!("x".repeat(1 << 20));
    let mut in_metadata = a2a_support::echo_request(vec![Part::text("hi")]);
    in_metadata.message.metadata = Some([("blob".to_owned(), blob.clone())].into());
    let mut in_a_part = a2a_support::echo_request(vec![Part {
        metadata: Some([("blob".to_owned(), blob)].into()),
        ..Part::text("hi")
    }]);
    in_a_part.message.metadata = None;
    let mut referenced = a2a_support::echo_request(vec![Part::text("hi")]);
    referenced.message.reference_task_ids = Some(vec!["t".repeat(200); 400]);
    for req in [in_metadata, in_a_part, referenced] {
        for streaming in [false, true] {
            let err = if streaming {
                client.raw().send_streaming_message(&req).await.err()
            } else {
                client.raw().send_message(&req).await.err()
            };
            let err = err.expect("a message of 1 MiB outside its text was taken");
            assert_eq!(err.code, a2a::error_code::INVALID_PARAMS, "{err:?}");
            assert!(err.message.contains("outside its text"), "{err:?}");
        }
    }
    let listed = client
        .raw()
        .list_tasks(&a2a_support::all_tasks())
        .await
        .unwrap();
    assert!(listed.tasks.is_empty(), "{:?}", listed.tasks);

    // The text is not counted: 60 KiB of it, under --max-input-bytes.
    let text = "y".repeat(60 * 1024);
    let mut req = a2a_support::echo_request(vec![Part::text(text.clone())]);
    req.message.metadata = Some([("note".to_owned(), serde_json::json!("small"))].into());
    let SendMessageResponse::Task(t) = client.raw().send_message(&req).await.unwrap() else {
        panic!("not a task")
    };
    assert_eq!(t.status.state, TaskState::Completed);
    assert_eq!(a2a_support::answer_of(&t), text);
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

/// A stream's task snapshots keep at most `historyLength` messages, as the
/// blocking answer's task does.
#[tokio::test]
async fn a_streams_task_snapshot_keeps_at_most_history_length_messages() {
    use a2a::{Message, Part, Role, SendMessageConfiguration, SendMessageRequest};
    use futures::StreamExt;
    let (client, _tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    for (history_length, want) in [(Some(0), 0), (None, 1)] {
        let req = SendMessageRequest {
            message: Message::new(Role::User, vec![Part::text("hello")]),
            configuration: Some(SendMessageConfiguration {
                accepted_output_modes: None,
                task_push_notification_config: None,
                history_length,
                return_immediately: None,
            }),
            metadata: Some([("agent".to_owned(), serde_json::json!("echo"))].into()),
            tenant: None,
        };
        let mut events = client.raw().send_streaming_message(&req).await.unwrap();
        let mut snapshots = 0;
        while let Some(ev) = events.next().await {
            if let StreamResponse::Task(t) = ev.unwrap() {
                snapshots += 1;
                let n = t.history.map_or(0, |h| h.len());
                assert_eq!(n, want, "historyLength {history_length:?}");
            }
        }
        assert!(snapshots > 0);
    }
    let _ = stop.send(());
    handle.await.unwrap().unwrap();
}

/// Which update of a task's [`Failing`] store refuses, once.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Refuse {
    /// The update that stores the task's terminal state.
    Terminal,
    /// The first update that stores an artifact chunk.
    Chunk,
}

/// A memory store whose A2A tasks fail as [`FailingTasks`] with `refuse`
/// (`refused`: the one refusal spent already) and `refuse_sessions` say;
/// with its failing tasks, for the test to steer.
fn failing_store(
    refuse: Refuse,
    refused: bool,
    refuse_sessions: bool,
) -> (Arc<store_wrap::Wrapped>, Arc<FailingTasks>) {
    use agentd::store::a2a_tasks::A2aTaskSource;
    let inner = Arc::new(agentd::store::memory::MemoryStore::new());
    let tasks = Arc::new(FailingTasks {
        inner: inner.a2a_tasks(),
        refuse,
        refused: std::sync::atomic::AtomicBool::new(refused),
        hang_gets: Default::default(),
        refuse_sessions,
    });
    let store = Arc::new(store_wrap::Wrapped {
        hooks: Arc::new(Failing(tasks.clone())),
        inner,
    });
    (store, tasks)
}

struct FailingTasks {
    inner: Arc<dyn agentd::store::a2a_tasks::A2aTasks>,
    refuse: Refuse,
    refused: std::sync::atomic::AtomicBool,
    /// Once set, reads of a task never answer (a database that stopped
    /// answering on a connection already open).
    hang_gets: std::sync::atomic::AtomicBool,
    /// The store refuses to create a context's session (it failed over).
    refuse_sessions: bool,
}

#[async_trait::async_trait]
impl a2a_server::TaskStore for FailingTasks {
    async fn create(
        &self,
        t: a2a::Task,
    ) -> Result<a2a_server::task_store::TaskVersion, a2a::A2AError> {
        self.inner.create(t).await
    }
    async fn update(
        &self,
        t: a2a::Task,
    ) -> Result<a2a_server::task_store::TaskVersion, a2a::A2AError> {
        use std::sync::atomic::Ordering;
        let hit = match self.refuse {
            Refuse::Terminal => t.status.state.is_terminal(),
            Refuse::Chunk => t.artifacts.as_ref().is_some_and(|a| !a.is_empty()),
        };
        if hit && !self.refused.swap(true, Ordering::SeqCst) {
            return Err(a2a::A2AError::internal("the task store failed over"));
        }
        self.inner.update(t).await
    }
    async fn get(&self, id: &str) -> Result<Option<a2a::Task>, a2a::A2AError> {
        if self.hang_gets.load(std::sync::atomic::Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.get(id).await
    }
    async fn list(
        &self,
        r: &a2a::ListTasksRequest,
    ) -> Result<a2a::ListTasksResponse, a2a::A2AError> {
        self.inner.list(r).await
    }
    async fn begin_cancel(&self, id: &str) -> Result<a2a::Task, a2a::A2AError> {
        self.inner.begin_cancel(id).await
    }
}

#[async_trait::async_trait]
impl agentd::store::a2a_tasks::A2aTasks for FailingTasks {
    async fn ensure_session(
        &self,
        id: agentd::domain::SessionId,
        user: &agentd::domain::UserId,
    ) -> agentd::store::StoreResult<()> {
        if self.refuse_sessions {
            return Err(agentd::store::StoreError::Unavailable(anyhow::anyhow!(
                "the store failed over"
            )));
        }
        self.inner.ensure_session(id, user).await
    }
    async fn create_for(
        &self,
        owner: &agentd::domain::UserId,
        t: a2a::Task,
    ) -> Result<a2a_server::task_store::TaskVersion, a2a::A2AError> {
        self.inner.create_for(owner, t).await
    }
    async fn list_for(
        &self,
        owner: &agentd::domain::UserId,
        r: &a2a::ListTasksRequest,
    ) -> Result<a2a::ListTasksResponse, a2a::A2AError> {
        self.inner.list_for(owner, r).await
    }
    async fn owner(&self, id: &str) -> Result<Option<agentd::domain::UserId>, a2a::A2AError> {
        self.inner.owner(id).await
    }
}

/// The memory store's A2A task store, refusing one update.
struct Failing(Arc<FailingTasks>);

impl store_wrap::Hooks for Failing {
    fn a2a_tasks(
        &self,
        _inner: &dyn agentd::store::Store,
    ) -> Arc<dyn agentd::store::a2a_tasks::A2aTasks> {
        self.0.clone()
    }
}

/// A task whose run ended while its updates could not be stored (the
/// handler stops at the first it cannot store) still gets its end: the
/// task does not read WORKING for ever. Its answer is the turn's.
#[tokio::test]
async fn a_task_whose_update_could_not_be_stored_still_gets_its_end() {
    use a2a::Part;
    use futures::StreamExt;
    for refuse in [Refuse::Terminal, Refuse::Chunk] {
        let (store, _) = failing_store(refuse, false, false);
        let server = a2a_support::A2aServer::start_on(store).await;
        let client = server.grpc_client().await;
        let req = a2a_support::echo_request(vec![Part::text("hello there")]);
        let mut events = client.raw().send_streaming_message(&req).await.unwrap();
        let mut task_id = None;
        while let Some(ev) = events.next().await {
            match ev {
                Ok(StreamResponse::Task(t)) => task_id = Some(t.id),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let task_id = task_id.expect("the stream named its task");
        let task = a2a_support::ended_task(&client, &task_id, Duration::from_millis(25)).await;
        assert!(
            task.status.state.is_terminal(),
            "{refuse:?}: the task reads {:?}",
            task.status.state
        );
        if task.status.state == TaskState::Completed {
            assert_eq!(a2a_support::answer_of(&task), "hello there", "{refuse:?}");
        }
        server.stop().await;
    }
}

/// A task whose run the store refused before it started (its context's
/// session could not be made), and whose end (FAILED) the store refused
/// too, is still ended: it does not read SUBMITTED for ever.
#[tokio::test]
async fn a_task_whose_run_and_end_the_store_refused_still_gets_its_end() {
    use a2a::Part;
    use futures::StreamExt;
    let (store, _) = failing_store(Refuse::Terminal, false, true);
    let server = a2a_support::A2aServer::start_on(store).await;
    let client = server.grpc_client().await;
    let req = a2a_support::echo_request(vec![Part::text("hello there")]);
    let mut events = client.raw().send_streaming_message(&req).await.unwrap();
    let mut task_id = None;
    for _ in 0..64 {
        match events.next().await {
            Some(Ok(StreamResponse::Task(t))) => task_id = Some(t.id),
            Some(Ok(_)) => {}
            Some(Err(_)) | None => break,
        }
    }
    let task_id = task_id.expect("the stream named its task");
    let task = a2a_support::ended_task(&client, &task_id, Duration::from_millis(25)).await;
    assert_eq!(task.status.state, TaskState::Failed, "{:?}", task.status);
    server.stop().await;
}

/// The A2A task store's calls are bounded by the store timeout, as the
/// session store's are, and counted: a read that never answers fails the
/// call (retry later) instead of holding it until TCP gives up.
#[tokio::test]
async fn a_task_read_that_never_answers_fails_at_the_store_timeout_and_is_counted() {
    use a2a::Part;
    // Refused already: every update is stored.
    let (store, tasks) = failing_store(Refuse::Terminal, true, false);
    let metered = agentd::store::metered::Metered::new(store, Some(Duration::from_millis(500)));
    let server = a2a_support::A2aServer::start_on(Arc::new(metered)).await;
    let client = server.grpc_client().await;
    let req = a2a_support::echo_request(vec![Part::text("hello")]);
    let task = match client.raw().send_message(&req).await.unwrap() {
        a2a::SendMessageResponse::Task(t) => t,
        other => panic!("not a task: {other:?}"),
    };
    let errors = || {
        agentd::telemetry::metrics::render()
            .lines()
            .find_map(|l| {
                l.strip_prefix("agentd_store_errors_total{op=\"a2a_get\",error=\"unavailable\"} ")
            })
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let before = errors();
    tasks
        .hang_gets
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = tokio::time::timeout(Duration::from_secs(10), client.get_task(&task.id))
        .await
        .expect("GetTask answered by itself")
        .unwrap_err();
    assert!(err.message.contains("unavailable"), "{err:?}");
    assert_eq!(errors(), before + 1.0);
    server.stop().await;
}
