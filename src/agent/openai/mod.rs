//! Agents backed by an OpenAI-compatible chat-completions server (vLLM,
//! Ollama, llama.cpp's llama-server, OpenAI, Gemini's compatible endpoint).
//!
//! - [`wire`]: the request and chunk formats, lenient where servers differ;
//! - [`accumulate`]: streamed chunks → text deltas, tool calls, an ending;
//! - [`client`]: the HTTP client and its error table;
//! - [`agent`]: the tool loop that makes it an [`crate::agent::Agent`].

pub mod accumulate;
pub mod agent;
pub mod client;
pub mod wire;

pub use agent::{FirstCall, ModelAgent, ModelAgentConfig};
pub use client::{ChatClient, Endpoint, http_client};
pub use wire::Sampling;
