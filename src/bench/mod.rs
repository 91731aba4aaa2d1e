//! `agentd bench`: a load generator for any `agents.v1.AgentService` server.
//!
//! It opens S Run streams over C connections to a server on loopback, counts
//! events, records the producer→client latency of every event (from
//! `AgentEvent.created_unix_nanos`) and the first-event latency of every call
//! in HDR histograms, and reports events/s, calls/s and, for a server it
//! started itself (`-- CMD...`), that server's RSS and CPU time from /proc.
//! Everything is bounded: a run lasts `--duration` (the idle workload:
//! until its streams are open, plus `--settle`), and every call carries a
//! deadline.
//!
//! The same client drives agentd, a raw tonic server and a Python grpc.aio
//! server (see `bench/run.sh`), so their numbers can be read side by side.

mod load;
mod process;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

pub use load::Report;

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 500ms, 5s)"))
}

/// What the server is asked to do in each Run (parameters of the `stream`
/// agent, which the baseline servers understand too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// 10,000-event runs, the producer yielding as fast as it can.
    Bursty,
    /// 10,000-event runs, the producer yielding to the scheduler between events.
    OneAtATime,
    /// 10-event runs: calls/s and first-event latency.
    Short,
    /// Events paced at `--rate` per stream for the whole duration: latency.
    Paced,
    /// Streams that are opened and then wait: the server's memory per stream.
    Idle,
}

impl Workload {
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::Bursty => "bursty",
            Workload::OneAtATime => "one-at-a-time",
            Workload::Short => "short",
            Workload::Paced => "paced",
            Workload::Idle => "idle",
        }
    }

    /// The `stream` agent's parameters for one call of this workload.
    fn text(self, args: &BenchArgs) -> String {
        let size = args.size;
        match self {
            Workload::Bursty => format!("n=10000 size={size} rate=0 yield=0"),
            Workload::OneAtATime => format!("n=10000 size={size} rate=0 yield=1"),
            Workload::Short => format!("n=10 size={size} rate=0 yield=0"),
            Workload::Paced => {
                let n = (args.rate * (args.duration + args.warmup).as_secs_f64()).ceil() as u64 + 1;
                format!("n={n} size={size} rate={} yield=0", args.rate)
            }
            Workload::Idle => format!(
                "n=1 size={size} rate=0 yield=0 wait={}s",
                args.idle_wait.as_secs().max(1)
            ),
        }
    }
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// What each Run asks the server for.
    #[arg(long, value_enum)]
    pub workload: Workload,

    /// Concurrent Run streams.
    #[arg(long, default_value_t = 1)]
    pub streams: usize,

    /// HTTP/2 connections the streams are spread over (round robin).
    #[arg(long, default_value_t = 1)]
    pub connections: usize,

    /// Server to load; must be a loopback address.
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub target: SocketAddr,

    /// How long events are counted (after the warm-up).
    #[arg(long, value_parser = duration, default_value = "5s")]
    pub duration: Duration,

    /// How long the load runs before counting starts.
    #[arg(long, value_parser = duration, default_value = "1s")]
    pub warmup: Duration,

    /// Bytes of text per event.
    #[arg(long, default_value_t = 64)]
    pub size: usize,

    /// Events per second per stream for the `paced` workload.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,

    /// Idle workload: how long each stream's run waits before its only event
    /// (longer than opening all the streams takes).
    #[arg(long, value_parser = duration, default_value = "120s")]
    pub idle_wait: Duration,

    /// Idle workload: pause after the last stream opened, before RSS is read.
    #[arg(long, value_parser = duration, default_value = "2s")]
    pub settle: Duration,

    /// The agent to ask (agentd's RunRequest.agent; the baselines ignore it).
    #[arg(long, default_value = "stream")]
    pub agent: String,

    /// Send a request id with every Run (a new one per call), as clients
    /// that retry do; by default the server makes one up.
    #[arg(long)]
    pub request_ids: bool,

    /// Attach this many followers to every Run once its first event is in
    /// (as clients resuming a dropped stream, or watching a turn, do): each
    /// reads the turn from its first event to its end, through the store.
    /// Sends request ids (`--request-ids`). Their events are reported
    /// apart (`follower_events_per_second`).
    #[arg(long, default_value_t = 0)]
    pub followers: usize,

    /// Label of the server in the report (e.g. agentd, tonic, grpc.aio).
    #[arg(long, default_value = "server")]
    pub server_name: String,

    /// Append the result as one JSON object per line to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,

    /// Start this server command first (measuring its RSS and CPU), wait until
    /// it accepts connections on --target, and stop it at the end.
    #[arg(last = true)]
    pub spawn: Vec<String>,
}

/// Runs one benchmark and prints (and optionally appends) its report.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if !args.target.ip().is_loopback() {
        anyhow::bail!("--target must be a loopback address; the benchmark only loads this machine");
    }
    if args.streams == 0 || args.connections == 0 {
        anyhow::bail!("--streams and --connections must be at least 1");
    }
    if args.duration.is_zero() || args.duration > Duration::from_secs(600) {
        anyhow::bail!("--duration must be more than 0s and at most 10m");
    }
    let server = if args.spawn.is_empty() {
        None
    } else {
        Some(process::Server::spawn(&args.spawn, args.target).await?)
    };
    let result = load::run(&args, server.as_ref()).await;
    if let Some(s) = server {
        s.stop().await;
    }
    let report = result?;
    println!("{}", report.summary());
    if let Some(path) = &args.json_out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        writeln!(f, "{}", serde_json::to_string(&report)?)?;
    }
    Ok(())
}
