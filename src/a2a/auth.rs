//! Authentication of the A2A HTTP face (JSON-RPC and SSE), with the
//! credentials agents.v1 takes ([`crate::auth::Authenticator`]). The gRPC
//! binding shares the gRPC port's [`crate::auth::AuthLayer`].
//!
//! Either layer refuses a call without valid credentials before the
//! handler sees it (HTTP 401 with a JSON-RPC error body here, gRPC
//! UNAUTHENTICATED there), and passes the caller's name on as the
//! [`crate::auth::CALLER_HEADER`] service parameter, which the handler reads
//! as the call's user: the user its tasks run as and belong to. The header is removed from every incoming
//! request first, so a client cannot name itself. The agent card at
//! `/.well-known/agent-card.json` stays public: it says how to authenticate.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

use crate::auth::{Authenticator, CALLER_HEADER};

/// The JSON-RPC error code of a refused credential (an implementation-defined
/// server error: A2A 1.0 leaves authentication to the HTTP layer, 401).
pub const UNAUTHENTICATED_CODE: i32 = -32000;
/// The JSON-RPC error code of an authenticated caller the A2A faces refuse
/// (HTTP 403).
pub const PERMISSION_DENIED_CODE: i32 = -32099;

/// The path of the public agent card.
pub const CARD_PATH: &str = a2a_server::agent_card::WELL_KNOWN_AGENT_CARD_PATH;

/// `router` behind authentication, or as it is when `auth` is `None` (the
/// caller header is removed either way).
pub fn guard(router: axum::Router, auth: Option<Arc<Authenticator>>) -> axum::Router {
    router.layer(axum::middleware::from_fn_with_state(auth, check))
}

async fn check(
    State(auth): State<Option<Arc<Authenticator>>>,
    mut req: Request,
    next: Next,
) -> Response {
    let started = std::time::Instant::now();
    req.headers_mut().remove(CALLER_HEADER);
    let Some(auth) = auth else {
        return next.run(req).await;
    };
    if req.uri().path() == CARD_PATH {
        return next.run(req).await;
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match auth.authenticate(authorization, None) {
        Ok(caller) if !crate::auth::may_act_as_itself(&caller) => {
            crate::telemetry::metrics::a2a_request(
                "unknown",
                "PERMISSION_DENIED",
                started.elapsed(),
            );
            forbidden(crate::auth::A2A_SCOPE_REFUSAL)
        }
        Ok(caller) => {
            if let Ok(v) = HeaderValue::from_str(&caller.name) {
                req.headers_mut().insert(CALLER_HEADER, v);
            }
            next.run(req).await
        }
        Err(why) => {
            // Debug only: anyone can send such calls, and the metrics
            // count them.
            tracing::debug!(reason = %why, "A2A call refused: unauthenticated");
            // Counted without its method: the body of an unauthenticated
            // request is not read.
            crate::telemetry::metrics::a2a_request("unknown", "UNAUTHENTICATED", started.elapsed());
            unauthorized(&why.to_string())
        }
    }
}

/// HTTP 403 with a JSON-RPC error body (id null: the request was not read).
pub fn forbidden(why: &str) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": PERMISSION_DENIED_CODE, "message": format!("permission denied: {why}")},
    });
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = StatusCode::FORBIDDEN;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// HTTP 401 with a JSON-RPC error body (id null: the request was not read).
pub fn unauthorized(why: &str) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {"code": UNAUTHENTICATED_CODE, "message": format!("unauthenticated: {why}")},
    });
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = StatusCode::UNAUTHORIZED;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"agentd\""),
    );
    resp
}

/// The credentials the A2A faces take, as the card declares them: none
/// (both `false`) without authentication.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Credentials {
    /// Bearer tokens (`--auth-tokens`), on either binding.
    pub bearer: bool,
    /// Client certificates (`--tls-client-ca`), on the gRPC binding only:
    /// the JSON-RPC face is plain HTTP, where no certificate is presented.
    pub mtls: bool,
}

impl Credentials {
    pub fn of(auth: Option<&Authenticator>) -> Self {
        auth.map_or_else(Self::default, |a| Self {
            bearer: a.takes_tokens(),
            mtls: a.takes_certificates(),
        })
    }

    /// Whether a JSON-RPC call can ever be let in: without authentication,
    /// or with bearer tokens (a certificate never reaches that face).
    pub fn jsonrpc_usable(&self) -> bool {
        self.bearer || !self.mtls
    }
}

/// The card's security declaration when authentication is on: an HTTP
/// bearer scheme with tokens, a mutual TLS scheme with client certificates,
/// either one satisfying it (one requirement each); `None` without.
pub fn card_security(
    creds: Credentials,
) -> Option<(
    std::collections::HashMap<String, a2a::SecurityScheme>,
    Vec<a2a::SecurityRequirement>,
)> {
    let mut schemes = std::collections::HashMap::new();
    if creds.bearer {
        schemes.insert(
            BEARER_SCHEME.to_owned(),
            a2a::SecurityScheme::HttpAuth(a2a::HttpAuthSecurityScheme {
                scheme: "Bearer".into(),
                description: Some(if creds.mtls {
                    "A token from the server's --auth-tokens file, sent as \"authorization: Bearer <token>\" (HTTP header or gRPC metadata). The gRPC interface also needs a client certificate (its TLS asks every client for one), so a token alone serves on the JSON-RPC interface only.".into()
                } else {
                    "A token from the server's --auth-tokens file, sent as \"authorization: Bearer <token>\" (HTTP header or gRPC metadata).".into()
                }),
                bearer_format: None,
            }),
        );
    }
    if creds.mtls {
        schemes.insert(
            MTLS_SCHEME.to_owned(),
            a2a::SecurityScheme::MutualTls(a2a::MutualTlsSecurityScheme {
                description: Some("A client certificate signed by the server's --tls-client-ca, presented on the gRPC interface (the JSON-RPC interface takes bearer tokens only).".into()),
            }),
        );
    }
    if schemes.is_empty() {
        return None;
    }
    let mut names: Vec<&String> = schemes.keys().collect();
    names.sort();
    let requirements = names
        .into_iter()
        .map(|name| [(name.clone(), vec![])].into_iter().collect())
        .collect();
    Some((schemes, requirements))
}

/// The name of the bearer scheme in the card.
pub const BEARER_SCHEME: &str = "bearer";
/// The name of the mutual TLS scheme in the card.
pub const MTLS_SCHEME: &str = "mtls";
