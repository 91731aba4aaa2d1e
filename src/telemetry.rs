//! Logging, traces and metrics.
//!
//! Logs: human text on a terminal, JSON lines with `--log-format json`.
//! `RUST_LOG` (or `AGENTD_LOG`) filters; the default is `info`. A log line
//! written inside a call carries its trace id (the `trace_id` field of the
//! `grpc` span).
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
pub fn init(format: LogFormat) -> Telemetry {
    let mut builder = SdkTracerProvider::builder().with_resource(resource());
    if otlp_configured() {
        match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => builder = builder.with_batch_exporter(exporter),
            Err(e) => eprintln!("warning: OTLP trace export is off: {e}"),
        }
    }
    // Colours only for a person at a terminal: a log collector reading a
    // pipe or a file gets plain text (NO_COLOR turns them off anyway).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    install(format, std::io::stderr, builder.build(), ansi)
}

/// [`init`] with a chosen log writer and trace provider (tests use an
/// in-memory exporter). The first call in a process wins.
pub fn init_with<W>(format: LogFormat, writer: W, provider: SdkTracerProvider) -> Telemetry
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    install(format, writer, provider, false)
}

fn install<W>(format: LogFormat, writer: W, provider: SdkTracerProvider, ansi: bool) -> Telemetry
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let env = std::env::var("AGENTD_LOG")
        .ok()
        .and_then(|v| EnvFilter::try_new(v).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info,h2=warn,hyper=warn,tower=warn"));
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
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("agentd"))
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_filter(
            filter::Targets::new()
                .with_default(tracing::Level::INFO)
                .with_targets([
                    ("h2", tracing::Level::WARN),
                    ("hyper", tracing::Level::WARN),
                    ("tower", tracing::Level::WARN),
                ]),
        );
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(env))
        .with(otel)
        .try_init();
    Telemetry { provider }
}

fn resource() -> Resource {
    let builder = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_ok_and(|s| !s.is_empty()) {
        builder.build()
    } else {
        builder.with_service_name("agentd").build()
    }
}

/// Text-log fields without the OpenTelemetry attributes (`otel.*`, `rpc.*`,
/// `gen_ai.*`): those are for the trace backend, the line keeps the rest.
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
            write!(self.writer, "{sep}{value:?}")
        } else {
            write!(self.writer, "{sep}{name}={value:?}")
        };
    }
}
