//! Per-token overhead of the model backend.
//!
//! A fake OpenAI-compatible server streams N tokens as fast as it can. The
//! same stream is read (a) directly by a client (agentd's own chat client,
//! no gRPC) and (b) through agentd: a Run of a model-backed agent, events
//! over gRPC to the real client. Both at C concurrent runs, in the same
//! process and the same run, so the ratio is what agentd adds.
//!
//!   cargo run --release --example model_overhead -- tokens=256 concurrency=64 rounds=5
//!
//! `agentd=PATH` serves the agent from a separate `agentd serve` process
//! (that binary) instead of a server inside this process,
//! as in a deployment where agentd has its own pod; `pin=1` then puts
//! agentd on core 0 and this process (fake model and clients) on core 1.
//! `store=URL` picks agentd's store (default `memory:`). `ttft=50ms` makes
//! the fake model think that long before its first token, as a real one
//! does; `claim_first=1` runs agentd with `--claim-first` (the model call
//! waits for the turn's claim); `admin=127.0.0.1:9090` opens agentd's admin
//! port (its `/metrics`, the store's call times among them) while it runs.
//!
//! Prints time-to-first-token, time-to-last-token and the time to the
//! call's end (median, p99) of both paths and the ratios. The last token is
//! the last text read; the end is `[DONE]` read directly and, through
//! agentd, the call's status, which waits for the turn's outcome to be
//! stored (the final commit, with a durable store). Target: under 10% added to time-to-last-token and
//! under 1 ms added to time-to-first-token at 64 concurrent runs.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentd::agent::file::{self, LoadOptions};
use agentd::agent::openai::client::Step;
use agentd::agent::openai::wire::{ChatRequest, Message, Sampling, StreamOptions};
use agentd::agent::openai::{ChatClient, Endpoint, http_client};
use agentd::agent::{Agent, AgentRegistry};
use agentd::client::AgentClient;
use agentd::pb;
use agentd::server::ServerOptions;
use agentd::turn::{TurnConfig, Turns};
use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;

/// The allocator the `agentd` binary uses, so the in-process server costs
/// what the real one does.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Params {
    tokens: usize,
    concurrency: usize,
    rounds: usize,
    /// An `agentd` binary to run as a separate process.
    agentd: Option<std::path::PathBuf>,
    pin: bool,
    store: String,
    /// How long the fake model thinks before its first token (prefill).
    ttft: Duration,
    /// agentd's `--claim-first`.
    claim_first: bool,
    /// agentd's admin port (`/metrics`), when it runs as its own process.
    admin: String,
}

fn params() -> anyhow::Result<Params> {
    let mut p = Params {
        tokens: 256,
        concurrency: 64,
        rounds: 5,
        agentd: None,
        pin: false,
        store: "memory:".into(),
        ttft: Duration::ZERO,
        claim_first: false,
        admin: "off".into(),
    };
    for a in std::env::args().skip(1) {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("expected key=value, got {a:?}"))?;
        match k {
            "tokens" => p.tokens = v.parse()?,
            "concurrency" => p.concurrency = v.parse()?,
            "rounds" => p.rounds = v.parse()?,
            "agentd" => p.agentd = Some(v.into()),
            "pin" => p.pin = v == "1",
            "store" => p.store = v.into(),
            "ttft" => p.ttft = humantime::parse_duration(v)?,
            "claim_first" => p.claim_first = v == "1",
            "admin" => p.admin = v.into(),
            _ => anyhow::bail!(
                "unknown parameter {k:?}; use tokens, concurrency, rounds, agentd, pin, store, ttft, claim_first, admin"
            ),
        }
    }
    Ok(p)
}

/// The fake model: `tokens` deltas, one SSE event per body chunk, as fast as
/// the reader takes them, the first after `ttft`.
async fn fake_model(tokens: usize, ttft: Duration) -> String {
    let mut chunks: Vec<Bytes> = Vec::with_capacity(tokens + 3);
    chunks.push(Bytes::from_static(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"));
    for i in 0..tokens {
        chunks.push(Bytes::from(format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}}}}]}}\n\n"
        )));
    }
    chunks.push(Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    ));
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let chunks = Arc::new(chunks);
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let chunks = chunks.clone();
            async move {
                let first = chunks[0].clone();
                let prefill = futures::stream::once(async move {
                    if !ttft.is_zero() {
                        tokio::time::sleep(ttft).await;
                    }
                    Ok::<_, Infallible>(first)
                });
                let rest = futures::stream::iter(
                    (1..chunks.len()).map(move |i| Ok::<_, Infallible>(chunks[i].clone())),
                );
                let body = futures::StreamExt::chain(prefill, rest);
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(body))
                    .unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    // TCP_NODELAY, as model servers set it (uvicorn, llama-server): without
    // it a lone chunk waits for the reader's delayed ACK (about 40 ms).
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// PARTIAL_TEXT events received through agentd (deltas that arrive
/// together are merged, so there can be fewer than tokens).
static EVENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Bytes of text the fake model streams.
fn text_len(tokens: usize) -> usize {
    (0..tokens).map(|i| format!("tok{i} ").len()).sum()
}

/// The times of one run, from its request.
#[derive(Clone, Copy)]
struct Sample {
    /// The first token (text) read.
    first: Duration,
    /// The last token read.
    last: Duration,
    /// The end of the call: `[DONE]` read directly; through agentd, the
    /// call's status, which comes once the turn's outcome is stored.
    end: Duration,
}

async fn direct_once(client: &ChatClient, tokens: usize) -> anyhow::Result<Sample> {
    let messages = [Message::User {
        content: "go".into(),
    }];
    let sampling = Sampling::default();
    let req = ChatRequest {
        model: "fake",
        messages: &messages,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        tools: &[],
        tool_choice: None,
        sampling: &sampling,
    };
    let t0 = Instant::now();
    let mut s = client.start(&req, "call").await?;
    let (mut first, mut last) = (None, Duration::ZERO);
    let mut n = 0;
    loop {
        match s.next().await? {
            Step::Text(t) => {
                last = t0.elapsed();
                first.get_or_insert(last);
                n += t.len();
            }
            Step::ToolCall(_) => {}
            Step::Done(_) => break,
        }
    }
    anyhow::ensure!(
        n == text_len(tokens),
        "read {n} bytes of text, expected {}",
        text_len(tokens)
    );
    Ok(Sample {
        first: first.unwrap_or_default(),
        last,
        end: t0.elapsed(),
    })
}

async fn agentd_once(
    mut client: AgentClient,
    session: String,
    tokens: usize,
) -> anyhow::Result<Sample> {
    let req = pb::RunRequest {
        user_id: "bench".into(),
        session_id: session,
        text: "go".into(),
        request_id: String::new(),
        agent: "fake".into(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut call = client.run(req, Duration::from_secs(60)).await?;
    let (mut first, mut last) = (None, Duration::ZERO);
    let mut n = 0;
    while let Some(e) = call.events.message().await? {
        if e.kind() == pb::EventKind::PartialText {
            last = t0.elapsed();
            first.get_or_insert(last);
            n += e.text.len();
            EVENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    anyhow::ensure!(
        n == text_len(tokens),
        "read {n} bytes of text, expected {}",
        text_len(tokens)
    );
    Ok(Sample {
        first: first.unwrap_or_default(),
        last,
        end: t0.elapsed(),
    })
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Summary {
    ttft_p50: Duration,
    ttft_p99: Duration,
    ttlt_p50: Duration,
    ttlt_p99: Duration,
    end_p50: Duration,
    end_p99: Duration,
}

fn summarise(samples: &[Sample]) -> Summary {
    let mut ft: Vec<_> = samples.iter().map(|s| s.first).collect();
    let mut lt: Vec<_> = samples.iter().map(|s| s.last).collect();
    let mut end: Vec<_> = samples.iter().map(|s| s.end).collect();
    Summary {
        ttft_p50: pct(&mut ft, 0.5),
        ttft_p99: pct(&mut ft, 0.99),
        ttlt_p50: pct(&mut lt, 0.5),
        ttlt_p99: pct(&mut lt, 0.99),
        end_p50: pct(&mut end, 0.5),
        end_p99: pct(&mut end, 0.99),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let p = params()?;
    let url = fake_model(p.tokens, p.ttft).await;

    // (a) Direct: the chat client reading the model's stream.
    let direct_client = ChatClient::new(http_client()?, Endpoint::new(&url), "bench");
    // (b) Through agentd: an agent from an agents file, served on 127.0.0.1.
    let toml = format!(
        "[agents.fake]\ncall_timeout = \"60s\"\n[agents.fake.model]\nbase_url = \"{url}\"\nmodel = \"fake\"\n"
    );
    let mut external = None;
    let mut in_process = None;
    let addr = match &p.agentd {
        Some(bin) => {
            let (child, addr) = spawn_agentd(bin, &toml, &p)?;
            external = Some(child);
            addr
        }
        None => {
            let f = file::parse(&toml, Path::new("bench.toml"), &LoadOptions::default())?;
            let agents: Vec<Arc<dyn Agent>> = f.agents;
            let registry = AgentRegistry::new(agents, "fake")?;
            let cfg = TurnConfig {
                max_concurrent_runs: 4096,
                history_turns: 0,
                claim_first: p.claim_first,
                ..TurnConfig::default()
            };
            let store = agentd::store::open(&p.store).await?;
            let turns = Turns::new(store, registry, cfg);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(agentd::server::run(
                listener,
                turns,
                ServerOptions {
                    drain_delay: Duration::ZERO,
                    ..Default::default()
                },
                async {
                    let _ = stop_rx.await;
                },
            ));
            in_process = Some((stop, server));
            addr
        }
    };
    let client = connect(&format!("http://{addr}")).await?;

    let mut direct = Vec::new();
    let mut through = Vec::new();
    // Round 0 warms connections and allocators; it is not counted. Paths
    // alternate so drift (other load on the machine) hits both alike.
    for round in 0..=p.rounds {
        if round == 1 {
            EVENTS.store(0, std::sync::atomic::Ordering::Relaxed);
        }
        // A new session per run, made before the clock starts: the model
        // gets the same one message on both paths, no conversation history.
        let mut sessions = Vec::new();
        for _ in 0..p.concurrency {
            sessions.push(client.clone().create_session("bench").await?.session_id);
        }
        let runs = (0..p.concurrency).map(|_| direct_once(&direct_client, p.tokens));
        let d: Vec<Sample> = futures::future::try_join_all(runs).await?;
        let runs = sessions
            .iter()
            .map(|s| agentd_once(client.clone(), s.clone(), p.tokens));
        let a: Vec<Sample> = futures::future::try_join_all(runs).await?;
        if round > 0 {
            direct.extend(d);
            through.extend(a);
        }
    }
    let d = summarise(&direct);
    let a = summarise(&through);
    println!(
        "model overhead: {} tokens per run, {} concurrent runs, {} rounds ({} runs per path); agentd {}, store {}",
        p.tokens,
        p.concurrency,
        p.rounds,
        direct.len(),
        match (&p.agentd, p.pin) {
            (None, _) => "in this process",
            (Some(_), false) => "in its own process",
            (Some(_), true) => "in its own process on core 0, model and clients on core 1",
        },
        p.store
    );
    println!(
        "| path | TTFT p50 ms | TTFT p99 ms | TTLT p50 ms | TTLT p99 ms | end p50 ms | end p99 ms |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, s) in [
        ("direct (chat client)", &d),
        ("through agentd (gRPC Run)", &a),
    ] {
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            ms(s.ttft_p50),
            ms(s.ttft_p99),
            ms(s.ttlt_p50),
            ms(s.ttlt_p99),
            ms(s.end_p50),
            ms(s.end_p99)
        );
    }
    let ttlt_ratio = a.ttlt_p50.as_secs_f64() / d.ttlt_p50.as_secs_f64();
    let ttft_added = ms(a.ttft_p50) - ms(d.ttft_p50);
    println!(
        "end ratio agentd/direct (p50): {:.3} (the call's status, once the turn is stored, against [DONE]); p99 ratio {:.3}",
        a.end_p50.as_secs_f64() / d.end_p50.as_secs_f64(),
        a.end_p99.as_secs_f64() / d.end_p99.as_secs_f64()
    );
    println!(
        "TTLT ratio agentd/direct (p50): {ttlt_ratio:.3} (target < 1.10: {}); p99 ratio {:.3}",
        if ttlt_ratio < 1.10 { "met" } else { "NOT met" },
        a.ttlt_p99.as_secs_f64() / d.ttlt_p99.as_secs_f64()
    );
    println!(
        "TTFT added by agentd (p50): {ttft_added:.3} ms (target < 1 ms: {}); p99 added {:.3} ms",
        if ttft_added < 1.0 { "met" } else { "NOT met" },
        ms(a.ttft_p99) - ms(d.ttft_p99)
    );
    println!(
        "PARTIAL_TEXT events per run through agentd: {:.1} for {} tokens",
        EVENTS.load(std::sync::atomic::Ordering::Relaxed) as f64 / through.len() as f64,
        p.tokens
    );
    if let Some((stop, server)) = in_process {
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
    }
    if let Some(mut child) = external {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}

/// Starts `agentd serve` with the fake agent on a free loopback port.
fn spawn_agentd(
    bin: &Path,
    toml: &str,
    p: &Params,
) -> anyhow::Result<(std::process::Child, std::net::SocketAddr)> {
    let dir = std::env::temp_dir().join(format!("agentd-model-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let agents = dir.join("agents.toml");
    std::fs::write(&agents, toml)?;
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut cmd = if p.pin {
        let mut c = std::process::Command::new("taskset");
        c.args(["-c", "0"]).arg(bin);
        c
    } else {
        std::process::Command::new(bin)
    };
    cmd.args(["serve", "--listen", &addr.to_string()])
        .arg("--agents")
        .arg(&agents)
        .args(["--default-agent", "fake", "--store", &p.store])
        .args(["--max-concurrent-runs", "4096", "--history-turns", "0"])
        .args([
            "--admin-listen",
            &p.admin,
            "--a2a-listen",
            "off",
            "--drain-delay",
            "0s",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("agentd.log"))?);
    if p.claim_first {
        cmd.arg("--claim-first");
    }
    let child = cmd.spawn()?;
    if p.pin {
        // This process (the fake model and the clients) on the other core.
        let me = std::process::id().to_string();
        std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", "1", &me])
            .stdout(std::process::Stdio::null())
            .status()?;
    }
    Ok((child, addr))
}

/// Connects, waiting for a server that is still starting.
async fn connect(url: &str) -> anyhow::Result<AgentClient> {
    let mut last = None;
    for _ in 0..100 {
        match AgentClient::connect(url).await {
            Ok(c) => return Ok(c),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no server")))
}
