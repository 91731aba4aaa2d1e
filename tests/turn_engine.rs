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
    let user = UserId::parse("alice").unwrap();
    let session = store.create_session(&user).await.unwrap();
    let key = TurnKey {
        session_id: session.id,
        request_id: RequestId::parse("r1").unwrap(),
    };
    turns.begin_drain();
    let input = RunInput {
        user_id: user,
        key: key.clone(),
        generated_request_id: false,
        text: UserText::parse("hi".into(), 100).unwrap(),
        agent: None,
        on_disconnect: Default::default(),
    };
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
