//! The JSON-RPC binding of the A2A client, with what it reads from a peer
//! bounded ([`Limits`]).
//!
//! The SDK's own transport (`a2a_client::jsonrpc::JsonRpcTransport`) reads
//! a unary answer whole, however large, and parses a stream by appending
//! each chunk to one buffer that it scans again from the start for the end
//! of an event: a peer that never ends an event grows it without bound, and
//! a large event costs time quadratic in its size. This one speaks the same
//! envelope (a POST of `{"jsonrpc":"2.0","id":<UUIDv7>,"method":…,
//! "params":<ProtoJSON of the request>}`, the headers of the call's
//! [`ServiceParams`], `Accept: text/event-stream` for a stream) and reads
//! the same answers the same way, with these differences:
//! - a unary answer (and the JSON body answering a streaming call) is read
//!   up to [`Limits::max_body_bytes`], refused past it;
//! - a stream is read through [`BoundedSse`] and the `eventsource-stream`
//!   parser, in linear time, one event at most [`Limits::max_event_bytes`];
//! - past a limit, the error says so, and [`is_too_large`] tells it: the
//!   client ends the call at once, as for a gRPC message past the binding's
//!   limit (see `CallError::MessageTooLarge`).
//!
//! As the SDK's: a streaming call answered with a JSON body (not an event
//! stream) carrying a JSON-RPC error returns that error; an answer without a
//! content type is read as a stream (reading it to look would hang on a
//! stream that has sent nothing yet), and such a stream that holds a
//! JSON-RPC envelope alone yields its error (or result); events end at
//! `\n\n`, `\r\r` or `\r\n\r\n`; `data` may take several lines; an event the
//! stream ends inside is still read if it has a `data` line, and a stream
//! cut inside an event is an error, never a clean end; whitespace at the
//! end is a clean end. Errors carry no URL of their own (reqwest's quote
//! the endpoint's, which `A2aClient` masks).

use std::future::Future;

use a2a::{
    A2AError, AgentCard, AgentInterface, CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest, GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest, GetTaskRequest, JsonRpcError, JsonRpcId, JsonRpcRequest,
    JsonRpcResponse, ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse, ListTasksRequest, ListTasksResponse,
    SendMessageRequest, SendMessageResponse, StreamResponse, SubscribeToTaskRequest, Task,
    TaskPushNotificationConfig, TypedDetail, error_code, errordetails, methods,
};
use a2a_client::transport::{ServiceParams, Transport, TransportFactory};
use a2a_pb::protojson_conv::{self, ProtoJsonPayload};
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{BoxStream, Stream, StreamExt};
use serde_json::Value;

use crate::sse::{BodyError, BoundedSse};

/// What a call reads at most from the peer, besides what it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One event of a stream: its lines together, line ends not counted.
    pub max_event_bytes: usize,
    /// The body of a unary answer (or the JSON body answering a streaming
    /// call).
    pub max_body_bytes: usize,
}

/// What an event or an answer may hold beyond twice a call's artifacts:
/// the envelope, ids, status, a status message, a snapshot's history.
const HEADROOM: usize = 1 << 20;

/// The reason of the [`a2a::TypedDetail`] (an `ErrorInfo`) that marks an
/// error as an answer past a [`Limits`]; see [`is_too_large`].
const TOO_LARGE_REASON: &str = "RESPONSE_TOO_LARGE";
/// The domain of that `ErrorInfo`.
const DOMAIN: &str = "agentd.client";

tokio::task_local! {
    static LIMITS: Limits;
}

impl Limits {
    /// The limits of a call that buffers at most `max_artifact_bytes` of
    /// artifacts (`CallOptions::max_artifact_bytes`), both `2 ×
    /// max_artifact_bytes + 1 MiB`. One event (an artifact update, or the
    /// Task a stream begins with) and one answer (GetTask's Task) may hold
    /// every artifact the call keeps; ProtoJSON writes file bytes as base64
    /// (4/3 of their size) and escapes text, hence twice; the MiB is for
    /// the rest (ids, status and its message, a snapshot's history). So the
    /// call's own limit, which cancels the task, meets a task whose
    /// artifacts outgrow it first; these stop only a peer that sends far
    /// more than it could mean to (an event that never ends), and hold what
    /// a stream keeps to a few times their size.
    pub fn for_artifacts(max_artifact_bytes: usize) -> Self {
        let n = max_artifact_bytes
            .saturating_mul(2)
            .saturating_add(HEADROOM);
        Self {
            max_event_bytes: n,
            max_body_bytes: n,
        }
    }

    /// Runs `f` with these limits on every request a [`JsonRpcTransport`]
    /// makes in it (the SDK's [`Transport`] takes no options per call): the
    /// limits of a stream are those in force when it was opened.
    pub async fn scope<F: Future>(self, f: F) -> F::Output {
        LIMITS.scope(self, f).await
    }

    /// The limits of the innermost [`Self::scope`], else the default
    /// ([`Self::for_artifacts`] of `CallOptions::default()`'s 64 MiB).
    pub fn current() -> Self {
        LIMITS.try_with(|l| *l).unwrap_or_default()
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::for_artifacts(super::CallOptions::default().max_artifact_bytes)
    }
}

/// Whether `e` is an answer past a [`Limits`] (an event or a body).
pub fn is_too_large(e: &A2AError) -> bool {
    e.details.iter().flatten().any(|d| {
        d.type_url == errordetails::ERROR_INFO_TYPE
            && d.value.get("reason").and_then(Value::as_str) == Some(TOO_LARGE_REASON)
            && d.value.get("domain").and_then(Value::as_str) == Some(DOMAIN)
    })
}

/// `what` (from the remote agent) passed `limit` bytes.
pub(crate) fn too_large(what: &str, limit: usize) -> A2AError {
    A2AError::internal(format!(
        "{what} from the remote agent passed this client's limit of {limit} bytes, twice CallOptions::max_artifact_bytes plus 1 MiB"
    ))
    .with_details(vec![TypedDetail::error_info(TOO_LARGE_REASON, DOMAIN, None)])
}

/// The A2A error a JSON-RPC error stands for, as the SDK maps it (which
/// it does not export): its code, unless an `ErrorInfo` of the A2A
/// protocol's domain gives a known reason; a `BadRequest`'s field
/// violations appended to the message (and an INTERNAL_ERROR with one is
/// INVALID_PARAMS); the typed details of `data`, kept, but for one that
/// would pass for this client's own [`is_too_large`] mark.
fn from_jsonrpc_error(e: JsonRpcError) -> A2AError {
    let details: Vec<TypedDetail> = match e.data {
        Some(Value::Array(items)) => items
            .into_iter()
            .filter_map(|v| serde_json::from_value::<TypedDetail>(v).ok())
            .filter(|d| d.value.get("domain").and_then(Value::as_str) != Some(DOMAIN))
            .collect(),
        _ => Vec::new(),
    };
    let (mut code, mut message) = (e.code, e.message);
    for d in &details {
        let field = |k: &str| d.value.get(k).and_then(Value::as_str);
        match d.type_url.as_str() {
            errordetails::BAD_REQUEST_TYPE => {
                let violations: Vec<String> = d
                    .value
                    .get("fieldViolations")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|v| {
                        let field = v.get("field")?.as_str()?;
                        let description = v.get("description")?.as_str()?;
                        Some(if field.is_empty() {
                            description.to_owned()
                        } else {
                            format!("{field}: {description}")
                        })
                    })
                    .collect();
                if !violations.is_empty() {
                    message = format!("{message}: {}", violations.join("; "));
                }
                if code == error_code::INTERNAL_ERROR {
                    code = error_code::INVALID_PARAMS;
                }
            }
            errordetails::ERROR_INFO_TYPE
                if field("domain") == Some(errordetails::PROTOCOL_DOMAIN) =>
            {
                if let Some(c) = field("reason").and_then(a2a::reason_to_error_code) {
                    code = c;
                }
            }
            _ => {}
        }
    }
    A2AError {
        code,
        message,
        details: (!details.is_empty()).then_some(details),
    }
}

fn internal(what: &str, e: impl std::fmt::Display) -> A2AError {
    A2AError::internal(format!("{what}: {e}"))
}

/// The A2A client's JSON-RPC transport: see the module docs.
pub struct JsonRpcTransport {
    http: reqwest::Client,
    endpoint: String,
}

impl JsonRpcTransport {
    pub fn new(http: reqwest::Client, endpoint: String) -> Self {
        Self { http, endpoint }
    }

    /// POSTs `method` with `params` (a ProtoJSON value) as a JSON-RPC request.
    async fn post(
        &self,
        service: &ServiceParams,
        method: &str,
        params: Value,
        stream: bool,
    ) -> Result<reqwest::Response, A2AError> {
        let id = JsonRpcId::String(uuid::Uuid::now_v7().to_string());
        let mut req = self.http.post(&self.endpoint);
        if stream {
            req = req.header(reqwest::header::ACCEPT, "text/event-stream");
        }
        for (key, values) in service {
            for v in values {
                req = req.header(key, v);
            }
        }
        req.json(&JsonRpcRequest::new(id, method, Some(params)))
            .send()
            .await
            .map_err(|e| internal("HTTP request failed", e))
    }

    /// The JSON-RPC response of a unary call: its result (if any), or its
    /// error.
    async fn call_value(
        &self,
        service: &ServiceParams,
        method: &str,
        params: Value,
    ) -> Result<Option<Value>, A2AError> {
        let limit = Limits::current().max_body_bytes;
        let resp = self.post(service, method, params, false).await?;
        let rpc = read_response(resp, limit).await?;
        match rpc.error {
            Some(e) => Err(from_jsonrpc_error(e)),
            None => Ok(rpc.result),
        }
    }

    async fn call<Req: ProtoJsonPayload, Resp: ProtoJsonPayload>(
        &self,
        service: &ServiceParams,
        method: &str,
        req: &Req,
    ) -> Result<Resp, A2AError> {
        let result = self.call_value(service, method, protojson(req)?).await?;
        let result =
            result.ok_or_else(|| A2AError::internal("JSON-RPC response missing result"))?;
        protojson_conv::from_value(result).map_err(|e| internal("failed to deserialize result", e))
    }

    async fn call_streaming<Req: ProtoJsonPayload>(
        &self,
        service: &ServiceParams,
        method: &str,
        req: &Req,
    ) -> Result<BoxStream<'static, Result<StreamResponse, A2AError>>, A2AError> {
        let limits = Limits::current();
        let resp = self.post(service, method, protojson(req)?, true).await?;
        let event_stream = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .is_none_or(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if event_stream {
            return Ok(events(resp.bytes_stream(), limits.max_event_bytes));
        }
        // A JSON-RPC error answering a streaming call comes as a JSON body
        // (JSON-RPC reports failures in the envelope, with HTTP 200).
        let rpc = read_response(resp, limits.max_body_bytes).await?;
        Err(match rpc.error {
            Some(e) => from_jsonrpc_error(e),
            None => A2AError::internal(
                "expected streaming response but got non-streaming JSON-RPC result",
            ),
        })
    }

    /// A push-notification config in a result: as this SDK writes it, else
    /// as ProtoJSON (the SDK's fallback, which it does not export).
    fn push_config(result: Option<Value>) -> Result<TaskPushNotificationConfig, A2AError> {
        let result =
            result.ok_or_else(|| A2AError::internal("JSON-RPC response missing result"))?;
        serde_json::from_value(result.clone()).or_else(|serde_error| {
            protojson_conv::from_value(result).map_err(|e| {
                A2AError::internal(format!(
                    "failed to deserialize push-config response: {serde_error}; ProtoJSON fallback failed: {e}"
                ))
            })
        })
    }
}

fn protojson<T: ProtoJsonPayload>(req: &T) -> Result<Value, A2AError> {
    protojson_conv::to_value(req)
        .map_err(|e| internal("failed to serialize request as ProtoJSON", e))
}

/// Reads a JSON-RPC response of at most `limit` bytes.
async fn read_response(
    mut resp: reqwest::Response,
    limit: usize,
) -> Result<JsonRpcResponse, A2AError> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large("an answer", limit));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| internal("failed to parse JSON-RPC response", e))?
    {
        if body.len() + chunk.len() > limit {
            return Err(too_large("an answer", limit));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| internal("failed to parse JSON-RPC response", e))
}

/// The events of an SSE body, each at most `max` bytes.
fn events(
    body: impl Stream<Item = reqwest::Result<bytes::Bytes>> + Send + 'static,
    max: usize,
) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
    BoundedSse::new(body, max)
        .without_error_lines()
        .ending_the_last_event()
        .eventsource()
        .filter_map(move |item| {
            std::future::ready(match item {
                Ok(event) => event_data(&event.data),
                Err(EventStreamError::Transport(BodyError::Unterminated(tail))) => {
                    Some(tail_envelope(&tail))
                }
                Err(EventStreamError::Transport(BodyError::TooLarge)) => {
                    Some(Err(too_large("a server-sent event", max)))
                }
                Err(EventStreamError::Transport(BodyError::Utf8)) => {
                    Some(Err(A2AError::internal("SSE UTF-8 decode error")))
                }
                Err(e) => Some(Err(internal("SSE stream error", e))),
            })
        })
        .boxed()
}

/// The event an SSE event's `data` holds: a JSON-RPC response (its result,
/// or its error), else a StreamResponse itself; none if it has no data or
/// the response neither.
fn event_data(data: &str) -> Option<Result<StreamResponse, A2AError>> {
    if data.is_empty() {
        return None;
    }
    match serde_json::from_str::<JsonRpcResponse>(data) {
        Ok(rpc) => {
            if let Some(e) = rpc.error {
                return Some(Err(from_jsonrpc_error(e)));
            }
            let result = rpc.result?;
            Some(protojson_conv::from_value(result).map_err(|e| internal("SSE parse error", e)))
        }
        Err(_) => Some(protojson_conv::from_str(data).map_err(|e| internal("SSE parse error", e))),
    }
}

/// What a stream that ended inside an event without `data` held: a JSON-RPC
/// envelope answering the call (its error, or its result), or else the
/// stream was cut.
fn tail_envelope(tail: &[u8]) -> Result<StreamResponse, A2AError> {
    if let Ok(rpc) = serde_json::from_slice::<JsonRpcResponse>(tail) {
        if let Some(e) = rpc.error {
            return Err(from_jsonrpc_error(e));
        }
        if let Some(result) = rpc.result {
            return protojson_conv::from_value(result)
                .map_err(|e| internal("failed to parse JSON-RPC result at end of stream", e));
        }
    }
    Err(A2AError::internal(format!(
        "stream ended with {} unparseable trailing byte(s); the connection was probably cut mid-message",
        tail.len()
    )))
}

#[async_trait::async_trait]
impl Transport for JsonRpcTransport {
    async fn send_message(
        &self,
        params: &ServiceParams,
        req: &SendMessageRequest,
    ) -> Result<SendMessageResponse, A2AError> {
        self.call(params, methods::SEND_MESSAGE, req).await
    }

    async fn send_streaming_message(
        &self,
        params: &ServiceParams,
        req: &SendMessageRequest,
    ) -> Result<BoxStream<'static, Result<StreamResponse, A2AError>>, A2AError> {
        self.call_streaming(params, methods::SEND_STREAMING_MESSAGE, req)
            .await
    }

    async fn get_task(
        &self,
        params: &ServiceParams,
        req: &GetTaskRequest,
    ) -> Result<Task, A2AError> {
        self.call(params, methods::GET_TASK, req).await
    }

    async fn list_tasks(
        &self,
        params: &ServiceParams,
        req: &ListTasksRequest,
    ) -> Result<ListTasksResponse, A2AError> {
        self.call(params, methods::LIST_TASKS, req).await
    }

    async fn cancel_task(
        &self,
        params: &ServiceParams,
        req: &CancelTaskRequest,
    ) -> Result<Task, A2AError> {
        self.call(params, methods::CANCEL_TASK, req).await
    }

    async fn subscribe_to_task(
        &self,
        params: &ServiceParams,
        req: &SubscribeToTaskRequest,
    ) -> Result<BoxStream<'static, Result<StreamResponse, A2AError>>, A2AError> {
        self.call_streaming(params, methods::SUBSCRIBE_TO_TASK, req)
            .await
    }

    /// Sent as the SDK sends it: the config as its serde form, flat.
    async fn create_push_config(
        &self,
        params: &ServiceParams,
        req: &TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        let payload = serde_json::to_value(req)
            .map_err(|e| internal("failed to serialize create-push-config request", e))?;
        let result = self
            .call_value(params, methods::CREATE_PUSH_CONFIG, payload)
            .await?;
        Self::push_config(result)
    }

    async fn get_push_config(
        &self,
        params: &ServiceParams,
        req: &GetTaskPushNotificationConfigRequest,
    ) -> Result<TaskPushNotificationConfig, A2AError> {
        let result = self
            .call_value(params, methods::GET_PUSH_CONFIG, protojson(req)?)
            .await?;
        Self::push_config(result)
    }

    /// Read as the SDK reads it: the list as its serde form, a bare array of
    /// configs, or ProtoJSON.
    async fn list_push_configs(
        &self,
        params: &ServiceParams,
        req: &ListTaskPushNotificationConfigsRequest,
    ) -> Result<ListTaskPushNotificationConfigsResponse, A2AError> {
        let result = self
            .call_value(params, methods::LIST_PUSH_CONFIGS, protojson(req)?)
            .await?
            .ok_or_else(|| A2AError::internal("JSON-RPC response missing result"))?;
        if let Ok(list) = serde_json::from_value(result.clone()) {
            return Ok(list);
        }
        if let Ok(configs) = serde_json::from_value(result.clone()) {
            return Ok(ListTaskPushNotificationConfigsResponse {
                configs,
                next_page_token: None,
            });
        }
        protojson_conv::from_value(result)
            .map_err(|e| internal("failed to deserialize push-config list response", e))
    }

    async fn delete_push_config(
        &self,
        params: &ServiceParams,
        req: &DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), A2AError> {
        self.call_value(params, methods::DELETE_PUSH_CONFIG, protojson(req)?)
            .await
            .map(drop)
    }

    async fn get_extended_agent_card(
        &self,
        params: &ServiceParams,
        req: &GetExtendedAgentCardRequest,
    ) -> Result<AgentCard, A2AError> {
        self.call(params, methods::GET_EXTENDED_AGENT_CARD, req)
            .await
    }

    async fn destroy(&self) -> Result<(), A2AError> {
        Ok(())
    }
}

/// Makes a [`JsonRpcTransport`] for a card's JSON-RPC interface (its URL).
pub struct JsonRpcTransportFactory {
    http: reqwest::Client,
}

impl JsonRpcTransportFactory {
    pub fn new(http: reqwest::Client) -> Self {
        Self { http }
    }
}

#[async_trait::async_trait]
impl TransportFactory for JsonRpcTransportFactory {
    fn protocol(&self) -> &str {
        a2a::TRANSPORT_PROTOCOL_JSONRPC
    }

    async fn create(
        &self,
        _card: &AgentCard,
        iface: &AgentInterface,
    ) -> Result<Box<dyn Transport>, A2AError> {
        Ok(Box::new(JsonRpcTransport::new(
            self.http.clone(),
            iface.url.clone(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn error(code: i32, data: Value) -> JsonRpcError {
        JsonRpcError {
            code,
            message: "refused".into(),
            data: Some(data),
        }
    }

    /// As the SDK maps them: an ErrorInfo of the A2A domain names the
    /// code; a BadRequest adds its violations (and makes an internal error
    /// INVALID_PARAMS); another domain's ErrorInfo changes nothing.
    #[test]
    fn json_rpc_errors_map_as_the_sdk_maps_them() {
        let info = |domain: &str| json!([{"@type": errordetails::ERROR_INFO_TYPE, "reason": "TASK_NOT_FOUND", "domain": domain}]);
        let e = from_jsonrpc_error(error(
            error_code::INTERNAL_ERROR,
            info(errordetails::PROTOCOL_DOMAIN),
        ));
        assert_eq!(e.code, error_code::TASK_NOT_FOUND);
        assert_eq!(e.details.map(|d| d.len()), Some(1));
        let e = from_jsonrpc_error(error(error_code::INTERNAL_ERROR, info("example.com")));
        assert_eq!(e.code, error_code::INTERNAL_ERROR);
        let e = from_jsonrpc_error(error(
            error_code::INTERNAL_ERROR,
            json!([{"@type": errordetails::BAD_REQUEST_TYPE, "fieldViolations": [
                {"field": "message.parts", "description": "empty"},
                {"field": "", "description": "no text"},
            ]}]),
        ));
        assert_eq!(e.code, error_code::INVALID_PARAMS);
        assert_eq!(e.message, "refused: message.parts: empty; no text");
        let e = from_jsonrpc_error(JsonRpcError {
            code: -32000,
            message: "unauthenticated".into(),
            data: None,
        });
        assert_eq!((e.code, e.details), (-32000, None));
    }

    /// Only this client marks an answer too large: a peer's error that
    /// carries the mark does not pass for one.
    #[test]
    fn only_this_client_marks_an_answer_too_large() {
        let mine = too_large("an answer", 10);
        assert!(is_too_large(&mine));
        let data = serde_json::to_value(mine.details.unwrap()).unwrap();
        let forged = from_jsonrpc_error(error(error_code::INTERNAL_ERROR, data));
        assert!(!is_too_large(&forged), "{forged:?}");
        assert!(!is_too_large(&A2AError::internal("too large")));
    }
}
