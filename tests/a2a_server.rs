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
    let out = run_json(&py, &[script.to_str().unwrap(), &server.base_url(), binding]).await;
    eprintln!("{out:#}");

    // The card lists both bindings, A2A 1.0, streaming, one skill per agent.
    let card = &out["card"];
    let interfaces = card["interfaces"].as_array().unwrap();
    assert!(interfaces.contains(&serde_json::json!(["JSONRPC", format!("http://{}/", server.http), "1.0"])), "{card}");
    assert!(interfaces.contains(&serde_json::json!(["GRPC", server.grpc.to_string(), "1.0"])), "{card}");
    assert_eq!(card["streaming"], true);
    assert_eq!(card["skills"], serde_json::json!(["echo", "order_helper", "stream"]));

    // send: the finished task, its answer in the artifact.
    let send = &out["send"];
    assert_eq!(send["state"], "TASK_STATE_COMPLETED", "{send}");
    assert!(send["artifacts"]["answer"].as_str().unwrap().contains("1187"), "{send}");

    // stream: task, WORKING, the tool call and its result as status messages
    // with data parts, the answer as one last chunk, then COMPLETED.
    let stream = out["stream"].as_array().unwrap();
    let kinds: Vec<&str> = stream.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["task", "status", "status", "status", "artifact", "status"], "{stream:?}");
    assert_eq!(stream[2]["parts"][1]["data"]["toolCall"]["name"], "lookup_order", "{stream:?}");
    assert!(stream[3]["parts"][1]["data"]["toolResult"].is_object(), "{stream:?}");
    assert_eq!(stream[4]["last_chunk"], true);
    assert_eq!(stream[5]["state"], "TASK_STATE_COMPLETED");

    // get: the streamed task, stored with its artifact.
    assert_eq!(out["get"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(out["get"]["artifacts"]["answer"], stream[4]["text"]);

    // chunks: three partials append to one artifact; the final answer is the
    // last chunk.
    let chunks: Vec<&Value> = out["chunks"].as_array().unwrap().iter().filter(|e| e["kind"] == "artifact").collect();
    assert_eq!(chunks.len(), 4, "{:?}", out["chunks"]);
    assert_eq!(chunks[0]["append"], false);
    assert!(chunks[1..].iter().all(|c| c["append"] == true && c["artifact_id"] == "answer"));
    assert_eq!(chunks[3]["last_chunk"], true);
    assert_eq!(chunks[3]["text"], "sent 3 events");

    // cancel: CANCELED, and the run behind it stopped (the stream agent
    // would otherwise go on for half an hour).
    let cancel = &out["cancel"];
    assert_eq!(cancel["returned"]["state"], "TASK_STATE_CANCELED", "{cancel}");
    assert_eq!(cancel["after"]["state"], "TASK_STATE_CANCELED", "{cancel}");
    assert!(server.idle(Duration::from_secs(10)).await, "the cancelled run is still going");

    // subscribe: a new stream on a running task follows it to COMPLETED.
    let sub = &out["subscribe"];
    let events = sub["events"].as_array().unwrap();
    assert_eq!(events.last().unwrap()["state"], "TASK_STATE_COMPLETED", "{sub}");
    assert_eq!(sub["final"]["state"], "TASK_STATE_COMPLETED");
    assert!(sub["final"]["artifacts"]["answer"].as_str().unwrap().ends_with("sent 20 events"), "{sub}");

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
    expect("task_not_cancelable", "TaskNotCancelableError", "FAILED_PRECONDITION");
    expect("subscribe_terminal", "UnsupportedOperationError", "FAILED_PRECONDITION");
    expect("content_type", "ContentTypeNotSupportedError", "INVALID_ARGUMENT");
    if grpc {
        assert_eq!(e["version"]["grpc_code"], "FAILED_PRECONDITION", "{}", e["version"]);
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
