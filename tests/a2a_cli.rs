//! `agentd serve` with its A2A face, and `agentd a2a` calling it, as a user
//! runs them.

mod a2a_support;
mod serve_cmd;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_agentd");

struct Served {
    child: Child,
    a2a_url: String,
}

impl Served {
    fn start() -> Self {
        Self::start_with_env(&[])
    }

    fn start_with_env(env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                "--log-format",
                "json",
                "serve",
                "--stream-agent",
                "--listen",
                "127.0.0.1:0",
                "--a2a-listen",
                "127.0.0.1:0",
                "--admin-listen",
                "off",
                "--drain-delay",
                "0s",
            ])
            .env("AGENTD_STORE", "memory:")
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
                break v["a2a_listen"].as_str().unwrap().to_owned();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        Self {
            child,
            a2a_url: format!("http://{addr}"),
        }
    }

    /// `agentd a2a` against this server, bounded (see
    /// [`serve_cmd::output_within`]).
    fn a2a(&self, args: &[&str]) -> std::process::Output {
        serve_cmd::output_within(
            Command::new(BIN)
                .arg("a2a")
                .args(args)
                .env("AGENTD_A2A_URL", &self.a2a_url),
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

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_a2a_command_calls_our_server_over_both_bindings_and_fails_loudly_past_its_deadline() {
    let served = Served::start();
    let out = served.a2a(&["Where is order 1187?"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Order 1187"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("calling lookup_order"),
        "{}",
        text(&out.stderr)
    );

    let out = served.a2a(&[
        "--binding",
        "grpc",
        "--agent",
        "stream",
        "--json",
        "n=3 size=2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(v["state"], "completed");
    assert_eq!(v["incomplete"], false);
    // The stream agent's final answer is not its streamed text: it replaces it.
    assert_eq!(v["artifacts"][0]["text"], "sent 3 events");

    let out = served.a2a(&["--agent", "stream", "--deadline", "300ms", "n=100 rate=10"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("deadline passed"),
        "{}",
        text(&out.stderr)
    );

    let out = served.a2a(&["--agent", "nobody", "hi"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no such agent"),
        "{}",
        text(&out.stderr)
    );
    assert!(served.terminate().success());
}

/// A server that accepts the connection and never answers: the deadline
/// covers fetching its card, and the call fails instead of hanging.
#[test]
fn the_deadline_covers_fetching_the_card_of_a_server_that_never_answers() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().take(8) {
            held.push(conn);
        }
    });
    let mut child = Command::new(BIN)
        .args(["a2a", "--url", &url, "--deadline", "500ms", "hi"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("agentd a2a hung past its deadline");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    let mut stderr = String::new();
    use std::io::Read as _;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("deadline"), "{stderr}");
}

/// Behind a proxy, the card gives the URL clients use for JSON-RPC.
#[tokio::test]
async fn the_card_gives_the_advertised_url_for_json_rpc() {
    let served =
        Served::start_with_env(&[("AGENTD_A2A_ADVERTISE_URL", "https://agents.example.com/a2a")]);
    // reqwest is built without a default crypto provider; agentd installs ring.
    agentd::auth::tls::install_crypto_provider();
    let card: serde_json::Value =
        reqwest::get(format!("{}/.well-known/agent-card.json", served.a2a_url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let jsonrpc = card["supportedInterfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["protocolBinding"] == "JSONRPC")
        .expect("a JSON-RPC interface");
    assert_eq!(jsonrpc["url"], "https://agents.example.com/a2a", "{card}");
    assert!(served.terminate().success());
}

/// An answer given in the task's last status (no artifact) is printed; a
/// task that asks for input says how to reply, and the reply (`--task`,
/// `--context`) goes into that task. The remote is the A2A SDK's own
/// server (tests/a2a_test_agent.py).
#[tokio::test]
async fn status_answers_are_printed_and_a_task_that_asks_for_input_takes_the_reply() {
    let Some(python) = a2a_support::python() else {
        return;
    };
    let agent = a2a_support::PyAgent::start(&python, false).await;
    let a2a = |args: Vec<String>| {
        let url = agent.base_url.clone();
        async move {
            tokio::process::Command::new(BIN)
                .arg("a2a")
                .args(args)
                .env("AGENTD_A2A_URL", url)
                .output()
                .await
                .unwrap()
        }
    };
    let out = a2a(vec!["said=1".into()]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "all done");

    let out = a2a(vec!["input=1".into()]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "which order?");
    let stderr = text(&out.stderr);
    let hint = stderr
        .lines()
        .find_map(|l| {
            l.split_once("reply with: agentd a2a ")
                .map(|(_, h)| h.to_owned())
        })
        .unwrap_or_else(|| panic!("no reply hint: {stderr}"));
    // The hint names the agent it was sent to: pasted as it is, with no
    // AGENTD_A2A_URL set, the reply reaches the same agent.
    let words: Vec<String> = hint.split_whitespace().map(str::to_owned).collect();
    let (url, task, context) = match &words[..] {
        [u, url, t, task, c, context, last]
            if u == "--url" && t == "--task" && c == "--context" && last == "TEXT" =>
        {
            (url.clone(), task.clone(), context.clone())
        }
        _ => panic!("{hint}"),
    };
    assert_eq!(url, agent.base_url, "{hint}");
    let out = tokio::process::Command::new(BIN)
        .args([
            "a2a",
            "--url",
            &url,
            "--json",
            "--task",
            &task,
            "--context",
            &context,
            "chunks=2",
        ])
        .env_remove("AGENTD_A2A_URL")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&out.stdout).trim()).unwrap();
    assert_eq!(v["state"], "completed", "{v}");
    assert_eq!(
        v["taskId"],
        task.as_str(),
        "the reply went into the waiting task"
    );
    assert_eq!(v["artifacts"][0]["text"], "c0 c1 ", "{v}");
}

/// Interrupted (SIGINT), `agentd a2a` cancels the task it started, which
/// would otherwise run on: closing the stream does not end an A2A task.
#[test]
fn an_interrupted_a2a_call_cancels_its_task() {
    let served = Served::start();
    let mut call = Command::new(BIN)
        .args(["a2a", "--agent", "stream", "n=600 size=1 rate=20"])
        .env("AGENTD_A2A_URL", &served.a2a_url)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(call.stderr.take().unwrap()).lines();
    // The first status update: the task exists and runs.
    loop {
        let line = lines
            .next()
            .expect("the call ended before working")
            .unwrap();
        if line.contains("Working") {
            break;
        }
    }
    Command::new("kill")
        .args(["-INT", &call.id().to_string()])
        .status()
        .unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let until = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = call.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < until, "agentd a2a did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let said = rest.join("\n");
    assert!(said.contains("interrupted: cancelled task"), "{said}");
    assert!(said.contains("Canceled"), "{said}");
    assert!(served.terminate().success());
}
