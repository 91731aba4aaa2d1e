//! TLS and mutual TLS on the gRPC port, with certificates made in the test.

mod common;
mod secured;

use std::time::Duration;

use agentd::client::{AgentClient, ClientSecurity};
use common::run_request;
use secured::{Ca, Secure, SecureServer};
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_client_trusting_the_ca_runs_the_worked_trace_over_tls() {
    let server = SecureServer::start(Ca::new("test ca"), Secure::default()).await;
    let mut c = server.client(None, None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let (events, end) = c
        .run_to_end(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);
    assert!(
        events[2].is_final && events[2].text.contains("DHL"),
        "{:?}",
        events[2]
    );
    server.stop().await;
}

#[tokio::test]
async fn a_plaintext_client_gets_no_answer_from_a_tls_port() {
    let server = SecureServer::start(Ca::new("test ca"), Secure::default()).await;
    let result = async {
        let mut c = AgentClient::connect(&format!("http://{}", server.addr)).await?;
        c.create_session("alice").await.map_err(anyhow::Error::from)
    };
    let result = tokio::time::timeout(Duration::from_secs(10), result)
        .await
        .expect("a plaintext call must fail, not hang");
    assert!(result.is_err(), "a plaintext call was answered: {result:?}");
    server.stop().await;
}

/// A peer that connects and never starts the handshake is dropped after
/// the handshake timeout, not held (a socket and a task) for ever.
#[tokio::test]
async fn a_connection_that_never_completes_the_handshake_is_closed() {
    use tokio::io::AsyncReadExt as _;
    let server = SecureServer::start(Ca::new("test ca"), Secure::default()).await;
    let mut idle = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(
        agentd::auth::tls::TLS_HANDSHAKE_TIMEOUT * 3,
        idle.read(&mut buf),
    )
    .await
    .expect("the server closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(started.elapsed() >= agentd::auth::tls::TLS_HANDSHAKE_TIMEOUT / 2);
    server.stop().await;
}

/// TLS settings with an http:// address are refused before connecting: the
/// connection would be plaintext, and the token would travel in clear.
#[tokio::test]
async fn tls_settings_with_an_http_address_are_refused_not_sent_in_clear() {
    let ca = Ca::new("test ca");
    let result = AgentClient::connect_with(
        "http://127.0.0.1:9",
        &ClientSecurity {
            tls: Some(ClientSecurity::tls_from_pem(ca.pem.as_bytes(), None)),
            token: Some("a-token-not-for-plaintext".into()),
        },
    )
    .await;
    let err = format!("{:#}", result.err().expect("refused"));
    assert!(err.contains("https://"), "{err}");
    assert!(!err.contains("a-token"), "{err}");
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_servers_ca_cannot_connect() {
    let server = SecureServer::start(Ca::new("test ca"), Secure::default()).await;
    let other = Ca::new("another ca");
    let tls = ClientSecurity::tls_from_pem(other.pem.as_bytes(), None);
    let result = AgentClient::connect_with(
        &server.url(),
        &ClientSecurity {
            tls: Some(tls),
            token: None,
        },
    )
    .await;
    assert!(
        result.is_err(),
        "connected to a server whose certificate it cannot verify"
    );
    server.stop().await;
}

fn mtls(ca: &Ca, tokens_json: Option<&str>) -> Secure {
    Secure {
        client_ca: Some(ca.pem.clone()),
        tokens_json: tokens_json.map(str::to_owned),
        ..Secure::default()
    }
}

/// Asserts that the server refuses `identity` at the TLS handshake: the
/// call fails at connect, or at the first call (rustls may report it
/// either way), and never with a status of the server's own (a refusal by
/// the authentication layer would mean the handshake let the client in).
async fn assert_refused_at_the_handshake(server: &SecureServer, identity: Option<&secured::Pem>) {
    if let Ok(mut c) = server.client(identity, None).await {
        let status = c
            .create_session("alice")
            .await
            .expect_err("a call went through");
        assert!(
            !matches!(
                status.code(),
                Code::Unauthenticated | Code::PermissionDenied | Code::InvalidArgument
            ),
            "refused by the server after the handshake, not at it: {status:?}"
        );
    }
}

#[tokio::test]
async fn mtls_refuses_a_client_without_a_certificate() {
    let ca = Ca::new("test ca");
    let clients = Ca::new("client ca");
    let billing = clients.client("billing.internal");
    let server = SecureServer::start(ca, mtls(&clients, None)).await;
    assert_refused_at_the_handshake(&server, None).await;
    // The same server takes a certificate of its clients' CA.
    let mut c = server.client(Some(&billing), None).await.unwrap();
    c.create_session("alice").await.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn mtls_refuses_a_certificate_signed_by_another_ca() {
    let ca = Ca::new("test ca");
    let clients = Ca::new("client ca");
    let rogue = Ca::new("rogue ca").client("billing.internal");
    let server = SecureServer::start(ca, mtls(&clients, None)).await;
    assert_refused_at_the_handshake(&server, Some(&rogue)).await;
    server.stop().await;
}

#[tokio::test]
async fn mtls_without_a_tokens_file_trusts_every_certificate_of_its_ca() {
    let ca = Ca::new("test ca");
    let clients = Ca::new("client ca");
    let billing = clients.client("billing.internal");
    let server = SecureServer::start(ca, mtls(&clients, None)).await;
    let mut c = server.client(Some(&billing), None).await.unwrap();
    let session = c.create_session("anyone").await.unwrap().session_id;
    let (_, end) = c
        .run_to_end(
            run_request("anyone", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    server.stop().await;
}

#[tokio::test]
async fn the_client_certificates_name_is_the_caller_and_its_users_are_enforced() {
    let ca = Ca::new("test ca");
    let clients = Ca::new("client ca");
    let web = clients.client("web.internal");
    let stranger = clients.client("stranger.internal");
    let tokens = r#"{"clients": [{"name": "web.internal", "user_ids": ["alice"]}]}"#;
    let server = SecureServer::start(ca, mtls(&clients, Some(tokens))).await;

    let mut c = server.client(Some(&web), None).await.unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let (events, end) = c
        .run_to_end(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);

    let err = c.create_session("bob").await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = match c
        .run(
            run_request("bob", &session, "r2", "Where is order 1187?"),
            DEADLINE,
        )
        .await
    {
        Err(e) => e,
        Ok(_) => panic!("a run for a user the certificate may not act for started"),
    };
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // Signed by the right CA but not listed: not a caller this server knows.
    let mut s = server.client(Some(&stranger), None).await.unwrap();
    let err = s.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    assert_eq!(
        server.tool.started(),
        1,
        "only the allowed run executed the tool"
    );
    assert!(
        server.turn_exists(&session, "r2").await.is_none(),
        "the refused run was stored"
    );
    server.stop().await;
}

/// A server that accepts the connection and never completes the TLS
/// handshake: connecting gives up after the connect timeout (the TCP
/// connect's own bound ends once it is accepted) instead of hanging.
#[tokio::test]
async fn connecting_to_a_server_that_never_completes_the_handshake_gives_up() {
    let ca = Ca::new("test ca");
    let silent = common::Silent::start().await;
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(30),
        AgentClient::connect_with(
            &format!("https://{}", silent.addr),
            &ClientSecurity {
                tls: Some(ClientSecurity::tls_from_pem(ca.pem.as_bytes(), None)),
                token: None,
            },
        ),
    )
    .await
    .expect("connecting gave up by itself");
    let err = format!("{:#}", result.err().expect("no connection"));
    assert!(err.contains("no answer within"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// An https:// address without a CA to check the server with is refused
/// with the flag that is missing, not tonic's "transport error".
#[tokio::test]
async fn an_https_address_without_a_ca_names_the_missing_flag() {
    let result = AgentClient::connect_with("https://127.0.0.1:9", &ClientSecurity::default()).await;
    let err = format!("{:#}", result.err().expect("refused"));
    assert!(err.contains("--tls-ca"), "{err}");
}
