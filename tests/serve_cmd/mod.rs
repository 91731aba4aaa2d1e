//! `agentd serve` as the tests start it, in a child process.
#![allow(dead_code)]

/// `agentd serve` (the binary) with JSON logs, the gRPC port on
/// 127.0.0.1:0, the admin and A2A ports on `admin` and `a2a` (an address,
/// or `off`), and the memory store (not the default SQLite file, which
/// parallel tests would share; an `AGENTD_STORE` or `--store` set later
/// wins); then `args`. The caller sets the rest (stdio, environment).
pub fn agentd_serve(admin: &str, a2a: &str, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_agentd"));
    cmd.env("AGENTD_STORE", "memory:")
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", admin, "--a2a-listen", a2a])
        .args(args);
    cmd
}

/// Runs `cmd` to its end, as `Command::output` does, but for at most
/// `limit`: past it the process is killed and the test fails, naming the
/// command, instead of hanging until the runner's own timeout.
pub fn output_within(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::process::Output {
    let shown = format!("{cmd:?}");
    try_output_within(cmd, limit).unwrap_or_else(|_| panic!("{shown} did not end within {limit:?}"))
}

/// [`output_within`], with a process still running at `limit` killed and
/// what it wrote until then returned as the error.
pub fn try_output_within(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> Result<std::process::Output, std::process::Output> {
    use std::io::Read as _;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            pipe.read_to_end(&mut out).unwrap();
            out
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let until = std::time::Instant::now() + limit;
    let (status, ended) = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break (status, true);
        }
        if std::time::Instant::now() >= until {
            let _ = child.kill();
            break (child.wait().unwrap(), false);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let out = std::process::Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    if ended { Ok(out) } else { Err(out) }
}
