//! The `agentd` binary: `serve`, and the client commands `session`, `run`,
//! `health`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use agentd::agent::{Agent, AgentRegistry, demo, synthetic};
use agentd::config::{Cli, Command, HealthArgs, RunArgs, ServeArgs, SessionCommand};
use agentd::pb;
use agentd::turn::Turns;

fn main() -> ExitCode {
    let cli = Cli::parse();
    agentd::telemetry::init(cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(*args).await,
            Command::Session(SessionCommand::Create { client, user }) => {
                let mut c = client.connect().await?;
                let s = c.create_session(&user).await.map_err(status_error)?;
                println!("{}", s.session_id);
                Ok(())
            }
            Command::Run(args) => run(args).await,
            Command::Health(args) => health(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    let agents: Vec<Arc<dyn Agent>> = vec![
        Arc::new(demo::OrderHelper::new(args.tool_delay)),
        Arc::new(synthetic::Echo),
        Arc::new(synthetic::Streamer),
    ];
    let registry = AgentRegistry::new(agents, &args.default_agent)?;
    let store = agentd::store::open(&args.store).await?;
    let turns = Turns::new(store, registry, args.turn_config());
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    tracing::info!(listen = %listener.local_addr()?, "agentd starting");
    agentd::server::run(listener, turns, args.server_options(), shutdown_signal()).await
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the server");
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => tracing::info!("SIGINT received"),
            _ = term.recv() => tracing::info!("SIGTERM received"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut c = args.client.connect().await?;
    let req = pb::RunRequest {
        user_id: args.user,
        session_id: args.session,
        text: args.text,
        request_id: args.request_id.unwrap_or_default(),
        agent: args.agent.unwrap_or_default(),
        ..Default::default()
    };
    let mut call = c.run(req, args.deadline).await.map_err(status_error)?;
    if !args.json {
        eprintln!("request_id {} ({})", call.request_id, call.mode);
    }
    loop {
        match call.events.message().await {
            Ok(Some(e)) => print_event(&e, args.json),
            Ok(None) => return Ok(()),
            Err(s) => return Err(status_error(s)),
        }
    }
}

fn print_event(e: &pb::AgentEvent, json: bool) {
    let kind = match e.kind() {
        pb::EventKind::ToolCall => "tool_call",
        pb::EventKind::ToolResult => "tool_result",
        pb::EventKind::PartialText => "partial_text",
        pb::EventKind::FinalAnswer => "final_answer",
        pb::EventKind::Unspecified => "unspecified",
    };
    if json {
        let payload: serde_json::Value = serde_json::from_str(&e.payload_json).unwrap_or(serde_json::Value::Null);
        let v = serde_json::json!({
            "seq": e.seq, "kind": kind, "author": e.author, "text": e.text, "is_final": e.is_final,
            "tool_name": e.tool_name, "tool_call_id": e.tool_call_id, "payload": payload,
        });
        println!("{v}");
    } else if e.tool_name.is_empty() {
        println!("[{}] {kind}: {}", e.seq, e.text);
    } else {
        println!("[{}] {kind} {} {}", e.seq, e.tool_name, e.payload_json);
    }
}

async fn health(args: HealthArgs) -> anyhow::Result<()> {
    let mut c = args.client.connect().await?;
    let status = tokio::time::timeout(Duration::from_secs(10), c.health(&args.service))
        .await
        .map_err(|_| anyhow::anyhow!("health check timed out"))?
        .map_err(status_error)?;
    println!("{}", status.as_str_name());
    if status == tonic_health::pb::health_check_response::ServingStatus::Serving {
        Ok(())
    } else {
        anyhow::bail!("not serving")
    }
}
