//! The `conformance` agent (behind `--a2a-conformance`): scripted answers
//! chosen by the incoming messageId's prefix, so A2A conformance suites can
//! exercise every path (direct messages, files, data, INPUT_REQUIRED,
//! REJECTED, streaming, chunking, resubscription). Any other message goes to
//! our agents as usual.

use std::time::Duration;

use a2a::{
    A2AError, Artifact, Message, Part, Role, StreamResponse, Task, TaskArtifactUpdateEvent,
    TaskState, TaskStatus, TaskStatusUpdateEvent,
};
use a2a_server::{AgentExecutor, ExecutorContext};
use futures::stream::BoxStream;

/// What one scripted task does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    CompleteWithMessage,
    ArtifactText,
    ArtifactFile,
    ArtifactFileUrl,
    ArtifactData,
    MessageResponse,
    InputRequired,
    Reject,
    /// WORKING, one text artifact, COMPLETED.
    StreamText(&'static str),
    StreamFile,
    /// COMPLETED only.
    StreamCompletedOnly,
    StreamChunked,
    /// WORKING, a wait, COMPLETED.
    Resubscribe,
}

/// Prefixes, longest first where one extends another.
const SCRIPTS: &[(&str, Script)] = &[
    ("tck-complete-task", Script::CompleteWithMessage),
    ("tck-artifact-text", Script::ArtifactText),
    ("tck-artifact-file-url", Script::ArtifactFileUrl),
    ("tck-artifact-file", Script::ArtifactFile),
    ("tck-artifact-data", Script::ArtifactData),
    ("tck-message-response", Script::MessageResponse),
    ("tck-input-required", Script::InputRequired),
    ("tck-reject-task", Script::Reject),
    (
        "tck-stream-001",
        Script::StreamText("Stream hello from TCK"),
    ),
    ("tck-stream-002", Script::StreamCompletedOnly),
    (
        "tck-stream-003",
        Script::StreamText("Stream task lifecycle"),
    ),
    (
        "tck-stream-ordering-001",
        Script::StreamText("Ordered output"),
    ),
    (
        "tck-stream-artifact-text",
        Script::StreamText("Streamed text content"),
    ),
    ("tck-stream-artifact-file", Script::StreamFile),
    ("tck-stream-artifact-chunked", Script::StreamChunked),
    ("test-resubscribe-message-id", Script::Resubscribe),
];

fn script_for(message_id: &str) -> Option<Script> {
    SCRIPTS
        .iter()
        .find(|(p, _)| message_id.starts_with(p))
        .map(|(_, s)| *s)
}

/// Runs scripted tasks; hands everything else to `inner`.
pub struct ConformanceExecutor<E> {
    inner: E,
    /// How long `test-resubscribe-message-id` stays WORKING.
    resubscribe_wait: Duration,
}

impl<E> ConformanceExecutor<E> {
    pub fn new(inner: E, resubscribe_wait: Duration) -> Self {
        Self {
            inner,
            resubscribe_wait,
        }
    }
}

struct Ids {
    task_id: String,
    context_id: String,
}

impl Ids {
    fn status(&self, state: TaskState, text: Option<&str>) -> StreamResponse {
        StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            status: TaskStatus {
                state,
                message: text.map(|t| self.message(t)),
                timestamp: Some(chrono::Utc::now()),
            },
            metadata: None,
        })
    }

    fn message(&self, text: &str) -> Message {
        Message {
            context_id: Some(self.context_id.clone()),
            task_id: Some(self.task_id.clone()),
            ..Message::new(Role::Agent, vec![Part::text(text)])
        }
    }

    fn artifact(&self, id: &str, part: Part, append: bool, last: bool) -> StreamResponse {
        StreamResponse::ArtifactUpdate(TaskArtifactUpdateEvent {
            task_id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            artifact: Artifact {
                artifact_id: id.into(),
                name: Some(id.into()),
                description: None,
                parts: vec![part],
                metadata: None,
                extensions: None,
            },
            append: Some(append),
            last_chunk: Some(last),
            metadata: None,
        })
    }

    fn task(&self, history: Vec<Message>) -> StreamResponse {
        StreamResponse::Task(Task {
            id: self.task_id.clone(),
            context_id: self.context_id.clone(),
            status: TaskStatus {
                state: TaskState::Submitted,
                message: None,
                timestamp: Some(chrono::Utc::now()),
            },
            artifacts: None,
            history: Some(history),
            metadata: None,
        })
    }
}

fn file_part() -> Part {
    Part::raw(b"Generated file content".to_vec())
        .with_filename("output.txt")
        .with_media_type("text/plain")
}

fn events(script: Script, ids: &Ids) -> Vec<StreamResponse> {
    use Script::*;
    let text = |t: &str| Part::text(t);
    match script {
        CompleteWithMessage => vec![ids.status(TaskState::Completed, Some("Hello from TCK"))],
        ArtifactText => vec![
            ids.artifact("text", text("Generated text content"), false, true),
            ids.status(TaskState::Completed, None),
        ],
        ArtifactFile => vec![
            ids.artifact("file", file_part(), false, true),
            ids.status(TaskState::Completed, None),
        ],
        ArtifactFileUrl => vec![
            ids.artifact(
                "file",
                Part::url("https://example.com/output.txt")
                    .with_filename("output.txt")
                    .with_media_type("text/plain"),
                false,
                true,
            ),
            ids.status(TaskState::Completed, None),
        ],
        ArtifactData => vec![
            ids.artifact(
                "data",
                Part::data(serde_json::json!({"key": "value", "count": 42})),
                false,
                true,
            ),
            ids.status(TaskState::Completed, None),
        ],
        MessageResponse => vec![StreamResponse::Message(
            ids.message("Direct message response"),
        )],
        InputRequired => vec![ids.status(TaskState::InputRequired, Some("input required"))],
        Reject => vec![ids.status(TaskState::Rejected, Some("rejected"))],
        StreamText(t) => vec![
            ids.status(TaskState::Working, None),
            ids.artifact("stream", text(t), false, true),
            ids.status(TaskState::Completed, None),
        ],
        StreamFile => vec![
            ids.status(TaskState::Working, None),
            ids.artifact("file", file_part(), false, true),
            ids.status(TaskState::Completed, None),
        ],
        StreamCompletedOnly => vec![ids.status(TaskState::Completed, None)],
        StreamChunked => vec![
            ids.status(TaskState::Working, None),
            ids.artifact("chunked", text("chunk-1 "), false, false),
            ids.artifact("chunked", text("chunk-2"), true, true),
            ids.status(TaskState::Completed, None),
        ],
        Resubscribe => vec![ids.status(TaskState::Working, None)],
    }
}

impl<E: AgentExecutor> AgentExecutor for ConformanceExecutor<E> {
    fn execute(
        &self,
        ctx: ExecutorContext,
    ) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        let Some(script) = ctx.message.as_ref().and_then(|m| script_for(&m.message_id)) else {
            return self.inner.execute(ctx);
        };
        let ids = Ids {
            task_id: ctx.task_id.clone(),
            context_id: ctx.context_id.clone(),
        };
        // A task's stream begins with the task: a new one SUBMITTED, a
        // waiting one the reply continues as it continues it.
        let first = match (&ctx.stored_task, &ctx.message) {
            _ if script == Script::MessageResponse => None,
            (Some(t), Some(m)) if t.status.state != TaskState::Submitted => {
                Some(StreamResponse::Task(super::executor::continued_task(t, m)))
            }
            _ => Some(ids.task(ctx.message.iter().cloned().collect())),
        };
        let wait = self.resubscribe_wait;
        Box::pin(async_stream::stream! {
            if let Some(t) = first {
                yield Ok(t);
            }
            for e in events(script, &ids) {
                yield Ok(e);
            }
            if script == Script::Resubscribe {
                tokio::time::sleep(wait).await;
                yield Ok(ids.status(TaskState::Completed, None));
            }
        })
    }

    fn cancel(&self, ctx: ExecutorContext) -> BoxStream<'static, Result<StreamResponse, A2AError>> {
        self.inner.cancel(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longer_prefixes_win_over_the_ones_they_extend() {
        assert_eq!(
            script_for("tck-artifact-file-url-7"),
            Some(Script::ArtifactFileUrl)
        );
        assert_eq!(
            script_for("tck-artifact-file-7"),
            Some(Script::ArtifactFile)
        );
        assert_eq!(
            script_for("tck-stream-artifact-chunked-1"),
            Some(Script::StreamChunked)
        );
        assert_eq!(script_for("hello"), None);
    }
}
