//! An agent backed by an OpenAI-compatible model: the tool loop.
//!
//! model → tool calls (run in parallel, at most [`MAX_TOOLS_IN_FLIGHT`] at
//! a time, each observing cancellation) → results back to the model → …
//! until a final answer or `max_tool_turns`. Each model call and each tool
//! call is bounded by the per-call timeout and by the run's deadline;
//! dropping the run's stream drops the HTTP request. The tool results a run
//! keeps in its conversation are bounded by [`MAX_TOOL_RESULT_BYTES`].

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use tokio::time::Instant;

use super::accumulate::{Finish, parse_arguments};
use super::client::{ChatClient, Step};
use super::wire::{
    ChatRequest, FunctionSpec, Message, Sampling, StreamOptions, ToolCall, ToolSpec,
};
use crate::agent::tools::{Tool, ToolOutcome};
use crate::agent::{Agent, AgentError, Event, EventStream, RunContext};

/// The most tool calls of one run that run at the same time. A model may
/// ask for up to [`super::accumulate::MAX_TOOL_CALLS`] in one answer; all
/// at once would be a burst on the HTTP tools' servers (and as many
/// responses held) that one run should not be able to cause. The rest wait
/// for a place, within their own timeouts.
pub const MAX_TOOLS_IN_FLIGHT: usize = 8;

/// The most bytes of tool results one run keeps in its conversation, which
/// is held whole and sent whole to the model on each of its calls (one
/// result may take up to 512 KiB, and an answer may make 128 calls, each
/// tool turn). Past it, the model gets an error text in place of the
/// result, telling it the budget is spent, so it can answer with what it
/// has; the TOOL_RESULT event shows the same.
pub const MAX_TOOL_RESULT_BYTES: usize = 4 << 20;

/// How the first model call of a turn differs from the rest.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FirstCall {
    /// `tool_choice` of the first call (e.g. `required`); later calls leave
    /// it to the server's default, so the model can answer.
    pub tool_choice: Option<String>,
    /// Text sent as a trailing assistant message on the first call, which
    /// servers that continue such a message by default (llama.cpp's
    /// llama-server) continue from. vLLM does only when asked
    /// (`continue_final_message`), which agentd does not send.
    pub prefill: Option<String>,
}

/// Everything one model-backed agent is.
pub struct ModelAgentConfig {
    pub name: String,
    pub description: String,
    /// The system prompt.
    pub instruction: String,
    pub model: String,
    pub client: ChatClient,
    pub sampling: Sampling,
    /// Model calls that may end in tool calls before the agent gives up.
    pub max_tool_turns: u32,
    /// Bound of each model call and each tool call.
    pub call_timeout: Duration,
    pub tools: Vec<Arc<dyn Tool>>,
    pub first_call: FirstCall,
}

pub struct ModelAgent {
    cfg: Arc<ModelAgentConfig>,
    specs: Arc<Vec<ToolSpec>>,
}

impl ModelAgent {
    pub fn new(cfg: ModelAgentConfig) -> Self {
        let specs = cfg
            .tools
            .iter()
            .map(|t| ToolSpec {
                kind: "function",
                function: FunctionSpec {
                    name: t.def().name.clone(),
                    description: t.def().description.clone(),
                    parameters: t.def().parameters.clone(),
                },
            })
            .collect();
        Self {
            cfg: Arc::new(cfg),
            specs: Arc::new(specs),
        }
    }
}

impl Agent for ModelAgent {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn description(&self) -> &str {
        &self.cfg.description
    }

    /// Before its first event a run only calls the model: tools run once
    /// a model call has ended, after the events that announce them.
    fn starts_before_claim(&self) -> bool {
        true
    }

    fn run(&self, ctx: RunContext, input: String) -> EventStream {
        let cfg = self.cfg.clone();
        let specs = self.specs.clone();
        Box::pin(async_stream::try_stream! {
            let mut messages = initial_messages(&cfg.instruction, &ctx, input);
            let mut turn: u32 = 0;
            // Everything the model said this turn: the answer is what its
            // partial events streamed, text before tool calls included
            // (agents.v1: the partials concatenated are the answer).
            let mut said = String::new();
            // Bytes of tool results kept in `messages` so far.
            let mut results_kept = 0usize;
            loop {
                let first = turn == 0;
                // The prefill goes on the end of the conversation for this
                // call only (it is taken off once the request is sent),
                // which is not copied for it.
                let prefill = cfg.first_call.prefill.as_ref().filter(|_| first);
                if let Some(p) = prefill {
                    messages.push(Message::Assistant { content: Some(p.clone()), tool_calls: Vec::new() });
                }
                let req = ChatRequest {
                    model: &cfg.model,
                    messages: &messages,
                    stream: true,
                    stream_options: StreamOptions { include_usage: true },
                    tools: &specs,
                    tool_choice: if first { cfg.first_call.tool_choice.as_deref() } else { None },
                    sampling: &cfg.sampling,
                };
                // The call's span: the request goes out inside it, so its
                // traceparent names this span. The steps that follow are not
                // polled inside it: entering and leaving a span costs every
                // layer a lookup, once per token, and nothing under a step
                // needs it current (its warnings carry the run's span).
                let span = crate::telemetry::trace::model_call_span("openai", "chat", &cfg.model);
                let mut bound = CallBound::new(bounded(ctx.deadline, cfg.call_timeout), &ctx, cfg.call_timeout);
                let id_prefix = format!("call_{}_{turn}", ctx.request_id);
                let start = tracing::Instrument::instrument(cfg.client.start(&req, &id_prefix), span.clone());
                let started = bound.run(start).await;
                if prefill.is_some() {
                    messages.pop();
                }
                let mut stream = failed(&span, started)?;
                let mut announced = 0usize;
                let completion = loop {
                    match failed(&span, bound.run(stream.next()).await)? {
                        Step::Text(t) => yield Event::partial(&cfg.name, t),
                        Step::ToolCall(c) => {
                            announced += 1;
                            yield call_event(&cfg.name, &c);
                        }
                        Step::Done(c) => break c,
                    }
                };
                drop(stream);
                if let Some(u) = completion.usage {
                    span.record("gen_ai.usage.input_tokens", u.prompt_tokens);
                    span.record("gen_ai.usage.output_tokens", u.completion_tokens);
                    tracing::debug!(agent = %cfg.name, turn, prompt_tokens = u.prompt_tokens, completion_tokens = u.completion_tokens, "model call done");
                }
                if completion.finish != Finish::ToolCalls {
                    match &completion.finish {
                        // A model that spends its whole budget before any
                        // text (a reasoning model thinking past
                        // max_tokens, say) has not answered: an empty
                        // answer would pass for the model's.
                        Finish::Length if completion.text.is_empty() => {
                            failed(&span, Err::<(), _>(AgentError::FailedPrecondition(
                                "the model reached its token limit before answering; raise max_tokens (or max_completion_tokens) in the agents file".into(),
                            )))?;
                        }
                        Finish::Length => {
                            tracing::warn!(agent = %cfg.name, "the model hit its token limit; the answer may be cut");
                        }
                        // A stop for another reason (a content filter, an
                        // aborted request) with no text is no answer: an
                        // empty one would pass for the model's. The reason
                        // is a short label (`reason_label`), not model text.
                        Finish::Other(reason) if completion.text.is_empty() => {
                            failed(&span, Err::<(), _>(AgentError::FailedPrecondition(format!(
                                "the model stopped: {reason}"
                            ))))?;
                        }
                        Finish::Other(reason) => {
                            tracing::warn!(agent = %cfg.name, reason = %reason, "the model stopped for another reason than the end of its answer");
                        }
                        _ => {}
                    }
                    said_more(&mut said, &completion.text)?;
                    yield Event::final_answer(&cfg.name, said);
                    break;
                }
                for c in &completion.tool_calls[announced..] {
                    yield call_event(&cfg.name, c);
                }
                turn += 1;
                if turn > cfg.max_tool_turns {
                    Err(AgentError::FailedPrecondition(format!(
                        "the agent used its {} tool turns without reaching an answer",
                        cfg.max_tool_turns
                    )))?;
                }
                let calls = completion.tool_calls;
                said_more(&mut said, &completion.text)?;
                messages.push(Message::Assistant {
                    content: Some(completion.text).filter(|t| !t.is_empty()),
                    tool_calls: calls.iter().map(replayable).collect(),
                });
                // Run the calls in parallel, at most MAX_TOOLS_IN_FLIGHT at
                // a time; report each as it finishes, and answer the model
                // in the order it asked.
                // (Collected first: a lazy map would be a closure over
                // borrowed calls in the stream's type, which the compiler
                // cannot prove Send for every lifetime.)
                let calls_run: Vec<_> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let cfg = cfg.clone();
                        let ctx = &ctx;
                        // The span starts when the call does, not while it
                        // waits for a place.
                        async move {
                            // Named for the tool only if it is one of the
                            // agent's: the name is model output.
                            let name = &c.function.name;
                            let span = if cfg.tools.iter().any(|t| t.def().name == *name) {
                                crate::telemetry::trace::tool_span(name, &c.id)
                            } else {
                                crate::telemetry::trace::unknown_tool_span(name, &c.id)
                            };
                            (i, tracing::Instrument::instrument(run_tool(&cfg, ctx, c), span).await)
                        }
                    })
                    .collect();
                let mut running = futures::stream::iter(calls_run).buffer_unordered(MAX_TOOLS_IN_FLIGHT);
                let mut results: Vec<Option<String>> = vec![None; calls.len()];
                while let Some((i, outcome)) = running.next().await {
                    let c = &calls[i];
                    let (outcome, content) = within_budget(outcome, &mut results_kept);
                    yield Event::tool_result(&c.function.name, &c.id, outcome.summary, &outcome.result);
                    results[i] = Some(content);
                }
                drop(running);
                if ctx.cancel.is_cancelled() {
                    return;
                }
                for (c, content) in calls.iter().zip(results) {
                    let content = content.expect("every call reported");
                    messages.push(Message::Tool { tool_call_id: c.id.clone(), content });
                }
            }
        })
    }
}

/// System prompt, the session's earlier turns, then the new message.
fn initial_messages(instruction: &str, ctx: &RunContext, input: String) -> Vec<Message> {
    let mut m = Vec::with_capacity(2 + ctx.history.len() * 2);
    if !instruction.trim().is_empty() {
        m.push(Message::System {
            content: instruction.to_owned(),
        });
    }
    for t in ctx.history.iter().filter(|t| !t.answer.is_empty()) {
        m.push(Message::User {
            content: t.user_text.clone(),
        });
        m.push(Message::Assistant {
            content: Some(t.answer.clone()),
            tool_calls: Vec::new(),
        });
    }
    m.push(Message::User { content: input });
    m
}

fn call_event(agent: &str, c: &ToolCall) -> Event {
    // An argument string that is not JSON is still shown, as a JSON string.
    let args = parse_arguments(&c.function.arguments)
        .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
    Event::tool_call(agent, &c.function.name, &c.id, &args)
}

async fn run_tool(cfg: &ModelAgentConfig, ctx: &RunContext, c: &ToolCall) -> ToolOutcome {
    let Some(tool) = cfg.tools.iter().find(|t| t.def().name == c.function.name) else {
        return ToolOutcome::error(format!("there is no tool named {:?}", c.function.name));
    };
    let args = match parse_arguments(&c.function.arguments) {
        Ok(a @ Value::Object(_)) => a,
        Ok(_) => return ToolOutcome::error("the arguments are not a JSON object"),
        Err(_) => return ToolOutcome::error("the arguments are not valid JSON"),
    };
    if let Err(e) = tool.def().check(&args) {
        return ToolOutcome::error(e);
    }
    let deadline = bounded(ctx.deadline, cfg.call_timeout);
    tokio::select! {
        biased;
        _ = ctx.cancel.cancelled() => ToolOutcome::error("cancelled"),
        r = tokio::time::timeout_at(deadline, tool.call(args, &ctx.cancel)) => {
            r.unwrap_or_else(|_| ToolOutcome::error(format!("the tool did not answer within {}", humantime::format_duration(cfg.call_timeout))))
        }
    }
}

/// The earlier of the run's deadline and `timeout` from now.
fn bounded(deadline: Instant, timeout: Duration) -> Instant {
    deadline.min(Instant::now() + timeout)
}

/// The bounds of one model call: its deadline and the run's cancellation.
/// Both are registered once for the whole call, not once per streamed
/// token (a timer entry and a cancellation waiter each time), since a
/// call awaits one step per token.
struct CallBound {
    cancelled: std::pin::Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
}

impl CallBound {
    fn new(deadline: Instant, ctx: &RunContext, timeout: Duration) -> Self {
        Self {
            cancelled: Box::pin(ctx.cancel.clone().cancelled_owned()),
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            timeout,
        }
    }

    /// Awaits `f` (a step of the call) until the deadline or cancellation,
    /// flattening its result. A cancelled run ends with Unavailable here,
    /// but the turn has already ended it by then.
    async fn run<T>(
        &mut self,
        f: impl Future<Output = Result<T, AgentError>>,
    ) -> Result<T, AgentError> {
        tokio::select! {
            biased;
            _ = self.cancelled.as_mut() => Err(AgentError::Unavailable { message: "the run was cancelled".into(), retry_after: None }),
            r = f => r,
            _ = self.deadline.as_mut() => Err(AgentError::Unavailable {
                message: format!("the model did not finish within {}; retry later", humantime::format_duration(self.timeout)),
                retry_after: None,
            }),
        }
    }
}

/// `r`, with a failure marked on the model call's span.
fn failed<T>(span: &tracing::Span, r: Result<T, AgentError>) -> Result<T, AgentError> {
    if r.is_err() {
        span.record("otel.status_code", "error");
    }
    r
}

/// `call` as it goes back to the model in the conversation: arguments that
/// are not a JSON object (cut by the token limit, a trailing comma, or
/// JSON of another kind: `[1]`, `42`, an object encoded twice as a string)
/// are sent as `{}`, since servers parse the arguments of every call they
/// are sent into an object (vLLM, Ollama, llama-server) and would refuse
/// the request; the tool result that follows tells the model what was
/// wrong (the tool did not run: see `run_tool`).
fn replayable(call: &ToolCall) -> ToolCall {
    let mut call = call.clone();
    if !matches!(
        serde_json::from_str::<serde_json::Value>(&call.function.arguments),
        Ok(Value::Object(_))
    ) {
        call.function.arguments = "{}".into();
    }
    call
}

/// A tool's outcome as the model gets it (text as it came, anything else
/// as JSON), within the run's [`MAX_TOOL_RESULT_BYTES`]: past it, an error
/// in its place. `kept` counts the bytes kept so far.
fn within_budget(outcome: ToolOutcome, kept: &mut usize) -> (ToolOutcome, String) {
    let content = |r: &Value| match r {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    let text = content(&outcome.result);
    if *kept + text.len() <= MAX_TOOL_RESULT_BYTES {
        *kept += text.len();
        return (outcome, text);
    }
    let spent = ToolOutcome::error(format!(
        "this run's budget of {MAX_TOOL_RESULT_BYTES} bytes of tool results is spent ({} more bytes were left out); answer with the results you have",
        text.len()
    ));
    let text = content(&spent.result);
    *kept += text.len();
    (spent, text)
}

/// Adds one model call's text to the answer, which holds at most
/// [`super::accumulate::MAX_TEXT_BYTES`] across the turn's calls, as one
/// call's text does: it is sent whole as the final answer's event, stored,
/// and given back to every later turn as history.
fn said_more(said: &mut String, text: &str) -> Result<(), AgentError> {
    let limit = super::accumulate::MAX_TEXT_BYTES;
    if said.len() + text.len() > limit {
        return Err(AgentError::FailedPrecondition(format!(
            "the agent's answer passed agentd's limit of {limit} bytes of text across its model calls; bound it (max_tokens in the agent's sampling, or max_tool_turns)"
        )));
    }
    said.push_str(text);
    Ok(())
}
