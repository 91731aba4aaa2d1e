//! The turn engine as a library: what a server does not expose over the wire.

use std::sync::Arc;

use agentd::agent::synthetic::Echo;
use agentd::agent::{Agent, AgentRegistry};
use agentd::domain::{RequestId, RunInput, TurnKey, UserId, UserText};
use agentd::store::Store;
use agentd::store::memory::MemoryStore;
use agentd::turn::{RunError, TurnConfig, Turns};

#[tokio::test]
async fn a_draining_engine_refuses_new_runs_and_stores_nothing() {
    let store = Arc::new(MemoryStore::new());
    let agents = AgentRegistry::new(vec![Arc::new(Echo) as Arc<dyn Agent>], "echo").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    let (input, key) = first_turn(&*store, "hi").await;
    turns.begin_drain();
    assert!(matches!(
        turns.start(input, None).await,
        Err(RunError::ShuttingDown)
    ));
    assert!(store.get_turn(&key).await.unwrap().is_none());
    turns.wait_idle().await;
}

#[test]
fn the_default_agent_must_be_served() {
    let err = AgentRegistry::new(vec![Arc::new(Echo) as Arc<dyn Agent>], "order_helper")
        .err()
        .unwrap();
    assert!(err.to_string().contains("order_helper"), "{err}");
}

/// On SQLite a Run's events are stored with their kinds by number (12
/// bytes less each than by name) and are replayed as they were sent.
#[tokio::test]
async fn on_sqlite_a_runs_events_are_stored_with_kinds_by_number_and_replay_as_sent() {
    use agentd::agent::demo::OrderHelper;
    use agentd::store::KindEncoding;
    use futures::StreamExt;

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("a.db");
    let store = agentd::store::open(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    assert_eq!(store.kind_encoding(), KindEncoding::Code);
    let agent = Arc::new(OrderHelper::new(std::time::Duration::ZERO)) as Arc<dyn Agent>;
    let agents = AgentRegistry::new(vec![agent], "order_helper").unwrap();
    let turns = Turns::new(store.clone(), agents, TurnConfig::default());
    let (input, key) = first_turn(&*store, "Where is order 1187?").await;
    let started = turns.start(input, None).await.unwrap();
    let sent: Vec<_> = started
        .stream
        .map(|e| e.expect("the run ends with its final answer"))
        .collect()
        .await;
    assert_eq!(sent.len(), 3, "{sent:?}");
    let stored = store.events_after(&key, None, 100).await.unwrap();
    let as_sent: Vec<_> = sent
        .iter()
        .map(|e| (e.seq, e.kind, e.text.clone()))
        .collect();
    let as_stored: Vec<_> = stored
        .iter()
        .map(|e| {
            let wire = agentd::grpc::convert::into_wire(e.seq, e.event.clone());
            (wire.seq, wire.kind, wire.text)
        })
        .collect();
    assert_eq!(as_stored, as_sent);

    // The rows themselves: no kind written out by name.
    let log = sqlx::SqlitePool::connect(&format!("sqlite://{}-events?mode=ro", db.display()))
        .await
        .unwrap();
    let blobs: Vec<Vec<u8>> = sqlx::query_scalar("SELECT events FROM event_log")
        .fetch_all(&log)
        .await
        .unwrap();
    let bytes: Vec<u8> = blobs.concat();
    assert!(!bytes.is_empty());
    for name in ["tool_call", "tool_result", "final_answer"] {
        assert!(
            !bytes.windows(name.len()).any(|w| w == name.as_bytes()),
            "{name} stored by name"
        );
    }
    turns.begin_drain();
    turns.wait_idle().await;
}

/// A new session of alice's and the input of its turn `r1` saying `text`.
async fn first_turn(store: &dyn Store, text: &str) -> (RunInput, TurnKey) {
    let user = UserId::parse("alice").unwrap();
    let session = store.create_session(&user).await.unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    let input = RunInput {
        user_id: user,
        key: key.clone(),
        generated_request_id: false,
        text: UserText::parse(text.into(), 100).unwrap(),
        agent: None,
        on_disconnect: Default::default(),
    };
    (input, key)
}
