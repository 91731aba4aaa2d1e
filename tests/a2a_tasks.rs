//! A2A tasks live in our store: they survive a restart of `agentd serve` on
//! a SQLite file, any replica on one PostgreSQL database answers for any
//! task (GetTask, ListTasks, SubscribeToTask), and an A2A context keeps its
//! session (the agent's memory) across restarts and replicas.

mod a2a_support;
mod support;

use std::time::Duration;

use a2a::{
    ListTasksRequest, Message, Part, Role, SendMessageRequest, StreamResponse,
    SubscribeToTaskRequest, TaskState,
};
use a2a_support::{a2a_at, answer_of};
use agentd::client::a2a::{A2aClient, CallOptions, Outcome, parts_text};
use futures::StreamExt;
use support::*;

const ORDER_Q: &str = "Where is order 1187?";
const FOLLOW_UP: &str = "and when will it arrive?";
const ANSWER: &str =
    "Order 1187 (2 x espresso cups) has shipped with DHL and should arrive on 2026-12-04.";

fn opts() -> CallOptions {
    CallOptions {
        idle_timeout: Duration::from_secs(20),
        deadline: Duration::from_secs(60),
        ..CallOptions::default()
    }
}

async fn serve(store: &str, extra: &[&str]) -> Child {
    let mut args = vec!["--store", store, "--a2a-listen", "off"];
    args.extend_from_slice(extra);
    Child::serve(&args).await
}

/// Replica A on `store`, whose tool calls take a minute: its tasks stay
/// working while a test looks at them from elsewhere.
async fn slow_replica_a(store: &str) -> Child {
    serve(store, &["--replica-id", "replica-a", "--tool-delay", "60s"]).await
}

fn user_message(text: &str, context_id: Option<&str>) -> Message {
    Message {
        context_id: context_id.map(str::to_owned),
        ..Message::new(Role::User, vec![Part::text(text)])
    }
}

/// A SendMessage request of `message` alone.
fn send_request(message: Message) -> SendMessageRequest {
    SendMessageRequest {
        message,
        configuration: None,
        metadata: None,
        tenant: None,
    }
}

/// Sends `text` (in `context_id`, if given) and returns (task id, context
/// id, answer text) of the completed task.
async fn ask(client: &A2aClient, text: &str, context_id: Option<&str>) -> (String, String, String) {
    let out = client
        .send(user_message(text, context_id), &opts(), None)
        .await
        .unwrap();
    let Outcome::Completed {
        task_id,
        context_id,
        artifacts,
        incomplete,
        ..
    } = out
    else {
        panic!("not completed: {out:?}")
    };
    assert!(!incomplete);
    let answer = artifacts.iter().map(|a| parts_text(&a.parts)).collect();
    (task_id, context_id, answer)
}

async fn list(client: &A2aClient, req: ListTasksRequest) -> a2a::ListTasksResponse {
    client.raw().list_tasks(&req).await.unwrap()
}

fn all_tasks() -> ListTasksRequest {
    ListTasksRequest {
        context_id: None,
        status: None,
        page_size: None,
        page_token: None,
        history_length: None,
        status_timestamp_after: None,
        include_artifacts: Some(true),
        tenant: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_and_its_context_survive_a_restart_on_sqlite() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let first = serve(&db.url, &[]).await;
    let client = a2a_at(first.addr).await;
    let (task_id, context_id, answer) = ask(&client, ORDER_Q, None).await;
    assert_eq!(answer, ANSWER);
    // A second context, so the listing has something to filter out.
    let (other_task, other_context, _) = ask(&client, "hello", None).await;
    assert_ne!(other_context, context_id);
    first.kill9().await;

    let second = serve(&db.url, &[]).await;
    let client = a2a_at(second.addr).await;
    let task = client.get_task(&task_id).await.unwrap();
    assert_eq!(task.status.state, TaskState::Completed);
    assert_eq!(task.context_id, context_id);
    assert_eq!(answer_of(&task), ANSWER);

    let listed = list(&client, all_tasks()).await;
    let ids: Vec<&str> = listed.tasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(listed.total_size, 2, "{ids:?}");
    // Newest first.
    assert_eq!(ids, [other_task.as_str(), task_id.as_str()]);
    let in_context = list(
        &client,
        ListTasksRequest {
            context_id: Some(context_id.clone()),
            ..all_tasks()
        },
    )
    .await;
    assert_eq!(in_context.tasks.len(), 1);
    assert_eq!(in_context.tasks[0].id, task_id);
    assert_eq!(answer_of(&in_context.tasks[0]), ANSWER);

    // The context still maps to its session: the follow-up needs the first
    // turn's order number, which only the session's history has.
    let (follow_up, same_context, answer) = ask(&client, FOLLOW_UP, Some(&context_id)).await;
    assert_ne!(follow_up, task_id);
    assert_eq!(same_context, context_id);
    assert_eq!(answer, ANSWER);
    // A context never seen before has no such memory.
    let (_, _, fresh) = ask(&client, FOLLOW_UP, Some("a-new-context")).await;
    assert_ne!(fresh, ANSWER);
    second.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cut_by_a_killed_process_is_failed_at_the_next_start_on_sqlite() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let first = serve(&db.url, &["--tool-delay", "60s"]).await;
    let client = a2a_at(first.addr).await;
    let req = send_request(user_message(ORDER_Q, None));
    let mut stream = client.raw().send_streaming_message(&req).await.unwrap();
    let running = match stream.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t.id,
        other => panic!("first event is not the task: {other:?}"),
    };
    first.kill9().await;
    let second = serve(&db.url, &[]).await;
    let client = a2a_at(second.addr).await;
    let task = client.get_task(&running).await.unwrap();
    assert_eq!(task.status.state, TaskState::Failed);
    let why = parts_text(&task.status.message.unwrap().parts);
    assert!(why.contains("replica stopped"), "{why}");
    second.kill9().await;
}

/// A task whose run ends while the server shuts down (SIGTERM) has its end
/// stored before the process exits: after a restart on the same SQLite file
/// it reads COMPLETED with the answer (a task left unfinished would read
/// FAILED, failed at the start). The message returns at once, so no call
/// waits for the task's end: only shutdown's wait for idle does. The run
/// streams large chunks, each stored again with the whole artifact, so
/// the storing of the task's updates ends well after the turn has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_run_ends_during_shutdown_reads_completed_after_a_restart_on_sqlite() {
    const EVENTS: u32 = 40;
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let first = serve(&db.url, &["--stream-agent"]).await;
    let client = a2a_at(first.addr).await;
    let mut message = user_message(&format!("wait=300ms n={EVENTS} size=65536"), None);
    message.metadata = Some([("agent".to_owned(), serde_json::json!("stream"))].into());
    let req = SendMessageRequest {
        configuration: Some(a2a::SendMessageConfiguration {
            accepted_output_modes: None,
            task_push_notification_config: None,
            history_length: None,
            return_immediately: Some(true),
        }),
        ..send_request(message)
    };
    let task = match client.raw().send_message(&req).await.unwrap() {
        a2a::SendMessageResponse::Task(t) => t,
        other => panic!("not a task: {other:?}"),
    };
    assert!(!task.status.state.is_terminal(), "{:?}", task.status);
    drop(client);
    let exit = first.terminate().await;
    assert!(exit.success(), "{exit:?}");

    let second = serve(&db.url, &[]).await;
    let client = a2a_at(second.addr).await;
    let task = client.get_task(&task.id).await.unwrap();
    assert_eq!(task.status.state, TaskState::Completed, "{:?}", task.status);
    assert_eq!(answer_of(&task), format!("sent {EVENTS} events"));
    second.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_tasks_pages_filters_and_refuses_a_bad_token() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = serve(&db.url, &[]).await;
    let client = a2a_at(server.addr).await;
    let mut sent = Vec::new();
    for _ in 0..3 {
        sent.push(ask(&client, "hello", Some("paging")).await.0);
    }
    let mut seen = Vec::new();
    let mut token = None;
    loop {
        let page = list(
            &client,
            ListTasksRequest {
                page_size: Some(2),
                page_token: token.take(),
                include_artifacts: None,
                ..all_tasks()
            },
        )
        .await;
        assert_eq!(page.total_size, 3);
        assert!(page.tasks.len() <= 2);
        // Artifacts only on request.
        assert!(page.tasks.iter().all(|t| t.artifacts.is_none()));
        seen.extend(page.tasks.into_iter().map(|t| t.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = Some(page.next_page_token);
    }
    sent.reverse();
    assert_eq!(seen, sent);

    let none = list(
        &client,
        ListTasksRequest {
            status: Some(TaskState::Working),
            ..all_tasks()
        },
    )
    .await;
    assert_eq!((none.tasks.len(), none.total_size), (0, 0));
    let done = list(
        &client,
        ListTasksRequest {
            status: Some(TaskState::Completed),
            ..all_tasks()
        },
    )
    .await;
    assert_eq!(done.total_size, 3);

    let err = client
        .raw()
        .list_tasks(&ListTasksRequest {
            page_token: Some("not-a-token".into()),
            ..all_tasks()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code, a2a::error_code::INVALID_PARAMS, "{err:?}");
    assert!(!err.message.contains("not-a-token"), "{err:?}");
    server.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_run_on_one_replica_is_answered_and_followed_by_another() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = slow_replica_a(&db.url).await;
    let b = serve(&db.url, &["--replica-id", "replica-b", "--stream-agent"]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);

    // A finished task on A (the echo agent: no tool), fetched and listed
    // from B.
    let echo = Message {
        metadata: Some([("agent".to_owned(), serde_json::json!("echo"))].into()),
        ..user_message(ORDER_Q, None)
    };
    let Outcome::Completed {
        task_id,
        context_id,
        ..
    } = on_a.send(echo, &opts(), None).await.unwrap()
    else {
        panic!("the echo task did not complete")
    };
    let task = on_b.get_task(&task_id).await.unwrap();
    assert_eq!(task.status.state, TaskState::Completed);
    assert_eq!(answer_of(&task), ORDER_Q);
    let listed = list(&on_b, all_tasks()).await;
    assert_eq!(listed.tasks.len(), 1);
    assert_eq!(listed.tasks[0].id, task_id);

    // The context's session is shared: A's turn is B's history, so the
    // follow-up on B knows the order number.
    let (_, same, answer) = ask(&on_b, FOLLOW_UP, Some(&context_id)).await;
    assert_eq!(same, context_id);
    assert_eq!(answer, ANSWER);

    // A task that runs on A (its tool takes 60 s), followed from B.
    let req = send_request(user_message(ORDER_Q, None));
    let mut on_a_stream = on_a.raw().send_streaming_message(&req).await.unwrap();
    let running = match on_a_stream.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t.id,
        other => panic!("first event is not the task: {other:?}"),
    };
    // Wait until A has sent the tool call (the tool then sleeps).
    a2a_support::until_tool_call(&mut on_a_stream).await;
    assert_eq!(
        on_b.get_task(&running).await.unwrap().status.state,
        TaskState::Working
    );
    // A message into the working task is refused on either replica (B,
    // where it does not run, started a second run of it beside A's).
    for c in [&on_b, &on_a] {
        let more = send_request(Message {
            task_id: Some(running.clone()),
            ..user_message(FOLLOW_UP, None)
        });
        let err = c.raw().send_message(&more).await.unwrap_err();
        assert_eq!(err.code, a2a::error_code::UNSUPPORTED_OPERATION, "{err:?}");
        assert!(err.message.contains("still working"), "{err:?}");
    }
    let history = on_b.get_task(&running).await.unwrap().history;
    assert!(
        !history
            .iter()
            .flatten()
            .any(|m| parts_text(&m.parts) == FOLLOW_UP),
        "a refused message is in the task: {history:?}"
    );
    let mut followed = on_b
        .raw()
        .subscribe_to_task(&SubscribeToTaskRequest {
            id: running.clone(),
            tenant: None,
        })
        .await
        .unwrap();
    match followed.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => {
            assert_eq!(t.id, running);
            assert_eq!(t.status.state, TaskState::Working);
        }
        other => panic!("first event is not the task: {other:?}"),
    }
    // The tool call, replayed from A's turn.
    let StreamResponse::StatusUpdate(call) = followed.next().await.unwrap().unwrap() else {
        panic!("not the tool call")
    };
    assert_eq!(call.task_id, running);
    assert!(
        call.status
            .message
            .as_ref()
            .unwrap()
            .parts
            .iter()
            .any(|p| matches!(&p.content, a2a::PartContent::Data(d) if d["toolCall"]["name"] == "lookup_order")),
        "{call:?}"
    );
    // Cancelled on A: the follower on B sees the end.
    assert_eq!(
        on_a.cancel(&running).await.unwrap().status.state,
        TaskState::Canceled
    );
    let mut last = None;
    while let Some(ev) = followed.next().await {
        last = Some(ev.unwrap());
    }
    let Some(StreamResponse::StatusUpdate(end)) = last else {
        panic!("the followed stream did not end with a status: {last:?}")
    };
    assert_eq!(end.status.state, TaskState::Canceled);
    assert_eq!(
        on_b.get_task(&running).await.unwrap().status.state,
        TaskState::Canceled
    );
    // A finished task cannot be subscribed to, on either replica.
    for c in [&on_a, &on_b] {
        let err = match c
            .raw()
            .subscribe_to_task(&SubscribeToTaskRequest {
                id: task_id.clone(),
                tenant: None,
            })
            .await
        {
            Ok(_) => panic!("subscribed to a finished task"),
            Err(e) => e,
        };
        assert_eq!(err.code, a2a::error_code::UNSUPPORTED_OPERATION, "{err:?}");
    }
    a.kill9().await;
    b.kill9().await;
}

/// A replica following a task that runs on another, and stopped (a rolling
/// restart) before the task ends, ends its subscribers' streams with an
/// error, not a terminal status: the task runs on where it runs, and its
/// subscribers look again (GetTask, or subscribe elsewhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_following_a_task_does_not_end_it_for_its_subscribers() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = slow_replica_a(&db.url).await;
    let b = serve(&db.url, &["--replica-id", "replica-b"]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);
    let (running, _on_a_stream) = start_working(&on_a).await;
    let mut followed = on_b
        .raw()
        .subscribe_to_task(&SubscribeToTaskRequest {
            id: running.clone(),
            tenant: None,
        })
        .await
        .unwrap();
    assert!(matches!(
        followed.next().await.unwrap().unwrap(),
        StreamResponse::Task(t) if t.id == running
    ));
    a2a_support::until_tool_call(&mut followed).await;

    // B drains (the follower holds it), then a second signal cuts what it
    // still serves: its follower among them.
    b.sigterm().await;
    eventually("B to drain", || async {
        b.log_lines()
            .iter()
            .any(|l| l.contains("waiting for in-flight runs"))
            .then_some(())
    })
    .await;
    b.sigterm().await;
    let mut rest = vec![];
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(30), followed.next())
        .await
        .expect("the followed stream ends once B cuts its follower")
    {
        rest.push(ev);
    }
    assert!(
        !rest.iter().flatten().any(
            |ev| matches!(ev, StreamResponse::StatusUpdate(u) if u.status.state.is_terminal())
        ),
        "the follower's end was told as the task's: {rest:?}"
    );
    match rest.last() {
        Some(Err(e)) => assert!(e.message.contains("stopped following"), "{e:?}"),
        other => panic!("the followed stream did not end with an error: {other:?}"),
    }
    // The task runs on, on A.
    assert_eq!(
        on_a.get_task(&running).await.unwrap().status.state,
        TaskState::Working
    );
    a.kill9().await;
    b.kill9().await;
}

/// Replica "replica-a" on `store`, its turns' lease `lease`, whose order
/// tool takes a minute: a task sent to it is still running when the test
/// kills it.
async fn dying_replica(store: &str, lease: &str) -> Child {
    serve(
        store,
        &[
            "--replica-id",
            "replica-a",
            "--turn-lease",
            lease,
            "--tool-delay",
            "60s",
        ],
    )
    .await
}

/// Sends the order question on `on_a` as a streaming message and reads
/// until the task is WORKING (its tool started); returns the task's id and
/// the stream, still open.
async fn start_working(
    on_a: &A2aClient,
) -> (
    String,
    impl futures::Stream<Item = Result<StreamResponse, a2a::A2AError>>,
) {
    let req = send_request(user_message(ORDER_Q, None));
    let mut stream = on_a.raw().send_streaming_message(&req).await.unwrap();
    let mut running = None;
    while let Some(ev) = stream.next().await {
        match ev.unwrap() {
            StreamResponse::Task(t) => running = Some(t.id),
            StreamResponse::StatusUpdate(u) if u.status.state == TaskState::Working => break,
            _ => {}
        }
    }
    (running.expect("the stream named its task"), stream)
}

/// Waits (at most 10 s) for task `id` to end on `on_b`, and checks that it
/// ended FAILED because its replica stopped.
async fn assert_ends_replica_stopped(on_b: &A2aClient, id: &str) {
    assert_ends(on_b, id, "serving replica stopped").await;
}

/// Waits (at most 10 s) for task `id` to end on `on_b`, and checks that it
/// ended FAILED saying `why`.
async fn assert_ends(on_b: &A2aClient, id: &str, why: &str) {
    let task = a2a_support::ended_task(on_b, id, Duration::from_millis(50)).await;
    assert_eq!(task.status.state, TaskState::Failed, "{task:?}");
    let said = parts_text(&task.status.message.unwrap().parts);
    assert!(said.contains(why), "{said}");
}

/// A replica killed while it runs a task nobody follows: once the task's
/// turn lease expires, a replica still alive fails the turn and ends the
/// task with it (FAILED, "the serving replica stopped"). The task used to
/// read WORKING for ever, and refuse every follow-up message as still
/// working, until someone subscribed to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_replica_died_is_ended_failed_by_the_replica_that_fails_its_turn() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = dying_replica(&db.url, "1s").await;
    let b = serve(&db.url, &["--replica-id", "replica-b"]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);
    let (running, on_a_stream) = start_working(&on_a).await;
    assert_eq!(
        on_b.get_task(&running).await.unwrap().status.state,
        TaskState::Working,
        "the tool runs on A"
    );
    a.kill9().await;
    drop(on_a_stream);
    // A's lease is 1 s; B sweeps expired leases every second.
    assert_ends_replica_stopped(&on_b, &running).await;
    b.kill9().await;
}

/// The task of a turn failed by a replica that died before it settled the
/// task (its news of the failure died with it): any replica's look for
/// tasks left unsettled ends it, without anyone subscribing. It used to
/// read WORKING for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_left_working_after_its_turn_failed_is_ended_by_any_replica() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = dying_replica(&db.url, "1s").await;
    let on_a = a2a_at(a.addr).await;
    let (running, on_a_stream) = start_working(&on_a).await;
    a.kill9().await;
    drop(on_a_stream);
    // The replica that fails the turn, and dies before it settles the task:
    // the turn is failed through the store alone.
    let store = agentd::store::open(&db.url).await.unwrap();
    eventually("A's turn failed once its lease ran out", || async {
        let failed = store
            .fail_expired(&agentd::grpc::status::replica_stopped())
            .await
            .unwrap();
        (failed.len() == 1).then_some(())
    })
    .await;
    store.close().await;

    let b = serve(
        &db.url,
        &["--replica-id", "replica-b", "--turn-lease", "1s"],
    )
    .await;
    let on_b = a2a_at(b.addr).await;
    assert_ends_replica_stopped(&on_b, &running).await;
    b.kill9().await;
}

/// A task left SUBMITTED without a session (its replica died, or its store
/// failed, between storing it and starting its run) is failed once it has
/// been so for ten minutes, by any replica: it read SUBMITTED for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_run_never_started_is_failed_by_any_replica() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let store = db.open().await;
    let anonymous = agentd::domain::UserId::parse(agentd::store::a2a_tasks::A2A_USER).unwrap();
    let task = |id: &str| a2a::Task {
        id: id.into(),
        context_id: "ctx".into(),
        status: a2a::TaskStatus {
            state: TaskState::Submitted,
            message: None,
            timestamp: Some(chrono::Utc::now()),
        },
        artifacts: None,
        history: Some(vec![user_message(ORDER_Q, Some("ctx"))]),
        metadata: None,
    };
    let tasks = store.a2a_tasks();
    tasks.create_for(&anonymous, task("orphan")).await.unwrap();
    tasks.create_for(&anonymous, task("recent")).await.unwrap();
    store.close().await;
    // "orphan" was stored twenty minutes ago, "recent" just now.
    let pg = sqlx::PgPool::connect(&db.url).await.unwrap();
    sqlx::query("UPDATE a2a_tasks SET updated_at = updated_at - 1200000000 WHERE id = 'orphan'")
        .execute(&pg)
        .await
        .unwrap();
    pg.close().await;

    let b = serve(&db.url, &["--turn-lease", "1s"]).await;
    let on_b = a2a_at(b.addr).await;
    assert_ends(&on_b, "orphan", "run is gone").await;
    assert_eq!(
        on_b.get_task("recent").await.unwrap().status.state,
        TaskState::Submitted,
        "a task stored moments ago is left to its run"
    );
    b.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_replica_died_is_ended_failed_by_its_follower() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    // A lease long enough that B's subscription starts well before it
    // expires: B's own sweep then ends the task (its next renewal was due
    // within a second of the kill, so 4 to 5 s after it), and would refuse
    // a subscription that came later. The follower sees the end either way
    // (it fails the turn itself, or reads it failed by the sweep).
    let a = dying_replica(&db.url, "5s").await;
    let b = serve(&db.url, &["--replica-id", "replica-b", "--stream-agent"]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);
    let req = send_request(user_message(ORDER_Q, None));
    let mut on_a_stream = on_a.raw().send_streaming_message(&req).await.unwrap();
    let running = match on_a_stream.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t.id,
        other => panic!("first event is not the task: {other:?}"),
    };
    a.kill9().await;
    let mut followed = on_b
        .raw()
        .subscribe_to_task(&SubscribeToTaskRequest {
            id: running.clone(),
            tenant: None,
        })
        .await
        .unwrap();
    let mut last = None;
    while let Some(ev) = followed.next().await {
        last = Some(ev.unwrap());
    }
    let Some(StreamResponse::StatusUpdate(end)) = last else {
        panic!("the followed stream did not end with a status: {last:?}")
    };
    assert_eq!(end.status.state, TaskState::Failed);
    let task = on_b.get_task(&running).await.unwrap();
    assert_eq!(task.status.state, TaskState::Failed);
    let why = parts_text(&task.status.message.unwrap().parts);
    assert!(why.contains("replica stopped"), "{why}");
    b.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_session_of_a_context_deletes_its_tasks() {
    let db = TestDb::fresh(Backend::Sqlite).await.unwrap();
    let server = serve(&db.url, &[]).await;
    let client = a2a_at(server.addr).await;
    let (task_id, context_id, _) = ask(&client, "hello", None).await;
    let (kept, _, _) = ask(&client, "hello", None).await;
    let session = agentd::store::a2a_tasks::context_session(
        &agentd::domain::UserId::parse(agentd::store::a2a_tasks::A2A_USER).unwrap(),
        &context_id,
    );
    server
        .client
        .raw()
        .delete_session(agentd::pb::DeleteSessionRequest {
            user_id: agentd::store::a2a_tasks::A2A_USER.into(),
            session_id: session.to_string(),
        })
        .await
        .unwrap();
    let err = client.get_task(&task_id).await.unwrap_err();
    assert_eq!(err.code, a2a::error_code::TASK_NOT_FOUND, "{err:?}");
    assert_eq!(
        client.get_task(&kept).await.unwrap().status.state,
        TaskState::Completed
    );
    server.kill9().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cancelled_through_another_replica_ends_canceled_on_every_stream_of_its_own() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    let a = serve(&db.url, &["--replica-id", "replica-a", "--stream-agent"]).await;
    let b = serve(&db.url, &["--replica-id", "replica-b", "--stream-agent"]).await;
    let (on_a, on_b) = (a2a_at(a.addr).await, a2a_at(b.addr).await);
    // A chunk every 50 ms for half a minute, on A.
    let req = send_request(Message {
        metadata: Some([("agent".to_owned(), serde_json::json!("stream"))].into()),
        ..user_message("n=600 size=1 rate=20", None)
    });
    let mut sent = on_a.raw().send_streaming_message(&req).await.unwrap();
    let task = match sent.next().await.unwrap().unwrap() {
        StreamResponse::Task(t) => t,
        other => panic!("first event is not the task: {other:?}"),
    };
    // A second stream of the task on A, and both streaming its chunks.
    let mut subscribed = on_a
        .raw()
        .subscribe_to_task(&SubscribeToTaskRequest {
            id: task.id.clone(),
            tenant: None,
        })
        .await
        .unwrap();
    for stream in [&mut sent, &mut subscribed] {
        loop {
            let ev = stream.next().await.expect("ended before a chunk").unwrap();
            if matches!(ev, StreamResponse::ArtifactUpdate(_)) {
                break;
            }
        }
    }

    assert_eq!(
        on_b.cancel(&task.id).await.unwrap().status.state,
        TaskState::Canceled
    );

    // Each of A's streams ends with the CANCELED status, not an error.
    for (name, stream) in [("sent", &mut sent), ("subscribed", &mut subscribed)] {
        let mut last = None;
        while let Some(ev) = stream.next().await {
            let ev = ev.unwrap_or_else(|e| panic!("{name}: {e:?}"));
            last = Some(ev);
        }
        let Some(StreamResponse::StatusUpdate(end)) = last else {
            panic!("{name} did not end with a status: {last:?}")
        };
        assert_eq!(
            (end.task_id.as_str(), end.status.state),
            (task.id.as_str(), TaskState::Canceled),
            "{name}"
        );
    }
    // The run stopped: its turn on A ended cancelled, long before its
    // thirty seconds.
    let session = task.metadata.as_ref().unwrap()[agentd::store::a2a_tasks::SESSION_METADATA_KEY]
        .as_str()
        .unwrap()
        .to_owned();
    let turn = eventually("the task's turn to end", || {
        let (mut c, session) = (a.client.raw(), session.clone());
        async move {
            let s = c
                .get_session(agentd::pb::GetSessionRequest {
                    user_id: agentd::store::a2a_tasks::A2A_USER.into(),
                    session_id: session,
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            s.turns
                .into_iter()
                .find(|t| t.state() != agentd::pb::TurnState::Running)
        }
    })
    .await;
    assert_eq!(turn.state(), agentd::pb::TurnState::Cancelled, "{turn:?}");
    for c in [&on_a, &on_b] {
        assert_eq!(
            c.get_task(&task.id).await.unwrap().status.state,
            TaskState::Canceled
        );
    }

    // A blocking SendMessage on A answers the CANCELED task.
    let blocking = tokio::spawn({
        let (on_a, req) = (on_a.clone(), req.clone());
        async move { on_a.raw().send_message(&req).await }
    });
    let running = eventually("the blocking task to run", || {
        let on_b = on_b.clone();
        async move {
            let page = on_b
                .raw()
                .list_tasks(&ListTasksRequest {
                    status: Some(TaskState::Working),
                    ..all_tasks()
                })
                .await
                .ok()?;
            page.tasks.into_iter().next().map(|t| t.id)
        }
    })
    .await;
    on_b.cancel(&running).await.unwrap();
    match blocking.await.unwrap() {
        Ok(a2a::SendMessageResponse::Task(t)) => {
            assert_eq!((t.id, t.status.state), (running, TaskState::Canceled))
        }
        other => panic!("the blocking call did not answer the cancelled task: {other:?}"),
    }
    a.kill9().await;
    b.kill9().await;
}
