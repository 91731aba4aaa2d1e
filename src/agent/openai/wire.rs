//! The OpenAI chat-completions wire format, as real servers speak it.
//!
//! Requests are what every compatible server accepts. Response chunks are
//! parsed leniently: every field is optional, because servers differ (Ollama
//! reuses `index` 0, Gemini sends no `index`, some send `arguments` as an
//! object), and fields we do not know are kept so they can be sent back.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One message of the conversation sent to the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    System {
        content: String,
    },
    User {
        content: String,
    },
    Assistant {
        /// `null` when the model only called tools.
        content: Option<String>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    Tool {
        tool_call_id: String,
        content: String,
    },
}

/// A complete tool call, as the model made it and as it is sent back in the
/// assistant message of the next request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
    /// Fields the server sent that we do not know (e.g. Gemini's
    /// `extra_content.thought_signature`); they must go back unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as the model wrote them (a JSON document as a string).
    pub arguments: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A tool offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionSpec {
    pub name: String,
    pub description: String,
    /// A JSON schema of the arguments.
    pub parameters: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamOptions {
    pub include_usage: bool,
}

/// Sampling settings; absent ones are left to the server. The agents file
/// checks their ranges at load (a value a server refuses would fail every
/// run; a NaN would be sent as `null`, silently the server's default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// OpenAI's newer name of the bound (its reasoning models refuse
    /// `max_tokens`); sent as such, instead of `max_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
}

/// The body of `POST {base_url}/chat/completions`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatRequest<'a> {
    pub model: &'a str,
    pub messages: &'a [Message],
    pub stream: bool,
    pub stream_options: StreamOptions,
    #[serde(skip_serializing_if = "<[ToolSpec]>::is_empty")]
    pub tools: &'a [ToolSpec],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<&'a str>,
    #[serde(flatten)]
    pub sampling: &'a Sampling,
}

/// One `data:` payload of the stream.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Chunk {
    #[serde(deserialize_with = "null_is_default")]
    pub choices: Vec<Choice>,
    pub usage: Option<Usage>,
    /// A mid-stream error object (`{"error": {...}}`).
    pub error: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Choice {
    pub index: Option<u32>,
    #[serde(deserialize_with = "null_is_default")]
    pub delta: Delta,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Delta {
    pub content: Option<String>,
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A fragment of a tool call.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(default)]
pub struct ToolCallDelta {
    pub index: Option<u32>,
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: Option<FunctionDelta>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(default)]
pub struct FunctionDelta {
    pub name: Option<String>,
    /// Normally a string fragment; some servers send the whole object.
    pub arguments: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

/// `null` where a server means "nothing".
fn null_is_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}
