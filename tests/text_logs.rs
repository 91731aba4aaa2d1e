//! The text log format (`--log-format text`, the default) as agentd installs
//! it: what a caller sent cannot end a line and forge the next one, nor send
//! the reader's terminal a control sequence. Its own process: the JSON
//! format's tests are in tests/tracing.rs (a process has one log format).

mod openai_support;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use agentd::config::LogFormat;
use opentelemetry_sdk::trace::SdkTracerProvider;

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The process's text logs, in a buffer.
fn logs() -> &'static Logs {
    static L: OnceLock<Logs> = OnceLock::new();
    L.get_or_init(|| {
        let logs = Logs::default();
        let writer = logs.clone();
        // Kept for the life of the test process.
        std::mem::forget(agentd::telemetry::init_with(
            LogFormat::Text,
            move || writer.clone(),
            SdkTracerProvider::builder().build(),
        ));
        logs
    })
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
    let finished = text
        .lines()
        .find(|l| l.contains("run finished") && l.contains(&session))
        .unwrap_or_else(|| panic!("no 'run finished' line in:\n{text}"));
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
    let mut d = openai_support::Agentd::start("").await;
    let session = d.session("alice").await;
    let injected = "2025-06-01T12:00:00.000000Z  INFO agentd::turn::pump: run finished code=Ok";
    let req = agentd::pb::RunRequest {
        user_id: "alice".into(),
        session_id: session.clone(),
        text: "hello".into(),
        request_id: format!("x\n{injected}\x1b[31m"),
        ..Default::default()
    };
    let status = d.client.raw().run(req).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    d.stop().await;

    let text = logs.text();
    let refused = text
        .lines()
        .find(|l| l.contains("run refused") && l.contains(&session))
        .unwrap_or_else(|| panic!("no 'run refused' line in:\n{text}"));
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
