//! Command-line and environment configuration: one clap struct, every flag
//! also an `AGENTD_*` variable. Bad configuration fails at start-up.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::turn::{SlowConsumer, TurnConfig};

/// The longest duration any flag takes: a time that far ahead still fits
/// the clock's arithmetic (a larger one made deadlines overflow and panic).
const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 500ms, 30s, 5m)"))?;
    if d > MAX_DURATION {
        return Err("must be at most 10 years".into());
    }
    Ok(d)
}

/// A [`duration`] that must be more than zero: a wait of none would end a
/// call before it began.
fn positive_duration(s: &str) -> Result<Duration, String> {
    match duration(s)? {
        Duration::ZERO => Err("must be more than zero".into()),
        d => Ok(d),
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "agentd",
    version,
    about = "Serves AI agents to other services over gRPC (agents.v1.AgentService)."
)]
pub struct Cli {
    /// Log format: human-readable text, or one JSON object per line.
    #[arg(long, env = "AGENTD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (the demo agent `order_helper` by default).
    Serve(Box<ServeArgs>),
    /// Manage sessions on a running server.
    #[command(subcommand)]
    Session(SessionCommand),
    /// Send one turn to a session and print its events as they arrive.
    Run(RunArgs),
    /// Ask a server's grpc.health.v1 service; exits 0 only when SERVING.
    Health(HealthArgs),
    /// Print a turn's events after --after-seq, then follow it live until it
    /// ends (resume after a dropped stream). Never runs the agent.
    Attach(AttachArgs),
    /// Stop a running turn (e.g. one left by `run --on-disconnect continue`)
    /// and print its state after the call; a turn that had ended is left as
    /// it is.
    Cancel(CancelArgs),
    /// Load a server with Run streams and report events/s, latency and memory
    /// (see BENCHMARKS.md; `bench/run.sh` runs the whole comparison).
    Bench(Box<crate::bench::BenchArgs>),
    /// Send one message to an A2A agent (any A2A 1.0 server, agentd's too)
    /// and print its answer; survives dropped streams.
    A2a(A2aArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to serve gRPC on.
    #[arg(long, env = "AGENTD_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// Agent that serves a Run whose `agent` field is empty (default: the
    /// agents file's `default`, else order_helper).
    #[arg(long, env = "AGENTD_DEFAULT_AGENT")]
    pub default_agent: Option<String>,

    /// Agents file (TOML): model-backed agents and their HTTP tools, served
    /// beside the built-in ones. A bad file fails start-up. See README.
    #[arg(long, env = "AGENTD_AGENTS")]
    pub agents: Option<std::path::PathBuf>,

    /// Simulated latency of the demo agent's `lookup_order` tool.
    #[arg(long, env = "AGENTD_TOOL_DELAY", value_parser = duration, default_value = "0s")]
    pub tool_delay: Duration,

    /// Events buffered per Run between the agent and the client. With the
    /// HTTP/2 window, this bounds the memory one call can hold.
    #[arg(long, env = "AGENTD_CHANNEL_CAPACITY", default_value_t = 256)]
    pub channel_capacity: usize,

    /// When a client does not read and the buffer is full: `wait` back-pressures
    /// the agent; `fail` ends the call with RESOURCE_EXHAUSTED after
    /// --stall-timeout and cancels the agent (a Run with on_disconnect
    /// CONTINUE goes on without the client, its events stored).
    #[arg(long, env = "AGENTD_SLOW_CONSUMER", value_enum, default_value_t = SlowConsumer::Fail)]
    pub slow_consumer: SlowConsumer,

    /// How long the buffer may stay full before `fail` ends the call.
    #[arg(long, env = "AGENTD_STALL_TIMEOUT", value_parser = duration, default_value = "30s")]
    pub stall_timeout: Duration,

    /// Upper bound of every run, whatever the client's deadline. With the
    /// 5s a run may then wait for its outcome to be stored, it must fit in
    /// --shutdown-grace, so a draining server lets runs finish.
    #[arg(long, env = "AGENTD_MAX_RUN_DURATION", value_parser = duration, default_value = "120s")]
    pub max_run_duration: Duration,

    /// Agent runs in flight at once; past it Run answers RESOURCE_EXHAUSTED.
    #[arg(long, env = "AGENTD_MAX_CONCURRENT_RUNS", default_value_t = 1024)]
    pub max_concurrent_runs: usize,

    /// Agent runs one user (RunRequest.user_id, an A2A caller's user) may
    /// have in flight at once on this replica; past it that user's new
    /// Runs answer RESOURCE_EXHAUSTED while others are still served. Set
    /// it when several callers share the replicas, so one cannot take every
    /// run slot (0: no bound beyond --max-concurrent-runs).
    #[arg(long, env = "AGENTD_MAX_RUNS_PER_USER", default_value_t = 0)]
    pub max_runs_per_user: usize,

    /// Streams following a turn at once (Attach, a repeated request id, an
    /// A2A subscription): each reads the store while its turn runs on another
    /// replica. Past it they answer RESOURCE_EXHAUSTED.
    #[arg(long, env = "AGENTD_MAX_FOLLOWERS", default_value_t = 4096)]
    pub max_followers: usize,

    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS per connection.
    #[arg(long, env = "AGENTD_MAX_CONCURRENT_STREAMS", default_value_t = 1024)]
    pub max_concurrent_streams: u32,

    /// Connections each port (gRPC, A2A HTTP) holds at once. Past it a new
    /// connection is closed as soon as it is accepted (and logged), so a
    /// flood of idle connections cannot take every file descriptor; with
    /// --max-concurrent-streams it also bounds the calls in flight.
    #[arg(long, env = "AGENTD_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// Largest request message accepted, in bytes; a larger one is refused
    /// with INVALID_ARGUMENT before it is decoded (on the A2A HTTP face: a
    /// larger request body, with 413; that face takes 10 MiB at most).
    #[arg(long, env = "AGENTD_MAX_MESSAGE_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_message_bytes: usize,

    /// Longest accepted RunRequest.text, in bytes.
    #[arg(long, env = "AGENTD_MAX_INPUT_BYTES", default_value_t = 64 * 1024)]
    pub max_input_bytes: usize,

    /// Also serve the `stream` agent, for tests and benchmarks. Off by
    /// default: it emits as many events, as large, as its caller asks for
    /// (up to 10 million of 1 MiB each), and every one is stored.
    #[arg(long, env = "AGENTD_STREAM_AGENT", value_parser = clap::builder::BoolishValueParser::new())]
    pub stream_agent: bool,

    /// Earlier turns given to an agent as conversation memory (at most
    /// 10000). The same turns carry what agents keep for their later turns
    /// (a remote A2A agent's context and task): with 0 an agent gets no
    /// history, and a remote A2A agent starts a new context every turn.
    #[arg(long, env = "AGENTD_HISTORY_TURNS", default_value_t = 20)]
    pub history_turns: usize,

    /// The most bytes of earlier questions and answers (with the answers'
    /// payloads, up to 4 KiB each) an agent gets: the oldest of the
    /// --history-turns go first when they hold more (each answer may hold
    /// up to 2 MiB, which every later turn would send).
    #[arg(long, env = "AGENTD_HISTORY_BYTES", default_value_t = 1024 * 1024)]
    pub history_bytes: usize,

    /// Start every agent only once its turn is claimed. Without this flag a
    /// model-backed agent calls its model while its turn is being claimed,
    /// so the first token waits for the slower of the two, not both. A
    /// repeated request id whose turn is stored or being claimed on this
    /// replica makes no model call either way; one sent to another replica
    /// while its first is still being claimed starts a model call that is
    /// dropped as soon as its claim finds the turn (a hosted model may still
    /// bill its prompt). With this flag no repeat calls the model, and a
    /// server short of CPU spends it on claims before streams.
    #[arg(long, env = "AGENTD_CLAIM_FIRST", value_parser = clap::builder::BoolishValueParser::new())]
    pub claim_first: bool,

    /// HTTP/2 PING interval on idle connections (0s disables).
    #[arg(long, env = "AGENTD_KEEPALIVE_INTERVAL", value_parser = duration, default_value = "30s")]
    pub keepalive_interval: Duration,

    /// How long to wait for a PING ack before closing the connection.
    #[arg(long, env = "AGENTD_KEEPALIVE_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub keepalive_timeout: Duration,

    /// Age after which a connection gets GOAWAY, so clients reconnect and
    /// rebalance across replicas; in-flight calls finish (0s disables).
    #[arg(long, env = "AGENTD_MAX_CONNECTION_AGE", value_parser = duration, default_value = "30m")]
    pub max_connection_age: Duration,

    /// On SIGTERM, how long health reports NOT_SERVING while new calls are
    /// still accepted, so load balancers and endpoints stop sending traffic.
    #[arg(long, env = "AGENTD_DRAIN_DELAY", value_parser = duration, default_value = "5s")]
    pub drain_delay: Duration,

    /// After the drain delay, how long in-flight runs may take to finish
    /// before they are cut (ending with UNAVAILABLE).
    #[arg(long, env = "AGENTD_SHUTDOWN_GRACE", value_parser = duration, default_value = "130s")]
    pub shutdown_grace: Duration,

    /// This replica's name in the turn side table (default: the host name).
    #[arg(long, env = "AGENTD_REPLICA_ID")]
    pub replica_id: Option<String>,

    /// Where sessions, turns and events are kept: `sqlite://PATH` (one
    /// replica; the file is created if missing, the event log beside it in
    /// PATH-events), `postgres://USER@HOST/DB`
    /// (several replicas share it), or `memory:` (nothing survives a
    /// restart). Migrations run at start-up.
    #[arg(
        long,
        env = "AGENTD_STORE",
        default_value = "sqlite://agentd.db",
        hide_env_values = true
    )]
    pub store: String,

    /// The longest any store call may wait, queueing included; past it the
    /// call fails and the caller gets UNAVAILABLE. Bounds the wait on a
    /// database that stops answering without closing its connections (a
    /// network cut), which TCP would hold for minutes (0s: no bound).
    #[arg(long, env = "AGENTD_STORE_TIMEOUT", value_parser = duration, default_value = "30s")]
    pub store_timeout: Duration,

    /// How long finished turns (and their event logs) are kept before a
    /// background task prunes them (0s keeps them forever).
    #[arg(long, env = "AGENTD_RETAIN_TURNS", value_parser = duration, default_value = "7days")]
    pub retain_turns: Duration,

    /// How long a session with no turns left (never used, or every turn
    /// pruned) is kept after its last turn started (or its creation) before
    /// it is deleted; a Run in it is NOT_FOUND after that (0s keeps them
    /// forever).
    #[arg(long, env = "AGENTD_RETAIN_SESSIONS", value_parser = duration, default_value = "30days")]
    pub retain_sessions: Duration,

    /// A running turn's lease in the shared store, renewed by its replica
    /// every third of it. A replica that dies mid-turn stops renewing; once
    /// the lease expires the turn ends with UNAVAILABLE (never re-run).
    #[arg(long, env = "AGENTD_TURN_LEASE", value_parser = duration, default_value = "10s")]
    pub turn_lease: Duration,

    /// Admin HTTP address: /metrics (Prometheus), /healthz, /readyz. Plain
    /// HTTP, no authentication: keep it on a private address. `off` disables
    /// it (an empty value is refused).
    #[arg(long, env = "AGENTD_ADMIN_LISTEN", default_value = "127.0.0.1:9090", value_parser = listen_or_off)]
    pub admin_listen: AdminListen,

    /// PEM certificate (chain) of the gRPC port; with --tls-key, the port
    /// speaks TLS only.
    #[arg(long, env = "AGENTD_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "AGENTD_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,

    /// PEM CA bundle for client certificates: turns on mutual TLS. Every
    /// client must present a certificate it signed; the certificate's name
    /// (first DNS/URI SAN, else CN) is the caller.
    #[arg(long, env = "AGENTD_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// JSON file of bearer tokens (token → caller and the user_ids it may
    /// act for, or "*") and of client certificate names; see README. With it
    /// (or with --tls-client-ca) every call needs credentials.
    #[arg(long, env = "AGENTD_AUTH_TOKENS")]
    pub auth_tokens: Option<std::path::PathBuf>,

    /// How often the TLS files (--tls-cert, --tls-key, --tls-client-ca) and
    /// --auth-tokens are read again, as Kubernetes updates mounted Secrets
    /// in place; changed files are checked as at start-up and, if they
    /// pass, serve new handshakes and calls (a bad one changes nothing and
    /// is logged). SIGHUP reloads too (0s: only SIGHUP).
    #[arg(long, env = "AGENTD_RELOAD_INTERVAL", value_parser = duration, default_value = "30s")]
    pub reload_interval: Duration,

    /// Services callable without credentials when authentication is on
    /// (comma-separated; empty: none). Only grpc.health.v1.Health and
    /// grpc.reflection.v1.ServerReflection may be named: any other service
    /// is refused at start-up.
    #[arg(
        long,
        env = "AGENTD_AUTH_OPEN_SERVICES",
        value_delimiter = ',',
        default_value = "grpc.health.v1.Health,grpc.reflection.v1.ServerReflection"
    )]
    pub auth_open_services: Vec<String>,

    /// Address of the A2A HTTP face: JSON-RPC with SSE streaming at `/`, the
    /// agent card at /.well-known/agent-card.json (`off` disables it; A2A over
    /// gRPC is always on --listen).
    #[arg(long, env = "AGENTD_A2A_LISTEN", default_value = "127.0.0.1:8080", value_parser = listen_or_off)]
    pub a2a_listen: ListenAddr,

    /// Host name the agent card advertises for both A2A interfaces (default:
    /// the listening IP, or the host name when listening on all interfaces).
    /// A bare name or IP address: no scheme, port or path (a proxy's URL
    /// goes in --a2a-advertise-url).
    #[arg(long, env = "AGENTD_A2A_ADVERTISE_HOST")]
    pub a2a_advertise_host: Option<String>,

    /// URL the agent card gives for the JSON-RPC interface, when clients
    /// reach it through a proxy (another scheme, host or port), e.g.
    /// `https://agents.example.com/`. Default: http://HOST:PORT/ of
    /// `--a2a-listen` and `--a2a-advertise-host`.
    #[arg(long, env = "AGENTD_A2A_ADVERTISE_URL")]
    pub a2a_advertise_url: Option<String>,

    /// Serve A2A's `conformance` agent: a message whose messageId starts with
    /// `tck-` (or `test-resubscribe-`) gets the scripted answer conformance
    /// suites expect; other messages reach the agents as usual.
    #[arg(long, env = "AGENTD_A2A_CONFORMANCE", value_parser = clap::builder::BoolishValueParser::new())]
    pub a2a_conformance: bool,

    /// How long the conformance agent's `test-resubscribe-message-id` task
    /// stays WORKING.
    #[arg(long, env = "AGENTD_A2A_CONFORMANCE_WAIT", value_parser = duration, default_value = "5s")]
    pub a2a_conformance_wait: Duration,
}

/// A listening address, or none (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub Option<SocketAddr>);

/// `--admin-listen` and `--a2a-listen`: HOST:PORT, or `off` in any case.
/// An empty value is refused rather than read as `off`: it is most often a
/// variable a template left empty, and a port that silently does not open
/// (no /metrics, no probes' /readyz) shows only later, elsewhere.
fn listen_or_off(s: &str) -> Result<ListenAddr, String> {
    if s.trim().is_empty() {
        return Err(
            "empty; give HOST:PORT (e.g. 127.0.0.1:8080), or off to turn the port off".into(),
        );
    }
    if s.eq_ignore_ascii_case("off") {
        return Ok(ListenAddr(None));
    }
    s.parse()
        .map(|a| ListenAddr(Some(a)))
        .map_err(|_| "expected HOST:PORT (e.g. 127.0.0.1:8080) or off".to_string())
}

/// Where the admin HTTP port listens, if anywhere: the same as the A2A
/// port's, with the same parser, so `--admin-listen` and `--a2a-listen`
/// take the same values.
pub type AdminListen = ListenAddr;

/// An agent card URL clients can use: absolute http(s), a host, no
/// credentials, no fragment.
fn advertise_url(s: &str) -> Result<(), String> {
    let url = reqwest::Url::parse(s).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("must be an http:// or https:// URL".into());
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("must name a host".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not carry credentials (the card is public)".into());
    }
    if url.fragment().is_some() {
        return Err("must not have a #fragment".into());
    }
    Ok(())
}

/// `--a2a-advertise-host`: a bare host name or IP address, which the agent
/// card joins with each interface's port. A scheme, port or path here would
/// make URLs such as `http://https://host:8080:8080/` that no client can
/// use; those belong in `--a2a-advertise-url`. An IPv6 address may be given
/// bare or in brackets (the card brackets it).
fn advertise_host(s: &str) -> Result<(), String> {
    const USE_URL: &str = "a URL, another port or a path belongs in --a2a-advertise-url";
    if s.trim().is_empty() {
        return Err(
            "empty; give a host name or IP address, or leave it unset for the default".into(),
        );
    }
    let unbracketed = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(s);
    if unbracketed.parse::<std::net::Ipv6Addr>().is_ok() || s.parse::<std::net::Ipv4Addr>().is_ok()
    {
        return Ok(());
    }
    if s.contains("://") {
        return Err(format!(
            "must be a host name or IP address, not a URL ({USE_URL})"
        ));
    }
    if s.contains(['/', '?', '#']) {
        return Err(format!(
            "must be a host name or IP address, without a path ({USE_URL})"
        ));
    }
    if s.contains(':') {
        return Err(format!(
            "must be a host name or IP address, without a port: the card gives the ports of --listen and --a2a-listen ({USE_URL})"
        ));
    }
    let name = s.strip_suffix('.').unwrap_or(s);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!("{s:?} is not a host name or IP address"));
    }
    Ok(())
}

/// How long a run may hold its stream past its deadline while its outcome
/// is stored. A run may last --max-run-duration plus this, which
/// --shutdown-grace must cover.
const RUN_OUTCOME_WAIT: Duration = crate::turn::OUTCOME_WAIT;

/// The gRPC health service, which health checkers call without credentials.
const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// The most earlier turns `--history-turns` may give an agent: a bound on
/// what one Run reads (its bytes are bounded by --history-bytes).
const MAX_HISTORY_TURNS: usize = 10_000;

impl ServeArgs {
    /// Checks the combination of flags; the error is one line for a person.
    /// The longest a run holds its stream: its bound, then the wait for
    /// its outcome to be stored.
    fn longest_run(&self) -> Duration {
        self.max_run_duration.saturating_add(RUN_OUTCOME_WAIT)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.history_turns > MAX_HISTORY_TURNS {
            return Err(format!(
                "--history-turns ({}) must be at most {MAX_HISTORY_TURNS}",
                self.history_turns
            ));
        }
        // A run must end within the grace, or a draining server cuts runs
        // it promised to finish. (It may also hold its stream up to
        // RUN_OUTCOME_WAIT past its deadline while its outcome is stored:
        // a grace that covers the run but not that is warned about, not
        // refused, so a setting earlier releases took still starts.)
        if self.max_run_duration >= self.shutdown_grace {
            return Err(format!(
                "--max-run-duration ({}) must be shorter than --shutdown-grace ({}), or a draining server would cut runs it promised to finish: raise --shutdown-grace to {} or more (the run plus the {} it may wait for its outcome to be stored), or lower --max-run-duration",
                humantime::format_duration(self.max_run_duration),
                humantime::format_duration(self.shutdown_grace),
                humantime::format_duration(self.longest_run()),
                humantime::format_duration(RUN_OUTCOME_WAIT),
            ));
        }
        let positive: [(&str, usize); 6] = [
            ("--channel-capacity", self.channel_capacity),
            ("--max-connections", self.max_connections),
            ("--max-concurrent-runs", self.max_concurrent_runs),
            ("--max-followers", self.max_followers),
            ("--max-message-bytes", self.max_message_bytes),
            ("--max-input-bytes", self.max_input_bytes),
        ];
        // The first four are a semaphore's permits or a channel's
        // capacity: past tokio's bound they would panic when the server
        // starts, or on the first Run (no message comes near it either).
        let most = tokio::sync::Semaphore::MAX_PERMITS;
        for (flag, v) in positive {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
            if v > most {
                return Err(format!("{flag} must be at most {most}"));
            }
        }
        if self.max_concurrent_streams == 0 {
            return Err("--max-concurrent-streams must be at least 1".into());
        }
        if self.keepalive_timeout.is_zero() {
            return Err("--keepalive-timeout must be more than 0s (a PING would close its connection at once); --keepalive-interval 0s turns PINGs off".into());
        }
        if self.max_run_duration.is_zero() {
            return Err("--max-run-duration must be more than 0s".into());
        }
        if self.slow_consumer == SlowConsumer::Fail && self.stall_timeout.is_zero() {
            return Err("--stall-timeout must be more than 0s with --slow-consumer fail".into());
        }
        if self.max_input_bytes > self.max_message_bytes {
            return Err("--max-input-bytes cannot exceed --max-message-bytes".into());
        }
        let scheme = self
            .store
            .split_once(':')
            .map(|(s, _)| s)
            .unwrap_or_default();
        if !matches!(scheme, "sqlite" | "postgres" | "postgresql" | "memory") {
            return Err("--store must be sqlite://PATH, postgres://... or memory:".into());
        }
        if self.turn_lease < Duration::from_millis(300) {
            return Err("--turn-lease must be at least 300ms".into());
        }
        if let Some(h) = &self.a2a_advertise_host {
            advertise_host(h).map_err(|why| format!("--a2a-advertise-host: {why}"))?;
        }
        if let Some(u) = &self.a2a_advertise_url {
            advertise_url(u).map_err(|why| format!("--a2a-advertise-url: {why}"))?;
        }
        // Without authentication every service is open anyway.
        if self.auth_tokens.is_some() || self.tls_client_ca.is_some() {
            crate::auth::check_open_services(&self.auth_open_services)?;
        }
        Ok(())
    }

    /// Settings that serve, but insecurely or in a way that is most likely
    /// a mistake: start-up logs each as one warning line. (Plaintext behind
    /// a TLS-terminating proxy or a service mesh is a deliberate choice
    /// these lines cannot see.)
    pub fn insecure_settings(&self) -> Vec<String> {
        let tls = self.tls_cert.is_some() && self.tls_key.is_some();
        let auth = self.auth_tokens.is_some() || (tls && self.tls_client_ca.is_some());
        let exposed = |addr: SocketAddr| !addr.ip().to_canonical().is_loopback();
        let mut reachable: Vec<String> = Vec::new();
        if exposed(self.listen) {
            reachable.push(format!("{} (--listen)", self.listen));
        }
        if let Some(a2a) = self.a2a_listen.0.filter(|a| exposed(*a)) {
            reachable.push(format!("{a2a} (--a2a-listen)"));
        }
        let mut warnings = Vec::new();
        if !auth && !reachable.is_empty() {
            warnings.push(format!(
                "authentication is off and {} is not a loopback address: any client that reaches it may act for any user; set --auth-tokens or --tls-client-ca",
                reachable.join(" and ")
            ));
        }
        // With TLS the A2A HTTP port's plaintext has a warning of its own.
        if self.auth_tokens.is_some() && !tls && !reachable.is_empty() {
            warnings.push(format!(
                "bearer tokens are on without TLS and {} is not a loopback address: tokens cross the network in cleartext; set --tls-cert and --tls-key, or serve behind a TLS-terminating proxy",
                reachable.join(" and ")
            ));
        }
        if self.tls_client_ca.is_some() && self.auth_tokens.is_none() {
            warnings.push(
                "--tls-client-ca without --auth-tokens: every certificate the CA signed may act for any user; list the trusted certificate names under `clients` in an --auth-tokens file".to_owned(),
            );
        }
        // Health checkers send no token: with the health service closed the
        // kubelet's gRPC probes get UNAUTHENTICATED and the pod never turns
        // ready. Legitimate where every checker carries credentials (or
        // probes /readyz), so a warning, not a refusal. (With a client CA
        // alone every signed certificate is let in: no health check is
        // refused for want of a token.)
        let health_open = self
            .auth_open_services
            .iter()
            .any(|s| s.trim() == HEALTH_SERVICE);
        if self.auth_tokens.is_some() && !health_open {
            warnings.push(format!(
                "--auth-open-services does not name {HEALTH_SERVICE} while --auth-tokens is set: health checks without a token (the kubelet's gRPC probes, load balancers, `agentd health`) get UNAUTHENTICATED and a pod probed so never turns ready; add {HEALTH_SERVICE} to --auth-open-services, or probe the admin port's /readyz over HTTP"
            ));
        }
        if self.max_run_duration < self.shutdown_grace && self.longest_run() > self.shutdown_grace {
            warnings.push(format!(
                "--shutdown-grace ({}) covers --max-run-duration ({}) but not the {} a run may then wait for its outcome to be stored: a run that reaches its bound during a drain may be cut before its outcome is; set --shutdown-grace to {} or more",
                humantime::format_duration(self.shutdown_grace),
                humantime::format_duration(self.max_run_duration),
                humantime::format_duration(RUN_OUTCOME_WAIT),
                humantime::format_duration(self.longest_run()),
            ));
        }
        warnings
    }

    pub fn turn_config(&self) -> TurnConfig {
        TurnConfig {
            channel_capacity: self.channel_capacity,
            slow_consumer: self.slow_consumer,
            stall_timeout: self.stall_timeout,
            max_run_duration: self.max_run_duration,
            max_concurrent_runs: self.max_concurrent_runs,
            max_runs_per_user: (self.max_runs_per_user > 0).then_some(self.max_runs_per_user),
            max_followers: self.max_followers,
            replica_id: self.replica_id.clone().unwrap_or_else(default_replica_id),
            history_turns: self.history_turns,
            history_bytes: self.history_bytes,
            claim_first: self.claim_first,
            lease: self.turn_lease,
            retain_turns: (!self.retain_turns.is_zero()).then_some(self.retain_turns),
            retain_sessions: (!self.retain_sessions.is_zero()).then_some(self.retain_sessions),
            ..TurnConfig::default()
        }
    }

    /// Reads and checks the TLS and token files (start-up errors are one line).
    pub fn security(&self) -> anyhow::Result<crate::server::Security> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(crate::auth::tls::TlsFiles::load(
                cert,
                key,
                self.tls_client_ca.as_ref(),
            )?),
            _ => None,
        };
        let mtls = tls.as_ref().is_some_and(|t| t.mtls());
        let auth = if self.auth_tokens.is_some() || mtls {
            Some(std::sync::Arc::new(crate::auth::Authenticator::new(
                self.auth_tokens.as_deref(),
                mtls,
                &self.auth_open_services,
            )?))
        } else {
            None
        };
        Ok(crate::server::Security { tls, auth })
    }

    pub fn server_options(&self) -> crate::server::ServerOptions {
        let nonzero = |d: Duration| (!d.is_zero()).then_some(d);
        crate::server::ServerOptions {
            keepalive_interval: nonzero(self.keepalive_interval),
            keepalive_timeout: self.keepalive_timeout,
            max_connection_age: nonzero(self.max_connection_age),
            max_concurrent_streams: self.max_concurrent_streams,
            max_connections: self.max_connections,
            max_message_bytes: self.max_message_bytes,
            max_input_bytes: self.max_input_bytes,
            drain_delay: self.drain_delay,
            shutdown_grace: self.shutdown_grace,
            reload_interval: nonzero(self.reload_interval),
            reload_on_sighup: true,
            a2a_conformance: self.a2a_conformance.then_some(self.a2a_conformance_wait),
            ..Default::default()
        }
    }
}

fn default_replica_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|s| s.trim().to_owned())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| format!("agentd-{}", std::process::id()))
}

/// Where the client commands connect.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Server address: http://HOST:PORT for one server, or dns:///NAME:PORT
    /// to balance over every A/AAAA record of NAME (e.g. a Kubernetes
    /// headless Service), re-resolved every --resolve-interval.
    #[arg(long, env = "AGENTD_SERVER", default_value = "http://127.0.0.1:50051")]
    pub server: String,

    /// How often a dns:/// server name is resolved again, so that new and
    /// replaced replicas are used.
    #[arg(long, env = "AGENTD_RESOLVE_INTERVAL", value_parser = duration, default_value = "10s")]
    pub resolve_interval: Duration,
    /// Bearer token sent on every call (servers with --auth-tokens).
    #[arg(long, env = "AGENTD_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM CA that signed the server's certificate (for an https:// server).
    #[arg(long, env = "AGENTD_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// PEM client certificate, for servers with mutual TLS (with --tls-ca,
    /// which names the CA the server's certificate is checked against).
    #[arg(long, env = "AGENTD_TLS_CLIENT_CERT", requires_all = ["tls_client_key", "tls_ca"])]
    pub tls_client_cert: Option<std::path::PathBuf>,
    /// PEM key of --tls-client-cert.
    #[arg(long, env = "AGENTD_TLS_CLIENT_KEY", requires = "tls_client_cert")]
    pub tls_client_key: Option<std::path::PathBuf>,
}

impl ClientArgs {
    pub fn client_config(&self) -> anyhow::Result<crate::client::ClientConfig> {
        Ok(crate::client::ClientConfig {
            resolve_interval: self.resolve_interval,
            security: self.security()?,
            ..Default::default()
        })
    }

    pub async fn connect(&self) -> anyhow::Result<crate::client::AgentClient> {
        crate::client::AgentClient::connect_config(&self.server, self.client_config()?).await
    }

    /// [`Self::connect`], its calls (retries included) given `deadline`.
    pub async fn connect_within(
        &self,
        deadline: std::time::Duration,
    ) -> anyhow::Result<crate::client::AgentClient> {
        let cfg = crate::client::ClientConfig {
            deadline,
            ..self.client_config()?
        };
        crate::client::AgentClient::connect_config(&self.server, cfg).await
    }

    /// Reads the TLS files and token into client settings.
    pub fn security(&self) -> anyhow::Result<crate::client::ClientSecurity> {
        use anyhow::Context as _;
        let read = |p: &std::path::Path| {
            std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))
        };
        let tls = match &self.tls_ca {
            Some(ca) => {
                let identity = match (&self.tls_client_cert, &self.tls_client_key) {
                    (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
                    _ => None,
                };
                let ca = read(ca)?;
                Some(crate::client::ClientSecurity::tls_from_pem(
                    &ca,
                    identity.as_ref().map(|(c, k)| (&c[..], &k[..])),
                ))
            }
            None => None,
        };
        Ok(crate::client::ClientSecurity {
            tls,
            token: self.token.clone(),
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Create a session and print its id.
    Create {
        #[command(flatten)]
        client: ClientArgs,
        /// The user the session belongs to.
        #[arg(long)]
        user: String,
        /// The creation's idempotency key: run again with the same key (and
        /// user), it prints the session the first run made, while that
        /// session exists. Without it, each run makes a session (its
        /// retries still make one).
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Print a session and its turns as JSON.
    Get {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        user: String,
        #[arg(long)]
        session: String,
        /// Also print each turn's question and final answer (`user_text`,
        /// `answer`, `answer_payload_json`): the conversation, without
        /// replaying its turns.
        #[arg(long)]
        text: bool,
    },
    /// Print a user's sessions, one JSON object per line, oldest first.
    List {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        user: String,
    },
    /// Delete a session with its turns and events.
    Delete {
        #[command(flatten)]
        client: ClientArgs,
        #[arg(long)]
        user: String,
        #[arg(long)]
        session: String,
    },
}

/// The turn a command acts on, and the server it asks.
#[derive(Debug, Args)]
pub struct TurnArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The session's owner.
    #[arg(long)]
    pub user: String,
    #[arg(long)]
    pub session: String,
    /// The turn's request id.
    #[arg(long)]
    pub request_id: String,
}

#[derive(Debug, Args)]
pub struct AttachArgs {
    #[command(flatten)]
    pub turn: TurnArgs,
    /// The last seq already received; events after it are printed (default:
    /// all of them).
    #[arg(long)]
    pub after_seq: Option<u64>,
    /// Give up after this long.
    #[arg(long, value_parser = positive_duration, default_value = "120s")]
    pub deadline: Duration,
    /// Print each event as a JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub turn: TurnArgs,
    /// Print the turn as a JSON object (as `session get` does) instead of
    /// text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The session's owner.
    #[arg(long)]
    pub user: String,
    /// The session id (from `agentd session create`).
    #[arg(long)]
    pub session: String,
    /// Idempotency key; repeat it to replay or re-attach to the same turn.
    #[arg(long)]
    pub request_id: Option<String>,
    /// The agent to ask (default: the server's default agent).
    #[arg(long)]
    pub agent: Option<String>,
    /// Give up (and cancel the run) after this long.
    #[arg(long, value_parser = positive_duration, default_value = "120s")]
    pub deadline: Duration,
    /// Print each event as a JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
    /// `continue` keeps the run going after this command exits or is
    /// interrupted, so `agentd attach` can pick it up.
    #[arg(long, value_enum, default_value_t = OnDisconnectArg::Cancel)]
    pub on_disconnect: OnDisconnectArg,
    /// The message.
    pub text: String,
}

/// `RunRequest.on_disconnect` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnDisconnectArg {
    Cancel,
    Continue,
}

#[derive(Debug, Args)]
pub struct A2aArgs {
    /// Base URL of the agent; its card is read from
    /// <URL>/.well-known/agent-card.json.
    #[arg(long, env = "AGENTD_A2A_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Binding to use (default: the first of the card's interfaces this client
    /// speaks, JSON-RPC or gRPC, in the card's order; JSON-RPC only for https).
    #[arg(long, value_enum)]
    pub binding: Option<crate::client::a2a::Binding>,
    /// Sets message metadata "agent" (which of agentd's agents answers).
    #[arg(long)]
    pub agent: Option<String>,
    /// Bearer token sent on every call (servers with --auth-tokens); the
    /// card is read without it.
    #[arg(long, env = "AGENTD_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// No event for this long counts as a lost stream: the client recovers
    /// (task snapshot, then resubscribe).
    #[arg(long, value_parser = positive_duration, default_value = "30s")]
    pub idle_timeout: Duration,
    /// Give up after this long and cancel the remote task.
    #[arg(long, value_parser = positive_duration, default_value = "120s")]
    pub deadline: Duration,
    /// Recoveries in a row that bring no update before giving up (and
    /// cancelling the remote task); one that brings updates starts the
    /// count again.
    #[arg(long, default_value_t = 5)]
    pub max_recoveries: u32,
    /// Print the outcome as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Send the message into this task (one that waits for input: the
    /// reply the previous call asked for).
    #[arg(long)]
    pub task: Option<String>,
    /// Send the message in this context (a conversation the agent
    /// remembers), as a new task unless --task is given too.
    #[arg(long)]
    pub context: Option<String>,
    /// The message.
    pub text: String,
}

#[derive(Debug, Args)]
pub struct HealthArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Service to ask about; empty asks about the server as a whole.
    #[arg(long, default_value = "")]
    pub service: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> Box<ServeArgs> {
        let mut argv = vec!["agentd", "serve"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Serve(s) => s,
            _ => unreachable!(),
        }
    }

    #[test]
    fn defaults_are_valid() {
        serve(&[]).validate().unwrap();
        <Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn a_run_longer_than_the_shutdown_grace_is_refused() {
        let err = serve(&["--max-run-duration", "10m", "--shutdown-grace", "60s"])
            .validate()
            .unwrap_err();
        assert!(err.contains("--max-run-duration"), "{err}");
    }

    /// A run may hold its stream 5s past its deadline while its outcome is
    /// stored: a grace only 2s longer than the run bound would cut it.
    #[test]
    fn the_shutdown_grace_covers_a_run_and_is_warned_about_its_outcome_wait() {
        let err = serve(&["--max-run-duration", "130s", "--shutdown-grace", "130s"])
            .validate()
            .unwrap_err();
        assert!(
            err.contains("--max-run-duration (2m 10s)")
                && err.contains("--shutdown-grace (2m 10s)")
                && err.contains("2m 15s or more"),
            "{err}"
        );
        // Covers the run, not its outcome wait: starts, with a warning.
        let tight = serve(&["--max-run-duration", "128s", "--shutdown-grace", "130s"]);
        tight.validate().unwrap();
        let warned: Vec<_> = tight
            .insecure_settings()
            .into_iter()
            .filter(|w| w.contains("--shutdown-grace (2m 10s)") && w.contains("2m 13s or more"))
            .collect();
        assert_eq!(warned.len(), 1, "{:?}", tight.insecure_settings());
        let roomy = serve(&["--max-run-duration", "125s", "--shutdown-grace", "130s"]);
        roomy.validate().unwrap();
        assert!(
            !roomy
                .insecure_settings()
                .iter()
                .any(|w| w.contains("--shutdown-grace")),
            "{:?}",
            roomy.insecure_settings()
        );
        // No overflow at the longest durations the flags take.
        let most = "3650days";
        assert!(
            serve(&["--max-run-duration", most, "--shutdown-grace", most])
                .validate()
                .is_err()
        );
    }

    #[test]
    fn zero_capacity_is_refused() {
        assert!(serve(&["--channel-capacity", "0"]).validate().is_err());
    }

    #[test]
    fn an_advertised_url_must_be_one_clients_can_use() {
        serve(&["--a2a-advertise-url", "https://agents.example.com/"])
            .validate()
            .unwrap();
        for bad in [
            "agents.example.com",
            "ftp://agents.example.com/",
            "https://user:secret@agents.example.com/",
            "https://agents.example.com/#x",
        ] {
            let err = serve(&["--a2a-advertise-url", bad]).validate().unwrap_err();
            assert!(err.starts_with("--a2a-advertise-url"), "{bad}: {err}");
            assert!(!err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn an_advertised_host_must_be_a_bare_host_name_or_ip() {
        for good in [
            "agentd.agents.svc.cluster.local",
            "agentd.agents.svc.cluster.local.",
            "localhost",
            "my_service",
            "10.0.0.7",
            "fd00::7",
            "[fd00::7]",
        ] {
            serve(&["--a2a-advertise-host", good])
                .validate()
                .unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for (bad, why) in [
            ("", "empty"),
            ("agentd.agents:8080", "without a port"),
            ("[fd00::7]:8080", "without a port"),
            ("https://agentd.agents", "not a URL"),
            ("agentd.agents/a2a", "without a path"),
            ("agentd agents", "not a host name"),
            ("-agentd.agents", "not a host name"),
            ("agentd..agents", "not a host name"),
        ] {
            let err = serve(&[&format!("--a2a-advertise-host={bad}")])
                .validate()
                .unwrap_err();
            assert!(
                err.starts_with("--a2a-advertise-host") && err.contains(why),
                "{bad:?}: {err}"
            );
        }
        // The card's URLs with an IPv6 host: bracketed, bare or not.
        let grpc: SocketAddr = "[::]:50051".parse().unwrap();
        let http: SocketAddr = "[::]:8080".parse().unwrap();
        for host in ["fd00::7", "[fd00::7]"] {
            let card = crate::a2a::advertised(grpc, http, Some(host), false, None);
            assert_eq!(card.jsonrpc_url, "http://[fd00::7]:8080/", "{host}");
            assert_eq!(card.grpc_url, "[fd00::7]:50051", "{host}");
            reqwest::Url::parse(&card.jsonrpc_url).unwrap();
        }
        let card = crate::a2a::advertised(grpc, http, Some("fd00::7"), true, None);
        assert_eq!(card.grpc_url, "https://[fd00::7]:50051");
    }

    #[test]
    fn capacities_past_what_tokio_can_hold_are_refused() {
        let huge = usize::MAX.to_string();
        for flag in [
            "--channel-capacity",
            "--max-connections",
            "--max-concurrent-runs",
            "--max-followers",
        ] {
            let err = serve(&[flag, &huge]).validate().unwrap_err();
            assert!(err.contains(flag) && err.contains("at most"), "{err}");
        }
    }

    #[test]
    fn a_history_past_its_bound_is_refused_at_start_up() {
        serve(&["--history-turns", "10000"]).validate().unwrap();
        let err = serve(&["--history-turns", &u64::MAX.to_string()])
            .validate()
            .unwrap_err();
        assert!(err.contains("--history-turns"), "{err}");
    }

    #[test]
    fn the_store_defaults_to_sqlite_and_unknown_schemes_are_refused() {
        assert_eq!(serve(&[]).store, "sqlite://agentd.db");
        let err = serve(&["--store", "mysql://x"]).validate().unwrap_err();
        assert!(err.contains("--store"), "{err}");
        serve(&["--store", "postgres://u@h/db"]).validate().unwrap();
        assert_eq!(
            serve(&["--retain-turns", "0s"]).turn_config().retain_turns,
            None
        );
        assert_eq!(
            serve(&[]).turn_config().retain_sessions,
            Some(Duration::from_secs(30 * 86_400))
        );
        assert_eq!(
            serve(&["--retain-sessions", "0s"])
                .turn_config()
                .retain_sessions,
            None
        );
    }

    #[test]
    fn files_are_reloaded_every_30s_and_on_sighup_unless_0s() {
        let opts = serve(&[]).server_options();
        assert_eq!(opts.reload_interval, Some(Duration::from_secs(30)));
        assert!(opts.reload_on_sighup);
        let opts = serve(&["--reload-interval", "200ms"]).server_options();
        assert_eq!(opts.reload_interval, Some(Duration::from_millis(200)));
        let opts = serve(&["--reload-interval", "0s"]).server_options();
        assert_eq!(opts.reload_interval, None);
        assert!(opts.reload_on_sighup, "0s leaves SIGHUP");
    }

    #[test]
    fn the_admin_port_can_be_turned_off() {
        assert_eq!(
            serve(&[]).admin_listen,
            ListenAddr(Some("127.0.0.1:9090".parse().unwrap()))
        );
        assert_eq!(
            serve(&["--admin-listen", "off"]).admin_listen,
            ListenAddr(None)
        );
        assert!(Cli::try_parse_from(["agentd", "serve", "--admin-listen", "nowhere"]).is_err());
    }

    /// Both ports take the same values: `off` in any case turns one off,
    /// and an empty value (a template's unset variable) is refused rather
    /// than read as `off`.
    #[test]
    fn the_admin_and_a2a_ports_take_the_same_values_and_refuse_an_empty_one() {
        for flag in ["--admin-listen", "--a2a-listen"] {
            let port = |v: &str| {
                let s = serve(&[flag, v]);
                match flag {
                    "--admin-listen" => s.admin_listen,
                    _ => s.a2a_listen,
                }
            };
            for off in ["off", "OFF", "Off"] {
                assert_eq!(port(off), ListenAddr(None), "{flag} {off}");
            }
            assert_eq!(
                port("[::1]:9"),
                ListenAddr(Some("[::1]:9".parse().unwrap())),
                "{flag}"
            );
            for bad in ["", " ", "nowhere", "127.0.0.1"] {
                let err = Cli::try_parse_from(["agentd", "serve", flag, bad])
                    .unwrap_err()
                    .to_string();
                assert!(err.contains(flag), "{flag} {bad:?}: {err}");
                let why = if bad.trim().is_empty() {
                    "empty"
                } else {
                    "HOST:PORT"
                };
                assert!(
                    err.contains(why) && err.contains("off"),
                    "{flag} {bad:?}: {err}"
                );
            }
        }
    }

    #[test]
    fn by_default_health_and_reflection_are_open() {
        assert_eq!(
            serve(&[]).auth_open_services,
            crate::auth::DEFAULT_OPEN_SERVICES
        );
        assert_eq!(
            serve(&["--auth-open-services", ""])
                .auth_open_services
                .concat(),
            ""
        );
    }

    #[test]
    fn only_health_and_reflection_may_be_open_services() {
        serve(&["--auth-open-services", "grpc.health.v1.Health"])
            .validate()
            .unwrap();
        for open in [
            "agents.v1.AgentService",
            "grpc.health.v1.Health,lf.a2a.v1.A2AService",
        ] {
            let err = serve(&["--auth-tokens", "tokens.toml", "--auth-open-services", open])
                .validate()
                .unwrap_err();
            assert!(
                err.starts_with("--auth-open-services") && err.contains("any user"),
                "{err}"
            );
            // Without authentication every service is open anyway: a
            // setting left over is no reason to refuse to start.
            serve(&["--auth-open-services", open]).validate().unwrap();
        }
    }

    #[test]
    fn insecure_settings_are_named() {
        let warns = |args: &[&str]| serve(args).insecure_settings();
        // The defaults listen on loopback only.
        assert_eq!(warns(&[]), Vec::<String>::new());
        let w = warns(&["--listen", "0.0.0.0:50051"]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("authentication is off") && w[0].contains("0.0.0.0:50051"),
            "{w:?}"
        );
        let w = warns(&["--a2a-listen", "[::]:8080"]);
        assert!(w[0].contains("[::]:8080 (--a2a-listen)"), "{w:?}");
        assert_eq!(
            warns(&["--listen", "[::1]:1", "--a2a-listen", "127.0.0.2:1"]),
            Vec::<String>::new()
        );
        // Tokens without TLS, off loopback: cleartext tokens.
        let w = warns(&["--auth-tokens", "t.json", "--listen", "10.0.0.7:50051"]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("cleartext"), "{w:?}");
        assert_eq!(warns(&["--auth-tokens", "t.json"]), Vec::<String>::new());
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let mut args = tls.to_vec();
        args.extend(["--auth-tokens", "t.json", "--listen", "10.0.0.7:50051"]);
        assert_eq!(warns(&args), Vec::<String>::new());
        // A client CA without a tokens file: any signed certificate, any user.
        let mut args = tls.to_vec();
        args.extend(["--tls-client-ca", "ca.pem"]);
        let w = warns(&args);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("--tls-client-ca without --auth-tokens"),
            "{w:?}"
        );
        args.extend(["--auth-tokens", "t.json"]);
        assert_eq!(warns(&args), Vec::<String>::new());
    }

    /// With bearer tokens, a health service that needs one fails every
    /// probe without credentials: the pod would never turn ready.
    #[test]
    fn tokens_with_the_health_service_closed_are_warned_about() {
        let warns = |args: &[&str]| serve(args).insecure_settings();
        let tokens = ["--auth-tokens", "t.json"];
        for open in ["", "grpc.reflection.v1.ServerReflection", " , "] {
            let w = warns(&[&tokens[..], &["--auth-open-services", open]].concat());
            assert_eq!(w.len(), 1, "{open:?}: {w:?}");
            assert!(
                w[0].starts_with("--auth-open-services does not name grpc.health.v1.Health")
                    && w[0].contains("UNAUTHENTICATED")
                    && w[0].contains("/readyz"),
                "{w:?}"
            );
        }
        for open in [
            "grpc.health.v1.Health",
            " grpc.health.v1.Health ",
            "grpc.reflection.v1.ServerReflection,grpc.health.v1.Health",
        ] {
            let w = warns(&[&tokens[..], &["--auth-open-services", open]].concat());
            assert_eq!(w, Vec::<String>::new(), "{open:?}");
        }
        assert_eq!(warns(&tokens), Vec::<String>::new());
        // Without tokens nothing asks a health check for one.
        assert_eq!(warns(&["--auth-open-services", ""]), Vec::<String>::new());
    }

    #[test]
    fn a_tls_certificate_needs_its_key() {
        assert!(Cli::try_parse_from(["agentd", "serve", "--tls-cert", "c.pem"]).is_err());
        assert!(Cli::try_parse_from(["agentd", "serve", "--tls-client-ca", "ca.pem"]).is_err());
    }

    #[test]
    fn durations_take_human_units() {
        let s = serve(&["--stall-timeout", "1500ms", "--drain-delay", "0s"]);
        assert_eq!(s.stall_timeout, Duration::from_millis(1500));
        assert_eq!(s.drain_delay, Duration::ZERO);
    }

    /// A client's waits of zero would end its call before it began.
    #[test]
    fn client_deadlines_and_idle_timeouts_must_be_more_than_zero() {
        for argv in [
            &["agentd", "a2a", "--idle-timeout", "0s", "hi"][..],
            &["agentd", "a2a", "--deadline", "0ms", "hi"],
            &[
                "agentd",
                "run",
                "--user",
                "u",
                "--session",
                "s",
                "--deadline",
                "0s",
                "hi",
            ],
            &[
                "agentd",
                "attach",
                "--user",
                "u",
                "--session",
                "s",
                "--request-id",
                "r",
                "--deadline",
                "0s",
            ],
        ] {
            let err = Cli::try_parse_from(argv).unwrap_err().to_string();
            assert!(err.contains("must be more than zero"), "{argv:?}: {err}");
        }
        assert!(Cli::try_parse_from(["agentd", "a2a", "--idle-timeout", "1ms", "hi"]).is_ok());
    }

    #[test]
    fn client_commands_take_a_resolve_interval() {
        let health = |args: &[&str]| {
            let mut argv = vec!["agentd", "health"];
            argv.extend_from_slice(args);
            match Cli::try_parse_from(argv).unwrap().command {
                Command::Health(h) => h.client.client_config().unwrap().resolve_interval,
                _ => unreachable!(),
            }
        };
        assert_eq!(health(&[]), Duration::from_secs(10));
        assert_eq!(
            health(&["--resolve-interval", "250ms"]),
            Duration::from_millis(250)
        );
    }
}
