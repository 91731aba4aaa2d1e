//! A thin streaming client of `POST {base_url}/chat/completions`.
//!
//! HTTP failures become [`AgentError`]s a caller may see: 429, 5xx and
//! connection errors are UNAVAILABLE (with the server's Retry-After), other
//! 4xx are FAILED_PRECONDITION (the deployment is misconfigured) or
//! INVALID_ARGUMENT (the conversation itself was refused). The server's body
//! goes to the log, never into the error: model errors can echo the prompt.
//! An error the server reports mid-stream (a `data:` chunk holding an error
//! object, or llama-server's `error:` line) maps the same way.

use std::pin::Pin;
use std::time::{Duration, SystemTime};

use eventsource_stream::{EventStreamError, Eventsource};
use futures::{FutureExt, Stream, StreamExt};
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use super::accumulate::{Accumulator, Completion, Output, StreamError, server_error_line};
use super::wire::{ChatRequest, ToolCall};
use crate::agent::AgentError;
use crate::sse::{BodyError, BoundedSse};

/// Most bytes of an error body kept for the log.
const ERROR_BODY_LOG_BYTES: usize = 4096;

/// Where a model is served, and how to authenticate.
#[derive(Clone)]
pub struct Endpoint {
    /// The API root, e.g. `http://127.0.0.1:11434/v1` (no trailing slash).
    pub base_url: String,
    /// Sent as `Authorization: Bearer …`; never logged.
    pub api_key: Option<String>,
    /// Extra request headers (e.g. an organisation or routing header).
    pub headers: HeaderMap,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Endpoint {
    /// `POST` here: `{base_url}/chat/completions`, the base URL's query
    /// (e.g. Azure's `api-version`) kept after the path.
    pub fn chat_url(&self) -> String {
        match self.base_url.split_once('?') {
            Some((path, query)) => {
                format!("{}/chat/completions?{query}", path.trim_end_matches('/'))
            }
            None => format!("{}/chat/completions", self.base_url),
        }
    }

    /// The base URL for logs: without its query, which may carry a key.
    pub fn logged_base_url(&self) -> &str {
        self.base_url
            .split_once('?')
            .map_or(self.base_url.as_str(), |(path, _)| path)
    }

    pub fn new(base_url: &str) -> Self {
        Self {
            base_url: base_url.trim_end_matches('/').to_owned(),
            api_key: None,
            headers: HeaderMap::new(),
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> anyhow::Result<Self> {
        let name = HeaderName::try_from(name)
            .map_err(|_| anyhow::anyhow!("{name:?} is not a valid header name"))?;
        let mut value = HeaderValue::try_from(value)
            .map_err(|_| anyhow::anyhow!("the value of header {name} is not valid"))?;
        value.set_sensitive(true);
        self.headers.insert(name, value);
        Ok(self)
    }
}

/// The HTTP client shared by every model-backed agent and HTTP tool of a
/// process. It follows no redirect: reqwest would resend the request's
/// headers, secrets read from the environment or a file among them, to
/// wherever a redirect points (it drops only Authorization and cookies);
/// a model server or tool that redirects is refused with its status.
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    http_client_with(None, reqwest::redirect::Policy::none())
}

/// agentd's HTTP client (model servers, HTTP tools, remote A2A agents):
/// TLS against the system's roots, plus the certificates of the PEM bundle
/// `ca_pem` when given (a private CA).
pub fn http_client_trusting(ca_pem: Option<&[u8]>) -> anyhow::Result<reqwest::Client> {
    http_client_with(ca_pem, reqwest::redirect::Policy::default())
}

fn http_client_with(
    ca_pem: Option<&[u8]>,
    redirects: reqwest::redirect::Policy,
) -> anyhow::Result<reqwest::Client> {
    crate::auth::tls::install_crypto_provider();
    let mut builder = reqwest::Client::builder()
        .redirect(redirects)
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .user_agent(concat!("agentd/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = ca_pem {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| anyhow::anyhow!("the CA bundle is not PEM certificates: {e}"))?;
        builder = builder.tls_certs_merge(certs);
    }
    builder
        .build()
        .map_err(|e| anyhow::anyhow!("cannot build the HTTP client: {e}"))
}

/// A chat-completions client for one endpoint.
#[derive(Debug, Clone)]
pub struct ChatClient {
    http: reqwest::Client,
    endpoint: Endpoint,
    /// Names the agent in log lines.
    agent: String,
}

/// One step of a streamed completion.
#[derive(Debug)]
pub enum Step {
    Text(String),
    /// A tool call is complete (more may follow).
    ToolCall(ToolCall),
    /// The stream ended with `[DONE]`.
    Done(Completion),
}

type Events = Pin<
    Box<dyn Stream<Item = Result<eventsource_stream::Event, EventStreamError<BodyError>>> + Send>,
>;

/// A completion in progress. Dropping it closes the HTTP request.
pub struct ChatStream {
    events: Events,
    acc: Option<Accumulator>,
    pending: std::collections::VecDeque<Output>,
    /// An item read ahead while merging text, handled by the next call.
    lookahead: Option<Option<Result<eventsource_stream::Event, EventStreamError<BodyError>>>>,
    /// A failure met while merging text, returned by the next call.
    deferred: Option<AgentError>,
    /// Whether a text step went out: the first one never waits to merge,
    /// so the first token reaches the caller at once.
    texted: bool,
    agent: String,
}

/// Text deltas already received are merged into one step up to this size.
const MAX_MERGED_TEXT: usize = 16 * 1024;
/// How many times one step yields to let buffered deltas in (each only
/// after the previous one brought something), so a burst cannot hold text
/// back for long.
const MERGE_YIELDS: u32 = 16;

impl ChatClient {
    pub fn new(http: reqwest::Client, endpoint: Endpoint, agent: &str) -> Self {
        Self {
            http,
            endpoint,
            agent: agent.to_owned(),
        }
    }

    /// Sends `req` and returns its stream once the response headers are in.
    /// `id_prefix` names tool calls that came without an id.
    pub async fn start(
        &self,
        req: &ChatRequest<'_>,
        id_prefix: &str,
    ) -> Result<ChatStream, AgentError> {
        let url = self.endpoint.chat_url();
        let mut headers = self.endpoint.headers.clone();
        // The current span's traceparent, so the model server's trace (if
        // it keeps one) joins the run's.
        crate::telemetry::trace::inject_headers(&mut headers);
        let mut builder = self
            .http
            .post(&url)
            .headers(headers)
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .json(req);
        if let Some(key) = &self.endpoint.api_key {
            let mut v = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
                AgentError::FailedPrecondition(
                    "the model's API key is not a valid header value".into(),
                )
            })?;
            v.set_sensitive(true);
            builder = builder.header(AUTHORIZATION, v);
        }
        let resp = builder.send().await.map_err(|e| self.transport_error(e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(self.http_error(resp).await);
        }
        // A 200 that is not an event stream (a proxy's login page, a
        // gateway that ignores `stream`): a misconfiguration, not a
        // failure that a retry cures.
        let content_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        if !content_type.is_empty() && !content_type.starts_with("text/event-stream") {
            let body = read_capped(resp, ERROR_BODY_LOG_BYTES).await;
            tracing::warn!(
                agent = %self.agent,
                base_url = %self.endpoint.logged_base_url(),
                content_type = %content_type,
                body = %String::from_utf8_lossy(&body),
                "model server answered without an event stream"
            );
            return Err(AgentError::FailedPrecondition(
                "the model server did not answer with an event stream; is base_url an OpenAI-compatible API? (the server log has what it sent)".into(),
            ));
        }
        Ok(ChatStream {
            events: Box::pin(
                BoundedSse::new(resp.bytes_stream(), MAX_SSE_EVENT_BYTES).eventsource(),
            ),
            acc: Some(Accumulator::new(id_prefix)),
            pending: Default::default(),
            lookahead: None,
            deferred: None,
            texted: false,
            agent: self.agent.clone(),
        })
    }

    fn transport_error(&self, e: reqwest::Error) -> AgentError {
        // Without the URL reqwest's message ends with: its query may carry
        // a key (`logged_base_url` leaves it out for the same reason).
        let e = e.without_url();
        tracing::warn!(agent = %self.agent, base_url = %self.endpoint.logged_base_url(), error = %error_chain(&e), "model server unreachable");
        let message = if e.is_timeout() {
            "the model server did not answer in time; retry later"
        } else {
            "the model server is unreachable; retry later"
        };
        AgentError::Unavailable {
            message: message.into(),
            retry_after: None,
        }
    }

    async fn http_error(&self, resp: reqwest::Response) -> AgentError {
        let status = resp.status();
        let retry_after = retry_after(resp.headers());
        let body = read_capped(resp, ERROR_BODY_LOG_BYTES).await;
        tracing::warn!(
            agent = %self.agent,
            base_url = %self.endpoint.logged_base_url(),
            http_status = status.as_u16(),
            body = %String::from_utf8_lossy(&body),
            "model server refused the request"
        );
        map_status(status, &body, retry_after)
    }
}

/// The most bytes one server-sent event (its lines together) may take: the
/// SSE parser holds a line, and an event's data lines, whole until they
/// end, with no bound of its own.
pub const MAX_SSE_EVENT_BYTES: usize = 4 << 20;

/// The longest pushback a model server's `Retry-After` is passed on with.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// The table from a model server's HTTP status to what a caller sees.
pub fn map_status(status: StatusCode, body: &[u8], retry_after: Option<Duration>) -> AgentError {
    let unavailable = |message: &str| AgentError::Unavailable {
        message: message.into(),
        retry_after,
    };
    match status.as_u16() {
        // OpenAI answers 429 for an account out of credit too: no retry cures it.
        429 if is_quota_exhausted(body) => AgentError::FailedPrecondition(
            "the model account's quota is exhausted; the server log has the details".into(),
        ),
        429 => unavailable("the model server is rate-limiting requests; retry later"),
        408 | 504 => unavailable("the model server timed out; retry later"),
        500..=599 => unavailable("the model server failed; retry later"),
        401 | 403 => {
            AgentError::FailedPrecondition("the model server rejected agentd's credentials".into())
        }
        404 => AgentError::FailedPrecondition(
            "the model server does not serve the configured model or path".into(),
        ),
        413 => AgentError::InvalidInput("the conversation is too large for the model".into()),
        400 | 422 if is_context_length(body) => AgentError::InvalidInput(
            "the conversation is too long for the model's context window".into(),
        ),
        _ => AgentError::FailedPrecondition(format!(
            "the model server rejected the request (HTTP {}); the server log has the details",
            status.as_u16()
        )),
    }
}

/// Whether an error body says the account is out of quota (OpenAI's
/// `insufficient_quota`).
fn is_quota_exhausted(body: &[u8]) -> bool {
    let Some(e) = error_object(body) else {
        return false;
    };
    let e = &e;
    ["code", "type"]
        .iter()
        .any(|k| e.get(k).and_then(|c| c.as_str()) == Some("insufficient_quota"))
}

/// Whether an error body says the prompt exceeded the context window.
fn is_context_length(body: &[u8]) -> bool {
    error_object(body).is_some_and(|e| says_context_length(&e))
}

/// Whether an error object (the inside of `{"error": …}`) says the prompt
/// exceeded the context window.
pub(super) fn says_context_length(e: &serde_json::Value) -> bool {
    let fields = ["code", "type"].map(|k| {
        e.get(k)
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned()
    });
    let message = e
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_lowercase();
    fields
        .iter()
        .any(|f| f.contains("context_length") || f == "exceed_context_size_error")
        || message.contains("context length")
        || message.contains("context window")
        || message.contains("maximum context")
        // Gemini: "The input token count (…) exceeds the maximum number of
        // tokens allowed (…)".
        || message.contains("input token count")
        || message.contains("exceeds the maximum number of tokens")
}

/// The error object of an error body: `{"error": {…}}`, Gemini's
/// `[{"error": {…}}]`, or the body itself.
fn error_object(body: &[u8]) -> Option<serde_json::Value> {
    let mut v = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    if let serde_json::Value::Array(items) = &mut v
        && items.len() == 1
    {
        v = items.pop()?;
    }
    Some(match v.get_mut("error") {
        Some(e) => e.take(),
        None => v,
    })
}

/// `Retry-After` as seconds or an HTTP date, or OpenAI's `retry-after-ms`.
pub fn retry_after(h: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = h
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        return capped_secs(ms / 1000.0);
    }
    let v = h.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = v.parse::<f64>() {
        return capped_secs(secs);
    }
    let at = httpdate::parse_http_date(v).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// Seconds as a pushback of at most [`MAX_RETRY_AFTER`]; none if negative
/// or not a number.
fn capped_secs(secs: f64) -> Option<Duration> {
    (secs >= 0.0 && secs.is_finite()).then(|| {
        Duration::try_from_secs_f64(secs)
            .unwrap_or(MAX_RETRY_AFTER)
            .min(MAX_RETRY_AFTER)
    })
}

/// Reads at most `cap` bytes of a body (the rest is dropped).
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = cap - out.len();
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    out
}

use crate::error_chain;

impl ChatStream {
    /// The next step; after [`Step::Done`] the stream is spent.
    ///
    /// Text deltas that have already arrived (a server that streams faster
    /// than agentd's client reads sends many per TCP read) come out as one
    /// step: fewer, larger events, never a wait for more.
    pub async fn next(&mut self) -> Result<Step, AgentError> {
        let step = self.next_one().await?;
        let Step::Text(mut text) = step else {
            return Ok(step);
        };
        // Whether an event arrived since the last yield.
        let mut fresh = std::mem::replace(&mut self.texted, true);
        let mut yields = 0;
        while text.len() < MAX_MERGED_TEXT {
            match self.pending.front() {
                Some(Output::Text(_)) => {
                    if let Some(Output::Text(t)) = self.pending.pop_front() {
                        text.push_str(&t);
                    }
                }
                Some(Output::ToolCallReady(_)) => break,
                None => {
                    let Some(acc) = self.acc.as_mut().filter(|a| !a.is_done()) else {
                        break;
                    };
                    if self.lookahead.is_some() || self.deferred.is_some() {
                        break;
                    }
                    match self.events.next().now_or_never() {
                        None if fresh && yields < MERGE_YIELDS => {
                            // The HTTP client hands over one body chunk per
                            // wake-up of its connection task, even when many
                            // are buffered. Let it run once: a chunk already
                            // read joins this step; an idle stream costs one
                            // scheduler round trip and nothing more.
                            fresh = false;
                            yields += 1;
                            // Twice: the turn's pump polls a pending agent
                            // once more at once (turn/pump.rs, next_event),
                            // which would end a single yield on the spot.
                            tokio::task::yield_now().await;
                            tokio::task::yield_now().await;
                        }
                        None => break,
                        Some(Some(Ok(ev))) => match acc.push(&ev.data) {
                            Ok(outs) => {
                                fresh = true;
                                self.pending.extend(outs)
                            }
                            Err(e) => {
                                self.deferred = Some(self.stream_error(e));
                                break;
                            }
                        },
                        Some(other) => {
                            self.lookahead = Some(other);
                            break;
                        }
                    }
                }
            }
        }
        Ok(Step::Text(text))
    }

    async fn next_one(&mut self) -> Result<Step, AgentError> {
        loop {
            let acc = self
                .acc
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("ChatStream polled after Done"))?;
            if let Some(out) = self.pending.pop_front() {
                return Ok(match out {
                    Output::Text(t) => Step::Text(t),
                    Output::ToolCallReady(n) => Step::ToolCall(acc.call(n)),
                });
            }
            if let Some(e) = self.deferred.take() {
                return Err(e);
            }
            if acc.is_done() {
                // Nothing may follow [DONE]; do not wait for the server to
                // close the connection.
                let acc = self.acc.take().expect("checked above");
                return acc
                    .finish()
                    .map(Step::Done)
                    .map_err(|e| self.stream_error(e));
            }
            let item = match self.lookahead.take() {
                Some(item) => item,
                None => self.events.next().await,
            };
            match item {
                Some(Ok(ev)) => {
                    let outs = acc.push(&ev.data).map_err(|e| self.stream_error(e))?;
                    self.pending.extend(outs);
                }
                Some(Err(EventStreamError::Transport(BodyError::Server(line)))) => {
                    return Err(
                        self.stream_error(server_error_line(&String::from_utf8_lossy(&line)))
                    );
                }
                Some(Err(EventStreamError::Transport(BodyError::TooLarge))) => {
                    return Err(self.stream_error(StreamError::TooLarge {
                        what: "bytes in one server-sent event",
                        limit: MAX_SSE_EVENT_BYTES,
                    }));
                }
                Some(Err(EventStreamError::Transport(BodyError::Http(e)))) => {
                    let e = e.without_url();
                    tracing::warn!(agent = %self.agent, error = %error_chain(&e), "model stream broke");
                    return Err(AgentError::Unavailable {
                        message: "the connection to the model server broke mid-answer; retry later"
                            .into(),
                        retry_after: None,
                    });
                }
                Some(Err(e)) => {
                    return Err(self.stream_error(StreamError::Malformed {
                        detail: e.to_string(),
                    }));
                }
                None => {
                    let acc = self.acc.take().expect("checked above");
                    return acc
                        .finish()
                        .map(Step::Done)
                        .map_err(|e| self.stream_error(e));
                }
            }
        }
    }

    fn stream_error(&self, e: StreamError) -> AgentError {
        tracing::warn!(agent = %self.agent, error = %e, "model stream failed");
        match e {
            StreamError::Truncated => AgentError::Unavailable {
                message: "the model server ended its answer early; retry later".into(),
                retry_after: None,
            },
            StreamError::NoFinish => AgentError::Unavailable {
                message: "the model ended its answer without a finish reason; retry later".into(),
                retry_after: None,
            },
            StreamError::Server {
                context_window: true,
                ..
            } => AgentError::InvalidInput(
                "the conversation is too long for the model's context window".into(),
            ),
            StreamError::Server { code: Some(c), .. }
                if (400..500).contains(&c) && c != 429 && c != 408 =>
            {
                AgentError::FailedPrecondition(format!(
                    "the model server rejected the request mid-answer (code {c}); the server log has the details"
                ))
            }
            StreamError::Server { .. } => AgentError::Unavailable {
                message: "the model server failed mid-answer; retry later".into(),
                retry_after: None,
            },
            StreamError::Malformed { .. } => AgentError::Unexpected(anyhow::anyhow!(
                "the model server sent a stream agentd cannot read"
            )),
            StreamError::TooLarge { what, limit } => AgentError::FailedPrecondition(format!(
                "the model's answer passed agentd's limit of {limit} {what}; bound it (max_tokens in the agent's sampling)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_retryable_or_caller_errors() {
        let m = |code: u16, body: &str| {
            map_status(StatusCode::from_u16(code).unwrap(), body.as_bytes(), None)
        };
        assert!(matches!(m(429, ""), AgentError::Unavailable { .. }));
        assert!(matches!(m(503, ""), AgentError::Unavailable { .. }));
        assert!(matches!(m(401, ""), AgentError::FailedPrecondition(_)));
        assert!(matches!(m(404, ""), AgentError::FailedPrecondition(_)));
        assert!(matches!(
            m(400, r#"{"error":{"message":"bad temperature"}}"#),
            AgentError::FailedPrecondition(_)
        ));
        let too_long = r#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":"context_length_exceeded"}}"#;
        assert!(matches!(m(400, too_long), AgentError::InvalidInput(_)));
        let no_credit = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert!(matches!(
            m(429, no_credit),
            AgentError::FailedPrecondition(_)
        ));
        // Gemini's OpenAI-compatible endpoint: an array of one error.
        let gemini = r#"[{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]"#;
        assert!(matches!(m(400, gemini), AgentError::InvalidInput(_)));
        // A 5xx carries the server's Retry-After.
        let r = map_status(
            StatusCode::SERVICE_UNAVAILABLE,
            b"",
            Some(Duration::from_secs(7)),
        );
        assert!(
            matches!(r, AgentError::Unavailable { retry_after: Some(d), .. } if d == Duration::from_secs(7)),
            "{r:?}"
        );
    }

    #[test]
    fn a_retry_after_too_large_for_a_duration_is_capped_not_a_panic() {
        for (name, value) in [
            ("retry-after", "99999999999999999999"),
            ("retry-after-ms", "1e300"),
        ] {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static(value));
            assert_eq!(retry_after(&h), Some(MAX_RETRY_AFTER), "{name}");
        }
    }

    #[tokio::test]
    async fn server_sent_events_are_refused_once_a_line_or_an_event_passes_the_bound() {
        let body = |parts: &[&'static str]| {
            futures::stream::iter(
                parts
                    .iter()
                    .map(|p| Ok::<_, reqwest::Error>(bytes::Bytes::from_static(p.as_bytes())))
                    .collect::<Vec<_>>(),
            )
        };
        let passes = |parts: &'static [&'static str]| async move {
            BoundedSse::new(body(parts), 10)
                .collect::<Vec<_>>()
                .await
                .iter()
                .all(|r| r.is_ok())
        };
        assert!(passes(&["data: 12\r\n\r\n", "data: 34\n\n", "data: 5678\n\n"]).await);
        assert!(
            !passes(&["data: 12", "3456"]).await,
            "a line split across chunks"
        );
        assert!(
            !passes(&["data: 1\ndata: 2\n", "data: 3\n\n"]).await,
            "an event's lines together"
        );
        // Lines that end with a lone carriage return, as the SSE parser
        // reads them, and a CRLF split across chunks.
        assert!(passes(&["data: 1234\r\r", "data: 5678\r\r"]).await);
        assert!(passes(&["data: 1234\r", "\ndata: 5678\r\n\r\n"]).await);
        assert!(
            !passes(&["data: 1\rdata: 2\r", "data: 3\r\r"]).await,
            "an event's lines together"
        );
    }

    /// llama-server reports a failure met mid-answer as an `error:` line
    /// before `data: [DONE]`: the events before it go on, then the line's
    /// value fails the body (the SSE parser would drop it).
    #[tokio::test]
    async fn an_error_line_fails_the_body_after_the_events_before_it() {
        let read = |parts: Vec<&'static str>| async move {
            let body = futures::stream::iter(
                parts
                    .into_iter()
                    .map(|p| Ok::<_, reqwest::Error>(bytes::Bytes::from_static(p.as_bytes()))),
            );
            let items: Vec<_> = BoundedSse::new(body, 1 << 20).collect().await;
            let passed: String = items
                .iter()
                .filter_map(|r| r.as_ref().ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .collect();
            let error = items.iter().find_map(|r| match r {
                Err(BodyError::Server(v)) => Some(String::from_utf8_lossy(v).into_owned()),
                Err(e) => panic!("{e}"),
                Ok(_) => None,
            });
            assert!(
                items.iter().skip_while(|r| r.is_ok()).count() <= 1,
                "nothing follows the error"
            );
            (passed, error)
        };
        let llama = r#"{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}"#;
        let (passed, error) = read(vec![
            "data: {\"a\":1}\n\nerror: {\"code\":400,",
            "\"message\":\"the request exceeds the available context size\",\"type\":\"exceed_context_size_error\"}\n\n",
            "data: [DONE]\n\n",
        ])
        .await;
        assert_eq!(error.as_deref().map(str::trim), Some(llama));
        assert!(passed.starts_with("data: {\"a\":1}\n\n"), "{passed:?}");
        assert!(!passed.contains("[DONE]"), "{passed:?}");
        // Split inside its field name, with CRLF, or at the end of the body
        // without a line end.
        let (_, error) = read(vec!["data: x\r\n\r\nerr", "or:{\"code\":500}\r\n"]).await;
        assert_eq!(error.as_deref(), Some("{\"code\":500}"));
        let (_, error) = read(vec!["error: {\"code\":500}"]).await;
        assert_eq!(error.as_deref(), Some(" {\"code\":500}"));
        // Only a line that starts with the field: `data:` that holds the
        // word, and other fields, pass.
        let (passed, error) = read(vec![
            "data: error: no\n\n",
            "event: error\ndata: {}\n\n",
            "errors: 1\n\n",
        ])
        .await;
        assert_eq!(error, None);
        assert!(passed.ends_with("errors: 1\n\n"));
    }

    /// An `error:` line maps as an HTTP error body would: one that says the
    /// context window is full is INVALID_ARGUMENT, a 5xx UNAVAILABLE, and
    /// the message never carries the body.
    #[test]
    fn an_error_line_maps_as_an_error_body_would() {
        let s = ChatStream {
            events: Box::pin(futures::stream::empty()),
            acc: None,
            pending: Default::default(),
            lookahead: None,
            deferred: None,
            texted: false,
            agent: "t".into(),
        };
        let m = |line: &str| s.stream_error(server_error_line(line));
        let full = r#" {"code":400,"message":"the request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it; you said: 4111","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}"#;
        let e = m(full);
        assert!(matches!(e, AgentError::InvalidInput(_)), "{e:?}");
        assert!(!e.to_string().contains("4111"), "{e}");
        let e = m(r#"{"code":500,"message":"boom","type":"server_error"}"#);
        assert!(matches!(e, AgentError::Unavailable { .. }), "{e:?}");
        let e = m(r#"{"error":{"code":400,"message":"bad grammar: 4111"}}"#);
        assert!(matches!(e, AgentError::FailedPrecondition(_)), "{e:?}");
        assert!(!e.to_string().contains("4111"), "{e}");
        let e = m("not json: 4111");
        assert!(matches!(e, AgentError::Unavailable { .. }), "{e:?}");
        assert!(!e.to_string().contains("4111"), "{e}");
    }

    #[test]
    fn error_messages_never_carry_the_body() {
        let body = r#"{"error":{"message":"you said: my card is 4111-1111"}}"#;
        for code in [400u16, 401, 404, 422, 429, 500] {
            let msg =
                map_status(StatusCode::from_u16(code).unwrap(), body.as_bytes(), None).to_string();
            assert!(!msg.contains("4111"), "{code}: {msg}");
        }
    }

    #[test]
    fn retry_after_reads_seconds_milliseconds_and_dates() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
        let mut h = HeaderMap::new();
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        h.insert(RETRY_AFTER, HeaderValue::try_from(later).unwrap());
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(100) && d <= Duration::from_secs(120),
            "{d:?}"
        );
        h.insert(RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h), None);
    }
}
