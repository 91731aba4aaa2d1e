//! The life of an A2A task on our server, as a client sees it: what a
//! message may ask for before a task is made, and how a stream of a task
//! begins, for a new task and for a reply to one that waits for input.

mod a2a_support;

use std::time::Duration;

use a2a::{
    GetTaskRequest, Message, Part, Role, SendMessageConfiguration, SendMessageRequest,
    SendMessageResponse, StreamResponse, Task, TaskPushNotificationConfig, TaskState,
};
use a2a_support::A2aServer;
use agentd::client::a2a::parts_text;
use futures::StreamExt;

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
            let answer: String = task
                .artifacts
                .iter()
                .flatten()
                .map(|a| parts_text(&a.parts))
                .collect();
            assert_eq!(answer, "and now?");
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
