//! The agents file (`--agents agents.toml`): the model-backed agents one
//! process serves, and the HTTP tools they may call. A bad file fails at
//! start-up with the file, line and reason.
//!
//! ```toml
//! default = "support"              # optional: the agent for an empty RunRequest.agent
//!
//! [agents.support]
//! description = "Answers customer questions about orders."
//! instruction = "You are a helpful support agent. Use the tools."
//! tools = ["lookup_order", "stock"] # built-in tools, or [tools.*] below
//! max_tool_turns = 8                # model calls that may end in tool calls
//! call_timeout = "60s"              # bound of each model call and tool call
//!
//! [agents.support.model]
//! base_url = "http://127.0.0.1:11434/v1"
//! model = "qwen2.5:7b-instruct"
//! api_key_env = "OPENAI_API_KEY"    # or api_key_file = "/run/secrets/key"; neither for local servers
//!
//! [agents.support.sampling]           # checked at load: see `sampling`
//! temperature = 0.2
//! max_tokens = 1024                 # or max_completion_tokens (OpenAI's reasoning models)
//!
//! [tools.stock]
//! description = "Checks stock for a product."
//! url = "http://inventory.internal:8080/stock"
//! parameters = { type = "object", properties = { sku = { type = "string" } }, required = ["sku"] }
//! timeout = "5s"
//! max_response_bytes = 65536
//! ```

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::Agent;
use super::openai::{ChatClient, Endpoint, FirstCall, ModelAgent, ModelAgentConfig, Sampling};
use super::remote_a2a::{self, Remote, RemoteA2aAgent, RemoteA2aConfig, Token};
use super::tools::{self, HttpTool, Tool, ToolDef};
use crate::client::a2a::Binding;

/// Default bound of one model or tool call.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Default number of tool turns per run.
pub const DEFAULT_MAX_TOOL_TURNS: u32 = 8;
/// Default cap of an HTTP tool's response.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// The largest cap of an HTTP tool's response: its result, escaped as JSON
/// (up to 6 bytes a byte), must fit in one gRPC message of a client's
/// default limit (4 MiB).
pub const MAX_RESPONSE_BYTES: usize = 512 * 1024;
/// The longest timeout a file may give (longer ones are mistakes; runs are
/// bounded by --max-run-duration anyway).
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The values `first_call.tool_choice` may take.
const TOOL_CHOICES: [&str; 3] = ["none", "auto", "required"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    default: Option<Spanned<String>>,
    #[serde(default)]
    agents: BTreeMap<String, Spanned<AgentDoc>>,
    #[serde(default)]
    tools: BTreeMap<String, Spanned<HttpToolDoc>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentDoc {
    /// `openai` (the default: a model-backed agent) or `remote_a2a`.
    kind: Option<Spanned<String>>,
    #[serde(default)]
    description: String,
    #[serde(default)]
    instruction: String,
    model: Option<Spanned<ModelDoc>>,
    sampling: Option<Spanned<SamplingDoc>>,
    max_tool_turns: Option<Spanned<u32>>,
    call_timeout: Option<Spanned<String>>,
    #[serde(default)]
    tools: Vec<Spanned<String>>,
    first_call: Option<Spanned<FirstCall>>,
    /// The remote agent of a `remote_a2a` agent.
    a2a: Option<Spanned<RemoteDoc>>,
}

/// `[agents.NAME.sampling]`: [`Sampling`] with each value's place in the
/// file, for the range checks of [`sampling`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SamplingDoc {
    temperature: Option<Spanned<f64>>,
    top_p: Option<Spanned<f64>>,
    max_tokens: Option<Spanned<u32>>,
    max_completion_tokens: Option<Spanned<u32>>,
    seed: Option<i64>,
    presence_penalty: Option<Spanned<f64>>,
    frequency_penalty: Option<Spanned<f64>>,
    stop: Option<Vec<String>>,
}

/// `[agents.NAME.a2a]` of a `remote_a2a` agent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoteDoc {
    card_url: Option<Spanned<String>>,
    jsonrpc_url: Option<Spanned<String>>,
    binding: Option<Spanned<String>>,
    agent: Option<Spanned<String>>,
    token_env: Option<Spanned<String>>,
    token_file: Option<Spanned<PathBuf>>,
    /// Never accepted: a token written in the file. Declared so the refusal
    /// can say what to do instead.
    token: Option<Spanned<toml::Value>>,
    idle_timeout: Option<Spanned<String>>,
    /// A PEM bundle trusted besides the system's roots (an https remote
    /// behind a private CA).
    ca_file: Option<Spanned<PathBuf>>,
}

/// Names the file's agents may not take.
const BUILT_IN_AGENTS: &[&str] = &["order_helper", "echo", "stream"];

/// The kinds of agent a file may declare.
const KINDS: &[&str] = &["openai", "remote_a2a"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelDoc {
    base_url: Spanned<String>,
    model: String,
    api_key_env: Option<Spanned<String>>,
    api_key_file: Option<Spanned<PathBuf>>,
    #[serde(default)]
    headers: BTreeMap<String, Spanned<HeaderDoc>>,
}

/// A header's value: written out, or a secret read at start-up from an
/// environment variable or a file (`{ env = "VAR" }`, `{ file = "PATH" }`),
/// with an optional `prefix` (e.g. `"Bearer "`), so no credential need be
/// written in the agents file.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum HeaderDoc {
    Value(String),
    Secret(SecretDoc),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretDoc {
    env: Option<String>,
    file: Option<PathBuf>,
    #[serde(default)]
    prefix: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HttpToolDoc {
    #[serde(default)]
    description: String,
    url: Spanned<String>,
    parameters: Spanned<serde_json::Value>,
    #[serde(default)]
    headers: BTreeMap<String, Spanned<HeaderDoc>>,
    timeout: Option<Spanned<String>>,
    max_response_bytes: Option<usize>,
}

/// What an agents file declares, ready to serve.
pub struct AgentsFile {
    pub agents: Vec<Arc<dyn Agent>>,
    /// The file's `default`, if it names one.
    pub default: Option<String>,
}

/// Looks up an environment variable.
pub type EnvLookup = Box<dyn Fn(&str) -> Option<String>>;

/// What the loader needs from the process.
pub struct LoadOptions {
    /// Simulated latency of the built-in `lookup_order`.
    pub tool_delay: Duration,
    /// Looks up `api_key_env` (the process environment in production).
    pub env: EnvLookup,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            tool_delay: Duration::ZERO,
            env: Box::new(|k| std::env::var(k).ok()),
        }
    }
}

/// Reads and checks `path`. The error is one line: `file:line:column: reason`.
pub fn load(path: &Path, opts: &LoadOptions) -> anyhow::Result<AgentsFile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot read the agents file: {e}", path.display()))?;
    parse(&text, path, opts)
}

/// Parses an agents file held in memory; `path` names it in errors.
pub fn parse(text: &str, path: &Path, opts: &LoadOptions) -> anyhow::Result<AgentsFile> {
    let at = |span: Option<Range<usize>>, reason: &str| -> anyhow::Error {
        match span {
            Some(s) => {
                let (line, col) = line_col(text, s.start);
                anyhow::anyhow!("{}:{line}:{col}: {reason}", path.display())
            }
            None => anyhow::anyhow!("{}: {reason}", path.display()),
        }
    };
    let doc: FileDoc = toml::from_str(text).map_err(|e| {
        let reason = e.message().trim();
        match e.span().and_then(|s| array_of_tables(text, s.start)) {
            Some(table) => at(
                e.span(),
                &format!(
                    "{reason}: agents and tools are tables keyed by name (`[{table}.NAME]`), not an array of tables (`[[{table}]]`)"
                ),
            ),
            None => at(e.span(), reason),
        }
    })?;
    let http = super::openai::http_client()?;

    let mut http_tools: BTreeMap<String, Arc<dyn Tool>> = BTreeMap::new();
    for (name, t) in &doc.tools {
        let span = t.span();
        let t = t.get_ref();
        check_name(name).map_err(|r| at(Some(span.clone()), &format!("tool {name:?}: {r}")))?;
        if tools::BUILT_IN.contains(&name.as_str()) {
            return Err(at(
                Some(span),
                &format!("tool {name:?} is built in; give an HTTP tool another name"),
            ));
        }
        let url = parse_url(t.url.get_ref())
            .map_err(|r| at(Some(t.url.span()), &format!("tool {name:?}: {r}")))?;
        if t.parameters.get_ref().get("type") != Some(&serde_json::Value::from("object")) {
            return Err(at(
                Some(t.parameters.span()),
                &format!(
                    "tool {name:?}: parameters must be a JSON schema of type \"object\" (model servers take no other)"
                ),
            ));
        }
        let def =
            ToolDef::new(name, &t.description, t.parameters.get_ref().clone()).map_err(|r| {
                at(
                    Some(t.parameters.span()),
                    &format!("tool {name:?}: parameters: {r}"),
                )
            })?;
        let timeout = t
            .timeout
            .as_ref()
            .map(|d| duration(d, &at))
            .transpose()?
            .unwrap_or(DEFAULT_CALL_TIMEOUT);
        let headers = header_map(&t.headers, opts, &at)?;
        let cap = t.max_response_bytes.unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
        if cap == 0 || cap > MAX_RESPONSE_BYTES {
            return Err(at(
                Some(span),
                &format!(
                    "tool {name:?}: max_response_bytes must be between 1 and {MAX_RESPONSE_BYTES}"
                ),
            ));
        }
        http_tools.insert(
            name.clone(),
            Arc::new(HttpTool::new(def, http.clone(), url, headers, timeout, cap)),
        );
    }

    let mut agents: Vec<Arc<dyn Agent>> = Vec::new();
    for (name, a) in &doc.agents {
        let span = a.span();
        let a = a.get_ref();
        check_name(name).map_err(|r| at(Some(span.clone()), &format!("agent {name:?}: {r}")))?;
        // The built-in agents' names are taken (`stream` too, served with
        // --stream-agent).
        if BUILT_IN_AGENTS.contains(&name.as_str()) {
            return Err(at(
                Some(span),
                &format!("agent {name:?}: the name of a built-in agent; choose another"),
            ));
        }
        let kind = a.kind.as_ref().map_or("openai", |k| k.get_ref().as_str());
        if !KINDS.contains(&kind) {
            let k = a.kind.as_ref().expect("a kind was given");
            return Err(at(
                Some(k.span()),
                &format!(
                    "agent {name:?}: unknown kind {kind:?} (known: {})",
                    KINDS.join(", ")
                ),
            ));
        }
        if kind == "remote_a2a" {
            agents.push(remote_agent(name, a, span, &at, opts)?);
            continue;
        }
        if let Some(r) = &a.a2a {
            return Err(at(
                Some(r.span()),
                &format!("agent {name:?}: an a2a table needs kind = \"remote_a2a\""),
            ));
        }
        let Some(m) = &a.model else {
            return Err(at(
                Some(span),
                &format!(
                    "agent {name:?}: a model table is required (or kind = \"remote_a2a\" with an a2a table)"
                ),
            ));
        };
        let m = m.get_ref();
        let base = parse_url(m.base_url.get_ref()).map_err(|r| {
            at(
                Some(m.base_url.span()),
                &format!("agent {name:?}: base_url: {r}"),
            )
        })?;
        let refused = if !base.username().is_empty() || base.password().is_some() {
            Some("holds credentials; give the key with api_key_env or api_key_file, or headers")
        } else if base.fragment().is_some() {
            Some("has a #fragment")
        } else {
            None
        };
        if let Some(r) = refused {
            return Err(at(
                Some(m.base_url.span()),
                &format!("agent {name:?}: base_url {r}"),
            ));
        }
        if m.model.trim().is_empty() {
            return Err(at(
                Some(span),
                &format!("agent {name:?}: model.model is empty"),
            ));
        }
        let mut endpoint = Endpoint::new(m.base_url.get_ref());
        endpoint.headers = header_map(&m.headers, opts, &at)?;
        endpoint.api_key = match (&m.api_key_env, &m.api_key_file) {
            (Some(_), Some(f)) => {
                return Err(at(
                    Some(f.span()),
                    &format!("agent {name:?}: give api_key_env or api_key_file, not both"),
                ));
            }
            (Some(var), None) => Some(
                env_secret(var.get_ref(), opts, "api_key_env")
                    .map_err(|why| at(Some(var.span()), &format!("agent {name:?}: {why}")))?,
            ),
            (None, Some(file)) => Some(
                read_key(file.get_ref())
                    .map_err(|r| at(Some(file.span()), &format!("agent {name:?}: {r}")))?,
            ),
            (None, None) => None,
        }
        .map(|k| k.trim().to_owned());
        if let Some(k) = &endpoint.api_key
            && reqwest::header::HeaderValue::try_from(format!("Bearer {k}")).is_err()
        {
            let where_ = m
                .api_key_file
                .as_ref()
                .map(|f| f.span())
                .or(m.api_key_env.as_ref().map(|v| v.span()));
            return Err(at(
                where_,
                &format!(
                    "agent {name:?}: the API key cannot be sent in a header (a line break or a control character in it?)"
                ),
            ));
        }
        let call_timeout = a
            .call_timeout
            .as_ref()
            .map(|d| duration(d, &at))
            .transpose()?
            .unwrap_or(DEFAULT_CALL_TIMEOUT);
        let mut agent_tools: Vec<Arc<dyn Tool>> = Vec::new();
        for t in &a.tools {
            let tname = t.get_ref();
            if agent_tools.iter().any(|x| x.def().name == *tname) {
                return Err(at(
                    Some(t.span()),
                    &format!("agent {name:?}: tool {tname:?} is listed twice"),
                ));
            }
            let tool = http_tools
                .get(tname)
                .cloned()
                .or_else(|| tools::built_in(tname, opts.tool_delay))
                .ok_or_else(|| {
                    let mut known: Vec<&str> = tools::BUILT_IN.to_vec();
                    known.extend(http_tools.keys().map(String::as_str));
                    at(
                        Some(t.span()),
                        &format!(
                            "agent {name:?}: unknown tool {tname:?} (known: {})",
                            known.join(", ")
                        ),
                    )
                })?;
            agent_tools.push(tool);
        }
        let first_call = a
            .first_call
            .as_ref()
            .map(|f| f.get_ref().clone())
            .unwrap_or_default();
        if first_call.tool_choice.is_some() && agent_tools.is_empty() {
            return Err(at(
                Some(span),
                &format!("agent {name:?}: first_call.tool_choice needs at least one tool"),
            ));
        }
        if let Some(choice) = &first_call.tool_choice
            && !TOOL_CHOICES.contains(&choice.as_str())
        {
            return Err(at(
                Some(span),
                &format!(
                    "agent {name:?}: first_call.tool_choice {choice:?} is not one of {}",
                    TOOL_CHOICES.join(", ")
                ),
            ));
        }
        let max_tool_turns = a
            .max_tool_turns
            .as_ref()
            .map_or(DEFAULT_MAX_TOOL_TURNS, |t| *t.get_ref());
        if max_tool_turns == 0 && first_call.tool_choice.as_deref() == Some("required") {
            return Err(at(
                Some(span),
                &format!(
                    "agent {name:?}: first_call.tool_choice = \"required\" with max_tool_turns = 0 can never answer"
                ),
            ));
        }
        agents.push(Arc::new(ModelAgent::new(ModelAgentConfig {
            name: name.clone(),
            description: a.description.clone(),
            instruction: a.instruction.clone(),
            model: m.model.clone(),
            client: ChatClient::new(http.clone(), endpoint, name),
            sampling: a
                .sampling
                .as_ref()
                .map(|s| sampling(name, s.get_ref(), &at))
                .transpose()?
                .unwrap_or_default(),
            max_tool_turns,
            call_timeout,
            tools: agent_tools,
            first_call,
        })));
    }

    let default = match &doc.default {
        Some(d) if !doc.agents.contains_key(d.get_ref()) => {
            return Err(at(
                Some(d.span()),
                &format!(
                    "default agent {:?} is not defined in this file",
                    d.get_ref()
                ),
            ));
        }
        Some(d) => Some(d.get_ref().clone()),
        None => None,
    };
    Ok(AgentsFile { agents, default })
}

/// A `kind = "remote_a2a"` agent: its `[agents.NAME.a2a]` table checked,
/// its token read. The remote is not contacted here (see [`RemoteA2aAgent`]).
fn remote_agent(
    name: &str,
    a: &AgentDoc,
    span: Range<usize>,
    at: &impl Fn(Option<Range<usize>>, &str) -> anyhow::Error,
    opts: &LoadOptions,
) -> anyhow::Result<Arc<dyn Agent>> {
    let model_only: [(&str, Option<Range<usize>>); 5] = [
        ("model", a.model.as_ref().map(|m| m.span())),
        ("sampling", a.sampling.as_ref().map(|m| m.span())),
        (
            "max_tool_turns",
            a.max_tool_turns.as_ref().map(|m| m.span()),
        ),
        ("first_call", a.first_call.as_ref().map(|m| m.span())),
        ("tools", a.tools.first().map(|t| t.span())),
    ];
    for (field, at_span) in model_only {
        if let Some(s) = at_span {
            return Err(at(
                Some(s),
                &format!(
                    "agent {name:?}: {field} is for model-backed agents; a remote_a2a agent has none"
                ),
            ));
        }
    }
    if !a.instruction.is_empty() {
        return Err(at(
            Some(span),
            &format!(
                "agent {name:?}: instruction is for model-backed agents; a remote_a2a agent has none"
            ),
        ));
    }
    let Some(r) = &a.a2a else {
        return Err(at(
            Some(span),
            &format!(
                "agent {name:?}: kind \"remote_a2a\" needs an [agents.{name}.a2a] table with card_url or jsonrpc_url"
            ),
        ));
    };
    let r_span = r.span();
    let r = r.get_ref();
    let url = |u: &Spanned<String>, field: &str| -> anyhow::Result<String> {
        parse_url(u.get_ref()).map_err(|why| {
            at(
                Some(u.span()),
                &format!("agent {name:?}: a2a.{field}: {why}"),
            )
        })?;
        Ok(u.get_ref().clone())
    };
    let remote = match (&r.card_url, &r.jsonrpc_url) {
        (Some(_), Some(j)) => {
            return Err(at(
                Some(j.span()),
                &format!("agent {name:?}: give a2a.card_url or a2a.jsonrpc_url, not both"),
            ));
        }
        (None, None) => {
            return Err(at(
                Some(r_span),
                &format!("agent {name:?}: the a2a table needs card_url or jsonrpc_url"),
            ));
        }
        (Some(c), None) => Remote::Card {
            url: url(c, "card_url")?,
            binding: match &r.binding {
                None => None,
                Some(b) => Some(match b.get_ref().to_ascii_lowercase().as_str() {
                    "jsonrpc" => Binding::Jsonrpc,
                    "grpc" => Binding::Grpc,
                    _ => {
                        return Err(at(
                            Some(b.span()),
                            &format!("agent {name:?}: a2a.binding must be \"jsonrpc\" or \"grpc\""),
                        ));
                    }
                }),
            },
        },
        (None, Some(j)) => {
            if let Some(b) = &r.binding {
                return Err(at(
                    Some(b.span()),
                    &format!(
                        "agent {name:?}: a2a.binding goes with card_url; jsonrpc_url is JSON-RPC"
                    ),
                ));
            }
            Remote::JsonRpc {
                url: url(j, "jsonrpc_url")?,
            }
        }
    };
    if let Some(t) = &r.token {
        return Err(at(
            Some(t.span()),
            &format!(
                "agent {name:?}: a token is never written in the agents file; use a2a.token_env or a2a.token_file"
            ),
        ));
    }
    let token = match (&r.token_env, &r.token_file) {
        (Some(_), Some(f)) => {
            return Err(at(
                Some(f.span()),
                &format!("agent {name:?}: give a2a.token_env or a2a.token_file, not both"),
            ));
        }
        (Some(var), None) => Some(
            env_secret(var.get_ref(), opts, "a2a.token_env")
                .map_err(|why| at(Some(var.span()), &format!("agent {name:?}: {why}")))?,
        ),
        (None, Some(f)) => Some(
            read_secret(f.get_ref(), "a2a.token_file")
                .map_err(|why| at(Some(f.span()), &format!("agent {name:?}: {why}")))?,
        ),
        (None, None) => None,
    }
    .map(|t| t.trim().to_owned());
    if let Some(t) = &token
        && !t.bytes().all(|b| b.is_ascii_graphic())
    {
        let s = r
            .token_env
            .as_ref()
            .map(|v| v.span())
            .or(r.token_file.as_ref().map(|f| f.span()));
        return Err(at(
            s,
            &format!("agent {name:?}: the token must be printable ASCII without spaces"),
        ));
    }
    if let Some(ag) = &r.agent {
        check_name(ag.get_ref()).map_err(|why| {
            at(
                Some(ag.span()),
                &format!("agent {name:?}: a2a.agent: {why}"),
            )
        })?;
    }
    let idle_timeout = r
        .idle_timeout
        .as_ref()
        .map(|d| duration(d, at))
        .transpose()?
        .unwrap_or(remote_a2a::DEFAULT_IDLE_TIMEOUT);
    let call_timeout = a
        .call_timeout
        .as_ref()
        .map(|d| duration(d, at))
        .transpose()?
        .unwrap_or(remote_a2a::DEFAULT_CALL_TIMEOUT);
    let ca_pem = match &r.ca_file {
        None => None,
        Some(f) => {
            let why = |what: String| {
                at(
                    Some(f.span()),
                    &format!("agent {name:?}: a2a.ca_file: {what}"),
                )
            };
            let pem = std::fs::read(f.get_ref())
                .map_err(|e| why(format!("cannot read {}: {e}", f.get_ref().display())))?;
            match reqwest::Certificate::from_pem_bundle(&pem) {
                Ok(certs) if !certs.is_empty() => Some(pem),
                _ => {
                    return Err(why(format!(
                        "{} holds no PEM certificate",
                        f.get_ref().display()
                    )));
                }
            }
        }
    };
    let agent = RemoteA2aAgent::new(RemoteA2aConfig {
        name: name.to_owned(),
        description: a.description.clone(),
        remote,
        remote_agent: r.agent.as_ref().map(|a| a.get_ref().clone()),
        token: token.map(Token),
        ca_pem,
        idle_timeout,
        call_timeout,
    })
    .map_err(|e| at(Some(r_span), &format!("agent {name:?}: {e}")))?;
    Ok(Arc::new(agent))
}

/// Checks sampling settings no model server takes (or, for a NaN or an
/// infinity, which go out as JSON `null`, every server silently ignores),
/// on the value's line. Only what is wrong everywhere is refused: the
/// servers' own ranges differ (OpenAI caps temperature at 2 and the
/// penalties at ±2, vLLM refuses a `top_p` of 0, Ollama and llama-server
/// take wider values), and a server refuses what it does not take with a
/// 4xx on the run (`FAILED_PRECONDITION`).
fn sampling(
    name: &str,
    s: &SamplingDoc,
    at: &impl Fn(Option<Range<usize>>, &str) -> anyhow::Error,
) -> anyhow::Result<Sampling> {
    let number = |v: &Option<Spanned<f64>>,
                  field: &str,
                  ok: fn(f64) -> bool,
                  range: &str|
     -> anyhow::Result<Option<f64>> {
        let Some(v) = v else { return Ok(None) };
        let x = *v.get_ref();
        if !x.is_finite() || !ok(x) {
            return Err(at(
                Some(v.span()),
                &format!("agent {name:?}: sampling.{field} must be {range}"),
            ));
        }
        Ok(Some(x))
    };
    let tokens = |v: &Option<Spanned<u32>>, field: &str| -> anyhow::Result<Option<u32>> {
        match v {
            Some(v) if *v.get_ref() == 0 => Err(at(
                Some(v.span()),
                &format!("agent {name:?}: sampling.{field} must be at least 1"),
            )),
            v => Ok(v.as_ref().map(|v| *v.get_ref())),
        }
    };
    if let (Some(_), Some(c)) = (&s.max_tokens, &s.max_completion_tokens) {
        return Err(at(
            Some(c.span()),
            &format!(
                "agent {name:?}: give sampling.max_tokens or sampling.max_completion_tokens, not both"
            ),
        ));
    }
    let penalty = |_: f64| true;
    Ok(Sampling {
        temperature: number(
            &s.temperature,
            "temperature",
            |x| x >= 0.0,
            "a number of 0 or more",
        )?,
        top_p: number(
            &s.top_p,
            "top_p",
            |x| (0.0..=1.0).contains(&x),
            "a number from 0 to 1",
        )?,
        max_tokens: tokens(&s.max_tokens, "max_tokens")?,
        max_completion_tokens: tokens(&s.max_completion_tokens, "max_completion_tokens")?,
        seed: s.seed,
        presence_penalty: number(
            &s.presence_penalty,
            "presence_penalty",
            penalty,
            "a finite number",
        )?,
        frequency_penalty: number(
            &s.frequency_penalty,
            "frequency_penalty",
            penalty,
            "a finite number",
        )?,
        stop: s.stop.clone(),
    })
}

/// Agent and tool names: what RunRequest.agent and the model accept.
fn check_name(name: &str) -> Result<(), &'static str> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err("names must be 1-64 characters of [A-Za-z0-9_-]")
    }
}

fn parse_url(s: &str) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("the URL must be http:// or https://".into());
    }
    Ok(url)
}

fn duration(
    d: &Spanned<String>,
    at: &impl Fn(Option<Range<usize>>, &str) -> anyhow::Error,
) -> anyhow::Result<Duration> {
    let v = humantime::parse_duration(d.get_ref())
        .map_err(|e| at(Some(d.span()), &format!("{e} (use e.g. 500ms, 30s, 5m)")))?;
    if v.is_zero() {
        return Err(at(Some(d.span()), "a timeout must be more than 0s"));
    }
    if v > MAX_TIMEOUT {
        return Err(at(Some(d.span()), "a timeout must be at most 24h"));
    }
    Ok(v)
}

fn header_map(
    h: &BTreeMap<String, Spanned<HeaderDoc>>,
    opts: &LoadOptions,
    at: &impl Fn(Option<Range<usize>>, &str) -> anyhow::Error,
) -> anyhow::Result<reqwest::header::HeaderMap> {
    let mut e = Endpoint::new("");
    for (k, v) in h {
        let value = match v.get_ref() {
            HeaderDoc::Value(s) => s.clone(),
            HeaderDoc::Secret(s) => {
                let secret = match (&s.env, &s.file) {
                    (Some(var), None) => env_secret(var, opts, &format!("header {k}: env")),
                    (None, Some(path)) => read_secret(path, &format!("header {k}: file")),
                    _ => Err(format!("header {k}: give env or file (one of them)")),
                }
                .map_err(|r| at(Some(v.span()), &r))?;
                format!("{}{}", s.prefix, secret.trim())
            }
        };
        e = e
            .header(k, &value)
            .map_err(|r| at(Some(v.span()), &r.to_string()))?;
    }
    Ok(e.headers)
}

fn read_key(path: &Path) -> Result<String, String> {
    read_secret(path, "api_key_file")
}

/// Whether `s` reads as the name of an environment variable, as shells
/// write them (Kubernetes and Docker take others too, which are looked up
/// all the same: this only decides whether a missing one is quoted).
fn env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The secret in environment variable `var` (named by `field`). Errors go
/// to the log, so one never quotes what may be the secret itself: a key
/// pasted where its variable's name belongs is no set variable, and reads
/// as no shell variable's name.
fn env_secret(var: &str, opts: &LoadOptions, field: &str) -> Result<String, String> {
    if let Some(v) = (opts.env)(var).filter(|v| !v.trim().is_empty()) {
        return Ok(v);
    }
    if env_name(var) {
        Err(format!("environment variable {var} is not set"))
    } else {
        Err(format!(
            "{field} names no environment variable that is set (give the variable's name, not the secret itself)"
        ))
    }
}

/// The secret in the file at `path` (named by `field`). A path that is not
/// there and names no directory may be the secret itself, pasted where its
/// file's path belongs: it is not quoted.
fn read_secret(path: &Path, field: &str) -> Result<String, String> {
    let k = std::fs::read_to_string(path).map_err(|e| {
        let bare = path.components().count() == 1 && !path.to_string_lossy().contains('.');
        if e.kind() == std::io::ErrorKind::NotFound && bare {
            format!(
                "cannot read {field}: no such file (give the file's path, not the secret itself)"
            )
        } else {
            format!("cannot read {field} {}: {e}", path.display())
        }
    })?;
    if k.trim().is_empty() {
        return Err(format!("{field} {} is empty", path.display()));
    }
    Ok(k)
}

/// 1-based line and column of byte `offset`.
/// `agents` or `tools` when the line at `offset` opens an array of tables
/// of that name (`[[agents]]`), the shape many TOML files use for lists,
/// which this file does not.
fn array_of_tables(text: &str, offset: usize) -> Option<&'static str> {
    let line = text.get(offset..)?.lines().next()?.trim_start();
    let name = line.strip_prefix("[[")?.split(']').next()?.trim();
    ["agents", "tools"].into_iter().find(|t| *t == name)
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> LoadOptions {
        LoadOptions {
            tool_delay: Duration::ZERO,
            env: Box::new(|k| (k == "MODEL_KEY").then(|| "sk-test".to_owned())),
        }
    }

    fn err(text: &str) -> String {
        match parse(text, Path::new("agents.toml"), &opts()) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    const GOOD: &str = r#"
default = "support"

[agents.support]
description = "Answers order questions."
instruction = "Be brief."
tools = ["lookup_order", "stock"]
max_tool_turns = 3
call_timeout = "20s"

[agents.support.model]
base_url = "http://127.0.0.1:11434/v1/"
model = "qwen2.5"
api_key_env = "MODEL_KEY"

[agents.support.sampling]
temperature = 0.1
seed = 7

[tools.stock]
description = "Checks stock."
url = "http://127.0.0.1:9/stock"
parameters = { type = "object", properties = { sku = { type = "string" } }, required = ["sku"] }
"#;

    #[test]
    fn a_good_file_declares_its_agents_and_default() {
        let f = parse(GOOD, Path::new("agents.toml"), &opts()).unwrap();
        assert_eq!(f.default.as_deref(), Some("support"));
        assert_eq!(
            f.agents
                .iter()
                .map(|a| a.name().to_owned())
                .collect::<Vec<_>>(),
            vec!["support"]
        );
    }

    #[test]
    fn a_syntax_error_names_file_line_and_reason() {
        let e = err(
            "[agents.a]\ndescription = \"x\"\nmodel = { base_url = \"http://x\", model = \"m\" \n",
        );
        assert!(e.starts_with("agents.toml:3:"), "{e}");
    }

    #[test]
    fn an_array_of_agents_or_tools_is_refused_with_the_shape_the_file_takes() {
        for table in ["agents", "tools"] {
            let e = err(&format!("default = \"a\"\n\n[[{table}]]\nname = \"a\"\n"));
            assert!(e.starts_with("agents.toml:3:"), "{e}");
            assert!(
                e.contains(&format!(
                    "(`[{table}.NAME]`), not an array of tables (`[[{table}]]`)"
                )),
                "{e}"
            );
        }
        // Another type error gets no such hint.
        let e = err("[agents.a]\ndescription = 5\n");
        assert!(!e.contains("array of tables"), "{e}");
    }

    #[test]
    fn an_agent_named_like_a_built_in_one_is_refused_on_its_line() {
        let e = err(&GOOD
            .replace("[agents.support]", "[agents.echo]")
            .replace("[agents.support.", "[agents.echo.")
            .replace("default = \"support\"", "default = \"echo\""));
        assert!(e.starts_with("agents.toml:4:"), "{e}");
        assert!(e.contains("built-in agent"), "{e}");
    }

    #[test]
    fn settings_a_model_server_would_refuse_on_every_run_are_refused_at_load() {
        let cases = [
            (
                GOOD.replace(
                    "parameters = { type = \"object\",",
                    "parameters = { type = \"string\",",
                ),
                "agents.toml:23:",
                "type \"object\"",
            ),
            (
                GOOD.replace(
                    "http://127.0.0.1:11434/v1/",
                    "http://user:pw@127.0.0.1:11434/v1/",
                ),
                "agents.toml:12:",
                "holds credentials",
            ),
            (
                GOOD.replace(
                    "max_tool_turns = 3",
                    "max_tool_turns = 3\nfirst_call = { tool_choice = \"lookup_order\" }",
                ),
                "agents.toml:4:",
                "not one of none, auto, required",
            ),
            (
                GOOD.replace(
                    "max_tool_turns = 3",
                    "max_tool_turns = 0\nfirst_call = { tool_choice = \"required\" }",
                ),
                "agents.toml:4:",
                "can never answer",
            ),
            (
                GOOD.replace(
                    "call_timeout = \"20s\"",
                    "call_timeout = \"10000000000000000000s\"",
                ),
                "agents.toml:9:",
                "at most 24h",
            ),
            (
                GOOD.replace(
                    "url = \"http://127.0.0.1:9/stock\"",
                    "url = \"http://127.0.0.1:9/stock\"\nmax_response_bytes = 1048576",
                ),
                "agents.toml:",
                "between 1 and 524288",
            ),
            // Sampling values out of range, on the value's line and column.
            (
                GOOD.replace("temperature = 0.1", "temperature = nan"),
                "agents.toml:17:15:",
                "sampling.temperature must be a number of 0 or more",
            ),
            (
                GOOD.replace("temperature = 0.1", "temperature = inf"),
                "agents.toml:17:15:",
                "sampling.temperature",
            ),
            (
                GOOD.replace("temperature = 0.1", "temperature = -0.5"),
                "agents.toml:17:15:",
                "sampling.temperature",
            ),
            (
                GOOD.replace("seed = 7", "top_p = 2"),
                "agents.toml:18:9:",
                "sampling.top_p must be a number from 0 to 1",
            ),
            (
                GOOD.replace("seed = 7", "top_p = -0.1"),
                "agents.toml:18:9:",
                "sampling.top_p",
            ),
            (
                GOOD.replace("seed = 7", "max_tokens = 0"),
                "agents.toml:18:14:",
                "sampling.max_tokens must be at least 1",
            ),
            (
                GOOD.replace("seed = 7", "max_completion_tokens = 0"),
                "agents.toml:18:25:",
                "sampling.max_completion_tokens must be at least 1",
            ),
            (
                GOOD.replace("seed = 7", "max_tokens = 9\nmax_completion_tokens = 9"),
                "agents.toml:19:25:",
                "not both",
            ),
            (
                GOOD.replace("seed = 7", "frequency_penalty = -inf"),
                "agents.toml:18:21:",
                "sampling.frequency_penalty must be a finite number",
            ),
            (
                GOOD.replace("seed = 7", "presence_penalty = -nan"),
                "agents.toml:18:20:",
                "sampling.presence_penalty",
            ),
        ];
        for (text, line, reason) in cases {
            let e = err(&text);
            assert!(e.starts_with(line) && e.contains(reason), "{e}\n{text}");
        }
        // A key that cannot go in a header (a second line appended).
        let opts = LoadOptions {
            tool_delay: Duration::ZERO,
            env: Box::new(|k| (k == "MODEL_KEY").then(|| "sk-old\nsk-new".to_owned())),
        };
        let e = match parse(GOOD, Path::new("agents.toml"), &opts) {
            Ok(_) => panic!("a key with a line break is refused"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.starts_with("agents.toml:14:") && e.contains("API key"),
            "{e}"
        );
    }

    /// Values at the ends of their ranges load, and so do values only some
    /// servers take (past OpenAI's ranges); max_completion_tokens is sent
    /// under its own name.
    #[test]
    fn sampling_values_in_range_load_and_max_completion_tokens_is_sent_as_such() {
        for settings in [
            "temperature = 0\ntop_p = 1\nmax_completion_tokens = 64\npresence_penalty = -2\nfrequency_penalty = 2",
            "temperature = 2.5\ntop_p = 0\nmax_tokens = 1\npresence_penalty = 3\nfrequency_penalty = -3",
        ] {
            let text = GOOD.replace("temperature = 0.1\nseed = 7", settings);
            parse(&text, Path::new("agents.toml"), &opts()).unwrap();
        }
        let doc: SamplingDoc =
            toml::from_str("temperature = 2\nmax_completion_tokens = 64").unwrap();
        let s = sampling("a", &doc, &|_, r| anyhow::anyhow!("{r}")).unwrap();
        let sent = serde_json::to_value(&s).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"temperature": 2.0, "max_completion_tokens": 64})
        );
    }

    #[test]
    fn a_base_url_query_goes_after_the_path_and_stays_out_of_logs() {
        let e = Endpoint::new("https://example.test/openai/v1/?api-version=2024-10-21");
        assert_eq!(
            e.chat_url(),
            "https://example.test/openai/v1/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(e.logged_base_url(), "https://example.test/openai/v1/");
        let plain = Endpoint::new("http://127.0.0.1:11434/v1/");
        assert_eq!(
            plain.chat_url(),
            "http://127.0.0.1:11434/v1/chat/completions"
        );
    }

    #[test]
    fn an_unknown_tool_is_refused_on_its_line() {
        let bad = GOOD.replace(r#""lookup_order", "stock""#, r#""lookup_order", "stok""#);
        let e = err(&bad);
        assert!(e.starts_with("agents.toml:7:"), "{e}");
        assert!(e.contains("unknown tool \"stok\""), "{e}");
    }

    #[test]
    fn a_header_value_may_be_read_from_an_environment_variable_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "from-file\n").unwrap();
        let text = format!(
            "h = {{ A = {{ env = \"MODEL_KEY\", prefix = \"Bearer \" }}, B = {{ file = {:?} }}, C = \"plain\" }}",
            path.display().to_string()
        );
        let doc: BTreeMap<String, BTreeMap<String, Spanned<HeaderDoc>>> =
            toml::from_str(&text).unwrap();
        let h = header_map(&doc["h"], &opts(), &|_, r| anyhow::anyhow!("{r}")).unwrap();
        assert_eq!(h["A"], "Bearer sk-test");
        assert_eq!(h["B"], "from-file");
        assert_eq!(h["C"], "plain");
        assert!(h["A"].is_sensitive(), "kept out of debug output");

        let bad = GOOD.replace(
            "api_key_env = \"MODEL_KEY\"",
            "headers = { X-Token = { env = \"NO_SUCH_VAR\" } }",
        );
        let e = err(&bad);
        assert!(e.starts_with("agents.toml:14:"), "{e}");
        assert!(e.contains("NO_SUCH_VAR is not set"), "{e}");
        let both = GOOD.replace(
            "api_key_env = \"MODEL_KEY\"",
            "headers = { X-Token = { env = \"MODEL_KEY\", file = \"/x\" } }",
        );
        assert!(err(&both).contains("give env or file"), "{}", err(&both));
    }

    #[test]
    fn a_missing_api_key_variable_is_refused_without_showing_any_key() {
        let bad = GOOD.replace("MODEL_KEY", "NO_SUCH_VAR");
        let e = err(&bad);
        assert!(e.starts_with("agents.toml:14:"), "{e}");
        assert!(e.contains("NO_SUCH_VAR is not set"), "{e}");
    }

    /// A key pasted where its variable's name or its file's path belongs
    /// is refused without quoting it: start-up errors reach the logs.
    #[test]
    fn a_key_written_where_its_source_belongs_is_not_quoted() {
        const PASTED: &str = "sk-proj-AbC123xyz";
        for (field, text) in [
            (
                "api_key_env",
                GOOD.replace("\"MODEL_KEY\"", &format!("\"{PASTED}\"")),
            ),
            (
                "api_key_file",
                GOOD.replace(
                    "api_key_env = \"MODEL_KEY\"",
                    &format!("api_key_file = \"{PASTED}\""),
                ),
            ),
            (
                "header",
                GOOD.replace(
                    "api_key_env = \"MODEL_KEY\"",
                    &format!("headers = {{ X-Token = {{ env = \"{PASTED}\" }} }}"),
                ),
            ),
            (
                "token_env",
                REMOTE.replace("\"MODEL_KEY\"", &format!("\"{PASTED}\"")),
            ),
        ] {
            let e = err(&text);
            assert!(e.starts_with("agents.toml:"), "{field}: {e}");
            assert!(!e.contains(PASTED), "{field}: {e}");
            assert!(e.contains("not the secret itself"), "{field}: {e}");
        }
        // A set variable is read whatever its name (Kubernetes and Docker
        // take dashes and dots).
        let dashed = GOOD.replace("\"MODEL_KEY\"", "\"MODEL-KEY.v2\"");
        let o = LoadOptions {
            env: Box::new(|v| (v == "MODEL-KEY.v2").then(|| "sk-test".to_owned())),
            ..opts()
        };
        assert!(parse(&dashed, Path::new("agents.toml"), &o).is_ok());
        // A path with a directory is quoted: it is no key.
        let e = err(&GOOD.replace(
            "api_key_env = \"MODEL_KEY\"",
            "api_key_file = \"/run/secrets/missing-key\"",
        ));
        assert!(e.contains("/run/secrets/missing-key"), "{e}");
    }

    #[test]
    fn unknown_fields_bad_durations_urls_and_schemas_are_refused() {
        assert!(err(&GOOD.replace("max_tool_turns", "max_turns")).contains("unknown field"));
        let e = err(&GOOD.replace("\"20s\"", "\"soon\""));
        assert!(e.starts_with("agents.toml:9:"), "{e}");
        let e = err(&GOOD.replace("http://127.0.0.1:9/stock", "ftp://x/stock"));
        assert!(e.contains("http://"), "{e}");
        let e = err(&GOOD.replace("type = \"object\"", "type = \"objekt\""));
        assert!(e.contains("parameters"), "{e}");
        let e = err(&GOOD.replace("default = \"support\"", "default = \"nobody\""));
        assert!(e.starts_with("agents.toml:2:"), "{e}");
    }

    const REMOTE: &str = r#"
[agents.orders]
kind = "remote_a2a"
description = "Delegates."
call_timeout = "30s"

[agents.orders.a2a]
card_url = "http://127.0.0.1:9"
agent = "order_helper"
token_env = "MODEL_KEY"
idle_timeout = "5s"
"#;

    #[test]
    fn a_remote_a2a_agent_is_declared_without_contacting_the_remote() {
        let f = parse(REMOTE, Path::new("agents.toml"), &opts()).unwrap();
        assert_eq!(f.agents[0].name(), "orders");
        assert_eq!(f.agents[0].description(), "Delegates.");
    }

    #[test]
    fn a_remote_a2a_agent_refuses_model_fields_inline_tokens_other_schemes_and_a_missing_ca_file() {
        let e = err(&REMOTE.replace("call_timeout", "max_tool_turns = 3\ncall_timeout"));
        assert!(
            e.starts_with("agents.toml:5:") && e.contains("max_tool_turns"),
            "{e}"
        );
        let e = err(&REMOTE.replace(
            "token_env = \"MODEL_KEY\"",
            "token = \"sk-secret-value-123\"",
        ));
        assert!(
            e.starts_with("agents.toml:10:") && !e.contains("sk-secret"),
            "{e}"
        );
        let e = err(&REMOTE.replace("http://127.0.0.1:9", "ftp://127.0.0.1:9"));
        assert!(e.contains("http:// or https://"), "{e}");
        let e = err(&REMOTE.replace("card_url", "ca_file = \"/nonexistent/ca.pem\"\ncard_url"));
        assert!(e.contains("a2a.ca_file: cannot read"), "{e}");
        let e = err(&REMOTE.replace("card_url", "jsonrpc_url = \"http://x/\"\ncard_url"));
        assert!(e.contains("not both"), "{e}");
        let e = err(&REMOTE.replace("kind = \"remote_a2a\"\n", ""));
        assert!(e.contains("needs kind = \"remote_a2a\""), "{e}");
    }

    #[test]
    fn line_and_column_are_one_based() {
        assert_eq!(line_col("ab\ncd", 0), (1, 1));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
    }
}
