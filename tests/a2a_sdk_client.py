"""The official A2A Python SDK (1.x) as a client of agentd's A2A face.

Usage: a2a_sdk_client.py BASE_URL JSONRPC|GRPC [conformance]

Resolves the agent card at BASE_URL, connects over the named binding, runs
every scenario below and prints one JSON object with what each observed.
The Rust test (tests/a2a_server.rs) asserts on it; this script asserts
nothing itself, so every check is in one place. Every wait is bounded.
"""

import asyncio
import json
import sys
import uuid

import grpc
import httpx
from google.protobuf.json_format import MessageToDict

from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.card_resolver import A2ACardResolver
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.types import a2a_pb2, a2a_pb2_grpc

TIMEOUT = 20.0


def message(text, agent=None, media_type=None):
    part = Part(text=text)
    if media_type:
        part.media_type = media_type
    m = Message(role=Role.ROLE_USER, parts=[part], message_id=str(uuid.uuid4()))
    if agent:
        m.metadata.update({"agent": agent})
    return m


def event_summary(ev):
    """One line per stream event: its kind and the fields tests look at."""
    if ev.HasField("task"):
        return {"kind": "task", "state": TaskState.Name(ev.task.status.state), "id": ev.task.id}
    if ev.HasField("status_update"):
        s = ev.status_update
        parts = [MessageToDict(p) for p in s.status.message.parts] if s.status.HasField("message") else []
        return {"kind": "status", "state": TaskState.Name(s.status.state), "parts": parts}
    if ev.HasField("artifact_update"):
        a = ev.artifact_update
        return {
            "kind": "artifact",
            "artifact_id": a.artifact.artifact_id,
            "text": "".join(p.text for p in a.artifact.parts),
            "append": a.append,
            "last_chunk": a.last_chunk,
        }
    if ev.HasField("message"):
        return {"kind": "message", "text": "".join(p.text for p in ev.message.parts)}
    return {"kind": "unknown"}


def task_summary(task):
    return {
        "id": task.id,
        "state": TaskState.Name(task.status.state),
        "artifacts": {a.artifact_id: "".join(p.text for p in a.parts) for a in task.artifacts},
        "status_text": "".join(p.text for p in task.status.message.parts),
    }


def error_summary(e):
    out = {"error": type(e).__name__}
    cause = e.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        out["grpc_code"] = cause.code().name
    return out


async def collect(stream, limit=10_000):
    events = []
    async for ev in stream:
        events.append(ev)
        if len(events) >= limit:
            break
    return events


async def scenarios(client, binding, base_url, card):
    out = {}
    ctx = ClientCallContext(timeout=TIMEOUT)

    # send: non-streaming SendMessage returns the finished task.
    send_client = await make_client(base_url, binding, card, streaming=False)
    evs = await asyncio.wait_for(collect(send_client.send_message(
        SendMessageRequest(message=message("Where is order 1187?")), context=ctx)), TIMEOUT)
    out["send"] = task_summary(evs[-1].task) if evs and evs[-1].HasField("task") else {"events": len(evs)}

    # stream: SendStreamingMessage, every event.
    evs = await asyncio.wait_for(collect(client.send_message(
        SendMessageRequest(message=message("Where is order 1187?")), context=ctx)), TIMEOUT)
    out["stream"] = [event_summary(e) for e in evs]
    task_id = next((e.task.id for e in evs if e.HasField("task")), None)

    # get: the finished task, with its artifact.
    task = await client.get_task(GetTaskRequest(id=task_id), context=ctx)
    out["get"] = task_summary(task)

    # chunks: the stream agent's partial text as appended chunks.
    evs = await asyncio.wait_for(collect(client.send_message(
        SendMessageRequest(message=message("n=3 size=2", agent="stream")), context=ctx)), TIMEOUT)
    out["chunks"] = [event_summary(e) for e in evs]

    # cancel: a slow run, cancelled after its first chunk.
    slow = client.send_message(
        SendMessageRequest(message=message("n=100000 size=8 rate=50", agent="stream")), context=ctx)
    seen = []
    cancel_id = None
    async for ev in slow:
        seen.append(event_summary(ev))
        if ev.HasField("task"):
            cancel_id = ev.task.id
        if ev.HasField("artifact_update"):
            break
    await slow.aclose()
    cancelled = await client.cancel_task(CancelTaskRequest(id=cancel_id), context=ctx)
    after = await client.get_task(GetTaskRequest(id=cancel_id), context=ctx)
    out["cancel"] = {"id": cancel_id, "returned": task_summary(cancelled), "after": task_summary(after), "seen": seen[:3]}

    # subscribe: leave a running stream, resubscribe, follow it to the end.
    run = client.send_message(
        SendMessageRequest(message=message("n=60 size=4 rate=20", agent="stream")), context=ctx)
    sub_id = None
    async for ev in run:
        if ev.HasField("task"):
            sub_id = ev.task.id
            break
    await run.aclose()
    evs = await asyncio.wait_for(collect(client.subscribe(SubscribeToTaskRequest(id=sub_id), context=ctx)), TIMEOUT)
    final = await client.get_task(GetTaskRequest(id=sub_id), context=ctx)
    out["subscribe"] = {"events": [event_summary(e) for e in evs], "final": task_summary(final)}

    # errors, as the SDK's exception types (and the gRPC status code).
    errors = {}
    try:
        await client.get_task(GetTaskRequest(id=str(uuid.uuid4())), context=ctx)
        errors["task_not_found"] = {"error": None}
    except Exception as e:  # noqa: BLE001 - the type is what we report
        errors["task_not_found"] = error_summary(e)
    try:
        await client.cancel_task(CancelTaskRequest(id=task_id), context=ctx)
        errors["task_not_cancelable"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        errors["task_not_cancelable"] = error_summary(e)
    try:
        await asyncio.wait_for(collect(client.subscribe(SubscribeToTaskRequest(id=task_id), context=ctx)), TIMEOUT)
        errors["subscribe_terminal"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        errors["subscribe_terminal"] = error_summary(e)
    try:
        await asyncio.wait_for(collect(client.send_message(
            SendMessageRequest(message=message("a picture", media_type="image/png")), context=ctx)), TIMEOUT)
        errors["content_type"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        errors["content_type"] = error_summary(e)
    errors["version"] = await wrong_version(base_url, binding, card)
    out["errors"] = errors
    return out


async def wrong_version(base_url, binding, card):
    """A call that asks for A2A 2.0: the SDK always sends 1.0, so this goes
    around it (raw JSON-RPC over HTTP, the generated stub over gRPC)."""
    if binding == "GRPC":
        url = next(i.url for i in card.supported_interfaces if i.protocol_binding == "GRPC")
        async with grpc.aio.insecure_channel(url) as ch:
            stub = a2a_pb2_grpc.A2AServiceStub(ch)
            try:
                await stub.GetTask(a2a_pb2.GetTaskRequest(id="x"), metadata=[("a2a-version", "2.0")], timeout=TIMEOUT)
                return {"error": None}
            except grpc.aio.AioRpcError as e:
                return {"error": "rpc", "grpc_code": e.code().name}
    url = next(i.url for i in card.supported_interfaces if i.protocol_binding == "JSONRPC")
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        r = await http.post(url, headers={"A2A-Version": "2.0"},
                            json={"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}})
        return {"error": "jsonrpc", "code": r.json().get("error", {}).get("code")}


async def make_client(base_url, binding, card, streaming=True):
    config = ClientConfig(
        streaming=streaming,
        supported_protocol_bindings=[binding],
        grpc_channel_factory=lambda url: grpc.aio.insecure_channel(url),
    )
    return ClientFactory(config).create(card)


CONFORMANCE_IDS = [
    "tck-complete-task", "tck-artifact-text", "tck-artifact-file", "tck-artifact-file-url",
    "tck-artifact-data", "tck-message-response", "tck-input-required", "tck-reject-task",
    "tck-stream-001", "tck-stream-002", "tck-stream-003", "tck-stream-ordering-001",
    "tck-stream-artifact-text", "tck-stream-artifact-file", "tck-stream-artifact-chunked",
    "test-resubscribe-message-id",
]


async def conformance(client):
    """Each messageId prefix, streamed: the events it produced."""
    out = {}
    ctx = ClientCallContext(timeout=TIMEOUT)
    for prefix in CONFORMANCE_IDS:
        m = message("conformance")
        m.message_id = f"{prefix}-{uuid.uuid4()}"
        evs = await asyncio.wait_for(collect(client.send_message(SendMessageRequest(message=m), context=ctx)), TIMEOUT)
        summary = []
        for e in evs:
            s = event_summary(e)
            if e.HasField("artifact_update"):
                s["parts"] = [MessageToDict(p) for p in e.artifact_update.artifact.parts]
            if e.HasField("status_update") and e.status_update.status.HasField("message"):
                s["text"] = "".join(p.text for p in e.status_update.status.message.parts)
            summary.append(s)
        out[prefix] = summary
    return out


async def main():
    base_url, binding = sys.argv[1], sys.argv[2]
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        card = await A2ACardResolver(http, base_url).get_agent_card()
    client = await make_client(base_url, binding, card)
    if sys.argv[3:] == ["conformance"]:
        print(json.dumps(await conformance(client)))
        return
    out = {
        "card": {
            "interfaces": [[i.protocol_binding, i.url, i.protocol_version] for i in card.supported_interfaces],
            "streaming": card.capabilities.streaming,
            "skills": [s.id for s in card.skills],
        }
    }
    out.update(await scenarios(client, binding, base_url, card))
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(asyncio.wait_for(main(), 120))
