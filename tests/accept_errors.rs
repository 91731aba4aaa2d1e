//! Out of file descriptors: the gRPC port's accepts fail. It must wait
//! between tries and say so in its log, not try again at once in a loop
//! that takes a whole core and logs nothing (the connections it holds go on
//! being served, and the ones waiting in the listen queue are accepted once
//! descriptors free up). And at start-up the soft open-file limit is raised
//! to the hard one, with a warning when even that is short of what the
//! ports may hold.

mod support;

use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::{check_on_new_connection, serve_grpc_alone};
use tokio::io::AsyncBufReadExt;

/// `agentd serve` (memory store, the gRPC port alone) started with its
/// open-file limit at `soft`/`hard`; its log lines (JSON) gathered as they
/// come. Killed when dropped.
struct Limited {
    _child: tokio::process::Child,
    pid: u32,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl Limited {
    async fn serve(soft: u64, hard: u64, args: &[&str]) -> Limited {
        let mut cmd = serve_grpc_alone(&["--drain-delay", "0s"]);
        cmd.env("AGENTD_LOG", "info")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: between fork and exec the child only calls setrlimit,
        // which is async-signal-safe, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || rlimit::setrlimit(rlimit::Resource::NOFILE, soft, hard));
        }
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn agentd serve");
        let pid = child.id().unwrap();
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let log: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
        let gathered = log.clone();
        tokio::spawn(async move {
            let mut addr_tx = Some(addr_tx);
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if let Some(a) = v.get("listen").and_then(|l| l.as_str())
                    && let Some(tx) = addr_tx.take()
                {
                    let _ = tx.send(a.parse::<SocketAddr>().unwrap());
                }
                gathered.lock().unwrap().push(v);
            }
        });
        let addr = tokio::time::timeout(Duration::from_secs(30), addr_rx)
            .await
            .expect("agentd serve printed its address in time")
            .expect("agentd serve printed its address");
        Limited {
            _child: child,
            pid,
            addr,
            log,
        }
    }

    /// The log lines at `level` whose message contains `text`.
    fn lines(&self, level: &str, text: &str) -> Vec<serde_json::Value> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|v| {
                v["level"] == level && v["message"].as_str().is_some_and(|m| m.contains(text))
            })
            .cloned()
            .collect()
    }

    /// The file descriptors the process has open.
    fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// CPU time (user and system, every thread) the process has used.
    fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap();
        // After the command name in parentheses: state is field 3, utime
        // and stime fields 14 and 15, in clock ticks.
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second() as f64)
    }

    /// The soft and hard open-file limits of the process.
    fn nofile_limits(&self) -> (u64, u64) {
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", self.pid)).unwrap();
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap();
        let mut values = line["Max open files".len()..].split_whitespace();
        let mut next = || values.next().unwrap().parse::<u64>().unwrap();
        (next(), next())
    }
}

/// The unit of /proc's CPU times (USER_HZ; 100 on every Linux in use).
fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// Polls `done` every 20 ms for up to 10 s.
async fn within_10s(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "{what} within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const LIMIT: u64 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_file_descriptors_the_grpc_port_waits_between_accepts_and_warns_once() {
    // The hard limit too: the server raises its soft limit to the hard one.
    let server = Limited::serve(LIMIT, LIMIT, &["--max-connections", "1000"]).await;
    assert_eq!(
        server
            .lines(
                "WARN",
                "open-file limit (RLIMIT_NOFILE, raised to the hard limit) is below"
            )
            .len(),
        1,
        "a start-up warning that {LIMIT} descriptors cannot hold 1000 connections"
    );

    // More connections than descriptors: the server accepts until it has
    // none left; the rest wait in the listen queue, keeping the listener
    // readable while every accept fails with EMFILE.
    let mut held = Vec::new();
    for _ in 0..LIMIT + 40 {
        let c = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect(server.addr),
        )
        .await
        .expect("connected in time (the listen queue takes what is not accepted)")
        .unwrap();
        held.push(c);
    }
    within_10s("the server to use every descriptor", || {
        server.open_fds() as u64 >= LIMIT
    })
    .await;

    let (cpu_before, wall) = (server.cpu_time(), std::time::Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = server.cpu_time() - cpu_before;
    let share = used.as_secs_f64() / wall.elapsed().as_secs_f64();
    assert!(
        share < 0.2,
        "out of descriptors, the server used {used:?} of CPU in {:?} ({:.0}% of a core): it must wait between accepts",
        wall.elapsed(),
        share * 100.0
    );
    let warnings = server.lines("WARN", "could not accept connections");
    assert_eq!(
        warnings.len(),
        1,
        "one warning for the failing accepts, not one per try: {warnings:?}"
    );
    assert_eq!(warnings[0]["port"], "grpc");

    // Descriptors free up: the port accepts again, and says so.
    drop(held);
    within_10s("the log to say the port accepts again", || {
        !server
            .lines("INFO", "accepting connections again")
            .is_empty()
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while let Err(e) = check_on_new_connection(server.addr, Duration::from_secs(2)).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a new connection is served again: {e}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn at_start_up_the_soft_open_file_limit_is_raised_to_the_hard_one() {
    let (_, ours) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap();
    let hard = ours.min(4096);
    if hard <= 256 {
        eprintln!("skipped: this process's hard open-file limit is {ours}");
        return;
    }
    let server = Limited::serve(256, hard, &["--max-connections", "100"]).await;
    assert_eq!(server.nofile_limits(), (hard, hard));
    let starting = server.lines("INFO", "agentd starting");
    assert_eq!(starting[0]["open_file_limit"], hard);
    assert!(
        server.lines("WARN", "open-file limit").is_empty(),
        "{hard} descriptors hold 100 connections: no warning"
    );
}
