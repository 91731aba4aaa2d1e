//! agentd's A2A face against the official Python SDK as the client, over
//! JSON-RPC/SSE and over gRPC: send, stream, get, cancel, subscribe, and the
//! spec's errors with their codes.

mod a2a_support;

use std::time::Duration;

use a2a_support::{A2aServer, python, run_json, script};
use serde_json::Value;

async fn sdk_client_against_our_server(binding: &str) {
    let Some(py) = python() else { return };
    let server = A2aServer::start(Duration::ZERO).await;
    let script = script("a2a_sdk_client.py");
    let out = run_json(
        &py,
        &[script.to_str().unwrap(), &server.base_url(), binding],
    )
    .await;
    eprintln!("{out:#}");

    // The card lists both bindings, A2A 1.0, streaming, one skill per agent.
    let card = &out["card"];
    let interfaces = card["interfaces"].as_array().unwrap();
    assert!(
        interfaces.contains(&serde_json::json!([
            "JSONRPC",
            format!("http://{}/", server.http),
            "1.0"
        ])),
        "{card}"
    );
    assert!(
        interfaces.contains(&serde_json::json!(["GRPC", server.grpc.to_string(), "1.0"])),
        "{card}"
    );
    assert_eq!(card["streaming"], true);
    assert_eq!(
        card["skills"],
        serde_json::json!(["echo", "order_helper", "stream"])
    );

    // send: the finished task, its answer in the artifact.
    let send = &out["send"];
    assert_eq!(send["state"], "TASK_STATE_COMPLETED", "{send}");
    assert!(
        send["artifacts"]["answer"]
            .as_str()
            .unwrap()
            .contains("1187"),
        "{send}"
    );

    // stream: task, WORKING, the tool call and its result as status messages
    // with data parts, the answer as one last chunk, then COMPLETED.
    let stream = out["stream"].as_array().unwrap();
    let kinds: Vec<&str> = stream.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["task", "status", "status", "status", "artifact", "status"],
        "{stream:?}"
    );
    assert_eq!(
        stream[2]["parts"][1]["data"]["toolCall"]["name"], "lookup_order",
        "{stream:?}"
    );
    assert!(
        stream[3]["parts"][1]["data"]["toolResult"].is_object(),
        "{stream:?}"
    );
    assert_eq!(stream[4]["last_chunk"], true);
    assert_eq!(stream[5]["state"], "TASK_STATE_COMPLETED");

    // get: the streamed task, stored with its artifact.
    assert_eq!(out["get"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(out["get"]["artifacts"]["answer"], stream[4]["text"]);

    // chunks: the three partials append to one artifact (partials waiting
    // together go out as one chunk); the final answer is the last chunk,
    // which replaces them (the stream agent's answer is not its partials).
    let chunks: Vec<&Value> = out["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "artifact")
        .collect();
    assert!((2..=4).contains(&chunks.len()), "{:?}", out["chunks"]);
    assert_eq!(chunks[0]["append"], false);
    let (last, partials) = chunks.split_last().unwrap();
    assert!(
        partials[1..]
            .iter()
            .all(|c| c["append"] == true && c["artifact_id"] == "answer")
    );
    assert_eq!(last["last_chunk"], true);
    assert_eq!(last["append"], false);
    assert_eq!(last["artifact_id"], "answer");
    assert_eq!(last["text"], "sent 3 events");
    let streamed: String = partials
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, "xxxxxx", "{:?}", out["chunks"]);

    // cancel: CANCELED, and the run behind it stopped (the stream agent
    // would otherwise go on for half an hour).
    let cancel = &out["cancel"];
    assert_eq!(
        cancel["returned"]["state"], "TASK_STATE_CANCELED",
        "{cancel}"
    );
    assert_eq!(cancel["after"]["state"], "TASK_STATE_CANCELED", "{cancel}");
    assert!(
        server.idle(Duration::from_secs(10)).await,
        "the cancelled run is still going"
    );

    // subscribe: a new stream on a running task follows it to COMPLETED.
    let sub = &out["subscribe"];
    let events = sub["events"].as_array().unwrap();
    assert_eq!(
        events.last().unwrap()["state"],
        "TASK_STATE_COMPLETED",
        "{sub}"
    );
    assert_eq!(sub["final"]["state"], "TASK_STATE_COMPLETED");
    assert!(
        sub["final"]["artifacts"]["answer"]
            .as_str()
            .unwrap()
            .ends_with("sent 60 events"),
        "{sub}"
    );

    // Errors, as the SDK maps them (and, over gRPC, the 1.0 status codes).
    let e = &out["errors"];
    let grpc = binding == "GRPC";
    let expect = |name: &str, class: &str, code: &str| {
        assert_eq!(e[name]["error"], class, "{name}: {}", e[name]);
        if grpc {
            assert_eq!(e[name]["grpc_code"], code, "{name}: {}", e[name]);
        }
    };
    expect("task_not_found", "TaskNotFoundError", "NOT_FOUND");
    expect(
        "task_not_cancelable",
        "TaskNotCancelableError",
        "FAILED_PRECONDITION",
    );
    expect(
        "subscribe_terminal",
        "UnsupportedOperationError",
        "FAILED_PRECONDITION",
    );
    expect(
        "content_type",
        "ContentTypeNotSupportedError",
        "INVALID_ARGUMENT",
    );
    if grpc {
        assert_eq!(
            e["version"]["grpc_code"], "FAILED_PRECONDITION",
            "{}",
            e["version"]
        );
    } else {
        assert_eq!(e["version"]["code"], -32009, "{}", e["version"]);
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_sends_streams_gets_cancels_and_subscribes_over_json_rpc() {
    sdk_client_against_our_server("JSONRPC").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_sends_streams_gets_cancels_and_subscribes_over_grpc() {
    sdk_client_against_our_server("GRPC").await;
}

/// The last event of a conformance run, and the parts of its artifacts.
fn ends(out: &Value, prefix: &str) -> (String, Vec<Value>) {
    let events = out[prefix]
        .as_array()
        .unwrap_or_else(|| panic!("{prefix}: {out}"));
    let last = events.last().unwrap();
    let end = match last["kind"].as_str().unwrap() {
        "message" => format!("message:{}", last["text"].as_str().unwrap()),
        _ => last["state"].as_str().unwrap().to_owned(),
    };
    let parts = events
        .iter()
        .filter(|e| e["kind"] == "artifact")
        .flat_map(|e| e["parts"].as_array().unwrap().clone())
        .collect();
    (end, parts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_agent_answers_each_message_id_prefix_as_suites_expect() {
    let Some(py) = python() else { return };
    let server = A2aServer::start_with(Duration::ZERO, Some(Duration::from_millis(200))).await;
    let script = script("a2a_sdk_client.py");
    let out = run_json(
        &py,
        &[
            script.to_str().unwrap(),
            &server.base_url(),
            "JSONRPC",
            "conformance",
        ],
    )
    .await;
    eprintln!("{out:#}");
    let completed = "TASK_STATE_COMPLETED";
    let (end, _) = ends(&out, "tck-complete-task");
    assert_eq!(end, completed);
    assert_eq!(
        out["tck-complete-task"].as_array().unwrap().last().unwrap()["text"],
        "Hello from TCK"
    );
    assert_eq!(
        ends(&out, "tck-artifact-text"),
        (
            completed.into(),
            vec![serde_json::json!({"text": "Generated text content"})]
        )
    );
    let (_, file) = ends(&out, "tck-artifact-file");
    assert_eq!(
        (file[0]["filename"].as_str(), file[0]["mediaType"].as_str()),
        (Some("output.txt"), Some("text/plain")),
        "{file:?}"
    );
    let (_, url) = ends(&out, "tck-artifact-file-url");
    assert_eq!(url[0]["url"], "https://example.com/output.txt");
    assert_eq!(url[0]["filename"], "output.txt");
    let (_, data) = ends(&out, "tck-artifact-data");
    // protobuf's Struct holds numbers as doubles, so Python reads 42.0.
    assert_eq!(
        (
            data[0]["data"]["key"].as_str(),
            data[0]["data"]["count"].as_f64()
        ),
        (Some("value"), Some(42.0)),
        "{data:?}"
    );
    assert_eq!(
        ends(&out, "tck-message-response").0,
        "message:Direct message response"
    );
    assert_eq!(
        ends(&out, "tck-input-required").0,
        "TASK_STATE_INPUT_REQUIRED"
    );
    assert_eq!(ends(&out, "tck-reject-task").0, "TASK_STATE_REJECTED");
    assert_eq!(
        out["tck-reject-task"].as_array().unwrap().last().unwrap()["text"],
        "rejected"
    );
    for (prefix, text) in [
        ("tck-stream-001", "Stream hello from TCK"),
        ("tck-stream-003", "Stream task lifecycle"),
        ("tck-stream-ordering-001", "Ordered output"),
        ("tck-stream-artifact-text", "Streamed text content"),
    ] {
        let states: Vec<&str> = out[prefix]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["state"].as_str())
            .collect();
        assert_eq!(
            states,
            ["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", completed],
            "{prefix}"
        );
        assert_eq!(
            ends(&out, prefix),
            (completed.into(), vec![serde_json::json!({"text": text})]),
            "{prefix}"
        );
    }
    assert_eq!(
        ends(&out, "tck-stream-artifact-file").1[0]["filename"],
        "output.txt"
    );
    let only: Vec<&str> = out["tck-stream-002"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "status")
        .filter_map(|e| e["state"].as_str())
        .collect();
    assert_eq!(only, [completed]);
    let chunked: Vec<&Value> = out["tck-stream-artifact-chunked"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "artifact")
        .collect();
    assert_eq!(
        chunked
            .iter()
            .map(|c| (
                c["text"].as_str().unwrap(),
                c["append"].as_bool().unwrap(),
                c["last_chunk"].as_bool().unwrap()
            ))
            .collect::<Vec<_>>(),
        [("chunk-1 ", false, false), ("chunk-2", true, true)]
    );
    assert_eq!(ends(&out, "test-resubscribe-message-id").0, completed);
    server.stop().await;
}
