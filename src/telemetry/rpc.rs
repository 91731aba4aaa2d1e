//! The per-call tower layer: one span and one set of metrics per gRPC call,
//! recorded when the call really ends.
//!
//! For a streaming call the status is in the trailers, sent after the last
//! event, so the layer wraps the response body and reads `grpc-status` from
//! the trailers frame. A body dropped before its end (the client cancelled or
//! went away) counts as CANCELLED. A trailers-only response (a refusal before
//! any message) carries `grpc-status` in its headers.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use http_body::{Body, Frame, SizeHint};
use prost::Message;
use tonic::Code;
use tonic::codegen::http;
use tower::{Layer, Service};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::metrics::{self as m, code_name};
use super::trace;

/// Adds a span and metrics to every call. Only methods named in the given
/// descriptor sets get their own label values; any other path is counted
/// as `unknown`, so a caller cannot grow the metrics without bound.
#[derive(Clone)]
pub struct RpcLayer {
    known: Arc<Known>,
}

/// Path → labels of the served methods. The names are leaked once per
/// server so that a call's labels cost no allocation.
type Known = HashMap<String, Labels>;

#[derive(Clone, Copy)]
struct Labels {
    service: &'static str,
    method: &'static str,
    /// The span name, `service/method`.
    name: &'static str,
}

const UNKNOWN: Labels = Labels {
    service: "unknown",
    method: "unknown",
    name: "unknown/unknown",
};

impl RpcLayer {
    /// `descriptor_sets`: encoded `FileDescriptorSet`s of the served services.
    pub fn new(descriptor_sets: &[&[u8]]) -> anyhow::Result<Self> {
        let mut known = HashMap::new();
        for bytes in descriptor_sets {
            let set = prost_types::FileDescriptorSet::decode(*bytes)?;
            for file in set.file {
                let package = file.package.unwrap_or_default();
                for service in file.service {
                    let service_name = service.name.unwrap_or_default();
                    let prefix = if package.is_empty() {
                        String::new()
                    } else {
                        format!("{package}.")
                    };
                    let full: &'static str =
                        Box::leak(format!("{prefix}{service_name}").into_boxed_str());
                    for method in service.method {
                        let method = method.name.unwrap_or_default();
                        let name: &'static str =
                            Box::leak(format!("{full}/{method}").into_boxed_str());
                        let labels = Labels {
                            service: full,
                            method: &name[full.len() + 1..],
                            name,
                        };
                        known.insert(format!("/{name}"), labels);
                    }
                }
            }
        }
        m::handle();
        Ok(Self {
            known: Arc::new(known),
        })
    }
}

impl<S> Layer<S> for RpcLayer {
    type Service = RpcService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcService {
            inner,
            known: self.known.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    known: Arc<Known>,
}

impl<S, ReqB, ResB> Service<http::Request<ReqB>> for RpcService<S>
where
    S: Service<http::Request<ReqB>, Response = http::Response<ResB>>,
    ResB: Body,
{
    type Response = http::Response<RpcBody<ResB>>;
    type Error = S::Error;
    type Future = RpcFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqB>) -> Self::Future {
        let call = Call::start(&req, &self.known);
        // Entered while the handler is called, so its spans are children of
        // this one (the run's in the trace only: `trace::run_span`).
        let inner = call.span.in_scope(|| self.inner.call(req));
        RpcFuture {
            inner,
            call: Some(call),
        }
    }
}

/// One call in progress: its labels, its span and its start.
struct Call {
    labels: Labels,
    started: Instant,
    span: Span,
    done: bool,
}

impl Call {
    fn start<B>(req: &http::Request<B>, known: &Known) -> Self {
        let labels = known.get(req.uri().path()).copied().unwrap_or(UNKNOWN);
        let span = tracing::info_span!(
            "grpc",
            otel.name = labels.name,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = labels.service,
            rpc.method = labels.method,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            caller = tracing::field::Empty,
        );
        let _ = span.set_parent(trace::extract(req.headers()));
        if let Some(id) = trace::trace_id(&span) {
            span.record("trace_id", tracing::field::display(&id));
        }
        metrics::counter!(m::STARTED, "grpc_service" => labels.service, "grpc_method" => labels.method).increment(1);
        Call {
            labels,
            started: Instant::now(),
            span,
            done: false,
        }
    }

    fn finish(&mut self, code: Code) {
        if self.done {
            return;
        }
        self.done = true;
        let seconds = self.started.elapsed().as_secs_f64();
        let labels = [
            ("grpc_service", self.labels.service),
            ("grpc_method", self.labels.method),
            ("grpc_code", code_name(code)),
        ];
        metrics::counter!(m::HANDLED, &labels).increment(1);
        metrics::histogram!(m::HANDLING_SECONDS, &labels).record(seconds);
        self.span.record("rpc.grpc.status_code", code as i32);
        if is_server_error(code) {
            self.span.record("otel.status_code", "error");
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // Dropped before the end of its response: the client went away.
        self.finish(Code::Cancelled);
    }
}

/// The codes OpenTelemetry's RPC conventions count as a server span error.
fn is_server_error(code: Code) -> bool {
    matches!(
        code,
        Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::Unavailable
            | Code::DataLoss
    )
}

fn status_of(headers: &http::HeaderMap) -> Option<Code> {
    let v = headers.get("grpc-status")?;
    let n: i32 = v.to_str().ok()?.parse().ok()?;
    Some(Code::from(n))
}

pin_project_lite::pin_project! {
    pub struct RpcFuture<F> {
        #[pin]
        inner: F,
        call: Option<Call>,
    }
}

impl<F, ResB, E> Future for RpcFuture<F>
where
    F: Future<Output = Result<http::Response<ResB>, E>>,
{
    type Output = Result<http::Response<RpcBody<ResB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _enter = this.call.as_ref().map(|c| c.span.clone().entered());
        let result = ready!(this.inner.poll(cx));
        let mut call = this.call.take();
        match result {
            Ok(resp) => {
                if let (Some(code), Some(c)) = (status_of(resp.headers()), call.as_mut()) {
                    // Trailers-only: the call ended with its headers.
                    c.finish(code);
                    call = None;
                }
                Poll::Ready(Ok(resp.map(|inner| RpcBody { inner, call })))
            }
            Err(e) => {
                if let Some(c) = call.as_mut() {
                    c.finish(Code::Unknown);
                }
                Poll::Ready(Err(e))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that records its call when the trailers go out.
    pub struct RpcBody<B> {
        #[pin]
        inner: B,
        call: Option<Call>,
    }
}

impl<B: Body> Body for RpcBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let _enter = this.call.as_ref().map(|c| c.span.clone().entered());
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(code) = f.trailers_ref().and_then(status_of)
                    && let Some(mut c) = this.call.take()
                {
                    c.finish(code);
                }
            }
            Some(Err(_)) => {
                if let Some(mut c) = this.call.take() {
                    c.finish(Code::Unknown);
                }
            }
            None => {
                if let Some(mut c) = this.call.take() {
                    // A gRPC response always ends with a status; one without
                    // is broken.
                    c.finish(Code::Unknown);
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
