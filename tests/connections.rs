//! Connection management: max connection age sends GOAWAY (clients
//! reconnect and rebalance) without cutting calls in flight.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use agentd::client::AgentClient;
use common::*;

#[tokio::test]
async fn an_aged_connection_gets_goaway_and_its_call_in_flight_still_completes() {
    let mut opts = Options::default().tool_delay(Duration::from_millis(800));
    opts.server.max_connection_age = Some(Duration::from_millis(200));
    let server = TestServer::tcp(opts).await;
    let proxy = Proxy::start(server.addr.unwrap()).await;
    let mut client = AgentClient::connect(&format!("http://{}", proxy.addr))
        .await
        .unwrap();
    let s = client.create_session("alice").await.unwrap().session_id;
    assert_eq!(proxy.accepted.load(Ordering::SeqCst), 1);

    // Outlives the connection's age: must finish on the old connection.
    let (events, end) = client
        .run_to_end(
            run_request("alice", &s, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);

    // The next call goes over a new connection.
    let (_, end) = client
        .run_to_end(run_request("alice", &s, "r2", "hi"), DEADLINE)
        .await
        .unwrap();
    end.unwrap();
    assert!(
        proxy.accepted.load(Ordering::SeqCst) >= 2,
        "the client reconnected after GOAWAY"
    );
    server.stop().await;
}
