//! The life of an A2A task on our server, as a client sees it: what a
//! message may ask for before a task is made, and how a stream of a task
//! begins, for a new task and for a reply to one that waits for input, and
//! how a run ends when its task is cancelled through another replica.

mod a2a_support;
mod support;

use std::time::Duration;

use a2a::{
    GetTaskRequest, Message, Part, Role, SendMessageConfiguration, SendMessageRequest,
    SendMessageResponse, StreamResponse, Task, TaskPushNotificationConfig, TaskState,
};
use a2a_support::{A2aServer, a2a_at, answer_of};
use agentd::client::a2a::parts_text;
use futures::StreamExt;
use support::{Backend, Child, TestDb};

/// A replica of `agentd serve` on the PostgreSQL database `store`.
async fn replica(store: &str, id: &str, extra: &[&str]) -> Child {
    let mut args = vec!["--store", store, "--a2a-listen", "off", "--replica-id", id];
    args.extend_from_slice(extra);
    Child::serve(&args).await
}

/// Events a stream may carry before the test gives up on its end.
const MOST_EVENTS: usize = 64;

fn push_config() -> SendMessageConfiguration {
    SendMessageConfiguration {
        accepted_output_modes: None,
        task_push_notification_config: Some(TaskPushNotificationConfig {
            url: "http://127.0.0.1:9/hook".into(),
            id: None,
            task_id: String::new(),
            token: None,
            authentication: None,
            tenant: None,
        }),
        history_length: None,
        return_immediately: None,
    }
}

/// Push notifications are off: a message asking for them is refused with
/// PushNotificationNotSupported over either call, and no task is left
/// behind (the handler used to store the task, then refuse, and run
/// nothing: a task SUBMITTED for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_asking_for_push_notifications_is_refused_and_leaves_no_task() {
    let server = A2aServer::start(Duration::ZERO).await;
    let client = server.grpc_client().await;
    let req = SendMessageRequest {
        configuration: Some(push_config()),
        ..a2a_support::echo_request(vec![Part::text("hello")])
    };
    let err = client.raw().send_message(&req).await.unwrap_err();
    assert_eq!(
        err.code,
        a2a::error_code::PUSH_NOTIFICATION_NOT_SUPPORTED,
        "{err:?}"
    );
    let err = match client.raw().send_streaming_message(&req).await {
        Err(e) => e,
        Ok(mut events) => match events.next().await {
            Some(Err(e)) => e,
            other => panic!("the stream was not refused: {other:?}"),
        },
    };
    assert_eq!(
        err.code,
        a2a::error_code::PUSH_NOTIFICATION_NOT_SUPPORTED,
        "{err:?}"
    );
    let listed = client
        .raw()
        .list_tasks(&a2a_support::all_tasks())
        .await
        .unwrap();
    assert_eq!(listed.total_size, 0, "{:?}", listed.tasks);
    // A message without the push config is served as usual.
    let answered = client
        .raw()
        .send_message(&a2a_support::echo_request(vec![Part::text("hello")]))
        .await
        .unwrap();
    assert!(
        matches!(answered, SendMessageResponse::Task(t) if t.status.state == TaskState::Completed)
    );
    server.stop().await;
}

/// A task of the conformance agent that waits for input (INPUT_REQUIRED).
async fn waiting_task(client: &agentd::client::a2a::A2aClient) -> Task {
    let message = Message {
        message_id: format!("tck-input-required-{}", uuid::Uuid::new_v4()),
        ..Message::new(Role::User, vec![Part::text("start")])
    };
    let req = SendMessageRequest {
        message,
        configuration: None,
        metadata: None,
        tenant: None,
    };
    match client.raw().send_message(&req).await.unwrap() {
        SendMessageResponse::Task(t) => {
            assert_eq!(t.status.state, TaskState::InputRequired);
            t
        }
        other => panic!("not a task: {other:?}"),
    }
}

/// The reply to `task`, to the echo agent (or, with `message_id`, one the
/// conformance agent scripts).
fn reply(task: &Task, text: &str, message_id: Option<String>) -> SendMessageRequest {
    let mut message = Message {
        task_id: Some(task.id.clone()),
        context_id: Some(task.context_id.clone()),
        ..Message::new(Role::User, vec![Part::text(text)])
    };
    if let Some(id) = message_id {
        message.message_id = id;
    }
    SendMessageRequest {
        message,
        configuration: None,
        metadata: Some([("agent".to_owned(), serde_json::json!("echo"))].into()),
        tenant: None,
    }
}

/// The stored task, with its whole history.
async fn stored(client: &agentd::client::a2a::A2aClient, id: &str) -> Task {
    client
        .raw()
        .get_task(&GetTaskRequest {
            id: id.to_owned(),
            history_length: None,
            tenant: None,
        })
        .await
        .unwrap()
}

fn history_texts(task: &Task) -> Vec<String> {
    task.history
        .iter()
        .flatten()
        .map(|m| parts_text(&m.parts))
        .collect()
}

/// Spec (SendStreamingMessage): the stream begins with the Task. A reply
/// to a task that waits for input begins with it too (it began with a
/// WORKING status update), the task as the reply continues it: its history
/// with the reply last. It ends COMPLETED with the agent's answer, the
/// history stored once each (a blocking reply too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_reply_to_a_waiting_task_begins_with_the_task() {
    let server = A2aServer::start_with(Duration::ZERO, Some(Duration::from_millis(200))).await;
    let client = server.grpc_client().await;
    for scripted in [false, true] {
        let task = waiting_task(&client).await;
        let message_id = scripted.then(|| format!("tck-complete-task-{}", uuid::Uuid::new_v4()));
        let req = reply(&task, "and now?", message_id);
        let mut events = client.raw().send_streaming_message(&req).await.unwrap();
        let mut seen = Vec::new();
        while let Some(ev) = events.next().await {
            seen.push(ev.unwrap());
            assert!(seen.len() < MOST_EVENTS, "the stream does not end");
        }
        let Some(StreamResponse::Task(first)) = seen.first() else {
            panic!("scripted {scripted}: the stream does not begin with the task: {seen:?}")
        };
        assert_eq!(first.id, task.id);
        assert_eq!(first.status.state, TaskState::Working);
        assert_eq!(history_texts(first), ["start", "and now?"]);
        let Some(StreamResponse::StatusUpdate(last)) = seen.last() else {
            panic!("no status at the end: {seen:?}")
        };
        assert_eq!(last.status.state, TaskState::Completed, "{seen:?}");
        let task = stored(&client, &task.id).await;
        assert_eq!(task.status.state, TaskState::Completed);
        assert_eq!(history_texts(&task), ["start", "and now?"]);
        if !scripted {
            assert_eq!(answer_of(&task), "and now?");
        }
    }
    let task = waiting_task(&client).await;
    let answered = client
        .raw()
        .send_message(&reply(&task, "blocking", None))
        .await
        .unwrap();
    assert!(
        matches!(answered, SendMessageResponse::Task(t) if t.status.state == TaskState::Completed)
    );
    assert_eq!(
        history_texts(&stored(&client, &task.id).await),
        ["start", "blocking"]
    );
    server.stop().await;
}

/// A CancelTask served by another replica stops the run where it runs, at
/// once: the run used to go on (here, a tool call of a minute, then the
/// answer) until its next update was refused, holding its run slot and
/// adding its answer to the context's history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cancelled_through_another_replica_stops_its_run_promptly() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = replica(&db.url, "replica-a", &["--tool-delay", "60s"]).await;
    let b = replica(&db.url, "replica-b", &[]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);
    let req = SendMessageRequest {
        message: Message::new(Role::User, vec![Part::text("Where is order 1187?")]),
        configuration: None,
        metadata: None,
        tenant: None,
    };
    let mut sent = on_a.raw().send_streaming_message(&req).await.unwrap();
    let task = match sent.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t,
        other => panic!("first event is not the task: {other:?}"),
    };
    // Read until the tool call: the tool then sleeps for a minute.
    a2a_support::until_tool_call(&mut sent).await;
    assert_eq!(
        on_b.cancel(&task.id).await.unwrap().status.state,
        TaskState::Canceled
    );
    let cancelled = std::time::Instant::now();

    // The turn on A ends CANCELLED within seconds, not after the tool's minute.
    let session = task.metadata.as_ref().unwrap()[agentd::store::a2a_tasks::SESSION_METADATA_KEY]
        .as_str()
        .unwrap()
        .to_owned();
    let mut ended = None;
    for _ in 0..100 {
        let s = a
            .client
            .raw()
            .get_session(agentd::pb::GetSessionRequest {
                user_id: agentd::store::a2a_tasks::A2A_USER.into(),
                session_id: session.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ended = s
            .turns
            .into_iter()
            .find(|t| t.state() != agentd::pb::TurnState::Running);
        if ended.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let turn = ended.expect("the run on A was not stopped within 10 s of the cancel");
    assert_eq!(turn.state(), agentd::pb::TurnState::Cancelled, "{turn:?}");
    assert!(cancelled.elapsed() < Duration::from_secs(10));

    // A's stream of the task ends with the CANCELED status.
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(10), sent.collect::<Vec<_>>())
        .await
        .expect("A's stream did not end");
    let Some(Ok(StreamResponse::StatusUpdate(end))) = rest.last() else {
        panic!("A's stream did not end with a status: {rest:?}")
    };
    assert_eq!(end.status.state, TaskState::Canceled, "{rest:?}");
    for c in [&on_a, &on_b] {
        assert_eq!(stored(c, &task.id).await.status.state, TaskState::Canceled);
    }
    a.kill9().await;
    b.kill9().await;
}

/// Spec (SubscribeToTask): any task not in a terminal state can be
/// subscribed to, and the stream begins with the Task. One that waits for
/// input streams the task as it waits, then ends (nothing runs until a
/// reply); it used to answer TaskNotFound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribing_to_a_task_waiting_for_input_streams_the_task() {
    let server = A2aServer::start_with(Duration::ZERO, Some(Duration::from_millis(200))).await;
    let client = server.grpc_client().await;
    let task = waiting_task(&client).await;
    let events = client
        .raw()
        .subscribe_to_task(&a2a::SubscribeToTaskRequest {
            id: task.id.clone(),
            tenant: None,
        })
        .await
        .unwrap();
    let seen: Vec<_> = tokio::time::timeout(
        Duration::from_secs(10),
        events.take(MOST_EVENTS).collect::<Vec<_>>(),
    )
    .await
    .expect("the stream did not end");
    let [Ok(StreamResponse::Task(first))] = seen.as_slice() else {
        panic!("not the task alone: {seen:?}")
    };
    assert_eq!(first.id, task.id);
    assert_eq!(first.status.state, TaskState::InputRequired);
    assert_eq!(history_texts(first), ["start"]);
    // The task still takes its reply.
    let answered = client
        .raw()
        .send_message(&reply(&task, "go on", None))
        .await
        .unwrap();
    assert!(
        matches!(answered, SendMessageResponse::Task(t) if t.status.state == TaskState::Completed)
    );
    server.stop().await;
}

/// A stream whose reader falls behind its run goes on from the task as it
/// stands, and loses nothing. The crate keeps 32 updates per run for its
/// subscribers; one further behind used to get INTERNAL "Internal error"
/// and lose the rest of the run. Here the client's HTTP/2 windows (1 KiB)
/// hold the server back while the client reads nothing for the first 1.5 s
/// of a run of 2,800 chunks paced over 7 s, then reads slower than the run
/// for 4.5 s (it falls behind again and again: more often than the bound
/// on resumes that deliver nothing), then keeps up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_falls_behind_its_run_goes_on_from_the_task_and_loses_nothing() {
    const CHUNKS: usize = 2800;
    const SIZE: usize = 16;
    let server = A2aServer::start(Duration::ZERO).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .initial_stream_window_size(1024)
        .initial_connection_window_size(1024)
        .connect()
        .await
        .unwrap();
    let client = agentd::client::a2a::A2aClient::from_transport(Box::new(
        a2a_grpc::GrpcTransport::from_channel(channel),
    ));
    let mut message = Message::new(
        Role::User,
        vec![Part::text(format!("n={CHUNKS} size={SIZE} rate=400"))],
    );
    message.metadata = Some([("agent".to_owned(), serde_json::json!("stream"))].into());
    let req = SendMessageRequest {
        message,
        configuration: None,
        metadata: None,
        tenant: None,
    };
    let mut events = client.raw().send_streaming_message(&req).await.unwrap();
    let first = events.next().await.unwrap().unwrap();
    assert!(matches!(first, StreamResponse::Task(_)), "{first:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let slow_until = tokio::time::Instant::now() + Duration::from_millis(4500);

    // The answer's text as the client holds it: a Task replaces it, an
    // appended chunk adds to it. Just before the final answer (which
    // replaces the streamed text) it must be every chunk, once.
    let (mut text, mut streamed, mut snapshots, mut end) = (0, None, 0, None);
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(ev) = events.next().await {
            if tokio::time::Instant::now() < slow_until {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            match ev.unwrap_or_else(|e| panic!("the stream failed after {text} bytes: {e:?}")) {
                StreamResponse::Task(t) => {
                    snapshots += 1;
                    end = Some(t.status.state.clone());
                    let answer = answer_of(&t);
                    if t.status.state == TaskState::Completed {
                        // Fell behind once more at the very end: the
                        // snapshot holds the final answer.
                        assert_eq!(answer, format!("sent {CHUNKS} events"));
                        streamed = Some(CHUNKS * SIZE);
                    }
                    text = answer.len();
                }
                StreamResponse::ArtifactUpdate(u) if u.last_chunk == Some(true) => {
                    streamed = Some(text);
                }
                StreamResponse::ArtifactUpdate(u) => {
                    assert_eq!(u.append.unwrap_or(false), text > 0, "{u:?}");
                    text += parts_text(&u.artifact.parts).len();
                    assert!(text <= CHUNKS * SIZE, "chunks repeated: {text} bytes");
                }
                StreamResponse::StatusUpdate(s) => end = Some(s.status.state),
                StreamResponse::Message(m) => panic!("{m:?}"),
            }
        }
    });
    read.await.expect("the stream does not end");
    assert!(
        snapshots > 8,
        "the stream fell behind only {snapshots} times: the bound on resumes was not tested"
    );
    assert_eq!(streamed, Some(CHUNKS * SIZE), "chunks lost or repeated");
    assert_eq!(end, Some(TaskState::Completed));
    server.stop().await;
}
