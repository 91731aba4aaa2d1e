//! The admin HTTP port: `/metrics` (Prometheus), `/healthz` (the process
//! is up) and `/readyz` (SERVING: 200; draining or not started: 503).
//! Plain HTTP/1.1 on its own listener, so probes and scrapers need neither
//! the gRPC port's TLS nor its tokens; keep it off public networks.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

/// Whether the gRPC server reports SERVING; the server sets it with its
/// health entries, `/readyz` reads it.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Connections the admin port serves at once: scrapers and probes make a
/// few short ones. Past it new ones are closed, so a peer that opens many
/// cannot take the file descriptors the other ports and the store need.
const MAX_CONNECTIONS: usize = 128;

/// The admin routes.
pub fn router(readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(readiness)
}

/// Serves the admin routes on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let result = crate::server::serve_http(
        "admin",
        listener,
        router(readiness),
        MAX_CONNECTIONS,
        // HTTP/1 only: what scrapers and probes speak, and an HTTP/2
        // connection could be held open idle, holding a slot.
        false,
        shutdown,
    )
    .await;
    result.map_err(|e| anyhow::anyhow!("admin server failed: {e}"))
}

async fn metrics() -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        super::metrics::render(),
    )
}

async fn ready(State(r): State<Readiness>) -> impl IntoResponse {
    if r.get() {
        (StatusCode::OK, "serving\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not serving\n")
    }
}
