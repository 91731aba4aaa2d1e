//! A server process the benchmark started: readiness, RSS and CPU time from
//! /proc, and stopping it.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;

/// Linux reports utime/stime in clock ticks of 1/100 s (USER_HZ).
const TICKS_PER_SECOND: f64 = 100.0;
/// How long a server may take to accept its first connection.
const STARTUP: Duration = Duration::from_secs(30);

pub struct Server {
    child: Child,
}

/// RSS and cumulative CPU of a process (all its threads).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub rss_bytes: u64,
    pub cpu_seconds: f64,
}

impl Server {
    /// Starts `argv` (its output goes to the log file named by
    /// `AGENTD_BENCH_SERVER_LOG`, or nowhere) and waits until `addr` accepts.
    pub async fn spawn(argv: &[String], addr: SocketAddr) -> anyhow::Result<Self> {
        let log = match std::env::var_os("AGENTD_BENCH_SERVER_LOG") {
            Some(p) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&p)
                    .context("opening the server log")?,
            ),
            None => Stdio::null(),
        };
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting the server {:?}", argv[0]))?;
        let started = tokio::time::Instant::now();
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(Self { child });
            }
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("the server exited before accepting connections ({status})");
            }
            if started.elapsed() > STARTUP {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!("the server did not accept connections on {addr} within {STARTUP:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn usage(&self) -> anyhow::Result<Usage> {
        usage_of(&format!("/proc/{}", self.pid()))
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill();
        let _ = tokio::task::spawn_blocking(move || self.child.wait()).await;
    }
}

/// This process's own usage, to tell whether the client was the bottleneck.
pub fn own_usage() -> anyhow::Result<Usage> {
    usage_of("/proc/self")
}

/// Busy and total jiffies of all CPUs since boot, from /proc/stat.
pub fn machine_busy() -> anyhow::Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .context("no cpu line in /proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest is in user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Ok((total - idle, total))
}

fn usage_of(proc_dir: &str) -> anyhow::Result<Usage> {
    let status =
        std::fs::read_to_string(format!("{proc_dir}/status")).context("reading /proc status")?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc status")?;
    let stat = std::fs::read_to_string(format!("{proc_dir}/stat")).context("reading /proc stat")?;
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let after = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let cpu_seconds = (ticks(11) + ticks(12)) as f64 / TICKS_PER_SECOND;
    Ok(Usage {
        rss_bytes: rss_kb * 1024,
        cpu_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_usage_reads_a_plausible_rss_and_cpu_time() {
        // Burn a little CPU so the reading cannot be trivially zero forever.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let u = own_usage().unwrap();
        assert!(u.rss_bytes > 1 << 20, "rss {} bytes", u.rss_bytes);
        assert!(u.cpu_seconds >= 0.0);
    }
}
