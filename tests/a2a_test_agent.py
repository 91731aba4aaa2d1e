"""A small A2A 1.0 agent written with the official Python SDK: the remote
peer that tests agentd's A2A streaming client.

Usage: a2a_test_agent.py [--bare-snapshots] [--drop-every K] [--forget-tasks]
                         [--tls CERT KEY]
(JSON-RPC on 127.0.0.1, a free port; over https with --tls, PEM files)

--bare-snapshots strips the artifacts from every task snapshot it sends
(GetTask, and the task a resubscription starts with), as a server that does
not aggregate artifacts would: chunks lost in a drop cannot come back.
--drop-every K cuts every streaming response (the first, and each
resubscription) after K artifact events, as a flaky proxy would.
--forget-tasks answers GetTask and SubscribeToTask with TaskNotFound, as a
server restarted without its tasks would.

Prints "LISTENING <port>" once serving. What a task does is chosen by
key=value words in the message text:

  chunks=N    stream artifact "a1" as N text chunks "c0 " "c1 " ... (append,
              last_chunk on the last), then complete (default 3)
  second=1    also stream a second artifact "a2" ("second artifact")
  delay=S     seconds between chunks (default 0.02)
  drop=K      the server cuts the first SSE connection after K artifact
              events; the task goes on, so a client can resubscribe
  stall=K     after K chunks, go silent until cancelled
  message=1   answer with a direct Message "direct reply", no task
  fail=1      the task fails with "boom"
  reject=1    the task is rejected with "rejected"
  input=1     the task waits for input (INPUT_REQUIRED)
  said=1      the task completes with its answer "all done" in its status
              message, and no artifact
"""

import asyncio
import json
import re
import socket
import sys
import uuid

import uvicorn
from starlette.applications import Starlette

from a2a.helpers.proto_helpers import new_task_from_user_message, new_text_message
from a2a.server.agent_execution import AgentExecutor
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes.agent_card_routes import create_agent_card_routes
from a2a.server.routes.jsonrpc_routes import create_jsonrpc_routes
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.server.tasks.task_updater import TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
)


def options(text):
    return dict(w.split("=", 1) for w in text.split() if "=" in w)


class ChunkingAgent(AgentExecutor):
    async def execute(self, context, event_queue):
        opts = options(context.get_user_input())
        if opts.get("message"):
            await event_queue.enqueue_event(Message(
                role=Role.ROLE_AGENT, parts=[Part(text="direct reply")],
                message_id=str(uuid.uuid4()), context_id=context.context_id))
            return
        task = context.current_task or new_task_from_user_message(context.message)
        if not context.current_task:
            await event_queue.enqueue_event(task)
        up = TaskUpdater(event_queue, task.id, task.context_id)
        await up.start_work()
        if opts.get("reject"):
            await up.reject(new_text_message("rejected", context_id=task.context_id, task_id=task.id))
            return
        if opts.get("fail"):
            await up.failed(new_text_message("boom", context_id=task.context_id, task_id=task.id))
            return
        if opts.get("input"):
            await up.requires_input(new_text_message("which order?", context_id=task.context_id, task_id=task.id))
            return
        if opts.get("said"):
            await up.complete(new_text_message("all done", context_id=task.context_id, task_id=task.id))
            return
        n = int(opts.get("chunks", 3))
        delay = float(opts.get("delay", 0.02))
        stall = int(opts["stall"]) if "stall" in opts else None
        for i in range(n):
            if stall is not None and i == stall:
                await asyncio.Event().wait()  # silent until cancelled
            await up.add_artifact([Part(text=f"c{i} ")], artifact_id="a1", name="chunks",
                                  append=i > 0, last_chunk=i == n - 1)
            await asyncio.sleep(delay)
        if opts.get("second"):
            await up.add_artifact([Part(text="second artifact")], artifact_id="a2", name="second",
                                  append=False, last_chunk=True)
        await up.complete()

    async def cancel(self, context, event_queue):
        up = TaskUpdater(event_queue, context.task_id, context.context_id)
        await up.cancel()


def strip_artifacts(doc):
    """Removes the artifacts of the task in a JSON-RPC response, if any."""
    result = doc.get("result") if isinstance(doc, dict) else None
    if isinstance(result, dict):
        task = result.get("task", result if "status" in result else None)
        if isinstance(task, dict):
            task.pop("artifacts", None)
    return doc


class Middleware:
    """Wraps an ASGI app; `post` sees its POST requests, the rest pass."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        return await self.post(scope, receive, send)


class BareSnapshots(Middleware):
    """Strips artifacts from GetTask results and resubscription snapshots."""

    async def post(self, scope, receive, send):
        req, replay = await read_request(receive)
        method = req.get("method")
        if method == "GetTask":
            start = {}

            async def rewrite_unary(m):
                if m["type"] == "http.response.start":
                    start.update(m)
                    return
                doc = strip_artifacts(json.loads(m.get("body", b"") or b"{}"))
                out = json.dumps(doc).encode()
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(out)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": out})

            return await self.app(scope, replay, rewrite_unary)
        if method == "SubscribeToTask":
            async def rewrite_sse(m):
                b = m.get("body", b"") if m["type"] == "http.response.body" else b""
                if b.startswith(b"data: "):
                    doc = strip_artifacts(json.loads(b[6:].strip()))
                    m = {**m, "body": b"data: " + json.dumps(doc).encode() + b"\n\n"}
                await send(m)

            return await self.app(scope, replay, rewrite_sse)
        return await self.app(scope, replay, send)


async def read_body(receive):
    received, body = [], b""
    while True:
        m = await receive()
        received.append(m)
        body += m.get("body", b"")
        if m["type"] != "http.request" or not m.get("more_body"):
            return received, body


async def read_request(receive):
    """The JSON-RPC request of a POST (`{}` if it is not one), and the
    `receive` that gives the app the body again."""
    received, body = await read_body(receive)
    try:
        req = json.loads(body)
    except ValueError:
        req = {}
    return (req if isinstance(req, dict) else {}), replayer(received, receive)


def replayer(received, receive):
    async def replay():
        return received.pop(0) if received else await receive()
    return replay


def cut_after(send, k):
    """`send`, cutting the response after K artifact events, as a network
    failure would (the response ends without its terminating chunk)."""
    seen = 0

    async def cutting_send(m):
        nonlocal seen
        if m["type"] == "http.response.body" and b"artifactUpdate" in m.get("body", b""):
            seen += 1
            if seen > k:
                raise ConnectionAbortedError("test: connection dropped mid-stream")
        await send(m)

    return cutting_send


class DropStream(Middleware):
    """Cuts the first SendStreamingMessage response whose message says drop=K
    after K artifact events, as a network failure would (the response ends
    without its terminating chunk)."""

    async def post(self, scope, receive, send):
        req, replay = await read_request(receive)
        drop_after = None
        if req.get("method") == "SendStreamingMessage":
            m = re.search(r"\bdrop=(\d+)", json.dumps(req.get("params", {})))
            drop_after = int(m.group(1)) if m else None
        if drop_after is None:
            return await self.app(scope, replay, send)
        await self.app(scope, replay, cut_after(send, drop_after))


class DropEvery(Middleware):
    """Cuts every streaming response after K artifact events."""

    def __init__(self, app, k):
        super().__init__(app)
        self.k = k

    async def post(self, scope, receive, send):
        await self.app(scope, receive, cut_after(send, self.k))


class ForgetTasks(Middleware):
    """Answers GetTask and SubscribeToTask with TaskNotFound."""

    async def post(self, scope, receive, send):
        req, replay = await read_request(receive)
        if req.get("method") in ("GetTask", "SubscribeToTask"):
            out = json.dumps({"jsonrpc": "2.0", "id": req.get("id"),
                              "error": {"code": -32001, "message": "Task not found"}}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(out)).encode())]})
            await send({"type": "http.response.body", "body": out})
            return
        await self.app(scope, replay, send)


async def main():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until uvicorn serves
    port = sock.getsockname()[1]
    args = sys.argv[1:]
    tls = args[args.index("--tls") + 1:args.index("--tls") + 3] if "--tls" in args else None
    scheme = "https" if tls else "http"
    card = AgentCard(
        name="chunking test agent",
        description="Streams chunked artifacts; can drop or stall (tests only).",
        version="1.0.0",
        supported_interfaces=[AgentInterface(protocol_binding="JSONRPC", url=f"{scheme}://127.0.0.1:{port}/",
                                             protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="chunks", name="chunks", description="Streams chunks.", tags=["test"])],
    )
    handler = DefaultRequestHandler(agent_executor=ChunkingAgent(), task_store=InMemoryTaskStore(), agent_card=card)
    app = Starlette(routes=create_agent_card_routes(card) + create_jsonrpc_routes(handler, rpc_url="/"))
    inner = BareSnapshots(app) if "--bare-snapshots" in args else app
    if "--drop-every" in args:
        inner = DropEvery(inner, int(args[args.index("--drop-every") + 1]))
    if "--forget-tasks" in args:
        inner = ForgetTasks(inner)
    wrapped = DropStream(inner)
    ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
    server = uvicorn.Server(uvicorn.Config(wrapped, log_level="warning", lifespan="off", **ssl))
    print(f"LISTENING {port}", flush=True)
    await server.serve(sockets=[sock])


if __name__ == "__main__":
    asyncio.run(main())
