//! The `agentd` binary as a user runs it: serve, session create, run, health,
//! SIGTERM, and configuration errors at start-up.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod serve_cmd;

const BIN: &str = env!("CARGO_BIN_EXE_agentd");

struct Served {
    child: Child,
    url: String,
    /// Holds the server's SQLite store (a fresh one per test).
    _dir: tempfile::TempDir,
}

impl Served {
    fn start(extra: &[&str]) -> Self {
        Self::start_with_env(extra, &[])
    }

    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut child = serve_cmd::agentd_serve("127.0.0.1:0", "127.0.0.1:0", &[])
            // No drain delay unless the test asks for one.
            .env("AGENTD_DRAIN_DELAY", "0s")
            .env(
                "AGENTD_STORE",
                format!("sqlite://{}", dir.path().join("agentd.db").display()),
            )
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
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
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Self {
            child,
            url: format!("http://{addr}"),
            _dir: dir,
        }
    }

    /// The CLI against this server, bounded: its calls have deadlines of
    /// their own, but a hang anywhere else fails the test here.
    fn cli(&self, args: &[&str]) -> std::process::Output {
        serve_cmd::output_within(
            Command::new(BIN).args(args).env("AGENTD_SERVER", &self.url),
            Duration::from_secs(60),
        )
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < until, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A test that fails leaves no server behind (a clean stop has reaped it).
impl Drop for Served {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Asserts the command failed and said `what` on stderr.
fn fails_saying(out: &std::process::Output, what: &str) {
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains(what), "{stderr}");
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn serve_session_run_and_health_work_end_to_end_and_sigterm_exits_zero() {
    let served = Served::start(&["--stream-agent"]);
    let out = served.cli(&["session", "create", "--user", "alice"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let session = text(&out.stdout).trim().to_owned();
    assert_eq!(session.len(), 36, "a UUID: {session}");
    // With --request-id, run twice: one session, printed both times.
    let keyed: Vec<String> = (0..2)
        .map(|_| {
            let out = served.cli(&["session", "create", "--user", "alice", "--request-id", "k1"]);
            assert!(out.status.success(), "{}", text(&out.stderr));
            text(&out.stdout).trim().to_owned()
        })
        .collect();
    assert_eq!(keyed[0], keyed[1]);
    assert_ne!(keyed[0], session);
    let out = served.cli(&[
        "session",
        "create",
        "--user",
        "alice",
        "--request-id",
        "bad key",
    ]);
    fails_saying(&out, "request_id");

    let out = served.cli(&[
        "run",
        "--user",
        "alice",
        "--session",
        &session,
        "--request-id",
        "r1",
        "Where is order 1187?",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(
        lines[0].starts_with("[0] tool_call lookup_order {\"order_id\":\"1187\"}"),
        "{stdout}"
    );
    assert!(
        lines[1].starts_with("[1] tool_result lookup_order"),
        "{stdout}"
    );
    assert!(
        lines[2].starts_with("[2] final_answer: Order 1187"),
        "{stdout}"
    );

    let out = served.cli(&[
        "run",
        "--json",
        "--user",
        "alice",
        "--session",
        &session,
        "--request-id",
        "r1",
        "Where is order 1187?",
    ]);
    let events: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[2]["is_final"], true);
    assert_eq!(events[0]["payload"]["order_id"], "1187");
    assert!(
        text(&out.stderr).contains("request_id r1 (replay)"),
        "the id to attach by is told with --json too: {}",
        text(&out.stderr)
    );

    let out = served.cli(&["run", "--user", "mallory", "--session", &session, "hi"]);
    fails_saying(&out, "NotFound");

    let out = served.cli(&[
        "run",
        "--user",
        "alice",
        "--session",
        &session,
        "--agent",
        "stream",
        "--deadline",
        "200ms",
        "n=10 rate=5",
    ]);
    fails_saying(&out, "DeadlineExceeded");

    let out = served.cli(&["health"]);
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), "SERVING");

    let status = served.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status:?}");
}

/// `stream` emits what its caller asks for: served only when asked (a
/// switch's variable takes 1/0 and yes/no as well as true/false).
#[test]
fn the_stream_agent_is_served_only_with_its_switch() {
    let run_stream = |served: &Served| {
        let out = served.cli(&["session", "create", "--user", "alice"]);
        let session = text(&out.stdout).trim().to_owned();
        served.cli(&[
            "run",
            "--user",
            "alice",
            "--session",
            &session,
            "--agent",
            "stream",
            "n=2",
        ])
    };
    let off = Served::start(&[]);
    let out = run_stream(&off);
    fails_saying(&out, "NotFound");
    assert!(off.terminate().success());

    let on = Served::start_with_env(&[], &[("AGENTD_STREAM_AGENT", "1")]);
    let out = run_stream(&on);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("sent 2 events"),
        "{}",
        text(&out.stdout)
    );
    assert!(on.terminate().success());

    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory:"])
        .args(["--default-agent", "stream"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--stream-agent"), "{stderr}");
}

#[test]
fn a_bad_configuration_fails_at_start_up_with_one_clear_line() {
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--max-run-duration",
            "10m",
            "--shutdown-grace",
            "1m",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--max-run-duration") && stderr.contains("--shutdown-grace"),
        "{stderr}"
    );

    let out = Command::new(BIN)
        .args([
            "run",
            "--user",
            "u",
            "--session",
            "s",
            "--deadline",
            "300000000000y",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("--deadline")
            && stderr.contains("at most 10 years")
            && !stderr.contains("panicked"),
        "{stderr}"
    );

    let out = Command::new(BIN)
        .args(["serve", "--stall-timeout", "soon"])
        .output()
        .unwrap();
    fails_saying(&out, "--stall-timeout");

    let out = Command::new(BIN)
        .env("AGENTD_CHANNEL_CAPACITY", "0")
        .args(["serve", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "env vars are validated like flags");
    assert!(
        text(&out.stderr).contains("--channel-capacity"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn help_explains_every_serve_flag_and_its_environment_variable() {
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = text(&out.stdout);
    for flag in [
        "--listen",
        "--channel-capacity",
        "--slow-consumer",
        "--stall-timeout",
        "--max-run-duration",
        "--max-concurrent-runs",
        "--max-concurrent-streams",
        "--keepalive-interval",
        "--keepalive-timeout",
        "--max-connection-age",
        "--drain-delay",
        "--shutdown-grace",
        "--store",
        "--retain-turns",
        "--turn-lease",
        "--stream-agent",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
        let env = format!(
            "AGENTD_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        assert!(help.contains(&env), "{env} missing from --help");
    }
}

/// Text logs written to a pipe (a log collector, a file) are plain: no
/// terminal colour codes, so `grpc{trace_id=...}` and the fields read as
/// they are documented.
#[test]
fn text_logs_to_a_pipe_carry_no_colour_codes() {
    let mut child = Command::new(BIN)
        .args(["--log-format", "text", "serve", "--listen", "127.0.0.1:0"])
        .args([
            "--admin-listen",
            "off",
            "--a2a-listen",
            "off",
            "--store",
            "memory:",
        ])
        .env_remove("NO_COLOR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = loop {
        let line = lines
            .next()
            .expect("server exited before logging its start")
            .unwrap();
        if line.contains("agentd starting") {
            break line;
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(!line.contains('\x1b'), "colour codes in {line:?}");
    assert!(line.contains(" INFO "), "{line:?}");
}

/// A log filter that does not parse stops start-up with one line naming
/// the variable and the parser's reason (it was ignored, and the logs
/// stayed at the default). `AGENTD_LOG` comes first: a `RUST_LOG` meant
/// for another program does not matter when it is set.
#[test]
fn a_log_filter_that_does_not_parse_fails_at_start_up_with_one_clear_line() {
    let serve = |env: &[(&str, &str)]| {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args([
                "--admin-listen",
                "off",
                "--a2a-listen",
                "off",
                "--store",
                "memory:",
            ])
            .env_remove("AGENTD_LOG")
            .env_remove("RUST_LOG")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait_with_output().unwrap()
    };
    for var in ["AGENTD_LOG", "RUST_LOG"] {
        let out = serve(&[(var, "info,agentd=loud")]);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{var}: {stderr}");
        assert_eq!(out.status.code(), Some(1), "exited, not killed: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        let prefix = format!("error: {var}=\"info,agentd=loud\" is not a log filter: ");
        assert!(stderr.starts_with(&prefix), "{stderr}");
        let reason = stderr[prefix.len()..].split(" (e.g.").next().unwrap();
        assert!(reason.len() > 10, "the parser's reason: {stderr}");
    }

    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args([
            "--admin-listen",
            "off",
            "--a2a-listen",
            "off",
            "--store",
            "memory:",
        ])
        .env("AGENTD_LOG", "info")
        .env("RUST_LOG", "info,agentd=loud")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .any(|line| line.contains("agentd starting"));
    let _ = child.kill();
    let _ = child.wait();
    assert!(started, "AGENTD_LOG=info serves whatever RUST_LOG says");
}

/// With JSON logs, the line that says why agentd stopped is a JSON log
/// line too (a log pipeline would drop plain text).
#[test]
fn with_json_logs_a_start_up_failure_is_one_json_error_line() {
    let out = Command::new(BIN)
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "off", "--a2a-listen", "off"])
        .args(["--store", "memory:", "--agents", "/nonexistent/agents.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    let last = stderr.trim().lines().last().unwrap_or_default();
    let line: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("not a JSON line ({e}): {stderr}"));
    assert_eq!(line["level"], "ERROR", "{line}");
    assert!(
        line["message"]
            .as_str()
            .is_some_and(|m| m.contains("agents.toml")),
        "{line}"
    );
}

/// The start-up line carries what an incident asks first: the build, the
/// store (its kind, and its URL without a password), the replica and the
/// durations that decide how a pod stops; and `listen`, which tests and
/// tools read the port from.
#[test]
fn the_start_up_line_names_the_version_store_replica_and_shutdown_durations() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("agentd.db").display());
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "serve", "--listen", "127.0.0.1:0"])
        .args(["--admin-listen", "off", "--a2a-listen", "off"])
        .args(["--store", &store, "--replica-id", "agentd-7"])
        .args(["--drain-delay", "3s", "--shutdown-grace", "2m"])
        .args(["--max-run-duration", "90s"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let line = BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
        .find(|v| v["message"] == "agentd starting");
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("the start-up line");
    assert_eq!(line["version"], env!("CARGO_PKG_VERSION"), "{line}");
    assert_eq!(line["store"], "sqlite", "{line}");
    assert_eq!(line["store_url"], store.as_str(), "{line}");
    assert_eq!(line["replica_id"], "agentd-7", "{line}");
    assert_eq!(line["drain_delay"], "3s", "{line}");
    assert_eq!(line["shutdown_grace"], "2m", "{line}");
    assert_eq!(line["max_run_duration"], "1m 30s", "{line}");
    let listen = line["listen"].as_str().unwrap_or_default();
    assert!(
        listen.parse::<std::net::SocketAddr>().is_ok(),
        "listen: {line}"
    );
}

/// A second SIGTERM during the drain cuts the runs still in flight
/// (UNAVAILABLE) instead of waiting out the grace, ends the drain delay,
/// and the server exits.
#[test]
fn a_second_sigterm_during_the_drain_cuts_the_runs_in_flight() {
    let mut served = Served::start(&[
        "--tool-delay",
        "60s",
        "--max-run-duration",
        "90s",
        "--shutdown-grace",
        "100s",
        "--drain-delay",
        "40s",
    ]);
    let session = text(&served.cli(&["session", "create", "--user", "alice"]).stdout)
        .trim()
        .to_owned();
    let mut run = Command::new(BIN)
        .args(["run", "--user", "alice", "--session", &session])
        .arg("Where is order 1187?")
        .env("AGENTD_SERVER", &served.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The run is in flight once its tool call is printed.
    let mut out = BufReader::new(run.stdout.take().unwrap()).lines();
    let first = out.next().expect("a first event").unwrap();
    assert!(first.contains("tool_call"), "{first}");

    let term = |pid: u32| {
        let sent = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    let pid = served.child.id();
    term(pid);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        served.child.try_wait().unwrap().is_none(),
        "the drain waits for the run"
    );
    let cut = Instant::now();
    term(pid);
    let status = loop {
        if let Some(s) = served.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(20),
            "the server did not exit after the second SIGTERM (the drain delay is 40s)"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    let ran = run.wait_with_output().unwrap();
    assert!(!ran.status.success());
    assert!(
        text(&ran.stderr).contains("Unavailable"),
        "{}",
        text(&ran.stderr)
    );
}

/// `agentd run` into a reader that stops (`| head -1`) ends quietly when
/// the pipe closes: no panic, no backtrace, and the run is dropped as at
/// Ctrl-C: the CLI exits at once rather than reading the rest of the
/// stream (50 s of it), and its turn ends cancelled, not completed.
#[test]
fn run_into_a_closed_pipe_ends_quietly() {
    use std::io::Read as _;
    let served = Served::start(&["--stream-agent"]);
    let session = text(&served.cli(&["session", "create", "--user", "alice"]).stdout)
        .trim()
        .to_owned();
    let mut run = Command::new(BIN)
        .args([
            "run",
            "--json",
            "--user",
            "alice",
            "--session",
            &session,
            "--request-id",
            "r1",
            "--agent",
            "stream",
        ])
        .arg("n=100000 size=64 rate=2000")
        .env("AGENTD_SERVER", &served.url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(run.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains("partial_text"), "{first}");
    drop(out);
    let closed = Instant::now();
    let status = loop {
        if let Some(s) = run.try_wait().unwrap() {
            break s;
        }
        if closed.elapsed() > Duration::from_secs(10) {
            let _ = run.kill();
            let _ = run.wait();
            panic!("the run went on for 10 s after its reader went away");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    run.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(status.success(), "{status:?}: {stderr}");

    // The server hears the call dropped and records the turn cancelled.
    let state = |session: &str| {
        let got = served.cli(&["session", "get", "--user", "alice", "--session", session]);
        assert!(got.status.success(), "{}", text(&got.stderr));
        let v: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
        let turn = &v["turns"][0];
        assert_eq!(turn["request_id"], "r1", "{v}");
        turn["state"].as_str().unwrap().to_owned()
    };
    let until = Instant::now() + Duration::from_secs(10);
    let ended = loop {
        let now = state(&session);
        if now != "running" {
            break now;
        }
        assert!(
            Instant::now() < until,
            "the turn still runs 10 s after its caller left"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(ended, "cancelled", "the dropped run's turn is cancelled");
}

/// Every command that prints, into a pipe whose reader is gone, exits as
/// it would have without the printing: no panic (and no exit code 101).
#[test]
fn commands_that_print_into_a_closed_pipe_exit_without_a_panic() {
    let served = Served::start(&[]);
    let session = text(&served.cli(&["session", "create", "--user", "alice"]).stdout)
        .trim()
        .to_owned();
    for args in [
        &["session", "create", "--user", "alice"][..],
        &["session", "list", "--user", "alice"],
        &["session", "get", "--user", "alice", "--session", &session],
        &["health"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(BIN)
            .args(args)
            .env("AGENTD_SERVER", &served.url)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
    }
    assert!(served.terminate().success());
}

/// Runs `cmd`, an `agentd serve` that must refuse to start, and returns its
/// stderr. One still running after 30 s has started: it is killed and the
/// test fails (rather than waiting for ever on a server).
fn start_up_error(cmd: &mut Command) -> String {
    let out = serve_cmd::try_output_within(cmd, Duration::from_secs(30))
        .unwrap_or_else(|out| panic!("the server started: {}", text(&out.stderr)));
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    stderr
}

/// A SQLite store that cannot be opened names its file's full path (a
/// relative one is in the working directory, which nothing else shows) and
/// why: its directory is missing, or not writable (the default
/// `sqlite://agentd.db` in a read-only working directory, as in a container).
#[test]
fn a_sqlite_store_that_cannot_be_opened_names_its_full_path_and_why() {
    let serve = ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "off"];
    let serve = [&serve[..], &["--a2a-listen", "off"]].concat();
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path().canonicalize().unwrap();
    let err = start_up_error(
        Command::new(BIN)
            .current_dir(&cwd)
            .args(&serve)
            .args(["--store", "sqlite://nodir/x.db"]),
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let file = cwd.join("nodir/x.db");
    let missing = format!(
        "its directory {} does not exist",
        cwd.join("nodir").display()
    );
    assert!(
        err.contains(&format!("sqlite://nodir/x.db (the file {}", file.display()))
            && err.contains(&missing)
            && err.contains("create it"),
        "{err}"
    );

    // A directory this process cannot write to. Root writes anywhere: as
    // root the server runs as nobody, as a pod's non-root user would.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::process::CommandExt;
    let ro = cwd.join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    std::fs::set_permissions(&cwd, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new(BIN);
    if std::fs::metadata("/proc/self").unwrap().uid() == 0 {
        // The build's own binary may sit where nobody cannot reach (a
        // checkout under /root): nobody runs a copy in the test's directory.
        let bin = cwd.join("agentd");
        std::fs::copy(BIN, &bin).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        cmd = Command::new(&bin);
        cmd.uid(65534).gid(65534);
    }
    let err = start_up_error(cmd.current_dir(&ro).env_remove("AGENTD_STORE").args(&serve));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let file = ro.join("agentd.db");
    assert!(
        err.contains(&format!("sqlite://agentd.db (the file {}", file.display()))
            && err.contains(&format!("its directory {} is not writable", ro.display()))
            && err.contains("point --store into a directory this user can write"),
        "{err}"
    );
}

/// An empty listen address (a templated AGENTD_ADMIN_LISTEN left empty) is
/// refused, for the admin port as for the A2A port, rather than read as
/// `off`: a port that silently does not open shows only later, elsewhere.
#[test]
fn an_empty_listen_address_is_refused_not_read_as_off() {
    for (var, other) in [
        ("AGENTD_ADMIN_LISTEN", "--a2a-listen"),
        ("AGENTD_A2A_LISTEN", "--admin-listen"),
    ] {
        let err = start_up_error(
            Command::new(BIN)
                .env("AGENTD_STORE", "memory:")
                .env(var, "")
                .args(["serve", "--listen", "127.0.0.1:0", other, "off"]),
        );
        let flag = format!(
            "--{}",
            var["AGENTD_".len()..].to_lowercase().replace('_', "-")
        );
        assert!(
            err.contains(&flag) && err.contains("empty") && err.contains("off"),
            "{var}: {err}"
        );
    }
}

/// `agentd bench --followers` attaches followers to every Run and reports
/// what they received apart from the Runs' own events; without the flag
/// there is no such figure.
#[test]
fn bench_with_followers_reports_their_events_apart() {
    let served = Served::start_with_env(&[], &[("AGENTD_STREAM_AGENT", "1")]);
    let target = served.url.trim_start_matches("http://").to_owned();
    let dir = tempfile::tempdir().unwrap();
    let report = |followers: &str| {
        let out_file = dir.path().join(format!("bench-{followers}.jsonl"));
        let out = Command::new(BIN)
            .args(["bench", "--target", &target, "--workload", "one-at-a-time"])
            .args(["--streams", "2", "--connections", "1", "--duration", "1s"])
            .args(["--warmup", "200ms", "--followers", followers, "--json-out"])
            .arg(&out_file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let line = std::fs::read_to_string(&out_file).unwrap();
        serde_json::from_str::<serde_json::Value>(line.trim()).unwrap()
    };
    let with = report("2");
    assert_eq!(with["errors"], 0, "{with}");
    assert!(with["events_per_second"].as_f64().unwrap() > 0.0, "{with}");
    let followed = with["follower_events_per_second"].as_f64().unwrap();
    assert!(followed > 0.0, "{with}");
    let without = report("0");
    assert!(without["follower_events_per_second"].is_null(), "{without}");
    assert!(served.terminate().success());
}
