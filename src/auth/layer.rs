//! The tower layer that authenticates every call before it is decoded.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tower::{Layer, Service};

use super::{Authenticator, tls};

/// Refuses calls without valid credentials (UNAUTHENTICATED, trailers-only,
/// nothing decoded or run) and hands the [`super::Caller`] to the handlers.
#[derive(Clone)]
pub struct AuthLayer {
    auth: Option<Arc<Authenticator>>,
}

impl AuthLayer {
    /// `None` turns authentication off: every call passes untouched.
    pub fn new(auth: Option<Arc<Authenticator>>) -> Self {
        Self { auth }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            auth: self.auth.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Option<Arc<Authenticator>>,
}

impl<S, ReqB, ResB> Service<http::Request<ReqB>> for AuthService<S>
where
    S: Service<http::Request<ReqB>, Response = http::Response<ResB>>,
    ResB: Default,
{
    type Response = http::Response<ResB>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<http::Response<ResB>, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqB>) -> Self::Future {
        // Only this layer names the caller (see `super::CALLER_HEADER`).
        req.headers_mut().remove(super::CALLER_HEADER);
        let Some(auth) = &self.auth else {
            return Either::Left(self.inner.call(req));
        };
        let service = req
            .uri()
            .path()
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or_default();
        if auth.is_open(service) {
            return Either::Left(self.inner.call(req));
        }
        let certificate = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|i| i.peer_certs())
            .and_then(|certs| {
                certs
                    .first()
                    .and_then(|c| tls::certificate_name(c.as_ref()))
            });
        let authorization = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        match auth.authenticate(authorization, certificate.as_deref()) {
            Ok(caller) => {
                tracing::Span::current().record("caller", &*caller.name);
                if service == crate::a2a::A2A_SERVICE_NAME && !super::may_act_as_itself(&caller) {
                    return Either::Right(ready(Ok(tonic::Status::permission_denied(
                        super::A2A_SCOPE_REFUSAL,
                    )
                    .into_http())));
                }
                if let Ok(v) = http::HeaderValue::from_str(&caller.name) {
                    req.headers_mut().insert(super::CALLER_HEADER, v);
                }
                req.extensions_mut().insert(caller);
                Either::Left(self.inner.call(req))
            }
            Err(why) => {
                // Debug only: anyone can send such calls, and the metrics
                // count them.
                tracing::debug!(reason = %why, "call refused: unauthenticated");
                Either::Right(ready(Ok(
                    crate::grpc::status::unauthenticated(why).into_http()
                )))
            }
        }
    }
}
