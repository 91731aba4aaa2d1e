//! The A2A task store on each durable backend, below the A2A face.

mod support;

use a2a::{ListTasksRequest, Message, Part, Role, Task, TaskState, TaskStatus};
use agentd::domain::UserId;
use support::*;

fn page(page_size: Option<i32>, page_token: Option<String>) -> ListTasksRequest {
    ListTasksRequest {
        context_id: None,
        status: None,
        page_size,
        page_token,
        history_length: None,
        status_timestamp_after: None,
        include_artifacts: None,
        tenant: None,
    }
}

fn task(id: &str) -> Task {
    Task {
        id: id.into(),
        context_id: "ctx".into(),
        status: TaskStatus {
            state: TaskState::Working,
            message: None,
            timestamp: Some(chrono::Utc::now()),
        },
        artifacts: None,
        history: Some(vec![Message::new(Role::User, vec![Part::text("hi")])]),
        metadata: None,
    }
}

/// ListTasks lists a caller's tasks most recently updated first, as the
/// A2A specification requires, on one page or page by page. They were
/// listed newest created first.
async fn tasks_are_listed_most_recently_updated_first(db: TestDb) {
    let store = db.open().await;
    let tasks = store.a2a_tasks();
    let alice = UserId::parse(ALICE).unwrap();
    for id in ["t1", "t2", "t3"] {
        tasks.create_for(&alice, task(id)).await.unwrap();
        // Distinct times, in microseconds, on any clock.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let mut t1 = tasks.get("t1").await.unwrap().unwrap();
    t1.status.state = TaskState::Completed;
    tasks.update(t1).await.unwrap();

    let all = tasks.list_for(&alice, &page(None, None)).await.unwrap();
    let ids: Vec<_> = all.tasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["t1", "t3", "t2"]);

    let mut paged = Vec::new();
    let mut token = None;
    for _ in 0..10 {
        let page = tasks
            .list_for(&alice, &page(Some(1), token.clone()))
            .await
            .unwrap();
        paged.extend(page.tasks.into_iter().map(|t| t.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = Some(page.next_page_token);
    }
    assert_eq!(paged, ["t1", "t3", "t2"]);
    store.close().await;
}

#[tokio::test]
async fn sqlite_tasks_are_listed_most_recently_updated_first() {
    tasks_are_listed_most_recently_updated_first(TestDb::fresh(Backend::Sqlite).await.unwrap())
        .await;
}

#[tokio::test]
async fn postgres_tasks_are_listed_most_recently_updated_first() {
    let Some(db) = TestDb::fresh(Backend::Postgres).await else {
        return;
    };
    tasks_are_listed_most_recently_updated_first(db).await;
}
