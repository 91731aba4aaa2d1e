//! Our A2A client against our own server, in-process over its gRPC face.

mod a2a_support;

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
        matches!(&err, CallError::Task { state: TaskState::Rejected, message, .. } if message.contains("unknown agent")),
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
/// as text.
#[tokio::test]
async fn parts_the_agents_cannot_read_are_content_type_not_supported_and_no_task() {
    use a2a::{Message, Part, Role, SendMessageRequest, SendMessageResponse};
    let (client, _tool, stop, handle) = a2a_support::in_process(Duration::ZERO).await;
    let send = |parts: Vec<Part>| SendMessageRequest {
        message: Message::new(Role::User, parts),
        configuration: None,
        metadata: Some([("agent".to_owned(), serde_json::json!("echo"))].into()),
        tenant: None,
    };
    for parts in [
        vec![Part::data(serde_json::json!({"order": 1187}))],
        vec![
            Part::text("see this"),
            Part::url("https://example.com/x.png"),
        ],
        vec![Part::raw(vec![0xff, 0xfe]).with_media_type("text/plain")],
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
        .list_tasks(&a2a::ListTasksRequest {
            context_id: None,
            status: None,
            page_size: None,
            page_token: None,
            history_length: None,
            status_timestamp_after: None,
            include_artifacts: None,
            tenant: None,
        })
        .await
        .unwrap();
    assert!(listed.tasks.is_empty(), "{:?}", listed.tasks);

    let text = Part::raw(b"hello as bytes".to_vec()).with_media_type("text/plain");
    let SendMessageResponse::Task(t) = client.raw().send_message(&send(vec![text])).await.unwrap()
    else {
        panic!("not a task")
    };
    assert_eq!(t.status.state, TaskState::Completed);
    let answer: String = t
        .artifacts
        .iter()
        .flatten()
        .map(|a| parts_text(&a.parts))
        .collect();
    assert_eq!(answer, "hello as bytes");
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
