//! Bearer tokens over TLS: who may call, and for which users.

mod common;
mod secured;

use std::time::Duration;

use common::run_request;
use secured::{Ca, Secure, SecureServer};
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(30);
const TRUSTED: &str = "tok-trusted-service-000001";
const WEB: &str = "tok-web-frontend-00000002";

fn tokens() -> String {
    format!(
        r#"{{"tokens": [
            {{"token": "{TRUSTED}", "caller": "billing", "user_ids": ["*"]}},
            {{"token": "{WEB}", "caller": "web", "user_ids": ["alice"]}}
        ]}}"#
    )
}

async fn server() -> SecureServer {
    SecureServer::start(
        Ca::new("test ca"),
        Secure {
            tokens_json: Some(tokens()),
            ..Secure::default()
        },
    )
    .await
}

/// A session for `user`, made with the trusted token.
async fn session(server: &SecureServer, user: &str) -> String {
    let mut c = server.client(None, Some(TRUSTED)).await.unwrap();
    c.create_session(user).await.unwrap().session_id
}

async fn refused_run(
    server: &SecureServer,
    token: Option<&str>,
    user: &str,
    session: &str,
) -> tonic::Status {
    let mut c = server.client(None, token).await.unwrap();
    match c
        .run(
            run_request(user, session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
    {
        Err(s) => s,
        Ok(_) => panic!("the run started"),
    }
}

#[tokio::test]
async fn a_call_without_a_token_is_unauthenticated_and_runs_nothing() {
    let server = server().await;
    let session = session(&server, "alice").await;
    let err = refused_run(&server, None, "alice", &session).await;
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    let mut c = server.client(None, None).await.unwrap();
    assert_eq!(
        c.create_session("alice").await.unwrap_err().code(),
        Code::Unauthenticated
    );
    assert_eq!(server.tool.started(), 0);
    assert!(server.turn_exists(&session, "r1").await.is_none());
    server.stop().await;
}

#[tokio::test]
async fn a_bad_token_is_unauthenticated_and_not_echoed() {
    let server = server().await;
    let session = session(&server, "alice").await;
    let bad = "tok-web-frontend-00000003";
    let err = refused_run(&server, Some(bad), "alice", &session).await;
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    assert!(!err.message().contains(bad), "{}", err.message());
    assert_eq!(server.tool.started(), 0);
    assert!(server.turn_exists(&session, "r1").await.is_none());
    server.stop().await;
}

#[tokio::test]
async fn a_token_used_for_another_user_is_permission_denied_and_nothing_is_run_or_stored() {
    let server = server().await;
    let bobs = session(&server, "bob").await;
    let err = refused_run(&server, Some(WEB), "bob", &bobs).await;
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let mut web = server.client(None, Some(WEB)).await.unwrap();
    assert_eq!(
        web.create_session("bob").await.unwrap_err().code(),
        Code::PermissionDenied
    );
    assert_eq!(server.tool.started(), 0);
    assert!(server.turn_exists(&bobs, "r1").await.is_none());
    server.stop().await;
}

#[tokio::test]
async fn a_token_allowed_for_the_user_runs_the_turn() {
    let server = server().await;
    let mut web = server.client(None, Some(WEB)).await.unwrap();
    let session = web.create_session("alice").await.unwrap().session_id;
    let (events, end) = web
        .run_to_end(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(server.tool.completed(), 1);
    server.stop().await;
}

#[tokio::test]
async fn a_star_token_acts_for_any_user() {
    let server = server().await;
    let mut trusted = server.client(None, Some(TRUSTED)).await.unwrap();
    for user in ["alice", "bob", "svc:batch-7"] {
        let session = trusted.create_session(user).await.unwrap().session_id;
        let (_, end) = trusted
            .run_to_end(run_request(user, &session, "r1", "hello"), DEADLINE)
            .await
            .unwrap();
        end.unwrap();
    }
    server.stop().await;
}

#[tokio::test]
async fn health_and_reflection_stay_open_without_a_token() {
    let server = server().await;
    let mut c = server.client(None, None).await.unwrap();
    assert_eq!(
        c.health("").await.unwrap(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    let channel = tonic::transport::Endpoint::from_shared(server.url())
        .unwrap()
        .tls_config(agentd::client::ClientSecurity::tls_from_pem(
            server.ca.pem.as_bytes(),
            None,
        ))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let req = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::once(req))
        .await
        .unwrap()
        .into_inner();
    let answer = stream.message().await.unwrap().unwrap();
    assert!(
        format!("{answer:?}").contains("agents.v1.AgentService"),
        "{answer:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn health_can_require_a_token_too() {
    let secure = Secure {
        tokens_json: Some(tokens()),
        open_services: Some(vec![]),
        ..Secure::default()
    };
    let server = SecureServer::start(Ca::new("test ca"), secure).await;
    let mut anonymous = server.client(None, None).await.unwrap();
    assert_eq!(
        anonymous.health("").await.unwrap_err().code(),
        Code::Unauthenticated
    );
    let mut c = server.client(None, Some(TRUSTED)).await.unwrap();
    assert_eq!(
        c.health("").await.unwrap(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
    server.stop().await;
}

#[tokio::test]
async fn every_method_checks_the_user_id_against_the_token() {
    use agentd::pb;
    let server = server().await;
    let bobs = session(&server, "bob").await;
    let mut trusted = server.client(None, Some(TRUSTED)).await.unwrap();
    trusted
        .run_to_end(run_request("bob", &bobs, "r1", "hello"), DEADLINE)
        .await
        .unwrap()
        .1
        .unwrap();

    let web = server.client(None, Some(WEB)).await.unwrap();
    let mut raw = web.raw();
    let t = Duration::from_secs(10);
    let get = raw
        .get_session(web.request(
            pb::GetSessionRequest {
                user_id: "bob".into(),
                session_id: bobs.clone(),
                ..Default::default()
            },
            t,
        ))
        .await;
    assert_eq!(get.unwrap_err().code(), Code::PermissionDenied);
    let list = raw
        .list_sessions(web.request(
            pb::ListSessionsRequest {
                user_id: "bob".into(),
                ..Default::default()
            },
            t,
        ))
        .await;
    assert_eq!(list.unwrap_err().code(), Code::PermissionDenied);
    let attach = raw
        .attach(web.request(
            pb::AttachRequest {
                user_id: "bob".into(),
                session_id: bobs.clone(),
                request_id: "r1".into(),
                ..Default::default()
            },
            t,
        ))
        .await;
    match attach {
        Err(s) => assert_eq!(s.code(), Code::PermissionDenied),
        Ok(_) => panic!("attach for another user started"),
    }
    let delete = raw
        .delete_session(web.request(
            pb::DeleteSessionRequest {
                user_id: "bob".into(),
                session_id: bobs.clone(),
            },
            t,
        ))
        .await;
    assert_eq!(delete.unwrap_err().code(), Code::PermissionDenied);
    let cancel = raw
        .cancel_turn(web.request(
            pb::CancelTurnRequest {
                user_id: "bob".into(),
                session_id: bobs.clone(),
                request_id: "r1".into(),
            },
            t,
        ))
        .await;
    assert_eq!(cancel.unwrap_err().code(), Code::PermissionDenied);
    assert!(
        server.turn_exists(&bobs, "r1").await.is_some(),
        "the refused delete removed the session"
    );

    // The same calls for the token's own user pass the check.
    let mine = raw
        .list_sessions(web.request(
            pb::ListSessionsRequest {
                user_id: "alice".into(),
                ..Default::default()
            },
            t,
        ))
        .await;
    assert!(mine.is_ok(), "{mine:?}");
    server.stop().await;
}

/// A `dns:///` target over TLS: each address is dialled with the target's
/// host as the certificate's name, and the token goes with every call.
#[tokio::test]
async fn a_balanced_client_over_tls_sends_its_token_to_the_replicas() {
    use agentd::client::{AgentClient, ClientConfig, ClientSecurity, StaticResolver};
    let server = server().await;
    let resolver = std::sync::Arc::new(StaticResolver::new([server.addr]));
    let config = |token: Option<&str>| ClientConfig {
        security: ClientSecurity {
            tls: Some(ClientSecurity::tls_from_pem(server.ca.pem.as_bytes(), None)),
            token: token.map(str::to_owned),
        },
        ..ClientConfig::default()
    };

    let mut c = AgentClient::balanced(
        "localhost",
        server.addr.port(),
        resolver.clone(),
        config(Some(TRUSTED)),
    )
    .await
    .unwrap();
    let session = c.create_session("alice").await.unwrap().session_id;
    let (events, end) = c
        .run_to_end(
            run_request("alice", &session, "r1", "Where is order 1187?"),
            DEADLINE,
        )
        .await
        .unwrap();
    end.unwrap();
    assert!(
        events
            .last()
            .is_some_and(|e| e.is_final && e.text.contains("DHL")),
        "{events:?}"
    );

    let mut anonymous = AgentClient::balanced(
        "localhost",
        server.addr.port(),
        resolver.clone(),
        config(None),
    )
    .await
    .unwrap();
    let err = anonymous.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");

    // The certificate is not valid for another name.
    let mut wrong_name = AgentClient::balanced(
        "agentd.example",
        server.addr.port(),
        resolver,
        config(Some(TRUSTED)),
    )
    .await
    .unwrap();
    let err = wrong_name.create_session("alice").await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    server.stop().await;
}
