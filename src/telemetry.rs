//! Logging, traces and metrics.
//!
//! Logs: human text on a terminal, JSON lines with `--log-format json`.
//! `AGENTD_LOG` (or, when it is unset, `RUST_LOG`) filters; the default is
//! `info`. A filter that does not parse stops start-up. A log line
//! written inside a call carries its trace id (the `trace_id` field of the
//! `grpc` span, or of the `run` span, which is no child of it:
//! [`trace::run_span`]).
//!
//! Traces: every span also goes to OpenTelemetry ([`trace`]); spans are
//! exported over OTLP/gRPC only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Without it trace ids are
//! still made and propagated, so logs and callers can correlate.
//!
//! Metrics: [`metrics`], served by [`admin`].

pub mod admin;
pub mod metrics;
pub mod rpc;
pub mod trace;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, filter};

use crate::config::LogFormat;

/// Keeps the trace pipeline alive; dropping it flushes the spans not yet
/// exported. Drop it before the async runtime.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("warning: flushing traces at exit failed: {e}");
        }
    }
}

/// Whether OTLP export is configured by the standard environment variables.
pub fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()))
}

/// Installs logging and tracing for the process, logs to stderr. Call
/// inside the tokio runtime (the OTLP exporter's channel lives there).
/// Fails, before anything is installed, on a log filter that does not
/// parse ([`log_directives`]).
pub fn init(format: LogFormat) -> anyhow::Result<Telemetry> {
    let directives = log_directives()?;
    let mut builder = SdkTracerProvider::builder().with_resource(resource());
    if otlp_configured() {
        match otlp_exporter() {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => eprintln!("warning: OTLP trace export is off: {e}"),
        }
    }
    // Colours only for a person at a terminal: a log collector reading a
    // pipe or a file gets plain text (NO_COLOR turns them off anyway).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    Ok(install(
        format,
        &directives,
        std::io::stderr,
        builder.build(),
        ansi,
    ))
}

/// The first of `vars` that is set and not empty.
fn first_env(vars: &[&str]) -> Option<String> {
    vars.iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
}

/// The OTLP/gRPC span exporter the standard variables configure, its
/// failures logged ([`LoggedExporter`]).
fn otlp_exporter() -> anyhow::Result<LoggedExporter> {
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
    if let Some(tls) = otlp_tls()? {
        use opentelemetry_otlp::WithTonicConfig as _;
        builder = builder.with_tls_config(tls);
    }
    Ok(LoggedExporter {
        inner: builder.build()?,
        failing: std::sync::atomic::AtomicBool::new(false),
    })
}

/// TLS for an `https://` OTLP endpoint: the system's trust roots, or the
/// CA in `OTEL_EXPORTER_OTLP_CERTIFICATE` (a collector with a private CA)
/// and the client certificate and key in `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`
/// and `OTEL_EXPORTER_OTLP_CLIENT_KEY` (a collector that asks for one), each
/// also in its `_TRACES_` form. Without it an `https` endpoint was dialled
/// in plain text and every export failed.
fn otlp_tls() -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let endpoint = first_env(&[
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ])
    .unwrap_or_default();
    if !endpoint
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
    {
        return Ok(None);
    }
    let read = |what: &str, traces: &str, all: &str| -> anyhow::Result<Option<Vec<u8>>> {
        let Some(path) = first_env(&[traces, all]) else {
            return Ok(None);
        };
        std::fs::read(&path)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("cannot read the {what} in {path}: {e}"))
    };
    // The CA given is the one trusted, as OTLP exporters take it (an image
    // without a system CA bundle can still reach a private collector).
    let mut tls = match read(
        "collector's CA certificate",
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
    )? {
        Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
        None => ClientTlsConfig::new().with_enabled_roots(),
    };
    let cert = read(
        "client certificate",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    )?;
    let key = read(
        "client key",
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    )?;
    match (cert, key) {
        (Some(cert), Some(key)) => tls = tls.identity(Identity::from_pem(cert, key)),
        (None, None) => {}
        _ => anyhow::bail!(
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY go together"
        ),
    }
    Ok(Some(tls))
}

/// The OTLP exporter, saying when its exports fail: the SDK drops a batch
/// it cannot export without a word. Logged once when exports start to
/// fail, and once when they work again, not for every batch.
#[derive(Debug)]
struct LoggedExporter {
    inner: opentelemetry_otlp::SpanExporter,
    failing: std::sync::atomic::AtomicBool,
}

impl opentelemetry_sdk::trace::SpanExporter for LoggedExporter {
    async fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        use std::sync::atomic::Ordering::SeqCst;
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Err(e) if !self.failing.swap(true, SeqCst) => {
                tracing::warn!(spans, error = %e, "OTLP trace export failed; spans are dropped until the collector takes them again");
            }
            Ok(()) if self.failing.swap(false, SeqCst) => {
                tracing::info!("OTLP trace export works again");
            }
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The log filter: `AGENTD_LOG`, else `RUST_LOG`, else the default. The
/// variable in effect must parse: the error names it and gives the
/// parser's reason (a filter ignored silently left the logs at the default).
pub fn log_directives() -> anyhow::Result<String> {
    for var in ["AGENTD_LOG", EnvFilter::DEFAULT_ENV] {
        let Ok(v) = std::env::var(var) else {
            continue;
        };
        let directives = without_empty_directives(&v);
        if directives.is_empty() {
            // Set but empty (a ConfigMap's `AGENTD_LOG: ""`): the next
            // variable, or the default.
            continue;
        }
        return match EnvFilter::try_new(&directives) {
            Ok(_) => Ok(directives),
            Err(e) => Err(anyhow::anyhow!(
                "{var}={v:?} is not a log filter: {e} (e.g. info or info,agentd=debug)"
            )),
        };
    }
    Ok(DEFAULT_LOG.to_owned())
}

/// `directives` without empty ones (`info,`, `info,,agentd=debug`) and
/// blanks around each: the parser of [`filter::Targets`] reads an empty
/// directive as every target at TRACE.
fn without_empty_directives(directives: &str) -> String {
    directives
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect::<Vec<_>>()
        .join(",")
}

/// [`init`] with a chosen log writer and trace provider (tests use an
/// in-memory exporter). The first call in a process wins. Panics on a log
/// filter that does not parse.
pub fn init_with<W>(format: LogFormat, writer: W, provider: SdkTracerProvider) -> Telemetry
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let directives = log_directives().unwrap_or_else(|e| panic!("{e:#}"));
    install(format, &directives, writer, provider, false)
}

fn install<W>(
    format: LogFormat,
    directives: &str,
    writer: W,
    provider: SdkTracerProvider,
    ansi: bool,
) -> Telemetry
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi);
    let fmt = match format {
        LogFormat::Text => fmt.fmt_fields(TextFields).boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
    };
    // Traces have their own filter: quiet logs must not cut traces short.
    // The layer's work on every poll of an instrumented future (timing the
    // span's busy and idle time; making its context current, which nothing
    // here reads: propagation asks the span itself) is switched off: a run
    // polls its futures once per event.
    // Nor does a span carry the thread that opened it (a run's futures move
    // between the runtime's threads, and the name was a string allocated
    // for every span) or the source line of its macro: every span stays in
    // memory as long as its run: 10,000 Runs waiting on their model held
    // 7 MB of these.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("agentd"))
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_threads(false)
        .with_location(false);
    // Even with both switched off, the layer looks its span up and stamps
    // an end time on every exit; a span's end is its close (the layer ends
    // a span there when no exit stamped it).
    let otel = NoEnterExit(
        // The default log filter's levels, whatever the logs are set to.
        otel.with_filter(
            DEFAULT_LOG
                .parse::<filter::Targets>()
                .expect("the default log filter is a list of targets and levels"),
        ),
    );
    let fmt = match log_filter(directives) {
        // Neither the text nor the JSON format does anything on span entry
        // or exit, and a Targets filter has no span scopes to track.
        LogFilter::Targets(t) => NoEnterExit(fmt.with_filter(t)).boxed(),
        LogFilter::Env(e) => fmt.with_filter(e).boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .with(
            KeepCaller.with_filter(
                filter::filter_fn(|m| m.is_span() && m.fields().field("caller").is_some())
                    // The spans with a caller are at info; without a hint
                    // the filter would lift the whole subscriber's to trace.
                    .with_max_level_hint(tracing::level_filters::LevelFilter::INFO),
            ),
        )
        .try_init();
    Telemetry { provider }
}

/// A layer whose span entries and exits are skipped: everything else goes
/// to the layer inside. A run's span is entered and left on every poll of
/// its task, once per event or token streamed, and the registry keeps the
/// current span itself; the layers here need neither call (the log
/// formats record no span timings; OpenTelemetry's context activation and
/// busy/idle tracking are off). `EnvFilter` does need them, for its
/// span-scoped directives, so a layer filtered by one is not wrapped.
struct NoEnterExit<L>(L);

impl<S, L> Layer<S> for NoEnterExit<L>
where
    S: tracing::Subscriber,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.0.on_register_dispatch(subscriber)
    }
    fn on_layer(&mut self, subscriber: &mut S) {
        self.0.on_layer(subscriber)
    }
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        self.0.register_callsite(metadata)
    }
    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.enabled(metadata, ctx)
    }
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.0.max_level_hint()
    }
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_new_span(attrs, id, ctx)
    }
    fn on_record(
        &self,
        span: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_record(span, values, ctx)
    }
    fn on_follows_from(
        &self,
        span: &tracing::span::Id,
        follows: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_follows_from(span, follows, ctx)
    }
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.event_enabled(event, ctx)
    }
    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_event(event, ctx)
    }
    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_close(id, ctx)
    }
    fn on_id_change(
        &self,
        old: &tracing::span::Id,
        new: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_id_change(old, new, ctx)
    }
    // The per-layer filter machinery and OpenTelemetry's span context
    // lookups find the inner layers through this.
    unsafe fn downcast_raw(&self, id: std::any::TypeId) -> Option<*const ()> {
        unsafe { self.0.downcast_raw(id) }
    }
}

/// Keeps the `caller` a span records (the authentication layer names the
/// caller on the call's span once it is let in) in that span's extensions,
/// where [`caller_of`] finds it: a run's span is no child of its call's
/// ([`trace::run_span`]), and copies it for its log lines. Sees only spans
/// with a `caller` field (its filter).
struct KeepCaller;

/// The caller a span recorded ([`KeepCaller`]).
struct CallerName(String);

impl<S> Layer<S> for KeepCaller
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut caller = CallerField(None);
        values.record(&mut caller);
        if let (Some(name), Some(span)) = (caller.0, ctx.span(id)) {
            span.extensions_mut().replace(CallerName(name));
        }
    }
}

struct CallerField(Option<String>);

impl Visit for CallerField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "caller" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "caller" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

/// The caller recorded on `span` or the nearest span above it that has one
/// ([`KeepCaller`]); `None` outside an authenticated call, or when the
/// telemetry was not installed here ([`init`]).
pub(crate) fn caller_of(span: &tracing::Span) -> Option<String> {
    use tracing_subscriber::registry::LookupSpan;
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<tracing_subscriber::Registry>()?;
        registry
            .span(id)?
            .scope()
            .find_map(|s| s.extensions().get::<CallerName>().map(|c| c.0.clone()))
    })
    .flatten()
}

/// The log filter when neither `AGENTD_LOG` nor `RUST_LOG` is set, and the
/// traces' filter always.
const DEFAULT_LOG: &str = "info,h2=warn,hyper=warn,tower=warn";

// Made once, at start-up: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum LogFilter {
    Targets(filter::Targets),
    Env(EnvFilter),
}

/// The log filter for `directives`: a [`filter::Targets`] when they only
/// name targets and levels (the usual case), an [`EnvFilter`] when they
/// select by span or field. Both read `target=level` the same way, but an
/// `EnvFilter` also works on every entry to and exit from a span (a lock
/// and a map lookup, to track span-scoped directives), and a run's span is
/// entered for every event it streams.
fn log_filter(directives: &str) -> LogFilter {
    if !directives.contains(['[', '{'])
        && let Ok(t) = directives.parse::<filter::Targets>()
    {
        return LogFilter::Targets(t);
    }
    LogFilter::Env(EnvFilter::new(directives))
}

/// The process's resource, from the standard variables; `service.name` is
/// "agentd" unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` names
/// it (the SDK's own default, `unknown_service`, says nothing).
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    if named {
        detected
    } else {
        Resource::builder().with_service_name("agentd").build()
    }
}

/// Text-log fields without the OpenTelemetry attributes (`otel.*`, `rpc.*`,
/// `gen_ai.*`): those are for the trace backend, the line keeps the rest.
///
/// Every value is written through [`Escaping`]: a `%` field (and the
/// message) is written as its `Display` text, unquoted, so a caller's id
/// logged as it came (a refused Run's, [`crate::grpc`]) could otherwise
/// end the line and forge the next one, or drive the reader's terminal.
/// tracing-subscriber's own formatter escapes only ANSI sequences, and only
/// in the message. The JSON format needs none of this: serde_json escapes
/// every control character in a string.
struct TextFields;

impl<'w> FormatFields<'w> for TextFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut v = TextVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct TextVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl Visit for TextVisitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        let name = field.name();
        if self.result.is_err()
            || name.starts_with("otel.")
            || name.starts_with("rpc.")
            || name.starts_with("gen_ai.")
        {
            return;
        }
        let sep = if std::mem::take(&mut self.first) {
            ""
        } else {
            " "
        };
        self.result = if name == "message" {
            write!(self.writer, "{sep}")
                .and_then(|()| write!(Escaping(&mut self.writer), "{value:?}"))
        } else {
            write!(self.writer, "{sep}{name}=")
                .and_then(|()| write!(Escaping(&mut self.writer), "{value:?}"))
        };
    }
}

/// Writes text with its control characters escaped as Rust writes them in a
/// string literal (`\n`, `\r`, `\t`, `\u{1b}`): C0, DEL and C1, and the
/// Unicode line separators and bidirectional controls (text a viewer shows
/// on a line of its own, or reordered). A log line stays one line, and
/// nothing a caller sent reaches a terminal as a control sequence. Text
/// already escaped (a string field's `Debug`) has none left, so it passes
/// unchanged.
struct Escaping<W>(W);

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

impl<W: std::fmt::Write> std::fmt::Write for Escaping<W> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let mut rest = s;
        while let Some(i) = rest.find(needs_escape) {
            self.0.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().expect("found at i");
            write!(self.0, "{}", c.escape_debug())?;
            rest = &rest[i + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
}

/// `s` with its control characters escaped ([`Escaping`]): for text from
/// outside (a model's output) that becomes a span attribute.
pub(crate) fn escape_control(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    let _ = Escaping(&mut out).write_str(s);
    out
}

#[cfg(test)]
mod tests {
    use super::{LogFilter, log_filter};
    use tracing::Level;

    #[test]
    fn target_and_level_directives_get_the_light_filter_with_the_same_meaning() {
        let LogFilter::Targets(t) = log_filter(super::DEFAULT_LOG) else {
            panic!("the default filter should be a Targets filter");
        };
        assert!(t.would_enable("agentd::turn::pump", &Level::INFO));
        assert!(!t.would_enable("agentd::turn::pump", &Level::DEBUG));
        assert!(!t.would_enable("h2::codec", &Level::INFO));
        assert!(t.would_enable("h2::codec", &Level::WARN));
        let LogFilter::Targets(t) = log_filter("agentd=debug") else {
            panic!("a target=level list should be a Targets filter");
        };
        assert!(t.would_enable("agentd::store", &Level::DEBUG));
        // As with EnvFilter: a target no directive names logs nothing.
        assert!(!t.would_enable("sqlx::query", &Level::ERROR));
    }

    #[test]
    fn empty_directives_are_dropped_not_read_as_trace_for_everything() {
        for d in ["info,", ",info", "info,,", " info , "] {
            let LogFilter::Targets(t) = log_filter(&super::without_empty_directives(d)) else {
                panic!("{d:?} should be a Targets filter");
            };
            assert!(!t.would_enable("h2::codec", &Level::TRACE), "{d:?}");
            assert!(t.would_enable("h2::codec", &Level::INFO), "{d:?}");
        }
        assert_eq!(super::without_empty_directives(" , "), "");
    }

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        let forged = "r1\n2025-06-01T12:00:00Z  INFO run finished\x1b[31m\u{202e}é\u{85}";
        assert_eq!(
            super::escape_control(forged),
            "r1\\n2025-06-01T12:00:00Z  INFO run finished\\u{1b}[31m\\u{202e}é\\u{85}"
        );
        // A string's Debug has escaped them already: unchanged.
        let debug = format!("{forged:?}");
        assert_eq!(super::escape_control(&debug), debug);
    }

    #[test]
    fn span_and_field_directives_keep_the_env_filter() {
        assert!(matches!(
            log_filter("info,agentd[run]=debug"),
            LogFilter::Env(_)
        ));
        assert!(matches!(
            log_filter("agentd[{request_id=q1}]=trace"),
            LogFilter::Env(_)
        ));
    }
}
