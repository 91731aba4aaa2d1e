//! Tools a model-backed agent can call: the built-in `lookup_order`, and
//! HTTP tools (POST the arguments as JSON to a URL; the response body, size
//! capped, is the result). Arguments are checked against the tool's JSON
//! schema before it runs; a tool that fails tells the model why (as its
//! result) rather than failing the run, so the model can correct itself.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::demo::{self, LookupOrder};

/// What a tool answered.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    /// The result as JSON: what the model gets back, and the event payload.
    pub result: Value,
    /// One human-readable line for the TOOL_RESULT event's text.
    pub summary: String,
}

impl ToolOutcome {
    /// A failure the model is told about (`{"error": ...}`).
    pub fn error(message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            summary: format!("error: {message}"),
            result: json!({ "error": message }),
        }
    }
}

/// A tool as declared to the model, with its argument check.
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments object.
    pub parameters: Value,
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for ToolDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolDef")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ToolDef {
    /// Fails when `parameters` is not a valid JSON schema.
    pub fn new(name: &str, description: &str, parameters: Value) -> Result<Self, String> {
        let validator = jsonschema::validator_for(&parameters)
            .map_err(|e| format!("invalid JSON schema: {e}"))?;
        Ok(Self {
            name: name.to_owned(),
            description: description.to_owned(),
            parameters,
            validator,
        })
    }

    /// Checks arguments; the error lists what is wrong, for the model. A
    /// message quotes the value it refuses, which may be as large as the
    /// model made it: each is cut to [`MAX_SCHEMA_ERROR_BYTES`], so the
    /// tool result does not carry the arguments back several times over.
    pub fn check(&self, args: &Value) -> Result<(), String> {
        let errors: Vec<String> = self
            .validator
            .iter_errors(args)
            .take(5)
            .map(|e| clip(e.to_string(), MAX_SCHEMA_ERROR_BYTES))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "arguments do not match the schema: {}",
                errors.join("; ")
            ))
        }
    }
}

/// The most of one schema error's message a tool result carries.
pub const MAX_SCHEMA_ERROR_BYTES: usize = 300;

/// `s` cut to at most `max` bytes (on a character boundary), saying so.
fn clip(mut s: String, max: usize) -> String {
    if s.len() > max {
        let total = s.len();
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str(&format!("… ({total} bytes in all)"));
    }
    s
}

/// A callable tool.
#[async_trait::async_trait]
pub trait Tool: Send + Sync + 'static {
    fn def(&self) -> &ToolDef;
    /// Runs the tool. Dropping the future cancels it; `cancel` fires too.
    async fn call(&self, args: Value, cancel: &CancellationToken) -> ToolOutcome;
}

/// Names of the tools an agents file can use without defining them.
pub const BUILT_IN: &[&str] = &[demo::TOOL];

/// The built-in tool called `name`.
pub fn built_in(name: &str, tool_delay: Duration) -> Option<Arc<dyn Tool>> {
    match name {
        demo::TOOL => Some(Arc::new(LookupOrderTool::new(LookupOrder {
            delay: tool_delay,
            stats: Arc::default(),
        }))),
        _ => None,
    }
}

/// `lookup_order` over the demo's embedded order table.
pub struct LookupOrderTool {
    inner: LookupOrder,
    def: ToolDef,
}

impl LookupOrderTool {
    pub fn new(inner: LookupOrder) -> Self {
        let schema = json!({
            "type": "object",
            "properties": { "order_id": { "type": "string", "description": "The order number, e.g. \"1187\"." } },
            "required": ["order_id"],
            "additionalProperties": false
        });
        let def = ToolDef::new(
            demo::TOOL,
            "Looks up a customer order by its number: status, carrier, expected delivery date and items.",
            schema,
        )
        .expect("the built-in schema is valid");
        Self { inner, def }
    }

    /// The tool's counters, shared with whoever built it.
    pub fn stats(&self) -> Arc<demo::ToolStats> {
        self.inner.stats.clone()
    }
}

#[async_trait::async_trait]
impl Tool for LookupOrderTool {
    fn def(&self) -> &ToolDef {
        &self.def
    }

    async fn call(&self, args: Value, cancel: &CancellationToken) -> ToolOutcome {
        let id = args
            .get("order_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .trim()
            .to_owned();
        match self.inner.call(&id, cancel).await {
            None => ToolOutcome::error("cancelled"),
            Some(Some(o)) => ToolOutcome {
                summary: format!("order {} is {}", o.id, o.status),
                result: json!({ "found": true, "order_id": o.id, "status": o.status, "carrier": o.carrier, "eta": o.eta, "items": o.items }),
            },
            Some(None) => ToolOutcome {
                summary: format!("no order {id}"),
                result: json!({ "found": false, "order_id": id }),
            },
        }
    }
}

/// POSTs the arguments as JSON to `url`; the response body is the result.
pub struct HttpTool {
    def: ToolDef,
    http: reqwest::Client,
    url: reqwest::Url,
    /// `url` as logs show it: without credentials or query, which can carry
    /// secrets.
    shown_url: String,
    headers: reqwest::header::HeaderMap,
    /// How long one call may take.
    timeout: Duration,
    /// Larger responses are refused rather than cut (a cut JSON is junk).
    max_response_bytes: usize,
}

impl HttpTool {
    pub fn new(
        def: ToolDef,
        http: reqwest::Client,
        url: reqwest::Url,
        headers: reqwest::header::HeaderMap,
        timeout: Duration,
        max_response_bytes: usize,
    ) -> Self {
        let mut shown = url.clone();
        let _ = shown.set_username("");
        let _ = shown.set_password(None);
        shown.set_query(None);
        Self {
            def,
            http,
            url,
            shown_url: shown.to_string(),
            headers,
            timeout,
            max_response_bytes,
        }
    }

    async fn post(&self, args: &Value) -> Result<ToolOutcome, String> {
        let mut headers = self.headers.clone();
        // The tool call's span, so the tool's trace joins the run's.
        crate::telemetry::trace::inject_headers(&mut headers);
        let mut resp = self
            .http
            .post(self.url.clone())
            .headers(headers)
            .json(args)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| {
                let timeout = e.is_timeout();
                let e = e.without_url();
                tracing::warn!(tool = %self.def.name, url = %self.shown_url, error = %e, "HTTP tool unreachable");
                if timeout { "the tool timed out".to_owned() } else { "the tool is unreachable".to_owned() }
            })?;
        let status = resp.status();
        let mut body = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(chunk)) => {
                    if body.len() + chunk.len() > self.max_response_bytes {
                        return Err(format!(
                            "the tool's response exceeded {} bytes",
                            self.max_response_bytes
                        ));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(None) => break,
                Err(e) => {
                    let timeout = e.is_timeout();
                    let e = e.without_url();
                    tracing::warn!(tool = %self.def.name, error = %e, "HTTP tool response broke");
                    return Err(if timeout {
                        "the tool timed out"
                    } else {
                        "the tool's response broke off"
                    }
                    .into());
                }
            }
        }
        // JSON stays JSON; anything else is passed on as a string.
        let result = serde_json::from_slice::<Value>(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
        if !status.is_success() {
            return Ok(ToolOutcome {
                summary: format!("error: HTTP {}", status.as_u16()),
                result: json!({ "error": format!("the tool answered HTTP {}", status.as_u16()), "body": result }),
            });
        }
        Ok(ToolOutcome {
            summary: format!("{} answered ({} bytes)", self.def.name, body.len()),
            result,
        })
    }
}

#[async_trait::async_trait]
impl Tool for HttpTool {
    fn def(&self) -> &ToolDef {
        &self.def
    }

    async fn call(&self, args: Value, cancel: &CancellationToken) -> ToolOutcome {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => ToolOutcome::error("cancelled"),
            r = self.post(&args) => r.unwrap_or_else(ToolOutcome::error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let t = LookupOrderTool::new(LookupOrder {
            delay: Duration::ZERO,
            stats: Arc::default(),
        });
        assert!(t.def().check(&json!({"order_id": "1187"})).is_ok());
        assert!(t.def().check(&json!({})).unwrap_err().contains("order_id"));
        assert!(t.def().check(&json!({"order_id": 1187})).is_err());
    }

    /// The errors quote the refused value; a huge one is not carried back
    /// whole, once per error.
    #[test]
    fn schema_errors_do_not_carry_a_huge_value_back() {
        let def = ToolDef::new(
            "t",
            "d",
            json!({"type": "object", "properties": {"q": {"type": "string", "maxLength": 5, "pattern": "^a$"}}}),
        )
        .unwrap();
        let e = def.check(&json!({"q": "é".repeat(50_000)})).unwrap_err();
        assert!(e.len() < 2048, "{} bytes", e.len());
        assert!(e.contains("bytes in all"), "{e}");
        // Short ones are whole.
        let e = def.check(&json!({"q": "bb"})).unwrap_err();
        assert!(e.contains("\"bb\"") && !e.contains("bytes in all"), "{e}");
    }

    #[test]
    fn an_invalid_schema_is_refused() {
        assert!(ToolDef::new("t", "d", json!({"type": "no-such-type"})).is_err());
    }

    #[tokio::test]
    async fn lookup_order_answers_from_the_table() {
        let t = LookupOrderTool::new(LookupOrder {
            delay: Duration::ZERO,
            stats: Arc::default(),
        });
        let out = t
            .call(json!({"order_id": "1187"}), &CancellationToken::new())
            .await;
        assert_eq!(out.result["status"], "shipped");
        let out = t
            .call(json!({"order_id": "9999"}), &CancellationToken::new())
            .await;
        assert_eq!(out.result["found"], false);
    }
}
