//! W3C trace context in and out, and the spans agentd opens.
//!
//! An incoming call's `traceparent` (gRPC metadata is HTTP/2 headers) becomes
//! the parent of its RPC span, so a caller's trace continues inside agentd.
//! Outbound calls carry the current span's context: [`inject_headers`] for an
//! HTTP client (a model server), [`inject_metadata`] for a gRPC one,
//! [`inject_params`] for an A2A call (either binding). An A2A task's span
//! continues the trace of the call that sent its message ([`extract_params`]).

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// The trace context a caller sent (`traceparent`, `tracestate`); an empty
/// context when there is none or it is malformed.
pub fn extract(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// An A2A call's headers (gRPC metadata or HTTP headers, names in lower
/// case), as the A2A SDK hands them over.
pub type Params = std::collections::HashMap<String, Vec<String>>;

struct ParamsExtractor<'a>(&'a Params);

impl Extractor for ParamsExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.first()).map(String::as_str)
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

struct ParamsInjector<'a>(&'a mut Params);

impl Injector for ParamsInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), vec![value]);
    }
}

/// The trace context an A2A call carried; empty when it has none.
pub fn extract_params(params: &Params) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&ParamsExtractor(params))
}

/// Adds the current span's `traceparent` to an outbound A2A call's
/// headers (nothing when the current span is not part of a trace).
pub fn inject_params(params: &mut Params) {
    inject_current(&mut ParamsInjector(params));
}

/// Writes the current span's trace context with `injector`.
fn inject_current(injector: &mut dyn Injector) {
    TraceContextPropagator::new().inject_context(&Span::current().context(), injector);
}

/// Adds the current span's `traceparent` to an outbound HTTP request.
pub fn inject_headers(headers: &mut http::HeaderMap) {
    inject_current(&mut HeaderInjector(headers));
}

/// Adds the current span's `traceparent` to an outbound gRPC request.
pub fn inject_metadata(metadata: &mut tonic::metadata::MetadataMap) {
    let mut headers = http::HeaderMap::new();
    inject_headers(&mut headers);
    for (k, v) in headers.iter() {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(k.as_str().as_bytes()),
            tonic::metadata::AsciiMetadataValue::try_from(v.as_bytes()),
        ) {
            metadata.insert(k, v);
        }
    }
}

/// The trace id of `span` as 32 hex digits, if it is part of a trace.
pub fn trace_id(span: &Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// The span of one agent run (or of a replay/attach of one). In the trace it
/// is a child of the span current where it starts (a Run's or an Attach's
/// RPC span, an A2A task's span); to tracing it has no parent. A tracing
/// span stays open as long as any child does: as the run's parent, the RPC
/// span of a run that goes on after its client left
/// (`ON_DISCONNECT_CONTINUE`) would last until the run ended, in memory and
/// in the trace (its end time, long after the call's, which
/// `grpc_server_handling_seconds` counts). So the run's log lines carry
/// themselves what they would take from the call's span: the trace id, and
/// the caller the authentication layer named on it (which the telemetry's
/// `KeepCaller` layer keeps for this).
pub fn run_span(
    mode: &'static str,
    agent: &str,
    session: &dyn std::fmt::Display,
    request_id: &dyn std::fmt::Display,
) -> Span {
    let current = Span::current();
    let span = tracing::info_span!(
        parent: None,
        "run",
        otel.name = "run",
        mode,
        agent,
        session = %session,
        request_id = %request_id,
        trace_id = tracing::field::Empty,
        caller = tracing::field::Empty,
    );
    // No current span: an empty context, and the run starts a trace.
    let _ = span.set_parent(current.context());
    if let Some(id) = trace_id(&span) {
        span.record("trace_id", tracing::field::display(&id));
    }
    if let Some(caller) = crate::telemetry::caller_of(&current) {
        span.record("caller", caller.as_str());
    }
    span
}

/// The span of one A2A task's turn on this server. Its parent is the trace
/// context the message's call carried ([`extract_params`]): the A2A SDK runs
/// the task on a task of its own, outside the call's span.
pub fn a2a_task_span(task_id: &str, context_id: &str, parent: opentelemetry::Context) -> Span {
    let span = tracing::info_span!(
        "a2a_task",
        otel.name = "a2a task",
        otel.kind = "server",
        a2a.task.id = task_id,
        a2a.context.id = context_id,
        trace_id = tracing::field::Empty,
    );
    let _ = span.set_parent(parent);
    // Log lines of the task's run carry the trace's id, as a call's do.
    if let Some(id) = trace_id(&span) {
        span.record("trace_id", tracing::field::display(&id));
    }
    span
}

/// The span of one turn delegated to a remote A2A agent, a child of the
/// run's span, named as OpenTelemetry's GenAI conventions name an agent
/// invocation. The call's requests (the message, GetTask and
/// SubscribeToTask after a drop, CancelTask) carry its `traceparent`.
pub fn invoke_agent_span(agent: &str) -> Span {
    tracing::info_span!(
        "invoke_agent",
        otel.name = %format!("invoke_agent {agent}"),
        otel.kind = "client",
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = agent,
        a2a.task.id = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// The span of one call of the configured tool `tool`, a child of the run's
/// span. A name the model sent that is none of the agent's tools gets
/// [`unknown_tool_span`] instead: a span's name must come from a small set.
pub fn tool_span(tool: &str, call_id: &str) -> Span {
    tracing::info_span!(
        "tool",
        otel.name = %format!("execute_tool {tool}"),
        otel.kind = "internal",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = tool,
        gen_ai.tool.call.id = %bounded(call_id),
    )
}

/// The span of a call of a tool the agent does not have, named
/// `execute_tool unknown`. The name is model output (hallucinated, or put
/// there by a prompt injection) of up to the model's answer size: as the
/// span's name it made one span name per call, of any length. It is kept
/// as `gen_ai.tool.name`, cut to [`MAX_ATTRIBUTE_CHARS`], its control
/// characters escaped.
pub fn unknown_tool_span(requested: &str, call_id: &str) -> Span {
    tracing::info_span!(
        "tool",
        otel.name = "execute_tool unknown",
        otel.kind = "internal",
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %bounded(requested),
        gen_ai.tool.call.id = %bounded(call_id),
    )
}

/// The most characters of model output kept in a span attribute.
pub const MAX_ATTRIBUTE_CHARS: usize = 128;

/// Model output as a span attribute: at most [`MAX_ATTRIBUTE_CHARS`]
/// characters (the rest marked with `…`), control characters escaped.
fn bounded(v: &str) -> String {
    match v.char_indices().nth(MAX_ATTRIBUTE_CHARS) {
        Some((cut, _)) => format!("{}…", crate::telemetry::escape_control(&v[..cut])),
        None => crate::telemetry::escape_control(v),
    }
}

/// The span of one call to a model server, a child of the run's span, named
/// and attributed as OpenTelemetry's GenAI conventions say. Run the request
/// inside it (`.instrument(span)`) and call [`inject_headers`] on the request
/// so the model server's trace joins ours. Record the outcome with
/// `span.record("gen_ai.response.model", ..)` and the token counts
/// (`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`); a failed call
/// records `otel.status_code = "error"`.
///
/// ```no_run
/// use tracing::Instrument;
/// use agentd::telemetry::trace;
/// # async fn example() {
/// let span = trace::model_call_span("openai", "chat", "gpt-4o-mini");
/// async {
///     let mut headers = tonic::codegen::http::HeaderMap::new();
///     trace::inject_headers(&mut headers); // traceparent: this model-call span
///     // ... send the request with `headers`, read the answer ...
///     tracing::Span::current().record("gen_ai.usage.input_tokens", 12);
/// }
/// .instrument(span)
/// .await;
/// # }
/// ```
pub fn model_call_span(system: &str, operation: &str, model: &str) -> Span {
    tracing::info_span!(
        "model",
        otel.name = %format!("{operation} {model}"),
        otel.kind = "client",
        gen_ai.system = system,
        gen_ai.operation.name = operation,
        gen_ai.request.model = model,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}
