//! A turn's recorded outcome and what its status tells a caller to do: a
//! resend with the same request_id replays it, so a recorded UNAVAILABLE
//! (the model server rate-limited the run) of a caller's own request_id
//! carries no retry pushback (the `recorded` trailer says a resend would
//! replay it); a new request_id runs the turn again. A Run whose
//! request_id the server made up gets the pushback: its resend is a new
//! turn.

mod openai_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentd::grpc::status::TURN_OUTCOME_HEADER;
use tonic::Code;

/// A model server that rate-limits its first two requests (429 with
/// `Retry-After: 3`) and answers the others; its URL and how many requests
/// it got.
async fn rate_limited_once() -> (String, Arc<AtomicUsize>) {
    use axum::routing::post;
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let first = seen.fetch_add(1, Ordering::SeqCst) < 2;
            async move {
                let r = axum::response::Response::builder();
                if first {
                    r.status(429)
                        .header("retry-after", "3")
                        .header("content-type", "application/json")
                        .body(axum::body::Body::from(
                            r#"{"error":{"message":"rate limited","type":"rate_limit_error"}}"#,
                        ))
                        .unwrap()
                } else {
                    let chunk = r#"{"choices":[{"index":0,"delta":{"content":"Shipped."},"finish_reason":"stop"}]}"#;
                    r.header("content-type", "text/event-stream")
                        .body(axum::body::Body::from(format!(
                            "data: {chunk}\n\ndata: [DONE]\n\n"
                        )))
                        .unwrap()
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, calls)
}

/// Alice's turn `request_id` of `helper` in `session` over the raw gRPC
/// client (no retries of its own): how many events came, and the end.
async fn turn(
    d: &mut openai_support::Agentd,
    session: &str,
    request_id: &str,
) -> (usize, Result<(), tonic::Status>) {
    let req = agentd::pb::RunRequest {
        user_id: "alice".into(),
        session_id: session.into(),
        text: "Where is order 1187?".into(),
        request_id: request_id.into(),
        agent: "helper".into(),
        ..Default::default()
    };
    let mut stream = match d.client.raw().run(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => return (0, Err(s)),
    };
    let mut n = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("the turn ends")
        {
            Ok(Some(_)) => n += 1,
            Ok(None) => return (n, Ok(())),
            Err(s) => return (n, Err(s)),
        }
    }
}

#[tokio::test]
async fn a_recorded_unavailable_has_a_pushback_only_where_a_resend_runs_again() {
    let (url, calls) = rate_limited_once().await;
    let agents = format!(
        r#"
[agents.helper]
description = "test agent"
instruction = "You answer order questions."
[agents.helper.model]
base_url = "{url}"
model = "test-model"
"#
    );
    let mut d = openai_support::Agentd::start(&agents).await;
    let session = d.session("alice").await;

    let (_, end) = turn(&mut d, &session, "r1").await;
    let first = end.unwrap_err();
    assert_eq!(first.code(), Code::Unavailable, "{first:?}");
    assert!(
        first.metadata().get(TURN_OUTCOME_HEADER).is_some(),
        "the rate-limited turn is recorded: {first:?}"
    );
    assert!(
        first.metadata().get("grpc-retry-pushback-ms").is_none(),
        "a pushback invites a resend, which would only replay it: {first:?}"
    );
    // When a new turn may do better is still said, in a trailer of its own.
    assert_eq!(
        first
            .metadata()
            .get(agentd::grpc::status::RETRY_AFTER_HEADER)
            .map(|v| v.to_str().unwrap()),
        Some("3000"),
        "{first:?}"
    );

    // What the pushback invited: the same request, later. The stored
    // outcome again, and the model is not asked.
    let (_, end) = turn(&mut d, &session, "r1").await;
    let again = end.unwrap_err();
    assert_eq!(
        (again.code(), again.message()),
        (first.code(), first.message())
    );
    assert!(again.metadata().get(TURN_OUTCOME_HEADER).is_some());
    assert!(again.metadata().get("grpc-retry-pushback-ms").is_none());
    // The replay does not know how long ago the model server said it.
    assert!(
        again
            .metadata()
            .get(agentd::grpc::status::RETRY_AFTER_HEADER)
            .is_none()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // No request_id: the server makes one up, and a resend is a new turn,
    // so the model server's Retry-After is the pushback.
    let (_, end) = turn(&mut d, &session, "").await;
    let made_up = end.unwrap_err();
    assert_eq!(made_up.code(), Code::Unavailable, "{made_up:?}");
    assert_eq!(
        made_up
            .metadata()
            .get("grpc-retry-pushback-ms")
            .map(|v| v.to_str().unwrap()),
        Some("3000"),
        "{made_up:?}"
    );
    assert!(
        made_up
            .metadata()
            .get(agentd::grpc::status::RETRY_AFTER_HEADER)
            .is_none()
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // A new request_id runs the turn again.
    let (events, end) = turn(&mut d, &session, "r2").await;
    end.unwrap();
    assert!(events > 0);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    d.stop().await;
}
