"""The benchmarks' Python peer: agents.v1.AgentService on grpc.aio.

What many teams would write instead of agentd: a short asyncio server that
emits the `stream` agent's events (same parameters: n, size, rate, yield,
wait) from an async generator. CreateSession returns a fresh id.

    python server.py 127.0.0.1:50063 GENERATED_DIR

GENERATED_DIR holds agent_pb2.py / agent_pb2_grpc.py made by grpc_tools.protoc
from proto/agents/v1/agent.proto (bench/run.sh does it).
"""

import asyncio
import re
import sys
import time
import uuid

sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else ".")

import grpc  # noqa: E402
from agents.v1 import agent_pb2, agent_pb2_grpc  # noqa: E402

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def parse_spec(text):
    spec = {"n": 10, "size": 16, "rate": 0.0, "yield": False, "wait": 0.0}
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "n":
            spec["n"] = int(value)
        elif key == "size":
            spec["size"] = int(value)
        elif key == "rate":
            spec["rate"] = float(value)
        elif key == "yield":
            spec["yield"] = value in ("1", "true", "yes")
        elif key == "wait":
            m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", value)
            if not m:
                raise ValueError("wait must be a duration like 5s")
            spec["wait"] = float(m.group(1)) * _UNITS[m.group(2)]
        else:
            raise ValueError("unknown parameter; use n, size, rate, yield, wait")
    return spec


def event(seq, text, kind):
    return agent_pb2.AgentEvent(
        seq=seq,
        text=text,
        is_final=kind == agent_pb2.EVENT_KIND_FINAL_ANSWER,
        kind=kind,
        author="stream",
        created_unix_nanos=time.time_ns(),
    )


class Service(agent_pb2_grpc.AgentServiceServicer):
    async def CreateSession(self, request, context):
        return agent_pb2.SessionRef(user_id=request.user_id, session_id=str(uuid.uuid4()))

    async def Run(self, request, context):
        try:
            spec = parse_spec(request.text)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Headers now, as agentd and tonic send them, so an idle stream is open.
        await context.send_initial_metadata(())
        if spec["wait"]:
            await asyncio.sleep(spec["wait"])
        body = "x" * spec["size"]
        loop = asyncio.get_running_loop()
        start = loop.time()
        period = 1.0 / spec["rate"] if spec["rate"] > 0 else 0.0
        for seq in range(spec["n"]):
            if period:
                delay = start + seq * period - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            elif spec["yield"]:
                await asyncio.sleep(0)
            yield event(seq, body, agent_pb2.EVENT_KIND_PARTIAL_TEXT)
        yield event(spec["n"], f"sent {spec['n']} events", agent_pb2.EVENT_KIND_FINAL_ANSWER)


async def main(addr):
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1024)])
    agent_pb2_grpc.add_AgentServiceServicer_to_server(Service(), server)
    server.add_insecure_port(addr)
    await server.start()
    print(f"server.py: serving agents.v1.AgentService on {addr}", file=sys.stderr, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50063"))
