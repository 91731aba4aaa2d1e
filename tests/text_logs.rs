//! The text log format (`--log-format text`, the default) as agentd installs
//! it: what a caller sent cannot end a line and forge the next one, nor send
//! the reader's terminal a control sequence. Its own process: the JSON
//! format's tests are in tests/tracing.rs (a process has one log format).

mod log_capture;
mod openai_support;

use std::sync::OnceLock;

use agentd::config::LogFormat;
use log_capture::{Logs, line_with};
use opentelemetry_sdk::trace::SdkTracerProvider;

/// The process's text logs, in a buffer.
fn logs() -> &'static Logs {
    static L: OnceLock<Logs> = OnceLock::new();
    L.get_or_init(|| Logs::install(LogFormat::Text, SdkTracerProvider::builder().build()))
}

/// A run's span has no tracing parent (the call's span would be held open
/// by it): the run's lines carry the trace id themselves.
#[tokio::test]
async fn a_runs_lines_carry_the_trace_id() {
    let logs = logs();
    let mut d = openai_support::Agentd::start("").await;
    let session = d.session("alice").await;
    let mut req = tonic::Request::new(agentd::pb::RunRequest {
        user_id: "alice".into(),
        session_id: session.clone(),
        text: "Where is order 1187?".into(),
        request_id: "r1".into(),
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    let mut stream = d.client.raw().run(req).await.unwrap().into_inner();
    while stream.message().await.unwrap().is_some() {}
    d.stop().await;

    let text = logs.text();
    let finished = line_with(&text, &["run finished", &session]);
    assert!(
        finished.contains("run{") && finished.contains("trace_id=4bf92f3577b34da6a3ce929d0e0e4736"),
        "{finished}"
    );
}

/// A refused Run's ids are logged as they came (bounded, not checked: they
/// are what was refused), as `%` fields, whose text the formatter writes
/// unquoted: a newline in one started a line of the caller's choosing.
#[tokio::test]
async fn a_callers_ids_cannot_forge_a_log_line_or_reach_the_terminal() {
    let logs = logs();
    let injected = "2025-06-01T12:00:00.000000Z  INFO agentd::turn::pump: run finished code=Ok";
    let session = openai_support::refused_run(format!("x\n{injected}\x1b[31m")).await;

    let text = logs.text();
    let refused = line_with(&text, &["run refused", &session]);
    assert!(
        !text.lines().any(|l| l.starts_with(injected)),
        "a line was forged:\n{text}"
    );
    assert!(!text.contains('\x1b'), "a raw ESC was logged:\n{text}");
    assert!(
        refused.contains(&format!("request_id=x\\n{injected}\\u{{1b}}[31m")),
        "the id is on its line, escaped: {refused}"
    );
}
