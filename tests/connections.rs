//! Connection management: max connection age sends GOAWAY (clients
//! reconnect and rebalance) without cutting calls in flight.

mod common;
mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use agentd::client::AgentClient;
use common::*;
use support::check_on_new_connection;

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

#[tokio::test]
async fn past_the_connection_limit_a_new_grpc_connection_is_closed_until_one_ends() {
    let mut opts = Options::default();
    opts.server.max_connections = 2;
    // The server's own client holds one connection.
    let server = TestServer::tcp(opts).await;
    let addr = server.addr.unwrap();

    let second = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic_health::pb::health_client::HealthClient::new(second.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("the second connection is within the limit");

    let refused = check_on_new_connection(addr, Duration::from_secs(5)).await;
    assert!(
        refused.is_err(),
        "a third connection is served: {refused:?}"
    );
    assert!(
        agentd::telemetry::metrics::render()
            .contains("agentd_connections_refused_total{port=\"grpc\"}"),
        "the refusal is counted"
    );

    // A connection that ends frees its slot.
    drop(second);
    let mut served = Err(String::new());
    for _ in 0..100 {
        served = check_on_new_connection(addr, Duration::from_secs(5)).await;
        if served.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    served.expect("a new connection is served once one ended");
    server.stop().await;
}

/// The A2A HTTP face's serving loop, answering "ok" on `/`, at most `max`
/// connections: its address, what stops it, and its task.
async fn http_face(
    max: usize,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(agentd::a2a::serve_http(listener, router, max, async {
        let _ = stopped.await;
    }));
    (addr, stop, serving)
}

#[tokio::test]
async fn past_the_connection_limit_a_new_a2a_http_connection_is_closed_until_one_ends() {
    let (addr, stop, serving) = http_face(1).await;
    let http = agentd::agent::openai::http_client().unwrap();
    let get = || {
        http.get(format!("http://{addr}/"))
            .timeout(Duration::from_secs(5))
            .send()
    };

    // An idle connection takes the one slot (its headers may take 10 s).
    let idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = get().await;
    assert!(
        refused.is_err(),
        "a second connection is served: {refused:?}"
    );
    assert!(
        agentd::telemetry::metrics::render()
            .contains("agentd_connections_refused_total{port=\"a2a_http\"}"),
        "the refusal is counted"
    );

    drop(idle);
    let mut served = None;
    for _ in 0..100 {
        if let Ok(r) = get().await {
            served = Some(r.text().await.unwrap());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        served.as_deref(),
        Some("ok"),
        "served once the idle one closed"
    );
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}

/// A connection that sends nothing, or only the start of HTTP/2's preface,
/// is closed after the header read timeout: it used to hold its connection
/// slot for ever (hyper waits for the bytes that tell HTTP/1 from HTTP/2
/// without a deadline), so enough of them took every slot of the port.
#[tokio::test]
async fn an_http_connection_that_sends_no_request_is_closed_in_time() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (addr, stop, serving) = http_face(8).await;
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut partial = tokio::net::TcpStream::connect(addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let started = std::time::Instant::now();
    let bound = agentd::a2a::HEADER_READ_TIMEOUT * 3;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (silent_closed, partial_closed) = tokio::join!(
        tokio::time::timeout(bound, silent.read_to_end(&mut a)),
        tokio::time::timeout(bound, partial.read_to_end(&mut b)),
    );
    assert!(silent_closed.is_ok(), "a silent connection is held open");
    assert!(partial_closed.is_ok(), "a half-sent preface is held open");
    assert!(started.elapsed() >= agentd::a2a::HEADER_READ_TIMEOUT / 2);
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}

/// The admin port serves a bounded number of connections at once: past
/// it new ones are closed (and counted) until one ends. It took any number,
/// each holding a file descriptor the other ports and the store share.
#[tokio::test]
async fn past_its_connection_limit_the_admin_port_closes_new_connections() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(agentd::telemetry::admin::serve(
        listener,
        agentd::telemetry::admin::Readiness::default(),
        async {
            let _ = stopped.await;
        },
    ));
    // A new client for each request: a pooled connection would be reused.
    let get = || {
        agentd::agent::openai::http_client()
            .unwrap()
            .get(format!("http://{addr}/healthz"))
            .timeout(Duration::from_secs(5))
            .send()
    };
    assert_eq!(get().await.unwrap().status(), 200);

    // Idle connections take every slot (each may wait 10 s for a request).
    let mut idle = Vec::new();
    for _ in 0..128 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = get().await;
    assert!(refused.is_err(), "a connection past the limit is served");
    assert!(
        agentd::telemetry::metrics::render()
            .contains("agentd_connections_refused_total{port=\"admin\"}"),
        "the refusal is counted"
    );

    idle.clear();
    let mut served = None;
    for _ in 0..100 {
        if let Ok(r) = get().await {
            served = Some(r.status());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        served,
        Some(reqwest::StatusCode::OK),
        "served once they closed"
    );
    let _ = stop.send(());
    serving.await.unwrap().unwrap();
}

/// Shutting down, the HTTP face closes a connection that has sent nothing
/// yet at once: it used to wait for it to send a request or time out (10 s).
#[tokio::test]
async fn a_silent_http_connection_does_not_hold_up_the_shutdown() {
    let (addr, stop, serving) = http_face(8).await;
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = stop.send(());
    let stopped = tokio::time::timeout(agentd::a2a::HEADER_READ_TIMEOUT / 2, serving).await;
    assert!(
        stopped.is_ok(),
        "the shutdown waited for a silent connection"
    );
}
