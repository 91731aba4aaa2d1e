//! OTLP export from the real binary: with OTEL_EXPORTER_OTLP_ENDPOINT set,
//! the spans of a run reach a collector (here a tiny in-test OTLP/gRPC
//! receiver on 127.0.0.1).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

mod secured;
mod serve_cmd;

const BIN: &str = env!("CARGO_BIN_EXE_agentd");

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(req.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    /// (service.name, span name) of every span received.
    fn spans(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for req in self.0.lock().unwrap().iter() {
            for rs in &req.resource_spans {
                let service = rs
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                    .map(|v| match v {
                        Value::StringValue(s) => s.clone(),
                        other => format!("{other:?}"),
                    })
                    .unwrap_or_default();
                for ss in &rs.scope_spans {
                    for span in &ss.spans {
                        out.push((service.clone(), span.name.clone()));
                    }
                }
            }
        }
        out
    }
}

/// A collector on 127.0.0.1, over TLS with `tls`'s certificate if given;
/// its endpoint URL (https names the host `localhost`, which the
/// certificate is for).
async fn start_collector(collector: &Collector, tls: Option<&secured::Pem>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let mut server = tonic::transport::Server::builder();
    if let Some(pem) = tls {
        server = server
            .tls_config(
                tonic::transport::ServerTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(&pem.cert, &pem.key)),
            )
            .unwrap();
    }
    tokio::spawn(
        server
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(incoming),
    );
    match tls {
        Some(_) => format!("https://localhost:{port}"),
        None => format!("http://127.0.0.1:{port}"),
    }
}

/// Starts `agentd serve` with `env` (OTEL_* unset otherwise), creates a
/// session and runs one turn through the CLI, then stops the server with
/// SIGTERM (shutdown flushes the spans not yet exported). Its exit status
/// and its log lines.
async fn one_run_exported(
    env: Vec<(&'static str, String)>,
) -> (std::process::ExitStatus, Vec<String>) {
    tokio::task::spawn_blocking(move || {
        let mut cmd = serve_cmd::agentd_serve("off", "127.0.0.1:0", &["--drain-delay", "0s"]);
        for var in [
            "OTEL_SERVICE_NAME",
            "OTEL_RESOURCE_ATTRIBUTES",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        ] {
            cmd.env_remove(var);
        }
        cmd.envs(env);
        let mut child = KillOnDrop(
            cmd.stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut lines = BufReader::new(child.0.stderr.take().unwrap()).lines();
        let mut log = Vec::new();
        let addr = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("server exited before listening: {log:?}"))
                .unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            log.push(line);
            if v["message"] == "agentd starting" {
                break v["listen"].as_str().unwrap().to_owned();
            }
        };
        let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
        let server = format!("http://{addr}");
        let cli = |args: &[&str]| {
            Command::new(BIN)
                .args(args)
                .env("AGENTD_SERVER", &server)
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .output()
                .unwrap()
        };
        let out = cli(&["session", "create", "--user", "alice"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let session = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        let out = cli(&[
            "run",
            "--user",
            "alice",
            "--session",
            &session,
            "Where is order 1187?",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        Command::new("kill")
            .args(["-TERM", &child.0.id().to_string()])
            .status()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < until, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        log.extend(rest.join().unwrap());
        (status, log)
    })
    .await
    .unwrap()
}

/// The spans of a run as `service` names them.
fn assert_spans_of_a_run(collector: &Collector, service: &str) {
    let spans = collector.spans();
    for name in [
        "agents.v1.AgentService/Run",
        "run",
        "execute_tool lookup_order",
        "agents.v1.AgentService/CreateSession",
    ] {
        assert!(
            spans.iter().any(|(s, n)| s == service && n == name),
            "no {name} span from {service} in {spans:?}"
        );
    }
}

#[tokio::test]
async fn with_an_otlp_endpoint_the_spans_of_a_run_reach_the_collector() {
    let collector = Collector::default();
    let endpoint = start_collector(&collector, None).await;
    let (status, log) = one_run_exported(vec![("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)]).await;
    assert!(status.success(), "server exited with {status}: {log:?}");
    assert_spans_of_a_run(&collector, "agentd");
}

/// An `https` endpoint is dialled over TLS, trusting the CA in
/// OTEL_EXPORTER_OTLP_CERTIFICATE (on a host with no CA bundle of its own,
/// as in a minimal image); and a service name given in
/// OTEL_RESOURCE_ATTRIBUTES is the one the spans carry.
#[tokio::test]
async fn an_https_endpoint_with_a_private_ca_gets_the_spans_under_the_configured_name() {
    let ca = secured::Ca::new("otlp test ca");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let (no_bundle, no_certs) = (dir.path().join("none.pem"), dir.path().join("none"));
    std::fs::write(&no_bundle, "").unwrap();
    std::fs::create_dir(&no_certs).unwrap();
    let collector = Collector::default();
    let endpoint = start_collector(&collector, Some(&ca.server())).await;
    let (status, log) = one_run_exported(vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            ca_file.display().to_string(),
        ),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=billing-agents,deployment.environment=test".into(),
        ),
        ("SSL_CERT_FILE", no_bundle.display().to_string()),
        ("SSL_CERT_DIR", no_certs.display().to_string()),
    ])
    .await;
    assert!(status.success(), "server exited with {status}: {log:?}");
    assert_spans_of_a_run(&collector, "billing-agents");
}

/// Spans that cannot be exported are dropped, and the log says so (once).
#[tokio::test]
async fn an_unreachable_collector_is_logged() {
    // A port that refuses connections: bound, not listening, and held
    // for the test, so that no other test's server takes it meanwhile.
    let held = tokio::net::TcpSocket::new_v4().unwrap();
    held.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = held.local_addr().unwrap().port();
    let (status, log) = one_run_exported(vec![(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        format!("http://127.0.0.1:{port}"),
    )])
    .await;
    assert!(status.success(), "server exited with {status}: {log:?}");
    let failed = log
        .iter()
        .filter(|l| l.contains("OTLP trace export failed"))
        .count();
    assert_eq!(failed, 1, "{log:#?}");
}

/// The server, killed if the test fails before stopping it.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
