//! The load itself: streams over connections, counted and timed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;
use tokio::time::Instant;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};

use super::process::{self, Server, Usage};
use super::{BenchArgs, Workload};
use crate::agent::now_unix_nanos;
use crate::pb;
use crate::pb::agent_service_client::AgentServiceClient;

/// Histograms hold microseconds, from 1 µs to 10 minutes, 3 significant digits.
const HIST_MAX_US: u64 = 600_000_000;
/// Extra time on every call's deadline beyond the end of the run.
const DEADLINE_SLACK: Duration = Duration::from_secs(30);

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

/// Percentiles of one histogram, in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Quantiles {
    pub count: u64,
    pub mean: f64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

impl Quantiles {
    fn of(h: &Histogram<u64>) -> Option<Self> {
        (!h.is_empty()).then(|| Self {
            count: h.len(),
            mean: h.mean(),
            p50: h.value_at_quantile(0.50),
            p90: h.value_at_quantile(0.90),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        })
    }
}

/// The idle workload's memory reading.
#[derive(Debug, Clone, Serialize)]
pub struct IdleReport {
    /// Streams whose response headers arrived (the run is open and waiting).
    pub opened: usize,
    /// How long opening all of them took.
    pub open_seconds: f64,
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    /// (after - before) / opened.
    pub bytes_per_stream: f64,
}

/// What one benchmark run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub server: String,
    pub workload: &'static str,
    pub streams: usize,
    pub connections: usize,
    /// The `stream` agent parameters of every call.
    pub text: String,
    pub seconds: f64,
    pub events: u64,
    pub events_per_second: f64,
    /// Calls that ended with their final event inside the window.
    pub calls: u64,
    pub calls_per_second: f64,
    /// Events the followers (`--followers`) received inside the window, per
    /// second; `None` without followers.
    pub follower_events_per_second: Option<f64>,
    pub errors: u64,
    /// The first error's status, if any.
    pub first_error: Option<String>,
    /// Producer timestamp → client receive, per event.
    pub latency_us: Option<Quantiles>,
    /// Call start → first event, per call.
    pub first_event_us: Option<Quantiles>,
    /// Server RSS at the end of the window (a server this run started).
    pub server_rss_bytes: Option<u64>,
    /// Server CPU time / wall time over the window (1.0 = one core busy).
    pub server_cpu: Option<f64>,
    /// Client CPU time / wall time over the window.
    pub client_cpu: Option<f64>,
    /// Share of all the machine's CPU time that was busy over the window
    /// (1.0 = every core; other processes count too).
    pub machine_busy: Option<f64>,
    pub idle: Option<IdleReport>,
    /// /proc/loadavg at the end.
    pub load_average: String,
}

impl Report {
    /// One line for a person.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} {} streams={} conns={}: {:.0} events/s, {:.1} calls/s",
            self.server,
            self.workload,
            self.streams,
            self.connections,
            self.events_per_second,
            self.calls_per_second
        );
        if let Some(l) = &self.latency_us {
            s += &format!(", latency p50 {} us p99 {} us", l.p50, l.p99);
        }
        if let Some(f) = &self.first_event_us {
            s += &format!(", first event p50 {} us p99 {} us", f.p50, f.p99);
        }
        if let Some(i) = &self.idle {
            s += &format!(
                ", {} open in {:.1}s, rss {:.1} MiB -> {:.1} MiB ({:.0} B/stream)",
                i.opened,
                i.open_seconds,
                i.rss_before_bytes as f64 / 1048576.0,
                i.rss_after_bytes as f64 / 1048576.0,
                i.bytes_per_stream
            );
        } else if let Some(r) = self.server_rss_bytes {
            s += &format!(", server rss {:.1} MiB", r as f64 / 1048576.0);
        }
        if let (Some(sc), Some(cc)) = (self.server_cpu, self.client_cpu) {
            s += &format!(", cpu server {sc:.2} client {cc:.2}");
        }
        if let Some(m) = self.machine_busy {
            s += &format!(", machine busy {:.0}%", m * 100.0);
        }
        if self.errors > 0 {
            s += &format!(
                ", {} errors (first: {})",
                self.errors,
                self.first_error.as_deref().unwrap_or("?")
            );
        }
        s + &format!(", load {}", self.load_average)
    }
}

/// One stream's counts, merged at the end (no shared state while running).
struct StreamStats {
    events: u64,
    calls: u64,
    errors: u64,
    first_error: Option<String>,
    latency: Histogram<u64>,
    first_event: Histogram<u64>,
}

impl StreamStats {
    fn new() -> Self {
        Self {
            events: 0,
            calls: 0,
            errors: 0,
            first_error: None,
            latency: histogram(),
            first_event: histogram(),
        }
    }

    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }

    fn merge(&mut self, o: StreamStats) {
        self.events += o.events;
        self.calls += o.calls;
        self.errors += o.errors;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
        self.latency.add(&o.latency).expect("same bounds");
        self.first_event.add(&o.first_event).expect("same bounds");
    }
}

/// Where one stream sends its calls.
#[derive(Clone)]
struct Target {
    client: AgentServiceClient<Channel>,
    user: String,
    session: String,
    agent: String,
    text: String,
    /// Calls sent with a request id of their own (`--request-ids`); `None`
    /// leaves the request id to the server.
    request_ids: Option<u64>,
    /// Followers attached to each call (`--followers`), and the events
    /// they all received inside the window.
    followers: usize,
    follower_events: Arc<AtomicU64>,
}

impl Target {
    fn request(&mut self, timeout: Duration) -> Request<pb::RunRequest> {
        let request_id = match &mut self.request_ids {
            Some(n) => {
                *n += 1;
                format!("bench-{n}")
            }
            None => String::new(),
        };
        let mut req = Request::new(pb::RunRequest {
            user_id: self.user.clone(),
            session_id: self.session.clone(),
            text: self.text.clone(),
            request_id,
            agent: self.agent.clone(),
            ..Default::default()
        });
        req.set_timeout(timeout);
        req
    }
}

async fn connect(args: &BenchArgs) -> anyhow::Result<Vec<AgentServiceClient<Channel>>> {
    let uri = format!("http://{}", args.target);
    let mut clients = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        // One Endpoint::connect is one TCP connection.
        let channel = Endpoint::from_shared(uri.clone())?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .with_context(|| format!("connecting to {uri}"))?;
        clients.push(AgentServiceClient::new(channel).max_decoding_message_size(16 << 20));
    }
    Ok(clients)
}

/// One session per stream, created on the stream's connection.
async fn targets(
    args: &BenchArgs,
    clients: &[AgentServiceClient<Channel>],
) -> anyhow::Result<Vec<Target>> {
    let user = "bench".to_string();
    let text = args.workload.text(args);
    let follower_events = Arc::new(AtomicU64::new(0));
    let mut out = Vec::with_capacity(args.streams);
    for i in 0..args.streams {
        let mut client = clients[i % clients.len()].clone();
        let mut req = Request::new(pb::CreateSessionRequest {
            user_id: user.clone(),
            request_id: String::new(),
        });
        req.set_timeout(Duration::from_secs(10));
        let session = client
            .create_session(req)
            .await
            .context("CreateSession")?
            .into_inner()
            .session_id;
        out.push(Target {
            client,
            user: user.clone(),
            session,
            agent: args.agent.clone(),
            text: text.clone(),
            request_ids: (args.request_ids || args.followers > 0).then_some(0),
            followers: args.followers,
            follower_events: follower_events.clone(),
        });
    }
    Ok(out)
}

/// A follower of `t`'s call `request_id`: Attach from the start, read to
/// the end, events inside the window counted.
async fn follow(t: Target, request_id: String, measure_from: Instant, end: Instant) {
    let mut req = Request::new(pb::AttachRequest {
        user_id: t.user.clone(),
        session_id: t.session.clone(),
        request_id,
        after_seq: None,
    });
    req.set_timeout(end.saturating_duration_since(Instant::now()) + DEADLINE_SLACK);
    let mut client = t.client.clone();
    let Ok(events) = client.attach(req).await else {
        return;
    };
    let mut events = events.into_inner();
    while let Ok(Ok(Some(_))) = tokio::time::timeout_at(end, events.message()).await {
        if Instant::now() >= measure_from {
            t.follower_events.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub async fn run(args: &BenchArgs, server: Option<&Server>) -> anyhow::Result<Report> {
    let clients = connect(args).await?;
    let targets = targets(args, &clients).await?;
    let mut report = match args.workload {
        Workload::Idle => idle(args, server, targets).await?,
        _ => timed(args, server, targets).await?,
    };
    report.load_average = load_average();
    Ok(report)
}

/// Every stream runs calls back to back; events and calls are counted from
/// the end of the warm-up to the end of the duration, then everything stops.
async fn timed(
    args: &BenchArgs,
    server: Option<&Server>,
    targets: Vec<Target>,
) -> anyhow::Result<Report> {
    let begin = Instant::now();
    let measure_from = begin + args.warmup;
    let end = measure_from + args.duration;
    let text = targets[0].text.clone();
    let (followers, follower_events) = (targets[0].followers, targets[0].follower_events.clone());
    let tasks: Vec<_> = targets
        .into_iter()
        .map(|t| tokio::spawn(drive(t, measure_from, end)))
        .collect();

    tokio::time::sleep_until(measure_from).await;
    let (before, machine_before, read_before) =
        (usages(server), process::machine_busy(), Instant::now());
    tokio::time::sleep_until(end).await;
    let (after, machine_after, read_after) =
        (usages(server), process::machine_busy(), Instant::now());
    // A starved client reads late: divide CPU time by the time between readings.
    let cpu_secs = (read_after - read_before).as_secs_f64();

    let mut total = StreamStats::new();
    for t in tasks {
        total.merge(t.await.context("a load task panicked")?);
    }
    let secs = args.duration.as_secs_f64();
    let (server_cpu, client_cpu) = match (&before, &after) {
        (Ok((sb, cb)), Ok((sa, ca))) => (
            sb.zip(*sa)
                .map(|(b, a)| (a.cpu_seconds - b.cpu_seconds) / cpu_secs),
            Some((ca.cpu_seconds - cb.cpu_seconds) / cpu_secs),
        ),
        _ => (None, None),
    };
    Ok(Report {
        server: args.server_name.clone(),
        workload: args.workload.as_str(),
        streams: args.streams,
        connections: args.connections,
        text,
        seconds: secs,
        events: total.events,
        events_per_second: total.events as f64 / secs,
        calls: total.calls,
        calls_per_second: total.calls as f64 / secs,
        follower_events_per_second: (followers > 0)
            .then(|| follower_events.load(Ordering::Relaxed) as f64 / secs),
        errors: total.errors,
        first_error: total.first_error,
        latency_us: Quantiles::of(&total.latency),
        first_event_us: Quantiles::of(&total.first_event),
        server_rss_bytes: after.ok().and_then(|(s, _)| s.map(|s| s.rss_bytes)),
        server_cpu,
        client_cpu,
        machine_busy: match (machine_before, machine_after) {
            (Ok(b), Ok(a)) if a.1 > b.1 => Some((a.0 - b.0) as f64 / (a.1 - b.1) as f64),
            _ => None,
        },
        idle: None,
        load_average: String::new(),
    })
}

fn usages(server: Option<&Server>) -> anyhow::Result<(Option<Usage>, Usage)> {
    let s = server.map(|s| s.usage()).transpose()?;
    Ok((s, process::own_usage()?))
}

/// Back-to-back calls on one stream slot until `end`.
async fn drive(mut t: Target, measure_from: Instant, end: Instant) -> StreamStats {
    let mut stats = StreamStats::new();
    let stop = tokio::time::sleep_until(end);
    tokio::pin!(stop);
    'calls: loop {
        let started = Instant::now();
        if started >= end {
            break;
        }
        let req = t.request(end - started + DEADLINE_SLACK);
        let request_id = req.get_ref().request_id.clone();
        let resp = tokio::select! {
            biased;
            _ = &mut stop => break,
            r = t.client.run(req) => r,
        };
        let mut events = match resp {
            Ok(r) => r.into_inner(),
            Err(s) => {
                stats.error(format!("{:?}: {}", s.code(), s.message()));
                // Do not spin on a refusing server.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let mut first = true;
        loop {
            let msg = tokio::select! {
                biased;
                _ = &mut stop => break 'calls,
                m = events.message() => m,
            };
            match msg {
                Ok(Some(ev)) => {
                    let received = Instant::now();
                    let lat_ns = now_unix_nanos() - ev.created_unix_nanos;
                    if first {
                        first = false;
                        for _ in 0..t.followers {
                            tokio::spawn(follow(t.clone(), request_id.clone(), measure_from, end));
                        }
                        if started >= measure_from {
                            let us = (received - started).as_micros() as u64;
                            stats.first_event.saturating_record(us.max(1));
                        }
                    }
                    if received >= measure_from {
                        stats.events += 1;
                        stats
                            .latency
                            .saturating_record((lat_ns / 1000).max(1) as u64);
                        if ev.is_final {
                            stats.calls += 1;
                        }
                    }
                }
                Ok(None) => break,
                Err(s) => {
                    stats.error(format!("{:?}: {}", s.code(), s.message()));
                    break;
                }
            }
        }
    }
    stats
}

/// Opens every stream, waits until all are open (headers received), lets the
/// server settle, and reads its RSS; then drops them all.
async fn idle(
    args: &BenchArgs,
    server: Option<&Server>,
    targets: Vec<Target>,
) -> anyhow::Result<Report> {
    let server = server
        .context("the idle workload measures server memory: start the server with `-- CMD...`")?;
    let text = targets[0].text.clone();
    let rss_before = server.usage()?.rss_bytes;
    let opened = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let hold = args.idle_wait + DEADLINE_SLACK;
    let begin = Instant::now();
    let mut tasks = Vec::with_capacity(targets.len());
    for mut t in targets {
        let (opened, failed, mut release) = (opened.clone(), failed.clone(), release_rx.clone());
        tasks.push(tokio::spawn(async move {
            let req = t.request(hold);
            match t.client.run(req).await {
                Ok(stream) => {
                    opened.fetch_add(1, Ordering::SeqCst);
                    let _ = release.wait_for(|r| *r).await;
                    drop(stream);
                    None
                }
                Err(s) => {
                    failed.fetch_add(1, Ordering::SeqCst);
                    Some(format!("{:?}: {}", s.code(), s.message()))
                }
            }
        }));
    }
    // Bounded: the runs end by themselves after idle_wait anyway.
    let give_up = begin
        + args
            .idle_wait
            .saturating_sub(args.settle + Duration::from_secs(5));
    while opened.load(Ordering::SeqCst) + failed.load(Ordering::SeqCst) < args.streams
        && Instant::now() < give_up
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let open_seconds = begin.elapsed().as_secs_f64();
    tokio::time::sleep(args.settle).await;
    let rss_after = server.usage()?.rss_bytes;
    let n = opened.load(Ordering::SeqCst);
    let _ = release_tx.send(true);
    let mut errors = 0;
    let mut first_error = None;
    for t in tasks {
        t.abort();
        if let Ok(Some(e)) = t.await {
            errors += 1;
            first_error.get_or_insert(e);
        }
    }
    Ok(Report {
        server: args.server_name.clone(),
        workload: args.workload.as_str(),
        streams: args.streams,
        connections: args.connections,
        text,
        seconds: open_seconds,
        events: 0,
        events_per_second: 0.0,
        calls: 0,
        calls_per_second: 0.0,
        follower_events_per_second: None,
        errors,
        first_error,
        latency_us: None,
        first_event_us: None,
        server_rss_bytes: Some(rss_after),
        server_cpu: None,
        client_cpu: None,
        machine_busy: None,
        idle: Some(IdleReport {
            opened: n,
            open_seconds,
            rss_before_bytes: rss_before,
            rss_after_bytes: rss_after,
            bytes_per_stream: (rss_after as f64 - rss_before as f64) / n.max(1) as f64,
        }),
        load_average: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(request_ids: Option<u64>) -> Target {
        let channel = Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        Target {
            client: AgentServiceClient::new(channel),
            user: "bench".into(),
            session: "s".into(),
            agent: "stream".into(),
            text: "hi".into(),
            request_ids,
            followers: 0,
            follower_events: Arc::new(AtomicU64::new(0)),
        }
    }

    #[tokio::test]
    async fn with_request_ids_every_call_has_its_own_and_without_the_server_makes_them() {
        let mut t = target(Some(0));
        let ids: Vec<String> = (0..3)
            .map(|_| t.request(Duration::from_secs(1)).into_inner().request_id)
            .collect();
        assert_eq!(ids, ["bench-1", "bench-2", "bench-3"]);
        let mut t = target(None);
        assert_eq!(
            t.request(Duration::from_secs(1)).into_inner().request_id,
            ""
        );
    }
}
