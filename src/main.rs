//! The `agentd` binary: `serve`, and the client commands `session`, `run`,
//! `health`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use agentd::agent::{Agent, AgentRegistry, demo, synthetic};
use agentd::client::AgentClient;
use agentd::config::{
    A2aArgs, AttachArgs, CancelArgs, Cli, Command, HealthArgs, OnDisconnectArg, RunArgs, ServeArgs,
    SessionCommand,
};
use agentd::pb;
use agentd::turn::Turns;

/// Every event of a run is a few small allocations (its strings, the wire
/// copy, the boxes on the channels, the batch its writer stores): glibc's
/// malloc spent a third of the server's time on them under load, mimalloc
/// a fraction of that (see BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long a stopping agentd waits for its session store to close (part
/// of the shutdown arithmetic deploy/validate.py checks).
const STORE_CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// `println!`, except that a reader that went away (`agentd … | head`)
/// ends the output quietly instead of a panic; any other failure to write is
/// the command's error. For bodies that return `anyhow::Result`.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        match writeln!(std::io::stdout(), $($arg)*) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(e) => return Err(anyhow::anyhow!("cannot write to stdout: {e}")),
            Ok(()) => {}
        }
    }};
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Inside the runtime: the OTLP exporter's channel lives there. Dropped
    // (flushing spans) before the runtime. A log filter that does not parse
    // stops every command here.
    let _telemetry = {
        let _rt = rt.enter();
        match agentd::telemetry::init(cli.log_format) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Serve(args) => serve(*args).await,
            Command::Session(SessionCommand::Create {
                client,
                user,
                request_id,
            }) => {
                let mut c = client.connect_within(SESSION_DEADLINE).await?;
                let s = match request_id {
                    Some(key) => c.create_session_keyed(&user, &key).await,
                    None => c.create_session(&user).await,
                }
                .map_err(status_error)?;
                out!("{}", s.session_id);
                Ok(())
            }
            Command::Session(SessionCommand::Get {
                client,
                user,
                session,
                text,
            }) => {
                let c = client.connect().await?;
                // Every turn: the pages one after another.
                let mut s = pb::SessionInfo::default();
                let mut token = String::new();
                loop {
                    let req = pb::GetSessionRequest {
                        user_id: user.clone(),
                        session_id: session.clone(),
                        turn_page_size: 0,
                        turn_page_token: token,
                        include_text: text,
                    };
                    let page = c
                        .raw()
                        .get_session(with_timeout(&c, req))
                        .await
                        .map_err(status_error)?
                        .into_inner();
                    let mut turns = std::mem::take(&mut s.turns);
                    turns.extend(page.turns.iter().cloned());
                    s = pb::SessionInfo { turns, ..page };
                    token = std::mem::take(&mut s.next_turn_page_token);
                    if token.is_empty() {
                        break;
                    }
                }
                out!("{}", session_json(&s, text));
                Ok(())
            }
            Command::Session(SessionCommand::List { client, user }) => {
                list_sessions(&client, user).await
            }
            Command::Session(SessionCommand::Delete {
                client,
                user,
                session,
            }) => {
                let c = client.connect().await?;
                let req = pb::DeleteSessionRequest {
                    user_id: user,
                    session_id: session,
                };
                c.raw()
                    .delete_session(with_timeout(&c, req))
                    .await
                    .map_err(status_error)?;
                Ok(())
            }
            Command::Attach(args) => attach(args).await,
            Command::Cancel(args) => cancel(args).await,
            Command::Run(args) => run(args).await,
            Command::Health(args) => health(args).await,
            Command::Bench(args) => agentd::bench::run(*args).await,
            Command::A2a(args) => a2a_call(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            match cli.log_format {
                // One JSON line like every other, so a log pipeline keeps
                // the line that explains why the process stopped.
                agentd::config::LogFormat::Json => tracing::error!("{e:#}"),
                agentd::config::LogFormat::Text => eprintln!("error: {e:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    // SIGHUP reloads the TLS and token files once the server serves (see
    // agentd::auth::reload). Before that (the store opening, migrations
    // that can take minutes) it must not stop the process, as its default
    // action would: tokio's handler, once installed, stays for the
    // process's life, and a SIGHUP it takes now is ignored.
    #[cfg(unix)]
    if let Err(e) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        tracing::warn!(error = %e, "cannot handle SIGHUP: it would stop the server");
    }
    let open_file_limit = raise_open_file_limit(&args);
    let mut agents: Vec<Arc<dyn Agent>> = vec![
        Arc::new(demo::OrderHelper::new(args.tool_delay)),
        Arc::new(synthetic::Echo),
    ];
    if args.stream_agent {
        agents.push(Arc::new(synthetic::Streamer));
    }
    let mut default = None;
    if let Some(path) = &args.agents {
        let opts = agentd::agent::file::LoadOptions {
            tool_delay: args.tool_delay,
            ..Default::default()
        };
        let file = agentd::agent::file::load(path, &opts)?;
        agents.extend(file.agents);
        default = file.default;
    }
    let default = args
        .default_agent
        .clone()
        .or(default)
        .unwrap_or_else(|| demo::NAME.to_owned());
    if default == "stream" && !agents.iter().any(|a| a.name() == "stream") {
        anyhow::bail!("default agent \"stream\" is served only with --stream-agent");
    }
    let registry = AgentRegistry::new(agents, &default)?;
    let store = agentd::store::open_bounded(
        &args.store,
        (!args.store_timeout.is_zero()).then_some(args.store_timeout),
    )
    .await?;
    let turn_config = args.turn_config();
    let replica_id = turn_config.replica_id.clone();
    let turns = Turns::new(store.clone(), registry, turn_config);
    let mut opts = args.server_options();
    opts.security = args.security()?;
    let listener = agentd::server::bind(args.listen, "--listen")?;
    let admin = spawn_admin(&args, opts.readiness.clone()).await?;
    let grpc_addr = listener.local_addr()?;
    let a2a_http = match args.a2a_listen.0 {
        Some(addr) => {
            let l = agentd::server::bind(addr, "--a2a-listen")?;
            let advertised = agentd::a2a::advertised(
                grpc_addr,
                l.local_addr()?,
                args.a2a_advertise_host.as_deref(),
                opts.security.tls.is_some(),
                args.a2a_advertise_url.as_deref(),
            );
            Some(agentd::server::A2aHttp {
                listener: l,
                advertised,
            })
        }
        None => None,
    };
    let a2a_listen = match &a2a_http {
        Some(h) => h.listener.local_addr()?.to_string(),
        None => "off".to_owned(),
    };
    if a2a_http.is_some() && opts.security.tls.is_some() {
        // The A2A HTTP face has no TLS of its own: behind TLS on the gRPC
        // port, it is the one plaintext way in (bearer tokens included).
        tracing::warn!(
            a2a_listen = %a2a_listen,
            "the A2A HTTP port serves plaintext while the gRPC port serves TLS; put it behind a TLS-terminating proxy, or turn it off with --a2a-listen off"
        );
    }
    // Served, but insecurely: one line each, before the start-up line.
    for warning in args.insecure_settings() {
        tracing::warn!("{warning}");
    }
    // What an incident asks first: which build, which store, which replica,
    // and the durations that decide how it stops.
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        listen = %grpc_addr,
        a2a_listen = %a2a_listen,
        tls = opts.security.tls.is_some(),
        auth = opts.security.auth.is_some(),
        store = store_kind(&args.store),
        store_url = %agentd::store::redact(&args.store),
        replica_id = %replica_id,
        drain_delay = %humantime::format_duration(args.drain_delay),
        shutdown_grace = %humantime::format_duration(args.shutdown_grace),
        max_run_duration = %humantime::format_duration(args.max_run_duration),
        open_file_limit,
        "agentd starting"
    );
    let result =
        agentd::server::run_with_a2a(listener, a2a_http, turns.clone(), opts, async move {
            shutdown_signal().await;
            // A second signal during the drain cuts the runs still in
            // flight (UNAVAILABLE, recorded) instead of waiting out the
            // grace: an operator who means it now.
            tokio::spawn(async move {
                shutdown_signal().await;
                tracing::warn!(
                    runs = turns.runs_in_flight(),
                    followers = turns.followers_in_flight(),
                    "second signal: cutting the runs still in flight"
                );
                // New Runs are refused (UNAVAILABLE, retryable elsewhere)
                // instead of started only to be cut and recorded.
                turns.begin_drain();
                turns.cut_all();
            });
        })
        .await;
    // Every run has ended (or been cut): the store's connections close
    // cleanly, SQLite's WAL copied into its file.
    if tokio::time::timeout(STORE_CLOSE_TIMEOUT, store.close())
        .await
        .is_err()
    {
        tracing::warn!(timeout = ?STORE_CLOSE_TIMEOUT, "the session store did not close in time; stopping without it");
    } else {
        tracing::info!("session store closed");
    }
    if let Some((stop, task)) = admin {
        let _ = stop.send(());
        let _ = task.await;
    }
    result
}

/// File descriptors a server holds besides its ports' connections: the
/// runtime's, the listeners, the admin port's connections (128 at most),
/// connections to models and tools, log files.
const SPARE_FDS: u64 = 128;
/// The session store's connections and files: PostgreSQL's pools hold up
/// to 17 connections (statements, claimers, committers, the listener),
/// SQLite a writer and readers, each with its WAL files.
const STORE_FDS: u64 = 32;

/// Raises the soft open-file limit (RLIMIT_NOFILE) to the hard one: many
/// systems start a process at a soft 1024, far short of `--max-connections`
/// on each port, and the hard limit is what an operator set for this
/// process. Warns once when what the ports may hold (each port
/// `--max-connections`, plus [`SPARE_FDS`] and [`STORE_FDS`]) does not fit
/// in the limit that results: past it accepts fail (retried every 50 ms,
/// with a warning), so new connections wait in the listen queue while the
/// ones held are served. The limit (`None`: unknown), for the start-up line.
fn raise_open_file_limit(args: &ServeArgs) -> Option<u64> {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            tracing::warn!(error = %e, "could not raise the soft open-file limit (RLIMIT_NOFILE) to the hard one");
            rlimit::getrlimit(rlimit::Resource::NOFILE)
                .ok()
                .map(|(soft, _)| soft)?
        }
    };
    // gRPC, and A2A HTTP unless it is off.
    let ports: u64 = if args.a2a_listen.0.is_some() { 2 } else { 1 };
    let needed = ports
        .saturating_mul(args.max_connections as u64)
        .saturating_add(SPARE_FDS + STORE_FDS);
    if limit < needed {
        tracing::warn!(
            open_file_limit = limit,
            needed,
            max_connections = args.max_connections,
            "the open-file limit (RLIMIT_NOFILE, raised to the hard limit) is below what the ports may hold (--max-connections each, plus {} for the rest): past it new connections wait until others close; raise the hard limit (ulimit -Hn, systemd's LimitNOFILE, the container runtime's nofile) or lower --max-connections",
            SPARE_FDS + STORE_FDS
        );
    }
    Some(limit)
}

/// The kind of store `--store` names (its scheme, checked at start-up).
fn store_kind(url: &str) -> &'static str {
    match url.split_once(':').map(|(scheme, _)| scheme) {
        Some("sqlite") => "sqlite",
        Some("postgres" | "postgresql") => "postgres",
        Some("memory") => "memory",
        _ => "unknown",
    }
}

/// Starts the admin HTTP port (/metrics, /healthz, /readyz) unless it is off.
async fn spawn_admin(
    args: &ServeArgs,
    readiness: agentd::telemetry::admin::Readiness,
) -> anyhow::Result<
    Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )>,
> {
    let Some(addr) = args.admin_listen.0 else {
        return Ok(None);
    };
    let listener = agentd::server::bind(addr, "--admin-listen")?;
    tracing::info!(admin = %listener.local_addr()?, "admin HTTP port: /metrics /healthz /readyz");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(e) = agentd::telemetry::admin::serve(listener, readiness, shutdown).await {
            tracing::error!(error = %format!("{e:#}"), "admin HTTP port stopped");
        }
    });
    Ok(Some((stop, task)))
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
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
        on_disconnect: match args.on_disconnect {
            OnDisconnectArg::Cancel => pb::OnDisconnect::Cancel,
            OnDisconnectArg::Continue => pb::OnDisconnect::Continue,
        } as i32,
    };
    let mut call = c.run(req, args.deadline).await.map_err(status_error)?;
    // On stderr with --json too: the id a dropped stream is attached to by.
    eprintln!("request_id {} ({})", call.request_id, call.mode);
    loop {
        match call.events.message().await {
            Ok(Some(e)) => {
                if let Err(e) = print_event(&e, args.json) {
                    return unwritable(e);
                }
            }
            Ok(None) => return Ok(()),
            Err(s) => return Err(status_error(s)),
        }
    }
}

/// How long the CLI's `session` commands wait for an answer.
const SESSION_DEADLINE: Duration = Duration::from_secs(10);

fn with_timeout<T>(c: &AgentClient, msg: T) -> tonic::Request<T> {
    c.request(msg, SESSION_DEADLINE)
}

fn turn_state(t: &pb::TurnInfo) -> String {
    t.state()
        .as_str_name()
        .trim_start_matches("TURN_STATE_")
        .to_lowercase()
}

/// A turn as `session get` prints it; with `text`, its question and final
/// answer too.
fn turn_json(t: &pb::TurnInfo, text: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "request_id": t.request_id,
        "state": turn_state(t),
        "status_code": t.status_code.map(|c| format!("{:?}", tonic::Code::from(c))),
        "status_message": t.status_message, "agent": t.agent, "owner": t.owner,
        "created_unix_micros": t.created_unix_micros, "updated_unix_micros": t.updated_unix_micros,
    });
    if text {
        v["user_text"] = t.user_text.clone().into();
        v["answer"] = t.answer.clone().into();
        v["answer_payload_json"] = t.answer_payload_json.clone().into();
    }
    v
}

fn session_json(s: &pb::SessionInfo, text: bool) -> serde_json::Value {
    let turns: Vec<serde_json::Value> = s.turns.iter().map(|t| turn_json(t, text)).collect();
    serde_json::json!({
        "session_id": s.session_id, "user_id": s.user_id,
        "created_unix_micros": s.created_unix_micros, "updated_unix_micros": s.updated_unix_micros, "turns": turns,
    })
}

async fn list_sessions(client: &agentd::config::ClientArgs, user: String) -> anyhow::Result<()> {
    let client = client.connect().await?;
    let mut c = client.raw();
    let mut page_token = String::new();
    loop {
        let req = pb::ListSessionsRequest {
            user_id: user.clone(),
            page_size: 0,
            page_token,
        };
        let page = c
            .list_sessions(with_timeout(&client, req))
            .await
            .map_err(status_error)?
            .into_inner();
        for s in &page.sessions {
            let v = session_json(s, false);
            out!(
                "{}",
                serde_json::json!({ "session_id": v["session_id"], "user_id": v["user_id"],
                "created_unix_micros": v["created_unix_micros"], "updated_unix_micros": v["updated_unix_micros"] })
            );
        }
        if page.next_page_token.is_empty() {
            return Ok(());
        }
        page_token = page.next_page_token;
    }
}

async fn attach(args: AttachArgs) -> anyhow::Result<()> {
    let client = args.turn.client.connect().await?;
    let mut c = client.raw();
    let msg = pb::AttachRequest {
        user_id: args.turn.user,
        session_id: args.turn.session,
        request_id: args.turn.request_id,
        after_seq: args.after_seq,
    };
    let req = client.request(msg, args.deadline);
    let mut events = c.attach(req).await.map_err(status_error)?.into_inner();
    loop {
        match events.message().await {
            Ok(Some(e)) => {
                if let Err(e) = print_event(&e, args.json) {
                    return unwritable(e);
                }
            }
            Ok(None) => return Ok(()),
            Err(s) => return Err(status_error(s)),
        }
    }
}

/// CancelTurn, and the turn's state after it: `REQUEST_ID STATE CODE[:
/// MESSAGE]` (or, with --json, the turn as `session get` shows it, and
/// `cancelled_now`). A turn that had ended is said so on stderr.
async fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let t = &args.turn;
    let mut c = t.client.connect_within(SESSION_DEADLINE).await?;
    let r = c
        .cancel_turn(&t.user, &t.session, &t.request_id)
        .await
        .map_err(status_error)?;
    let t = r.turn.unwrap_or_default();
    if args.json {
        let mut v = turn_json(&t, false);
        v["cancelled_now"] = r.cancelled_now.into();
        out!("{v}");
    } else {
        let code = t
            .status_code
            .map(|c| format!("{:?}", tonic::Code::from(c)))
            .unwrap_or_default();
        match t.status_message.as_str() {
            "" => out!("{} {} {code}", t.request_id, turn_state(&t)),
            m => out!("{} {} {code}: {m}", t.request_id, turn_state(&t)),
        }
    }
    if !r.cancelled_now {
        eprintln!("the turn had ended already; nothing was changed");
    }
    Ok(())
}

/// Output that cannot be written: a closed pipe (`| head`) ends the command
/// quietly, the call dropped as at Ctrl-C; another error is reported.
fn unwritable(e: std::io::Error) -> anyhow::Result<()> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(anyhow::anyhow!("cannot write the events to stdout: {e}"))
    }
}

fn print_event(e: &pb::AgentEvent, json: bool) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let kind = match e.kind() {
        pb::EventKind::ToolCall => "tool_call",
        pb::EventKind::ToolResult => "tool_result",
        pb::EventKind::PartialText => "partial_text",
        pb::EventKind::FinalAnswer => "final_answer",
        pb::EventKind::Unspecified => "unspecified",
    };
    if json {
        let payload: serde_json::Value =
            serde_json::from_str(&e.payload_json).unwrap_or(serde_json::Value::Null);
        let v = serde_json::json!({
            "seq": e.seq, "kind": kind, "author": e.author, "text": e.text, "is_final": e.is_final,
            "tool_name": e.tool_name, "tool_call_id": e.tool_call_id, "payload": payload,
        });
        writeln!(out, "{v}")
    } else if e.tool_name.is_empty() {
        writeln!(out, "[{}] {kind}: {}", e.seq, e.text)
    } else {
        writeln!(out, "[{}] {kind} {} {}", e.seq, e.tool_name, e.payload_json)
    }
}

async fn health(args: HealthArgs) -> anyhow::Result<()> {
    let mut c = args.client.connect().await?;
    let status = tokio::time::timeout(Duration::from_secs(10), c.health(&args.service))
        .await
        .map_err(|_| anyhow::anyhow!("health check timed out"))?
        .map_err(status_error)?;
    out!("{}", status.as_str_name());
    if status == tonic_health::pb::health_check_response::ServingStatus::Serving {
        Ok(())
    } else {
        anyhow::bail!("not serving")
    }
}

async fn a2a_call(args: A2aArgs) -> anyhow::Result<()> {
    use agentd::client::a2a::{A2aClient, CallError, CallOptions, Control, Outcome, parts_text};
    // The deadline covers fetching the card and connecting too: a server
    // that accepts the connection and never answers must not hang the call.
    let started = tokio::time::Instant::now();
    let client = tokio::time::timeout(
        args.deadline,
        A2aClient::connect_with(&args.url, args.binding, args.token.as_deref()),
    )
    .await
    .map_err(|_| {
        anyhow::anyhow!(
            "{}: no agent card within the deadline ({:?})",
            args.url,
            args.deadline
        )
    })??;
    let opts = CallOptions {
        idle_timeout: args.idle_timeout,
        // What the card left of it.
        deadline: args.deadline.saturating_sub(started.elapsed()),
        max_recoveries: args.max_recoveries,
        ..CallOptions::default()
    };
    // How to send the reply a waiting task asks for: to the same agent, the
    // same way (credentials in the URL masked).
    let mut reply_with = format!(
        "agentd a2a --url {}",
        shell_word(&client.mask_secrets(&args.url))
    );
    if let Some(b) = args
        .binding
        .and_then(|b| clap::ValueEnum::to_possible_value(&b))
    {
        reply_with.push_str(&format!(" --binding {}", b.get_name()));
    }
    if let Some(a) = &args.agent {
        reply_with.push_str(&format!(" --agent {}", shell_word(a)));
    }
    let metadata = args.agent.map(|a| {
        [("agent".to_owned(), serde_json::Value::String(a))]
            .into_iter()
            .collect()
    });
    let message = a2a::Message {
        metadata,
        task_id: args.task,
        context_id: args.context,
        ..a2a::Message::new(a2a::Role::User, vec![a2a::Part::text(&args.text)])
    };
    let json = args.json;
    // The task's id once the agent named it: an interrupted call cancels it.
    let task_id = std::sync::Mutex::new(None::<String>);
    let mut progress = |ev: &a2a::StreamResponse, _: &agentd::client::a2a::CallState| {
        let id = match ev {
            a2a::StreamResponse::Task(t) => Some(&t.id),
            a2a::StreamResponse::StatusUpdate(u) => Some(&u.task_id),
            a2a::StreamResponse::ArtifactUpdate(u) => Some(&u.task_id),
            a2a::StreamResponse::Message(_) => None,
        };
        if let Some(id) = id.filter(|id| !id.is_empty()) {
            task_id
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(|| id.clone());
        }
        if let a2a::StreamResponse::StatusUpdate(u) = ev
            && !json
        {
            let text = u
                .status
                .message
                .as_ref()
                .map(|m| parts_text(&m.parts))
                .unwrap_or_default();
            eprintln!("[{:?}] {text}", u.status.state);
        }
        Control::Continue
    };
    let result = tokio::select! {
        r = client.send(message, &opts, Some(&mut progress)) => r,
        _ = shutdown_signal() => {
            // Interrupted (Ctrl-C, SIGTERM): the remote task is ours to end.
            let id = task_id.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let Some(id) = id else {
                anyhow::bail!("interrupted before the agent named its task; nothing to cancel");
            };
            match tokio::time::timeout(Duration::from_secs(10), client.cancel(&id)).await {
                Ok(Ok(t)) => anyhow::bail!("interrupted: cancelled task {id} (now {:?})", t.status.state),
                Ok(Err(e)) => anyhow::bail!("interrupted: cancelling task {id} failed ({}); it may still run", e.message),
                Err(_) => anyhow::bail!("interrupted: task {id} did not answer its cancel within 10s; it may still run"),
            }
        }
    };
    let artifacts_json = |a: &[a2a::Artifact]| -> serde_json::Value {
        a.iter()
            .map(|a| serde_json::json!({"artifactId": a.artifact_id, "text": parts_text(&a.parts)}))
            .collect()
    };
    match result {
        Ok(Outcome::Completed {
            task_id,
            artifacts,
            incomplete,
            message,
            ..
        }) => {
            let said = message.map(|m| parts_text(&m.parts)).unwrap_or_default();
            if json {
                out!(
                    "{}",
                    serde_json::json!({"state": "completed", "taskId": task_id, "incomplete": incomplete, "artifacts": artifacts_json(&artifacts), "message": said})
                );
            } else {
                for a in &artifacts {
                    out!("{}", parts_text(&a.parts));
                }
                // An agent that answers in its last status, not an artifact.
                if artifacts.is_empty() && !said.is_empty() {
                    out!("{said}");
                }
            }
            if incomplete {
                anyhow::bail!(
                    "task {task_id} completed but chunks were lost in transit: the result above is incomplete"
                );
            }
            Ok(())
        }
        Ok(Outcome::Message(m)) => {
            if json {
                out!(
                    "{}",
                    serde_json::json!({"state": "message", "text": parts_text(&m.parts)})
                );
            } else {
                out!("{}", parts_text(&m.parts));
            }
            Ok(())
        }
        Ok(Outcome::Waiting {
            state,
            task_id,
            context_id,
            message,
            ..
        }) => {
            let text = message.map(|m| parts_text(&m.parts)).unwrap_or_default();
            if json {
                out!(
                    "{}",
                    serde_json::json!({"state": format!("{state:?}"), "taskId": task_id, "contextId": context_id, "text": text})
                );
            } else {
                out!("{text}");
                eprintln!(
                    "the agent waits ({state:?}); reply with: {reply_with} --task {} --context {} TEXT",
                    shell_word(&task_id),
                    shell_word(&context_id)
                );
            }
            Ok(())
        }
        Ok(Outcome::Stopped { .. }) => Ok(()),
        Err(e) => {
            if json {
                let task_id = match &e {
                    CallError::Task { task_id, .. }
                    | CallError::Unrecoverable { task_id, .. }
                    | CallError::TaskLost { task_id, .. } => Some(task_id.clone()),
                    CallError::Deadline { task_id, .. } | CallError::TooLarge { task_id, .. } => {
                        task_id.clone()
                    }
                    _ => None,
                };
                out!(
                    "{}",
                    serde_json::json!({"state": "error", "taskId": task_id, "error": e.to_string()})
                );
            }
            Err(e.into())
        }
    }
}

/// `s` as one word of a shell command line: as it is when it holds nothing
/// a shell reads specially, else in single quotes.
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:@%+=,".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
