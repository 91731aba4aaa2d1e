//! Log lines kept in memory, for tests of what agentd logs: the writer of
//! the process's telemetry ([`Logs::install`]) or of a subscriber set on
//! one thread ([`Logs::capture`]).
#![allow(dead_code)]

use std::io::Write;
use std::sync::{Arc, Mutex};

use agentd::config::LogFormat;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// The bytes logged so far; clones share them.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

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
    /// Sets up the process's telemetry as `agentd serve` does, in `format`
    /// and with `provider`'s spans, writing its logs here; kept for the
    /// life of the test process (a process has one).
    pub fn install(format: LogFormat, provider: SdkTracerProvider) -> Self {
        let logs = Self::default();
        let writer = logs.clone();
        std::mem::forget(agentd::telemetry::init_with(
            format,
            move || writer.clone(),
            provider,
        ));
        logs
    }

    /// Captures the logs (JSON) at info and above of everything this thread
    /// runs (on a current-thread runtime: the test, and the server it
    /// starts) for as long as the guard lives.
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let logs = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || logs.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// All logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The lines (JSON) logged so far, from the `from`th on.
    pub fn lines_from(&self, from: usize) -> Vec<serde_json::Value> {
        self.text()
            .lines()
            .skip(from)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// The first line of `logs` that contains each of `parts`.
pub fn line_with<'a>(logs: &'a str, parts: &[&str]) -> &'a str {
    logs.lines()
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .unwrap_or_else(|| panic!("no line with {parts:?} in:\n{logs}"))
}
