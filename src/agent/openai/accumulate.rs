//! Turns the `data:` payloads of one streamed chat completion into text
//! deltas, complete tool calls and an ending.
//!
//! Tool-call fragments are keyed by `index`, falling back to `id` when the
//! index is missing (Gemini sends none, and the whole call in one chunk) or
//! reused for a different call (Ollama sends index 0 for every call).
//! Arguments are concatenated as strings and parsed only once the call is
//! complete. Unknown per-call fields are kept and sent back. A stream is
//! only complete after `[DONE]`: an EOF before it is an error.
//!
//! A call is announced ([`Output::ToolCallReady`], which becomes its
//! TOOL_CALL event) before the stream ends only once a later call has
//! started and its own arguments are a whole JSON document: servers may
//! interleave the fragments of parallel calls, and an event must show the
//! arguments the tool runs with. A fragment that would still change an
//! announced call (more arguments, another name or id) is logged and
//! ignored, so the event, the call that runs and the call sent back to the
//! model stay the same; nothing valid can follow a whole JSON document
//! anyway.

use serde_json::{Map, Value};
use thiserror::Error;

use super::wire::{Chunk, FunctionCall, ToolCall, ToolCallDelta, Usage};

/// What one payload produced, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Text(String),
    /// The tool call at this position of [`Completion::tool_calls`] is
    /// complete (a later call started, and its arguments are a whole JSON
    /// document); the rest complete at the end. Announced in order.
    ToolCallReady(usize),
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// The model wants tool results before it answers.
    ToolCalls,
    /// The model's answer is complete (or the server gave no reason for an
    /// answer that has text).
    Stop,
    /// The model hit its token limit; the answer may be cut.
    Length,
    /// Anything else the server said (`content_filter`, vLLM's `abort`, a
    /// safety stop), as a short label safe to show a caller (see
    /// [`reason_label`]).
    Other(String),
}

/// The result of one streamed call.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish: Finish,
    pub usage: Option<Usage>,
}

/// How a stream failed. The `detail`s are for the log only: they can carry
/// model output, which may echo the prompt.
#[derive(Debug, Error, PartialEq)]
pub enum StreamError {
    #[error("the model server sent a chunk that is not valid JSON: {detail}")]
    Malformed { detail: String },
    #[error("the model server reported an error mid-stream (code {code:?}): {detail}")]
    Server {
        code: Option<u16>,
        /// The error says the conversation passed the context window (as
        /// an HTTP error body would, see [`super::client::map_status`]).
        context_window: bool,
        detail: String,
    },
    #[error("the stream ended before [DONE]")]
    Truncated,
    /// `[DONE]` with no finish reason, no text and no tool call: a server
    /// that failed without saying so (a llama-server whose error event
    /// was lost), not an empty answer.
    #[error("the stream ended with [DONE] without a finish reason, text or tool call")]
    NoFinish,
    /// Past one of agentd's bounds on what it holds of one answer.
    #[error("the answer passed agentd's limit of {limit} {what}")]
    TooLarge { what: &'static str, limit: usize },
}

/// The most text one answer may hold (it is kept whole, and sent whole as
/// the final answer's event).
pub const MAX_TEXT_BYTES: usize = 2 << 20;
/// The most bytes of arguments one tool call may hold.
pub const MAX_ARGUMENTS_BYTES: usize = 1 << 20;
/// The most tool calls one answer may make (they run at most
/// [`super::agent::MAX_TOOLS_IN_FLIGHT`] at a time).
pub const MAX_TOOL_CALLS: usize = 128;
/// The most bytes of one tool call's name (a name streamed in pieces is
/// put together; no tool's name comes near it).
pub const MAX_NAME_BYTES: usize = 4 << 10;
/// The most bytes of the fields of one tool call agentd does not know (kept
/// and sent back; see [`Accumulator::call`]), counted as JSON each time a
/// fragment carries them.
pub const MAX_EXTRA_BYTES: usize = 1 << 20;

#[derive(Debug, Default)]
struct Slot {
    index: Option<u32>,
    id: String,
    kind: String,
    name: String,
    arguments: String,
    extra: Map<String, Value>,
    function_extra: Map<String, Value>,
    /// What the fragments' unknown fields took, replaced ones included.
    extra_bytes: usize,
    /// Whether `arguments` is a whole JSON document, once checked (reset
    /// when they grow).
    complete: Option<bool>,
}

impl Slot {
    /// Keeps a fragment's unknown fields of the function.
    fn keep_function_extra(&mut self, extra: Map<String, Value>) {
        self.extra_bytes += extra_bytes(&extra);
        self.function_extra.extend(extra);
    }

    /// Keeps a fragment's unknown fields of the call; those of the call and
    /// of its function must stay within [`MAX_EXTRA_BYTES`].
    fn keep_extra(&mut self, extra: Map<String, Value>) -> Result<(), StreamError> {
        self.extra_bytes += extra_bytes(&extra);
        self.extra.extend(extra);
        if self.extra_bytes > MAX_EXTRA_BYTES {
            return Err(StreamError::TooLarge {
                what: "bytes of unknown fields in one tool call",
                limit: MAX_EXTRA_BYTES,
            });
        }
        Ok(())
    }

    /// Whether the arguments so far are a whole JSON document: nothing the
    /// server may still send can be part of them. Empty is not (a server
    /// may send the name first and the arguments after).
    fn complete(&mut self) -> bool {
        *self.complete.get_or_insert_with(|| {
            !self.arguments.trim().is_empty()
                && serde_json::from_str::<serde::de::IgnoredAny>(&self.arguments).is_ok()
        })
    }
}

/// Accumulates one streamed completion.
#[derive(Debug)]
pub struct Accumulator {
    /// Prefix of ids generated for calls that came without one.
    id_prefix: String,
    text: String,
    slots: Vec<Slot>,
    /// Slots already announced as ready.
    ready: usize,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    done: bool,
}

impl Accumulator {
    pub fn new(id_prefix: impl Into<String>) -> Self {
        Self {
            id_prefix: id_prefix.into(),
            text: String::new(),
            slots: Vec::new(),
            ready: 0,
            finish_reason: None,
            usage: None,
            done: false,
        }
    }

    /// True once `[DONE]` was seen; later payloads are ignored.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Feeds one SSE `data:` payload.
    pub fn push(&mut self, data: &str) -> Result<Vec<Output>, StreamError> {
        if self.done {
            return Ok(Vec::new());
        }
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(Vec::new());
        }
        if data.is_empty() {
            return Ok(Vec::new());
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| StreamError::Malformed {
            detail: format!("{e}; payload {}", clip(data)),
        })?;
        if let Some(err) = chunk.error {
            return Err(server_error(err));
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        let mut out = Vec::new();
        // Only the first choice is followed (we never ask for n > 1).
        for choice in chunk
            .choices
            .into_iter()
            .filter(|c| c.index.unwrap_or(0) == 0)
        {
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                self.text.push_str(&text);
                if self.text.len() > MAX_TEXT_BYTES {
                    return Err(StreamError::TooLarge {
                        what: "bytes of text",
                        limit: MAX_TEXT_BYTES,
                    });
                }
                out.push(Output::Text(text));
            }
            for delta in choice.delta.tool_calls.into_iter().flatten() {
                self.tool_delta(delta, &mut out)?;
            }
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
                self.finish_reason = Some(reason);
            }
        }
        Ok(out)
    }

    fn tool_delta(
        &mut self,
        mut d: ToolCallDelta,
        out: &mut Vec<Output>,
    ) -> Result<(), StreamError> {
        let id = d.id.take().filter(|s| !s.is_empty());
        let named = d
            .function
            .as_ref()
            .and_then(|f| f.name.as_deref())
            .filter(|n| !n.is_empty());
        let slot = match self.find_slot(d.index, id.as_deref(), named) {
            Some(i) => i,
            None => {
                if self.slots.len() == MAX_TOOL_CALLS {
                    return Err(StreamError::TooLarge {
                        what: "tool calls",
                        limit: MAX_TOOL_CALLS,
                    });
                }
                // A new call starts: the earlier ones whose arguments are
                // whole are complete (fragments of parallel calls may
                // interleave: the others wait for the end).
                let upto = self.slots.len();
                self.announce(upto, out);
                self.slots.push(Slot {
                    index: d.index,
                    ..Slot::default()
                });
                self.slots.len() - 1
            }
        };
        if slot < self.ready {
            return self.late_fragment(slot, id, d);
        }
        let s = &mut self.slots[slot];
        // The first id names the call: a server that sends a fresh one on
        // each fragment of a call (see `find_slot`) does not rename it.
        if let Some(id) = id.filter(|_| s.id.is_empty()) {
            s.id = id;
        }
        if let Some(kind) = d.kind.filter(|k| !k.is_empty()) {
            s.kind = kind;
        }
        if let Some(f) = d.function {
            if let Some(name) = f.name.filter(|n| !n.is_empty()) {
                // Servers either send the name once, repeat it on every
                // fragment, or (rarely) stream it in pieces.
                if s.name.is_empty() {
                    s.name = name;
                } else if s.name != name {
                    s.name.push_str(&name);
                }
                if s.name.len() > MAX_NAME_BYTES {
                    return Err(StreamError::TooLarge {
                        what: "bytes of a tool call's name",
                        limit: MAX_NAME_BYTES,
                    });
                }
            }
            match f.arguments {
                Some(Value::String(piece)) => s.arguments.push_str(&piece),
                Some(Value::Null) | None => {}
                Some(whole) => s.arguments.push_str(&whole.to_string()),
            }
            s.complete = None;
            if s.arguments.len() > MAX_ARGUMENTS_BYTES {
                return Err(StreamError::TooLarge {
                    what: "bytes of arguments in one tool call",
                    limit: MAX_ARGUMENTS_BYTES,
                });
            }
            s.keep_function_extra(f.extra);
        }
        s.keep_extra(d.extra)
    }

    /// Announces the calls before position `upto` that are complete, in
    /// order, up to the first that is not.
    fn announce(&mut self, upto: usize, out: &mut Vec<Output>) {
        while self.ready < upto && self.slots[self.ready].complete() {
            out.push(Output::ToolCallReady(self.ready));
            self.ready += 1;
        }
    }

    /// A fragment of a call already announced: its unknown fields are kept
    /// (they go back to the model, and change neither the event nor what
    /// runs); anything that would change the call is logged and ignored.
    fn late_fragment(
        &mut self,
        slot: usize,
        id: Option<String>,
        d: ToolCallDelta,
    ) -> Result<(), StreamError> {
        let s = &mut self.slots[slot];
        let mut changes = id.is_some_and(|i| i != s.id);
        if let Some(f) = d.function {
            changes |= f
                .name
                .as_deref()
                .is_some_and(|n| !n.is_empty() && n != s.name);
            changes |= match &f.arguments {
                Some(Value::String(piece)) => !piece.trim().is_empty(),
                Some(Value::Null) | None => false,
                Some(_) => true,
            };
            s.keep_function_extra(f.extra);
        }
        if changes {
            tracing::warn!(
                call = slot,
                "the model server sent more of a tool call after it was complete; ignored"
            );
        }
        s.keep_extra(d.extra)
    }

    /// The slot this fragment continues, or `None` for a new call.
    /// `name` is the function name the fragment carries, if any.
    fn find_slot(
        &mut self,
        index: Option<u32>,
        id: Option<&str>,
        name: Option<&str>,
    ) -> Option<usize> {
        let last = self.slots.len().checked_sub(1);
        match (index, id) {
            // The same index with a different id is a new call when the
            // call so far is whole, or the fragment names another function
            // (Ollama sends index 0 and a fresh id for every call, each
            // call whole). Otherwise it continues the call: some servers
            // send a fresh id on every fragment of one call, and repeat
            // the call's name on each. That holds while the arguments are
            // still empty too: a server may send the name with `""` first,
            // and a call without arguments is not a whole call (they must
            // be a JSON object), so the next fragment's `{"x"` is the
            // start of its arguments, not a call of its own.
            (Some(ix), Some(id)) => {
                let i = self.slots.iter().rposition(|s| s.index == Some(ix))?;
                let s = &mut self.slots[i];
                if s.id.is_empty() || s.id == id {
                    return Some(i);
                }
                let new = s.complete() || name.is_some_and(|n| n != s.name);
                (!new).then_some(i)
            }
            (Some(ix), None) => self.slots.iter().rposition(|s| s.index == Some(ix)),
            (None, Some(id)) => self.slots.iter().rposition(|s| s.id == id),
            // No index, no id: a continuation of the call in progress.
            (None, None) => last,
        }
    }

    /// The tool call at position `n`, as accumulated so far (complete once
    /// announced by [`Output::ToolCallReady`]).
    pub fn call(&self, n: usize) -> ToolCall {
        let s = &self.slots[n];
        ToolCall {
            id: if s.id.is_empty() {
                format!("{}_{n}", self.id_prefix)
            } else {
                s.id.clone()
            },
            kind: if s.kind.is_empty() {
                "function".into()
            } else {
                s.kind.clone()
            },
            function: FunctionCall {
                name: s.name.clone(),
                arguments: s.arguments.clone(),
                extra: s.function_extra.clone(),
            },
            extra: s.extra.clone(),
        }
    }

    /// Ends the stream (EOF). Fails unless `[DONE]` was seen.
    pub fn finish(self) -> Result<Completion, StreamError> {
        if !self.done {
            return Err(StreamError::Truncated);
        }
        let tool_calls: Vec<ToolCall> = (0..self.slots.len()).map(|n| self.call(n)).collect();
        let finish = match self.finish_reason.as_deref() {
            // Gemini ends a tool-calling turn with "stop".
            _ if !tool_calls.is_empty() => Finish::ToolCalls,
            // Hugging Face TGI's names for a complete answer.
            Some("stop" | "eos_token" | "stop_sequence") => Finish::Stop,
            Some("length") => Finish::Length,
            None if self.text.is_empty() => return Err(StreamError::NoFinish),
            None => Finish::Stop,
            Some(other) => Finish::Other(reason_label(other)),
        };
        Ok(Completion {
            text: self.text,
            tool_calls,
            finish,
            usage: self.usage,
        })
    }
}

/// Parses a tool call's arguments once it is complete. Empty means `{}`.
pub fn parse_arguments(arguments: &str) -> Result<Value, serde_json::Error> {
    if arguments.trim().is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    serde_json::from_str(arguments)
}

/// What [`reason_label`] gives for a reason it will not repeat.
pub const UNSHOWN_REASON: &str = "an unreadable reason (the server log has it)";

/// A finish reason as a caller may see it. Servers name reasons with short
/// words (`content_filter`, `abort`, `SAFETY`); anything else (which could
/// be model or prompt text) is not repeated: it is logged, and the label
/// says so ([`UNSHOWN_REASON`]).
pub fn reason_label(reason: &str) -> String {
    let word = reason.len() <= 64
        && reason.starts_with(|c: char| c.is_ascii_alphabetic())
        && reason
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
    if word {
        return reason.to_owned();
    }
    tracing::warn!(reason = %clip(reason), "the model stopped for a reason that is not a word");
    UNSHOWN_REASON.to_owned()
}

/// An error the server reported mid-stream: the `error` object of a
/// `data:` chunk, or the JSON of an `error:` line (llama-server), which
/// may wrap it in `{"error": ...}` too. The detail is for the log only.
pub fn server_error(err: Value) -> StreamError {
    let inner = match err.get("error") {
        Some(e) if e.is_object() => e,
        _ => &err,
    };
    StreamError::Server {
        code: error_code(inner),
        context_window: super::client::says_context_length(inner),
        detail: clip(&err.to_string()),
    }
}

/// The payload of an `error:` line, which should be JSON but need not be.
pub fn server_error_line(payload: &str) -> StreamError {
    match serde_json::from_str::<Value>(payload.trim()) {
        Ok(v) => server_error(v),
        Err(_) => StreamError::Server {
            code: None,
            context_window: false,
            detail: clip(payload),
        },
    }
}

/// The numeric code of an error object, if it has one.
fn error_code(err: &Value) -> Option<u16> {
    let inner = err.get("error").unwrap_or(err);
    let code = inner.get("code").or_else(|| inner.get("status"))?;
    match code {
        Value::Number(n) => n.as_u64().and_then(|n| u16::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Keeps log lines bounded.
fn clip(s: &str) -> String {
    const MAX: usize = 512;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &s[..end], s.len())
}

/// The JSON bytes of `fields` (keys and values).
fn extra_bytes(fields: &Map<String, Value>) -> usize {
    fields
        .iter()
        .map(|(k, v)| k.len() + serde_json::to_string(v).map_or(0, |j| j.len()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds an SSE transcript (`data: ...` lines) and collects everything.
    fn run(transcript: &str) -> (Vec<Output>, Result<Completion, StreamError>) {
        let mut acc = Accumulator::new("call");
        let mut outs = Vec::new();
        for line in transcript.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            match acc.push(data) {
                Ok(o) => outs.extend(o),
                Err(e) => return (outs, Err(e)),
            }
        }
        (outs, acc.finish())
    }

    fn args(c: &ToolCall) -> Value {
        parse_arguments(&c.function.arguments).unwrap()
    }

    /// The id, name and arguments of each of `c`'s calls.
    fn calls(c: &Completion) -> Vec<(&str, &str, Value)> {
        c.tool_calls
            .iter()
            .map(|t| (t.id.as_str(), t.function.name.as_str(), args(t)))
            .collect()
    }

    // vLLM (and OpenAI): index on every fragment, id and name on the first,
    // arguments in pieces, then a usage chunk with empty choices.
    const VLLM: &str = r#"
data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"chatcmpl-tool-a","type":"function","function":{"name":"lookup_order","arguments":""}}]}}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"order_"}}]}}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"id\": \"1187\"}"}}]}}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"chatcmpl-tool-b","type":"function","function":{"name":"lookup_order","arguments":"{\"order_id\": "}}]}}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"\"1042\"}"}}]}}]}
data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}
data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":120,"completion_tokens":31,"total_tokens":151}}
data: [DONE]
"#;

    #[test]
    fn a_vllm_stream_yields_two_calls_with_fragmented_arguments_and_usage() {
        let (outs, done) = run(VLLM);
        let c = done.unwrap();
        assert_eq!(c.finish, Finish::ToolCalls);
        assert_eq!(c.tool_calls.len(), 2);
        assert_eq!(c.tool_calls[0].id, "chatcmpl-tool-a");
        assert_eq!(args(&c.tool_calls[0]), json!({"order_id": "1187"}));
        assert_eq!(c.tool_calls[1].id, "chatcmpl-tool-b");
        assert_eq!(args(&c.tool_calls[1]), json!({"order_id": "1042"}));
        assert_eq!(
            c.usage,
            Some(Usage {
                prompt_tokens: 120,
                completion_tokens: 31,
                total_tokens: 151
            })
        );
        // The first call is announced as soon as the second starts.
        assert_eq!(outs, vec![Output::ToolCallReady(0)]);
    }

    // Ollama: every call has index 0, each arrives whole, with its own id.
    const OLLAMA: &str = r#"
data: {"id":"chatcmpl-7","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":[{"id":"call_x1","index":0,"type":"function","function":{"name":"lookup_order","arguments":"{\"order_id\":\"1187\"}"}}]},"finish_reason":null}]}
data: {"id":"chatcmpl-7","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":[{"id":"call_x2","index":0,"type":"function","function":{"name":"check_stock","arguments":"{\"sku\":\"cup-2\"}"}}]},"finish_reason":null}]}
data: {"id":"chatcmpl-7","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;

    #[test]
    fn an_ollama_stream_that_reuses_index_zero_yields_separate_calls() {
        let (_, done) = run(OLLAMA);
        let c = done.unwrap();
        assert_eq!(c.finish, Finish::ToolCalls);
        let names: Vec<_> = c
            .tool_calls
            .iter()
            .map(|t| (t.id.as_str(), t.function.name.as_str()))
            .collect();
        assert_eq!(
            names,
            vec![("call_x1", "lookup_order"), ("call_x2", "check_stock")]
        );
        assert_eq!(args(&c.tool_calls[1]), json!({"sku": "cup-2"}));
    }

    #[test]
    fn index_zero_reused_within_one_chunk_still_separates_calls() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{}"}},{"index":0,"id":"b","function":{"name":"g","arguments":"{\"x\":1}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        assert_eq!(c.tool_calls.len(), 2);
        assert_eq!(args(&c.tool_calls[1]), json!({"x": 1}));
    }

    // Gemini's OpenAI-compatible endpoint: no index, the whole call in one
    // chunk, finish_reason "stop", and a per-call field we must send back.
    const GEMINI: &str = r#"
data: {"choices":[{"delta":{"role":"assistant","tool_calls":[{"extra_content":{"google":{"thought_signature":"CiQBVKhc7sig=="}},"function":{"arguments":"{\"order_id\":\"1187\"}","name":"lookup_order"},"id":"function-call-1","type":"function"}]},"finish_reason":"stop","index":0}],"created":1764000000,"id":"abc","model":"gemini-2.5-flash","object":"chat.completion.chunk","usage":{"completion_tokens":12,"prompt_tokens":80,"total_tokens":92}}
data: [DONE]
"#;

    #[test]
    fn a_gemini_stream_without_index_that_stops_with_calls_is_a_tool_call_turn() {
        let c = run(GEMINI).1.unwrap();
        assert_eq!(
            c.finish,
            Finish::ToolCalls,
            "stop with tool calls present means: run the tools"
        );
        assert_eq!(c.tool_calls.len(), 1);
        let call = &c.tool_calls[0];
        assert_eq!(call.id, "function-call-1");
        assert_eq!(args(call), json!({"order_id": "1187"}));
        assert_eq!(c.usage.map(|u| u.total_tokens), Some(92));
        // Sent back exactly as it came.
        let back = serde_json::to_value(call).unwrap();
        assert_eq!(
            back["extra_content"]["google"]["thought_signature"],
            "CiQBVKhc7sig=="
        );
        assert_eq!(back["function"]["name"], "lookup_order");
        assert_eq!(back["type"], "function");
    }

    #[test]
    fn gemini_calls_without_index_in_separate_chunks_are_told_apart_by_id() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"id":"fc-1","function":{"name":"a","arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"id":"fc-2","function":{"name":"b","arguments":"{}"}}]},"finish_reason":"stop"}]}
data: [DONE]
"#;
        let (outs, done) = run(t);
        let c = done.unwrap();
        assert_eq!(
            c.tool_calls
                .iter()
                .map(|t| t.id.as_str())
                .collect::<Vec<_>>(),
            vec!["fc-1", "fc-2"]
        );
        assert_eq!(outs, vec![Output::ToolCallReady(0)]);
    }

    #[test]
    fn text_deltas_stream_in_order_and_make_the_answer() {
        let t = r#"
data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}
data: {"choices":[{"index":0,"delta":{"content":"Order 1187 "}}]}
data: {"choices":[{"index":0,"delta":{"content":"has shipped."}}]}
data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
data: [DONE]
"#;
        let (outs, done) = run(t);
        assert_eq!(
            outs,
            vec![
                Output::Text("Order 1187 ".into()),
                Output::Text("has shipped.".into())
            ]
        );
        let c = done.unwrap();
        assert_eq!(
            (c.text.as_str(), c.finish),
            ("Order 1187 has shipped.", Finish::Stop)
        );
        assert!(c.tool_calls.is_empty());
    }

    #[test]
    fn an_answer_past_the_bounds_is_an_error() {
        let mut acc = Accumulator::new("c");
        let big = serde_json::json!({"choices":[{"index":0,"delta":{"content":"x".repeat(MAX_TEXT_BYTES)}}]});
        acc.push(&big.to_string()).unwrap();
        let one_more = r#"{"choices":[{"index":0,"delta":{"content":"x"}}]}"#;
        assert!(matches!(
            acc.push(one_more),
            Err(StreamError::TooLarge { .. })
        ));

        let mut acc = Accumulator::new("c");
        let call = |i: usize| {
            serde_json::json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":i,"id":format!("c{i}"),
                "function":{"name":"f","arguments":"{}"}}]}}]})
            .to_string()
        };
        for i in 0..MAX_TOOL_CALLS {
            acc.push(&call(i)).unwrap();
        }
        assert!(matches!(
            acc.push(&call(MAX_TOOL_CALLS)),
            Err(StreamError::TooLarge { .. })
        ));

        let mut acc = Accumulator::new("c");
        let args = serde_json::json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a",
            "function":{"name":"f","arguments":"x".repeat(MAX_ARGUMENTS_BYTES + 1)}}]}}]});
        assert!(matches!(
            acc.push(&args.to_string()),
            Err(StreamError::TooLarge { .. })
        ));
    }

    /// A call's name and its unknown fields are bounded across fragments
    /// too: a server repeating a name that differs each time, or sending
    /// new unknown fields on every fragment, fails the answer instead of
    /// growing it without end.
    #[test]
    fn a_calls_name_and_unknown_fields_are_bounded_across_fragments() {
        let pushes_until_refused = |fragment: &dyn Fn(usize) -> serde_json::Value| {
            let mut acc = Accumulator::new("c");
            (0..64).find(|&i| {
                let chunk = serde_json::json!({"choices":[{"index":0,"delta":{"tool_calls":[fragment(i)]}}]});
                matches!(
                    acc.push(&chunk.to_string()),
                    Err(StreamError::TooLarge { .. })
                )
            })
        };
        let piece = MAX_NAME_BYTES / 4;
        let refused = pushes_until_refused(
            &|i| serde_json::json!({"index":0,"id":"a","function":{"name":format!("{i}{}", "n".repeat(piece))}}),
        );
        assert_eq!(refused, Some(3), "a name past {MAX_NAME_BYTES} bytes");
        let piece = MAX_EXTRA_BYTES / 4;
        let refused = pushes_until_refused(
            &|i| serde_json::json!({"index":0,"id":"a",format!("k{i}"):"v".repeat(piece)}),
        );
        assert_eq!(
            refused,
            Some(3),
            "unknown fields past {MAX_EXTRA_BYTES} bytes"
        );
        let refused = pushes_until_refused(
            &|i| serde_json::json!({"index":0,"id":"a","function":{"name":"f",format!("k{i}"):"v".repeat(piece)}}),
        );
        assert_eq!(refused, Some(3), "unknown fields of the function too");
        // A name sent again whole, and a small field on every fragment,
        // stay within the bounds.
        assert_eq!(
            pushes_until_refused(
                &|_| serde_json::json!({"index":0,"id":"a","type":"function",
                "function":{"name":"lookup_order","arguments":"{}"},"extra_content":{"sig":"abc"}})
            ),
            None
        );
    }

    #[test]
    fn eof_before_done_is_an_error_not_a_success() {
        let t = r#"
data: {"choices":[{"index":0,"delta":{"content":"Order 1187 has"}}]}
data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
"#;
        assert_eq!(run(t).1, Err(StreamError::Truncated));
    }

    #[test]
    fn a_mid_stream_error_object_is_an_error_with_its_code() {
        let t = r#"
data: {"choices":[{"index":0,"delta":{"content":"partial"}}]}
data: {"error":{"code":500,"message":"The model produced output that does not match the expected format","type":"server_error"}}
data: [DONE]
"#;
        match run(t).1 {
            Err(StreamError::Server { code, .. }) => assert_eq!(code, Some(500)),
            other => panic!("expected a server error, got {other:?}"),
        }
    }

    #[test]
    fn a_chunk_that_is_not_json_is_malformed() {
        assert!(matches!(
            run("data: {not json\n").1,
            Err(StreamError::Malformed { .. })
        ));
    }

    #[test]
    fn null_choices_and_arguments_sent_as_an_object_are_accepted() {
        let t = r#"
data: {"choices":null,"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":{"a":[1,2]}}}]},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        assert_eq!(args(&c.tool_calls[0]), json!({"a": [1, 2]}));
        assert_eq!(
            c.tool_calls[0].id, "call_0",
            "a call without an id gets a generated one"
        );
        assert_eq!(c.usage.map(|u| u.total_tokens), Some(3));
    }

    #[test]
    fn a_name_repeated_on_every_fragment_is_not_doubled() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"lookup_order","arguments":"{\"order_id\""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"lookup_order","arguments":":\"1\"}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        assert_eq!(c.tool_calls.len(), 1);
        assert_eq!(c.tool_calls[0].function.name, "lookup_order");
        assert_eq!(args(&c.tool_calls[0]), json!({"order_id": "1"}));
    }

    /// Fragments of parallel calls that interleave: a call is announced
    /// only once its arguments are whole, so its TOOL_CALL event shows what
    /// the tool runs with.
    #[test]
    fn an_interleaved_call_is_announced_only_once_its_arguments_are_whole() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{\"x\""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":2,"id":"c","function":{"name":"h","arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let mut acc = Accumulator::new("call");
        let mut announced = Vec::new();
        for (n, line) in t
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .enumerate()
        {
            for o in acc.push(line).unwrap() {
                let Output::ToolCallReady(i) = o else {
                    panic!("{o:?}")
                };
                announced.push((n, i, acc.call(i)));
            }
        }
        // Call 0 waits past the opening of call 1 for its last fragment;
        // both are announced, in order, when call 2 opens.
        assert_eq!(
            announced.iter().map(|a| (a.0, a.1)).collect::<Vec<_>>(),
            vec![(3, 0), (3, 1)]
        );
        let c = acc.finish().unwrap();
        assert_eq!(args(&c.tool_calls[0]), json!({"x": 1}));
        for (_, i, call) in &announced {
            assert_eq!(*call, c.tool_calls[*i], "the event shows what runs");
        }
    }

    /// A fragment for a call already announced cannot change it: what the
    /// event showed is what runs and what goes back to the model. Unknown
    /// fields still join it (they change neither).
    #[test]
    fn a_fragment_after_a_call_was_announced_does_not_change_it() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"{\"x\":1}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f2","arguments":",\"y\":2}"},"sig":"s"}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let (outs, done) = run(t);
        assert_eq!(outs, vec![Output::ToolCallReady(0)]);
        let c = done.unwrap();
        assert_eq!(c.tool_calls.len(), 2);
        let call = &c.tool_calls[0];
        assert_eq!(
            (call.function.name.as_str(), args(call)),
            ("f", json!({"x": 1}))
        );
        assert_eq!(call.extra["sig"], "s");
    }

    /// Some servers send a fresh id on each fragment of one call: without a
    /// name, and while the call's arguments are not whole, a changed id on
    /// the same index continues the call (Ollama's calls, each whole and
    /// named, still start new ones: see the Ollama tests above).
    #[test]
    fn a_fresh_id_on_a_fragment_without_a_name_continues_the_call() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"b","function":{"arguments":"{\"x\""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":":1}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"d","function":{"arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        // The last fragment comes once the first call is whole: a new call.
        assert_eq!(
            calls(&c),
            vec![("a", "f", json!({"x": 1})), ("d", "", json!({}))]
        );
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"b","function":{"arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        assert_eq!(c.tool_calls.len(), 1);
        assert_eq!(
            (
                c.tool_calls[0].id.as_str(),
                c.tool_calls[0].function.name.as_str()
            ),
            ("a", "f")
        );
    }

    /// A server that sends a fresh id on every fragment and repeats the
    /// name each time, the name first with empty arguments: the pieces of
    /// the arguments that follow continue that call (the call had no
    /// arguments yet, so it was not whole), one call `f({"x":1})`, not
    /// `f({})` and `f(:1})`.
    #[test]
    fn a_fresh_id_and_the_same_name_on_every_fragment_continue_a_call_with_empty_arguments() {
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","type":"function","function":{"name":"f","arguments":""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"b","type":"function","function":{"name":"f","arguments":"{\"x\""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":":1}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let (outs, done) = run(t);
        assert_eq!(outs, vec![], "no call is announced before the end");
        let c = done.unwrap();
        assert_eq!(calls(&c), vec![("a", "f", json!({"x": 1}))]);
        // Another name on the same index, or arguments already whole,
        // still start a new call.
        let t = r#"
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":""}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"g","arguments":"{}"}}]}}]}
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"g","arguments":"{\"y\":2}"}}]}}]}
data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}
data: [DONE]
"#;
        let c = run(t).1.unwrap();
        assert_eq!(
            calls(&c),
            vec![
                ("a", "f", json!({})),
                ("b", "g", json!({})),
                ("c", "g", json!({"y": 2}))
            ]
        );
    }

    /// `[DONE]` with nothing before it (a llama-server whose error line was
    /// dropped) is no empty answer; text without a reason still answers.
    #[test]
    fn done_without_a_finish_reason_text_or_calls_is_an_error() {
        assert_eq!(run("data: [DONE]\n").1, Err(StreamError::NoFinish));
        let t = r#"
data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}
data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":0,"total_tokens":1}}
data: [DONE]
"#;
        assert_eq!(run(t).1, Err(StreamError::NoFinish));
        let t = r#"
data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}
data: [DONE]
"#;
        assert_eq!(run(t).1.unwrap().finish, Finish::Stop);
    }

    #[test]
    fn another_finish_reason_is_kept_as_a_short_safe_label() {
        let t = r#"
data: {"choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}
data: [DONE]
"#;
        assert_eq!(
            run(t).1.unwrap().finish,
            Finish::Other("content_filter".into())
        );
        assert_eq!(reason_label("abort"), "abort");
        assert_eq!(reason_label("SAFETY"), "SAFETY");
        for odd in ["you said: 4111 1111", "4111-1111", "", &"x".repeat(65)] {
            assert_eq!(reason_label(odd), UNSHOWN_REASON, "{odd:?}");
        }
        let t = r#"
data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"eos_token"}]}
data: [DONE]
"#;
        assert_eq!(run(t).1.unwrap().finish, Finish::Stop, "TGI's name");
    }

    /// An `error:` line's JSON (llama-server), wrapped or not, with a code
    /// and whether it says the context window is full.
    #[test]
    fn an_error_line_is_a_server_error_with_its_code_and_kind() {
        let full = r#" {"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}"#;
        assert!(matches!(
            server_error_line(full),
            StreamError::Server {
                code: Some(400),
                context_window: true,
                ..
            }
        ));
        assert!(matches!(
            server_error_line(r#"{"error":{"code":"503","message":"loading model"}}"#),
            StreamError::Server {
                code: Some(503),
                context_window: false,
                ..
            }
        ));
        assert!(matches!(
            server_error_line("oops"),
            StreamError::Server { code: None, .. }
        ));
    }

    #[test]
    fn arguments_are_parsed_only_at_the_end_and_empty_means_no_arguments() {
        assert_eq!(parse_arguments("").unwrap(), json!({}));
        assert!(parse_arguments("{\"a\":").is_err());
    }
}
