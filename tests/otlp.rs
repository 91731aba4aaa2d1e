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

#[tokio::test]
async fn with_an_otlp_endpoint_the_spans_of_a_run_reach_the_collector() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(incoming),
    );

    let result = tokio::task::spawn_blocking(move || {
        let mut child = KillOnDrop(
            serve_cmd::agentd_serve("off", "127.0.0.1:0", &["--drain-delay", "0s"])
                .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
                .env_remove("OTEL_SERVICE_NAME")
                .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut lines = BufReader::new(child.0.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("server exited before listening")
                .unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if v["message"] == "agentd starting" {
                break v["listen"].as_str().unwrap().to_owned();
            }
        };
        std::thread::spawn(move || for _ in lines {});
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

        // SIGTERM: shutdown flushes the spans not yet exported.
        Command::new("kill")
            .args(["-TERM", &child.0.id().to_string()])
            .status()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.0.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < until, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
    assert!(result.success(), "server exited with {result}");

    let spans = collector.spans();
    for name in [
        "agents.v1.AgentService/Run",
        "run",
        "execute_tool lookup_order",
        "agents.v1.AgentService/CreateSession",
    ] {
        assert!(
            spans
                .iter()
                .any(|(service, n)| service == "agentd" && n == name),
            "no {name} span from agentd in {spans:?}"
        );
    }
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
