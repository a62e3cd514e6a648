"""Run by test_ray_ingress_app.py inside a network namespace of its own (``unshare -n``): the ingress in front of one
replica that takes a request and answers nothing, its host then cut off the network (the namespace's loopback
taken down: no reset, no FIN, nothing). Prints the status and the body the client got, as one JSON line.

The client calls the ingress in this process (no socket of its own); the replica's stand-in actor answers the
watcher throughout, as Ray's path to a replica may while the ingress's path to its server is gone."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pie.serve.ray as ray_serve
from pie.serve.app import ServeSettings
from pie.serve.server import listen

SILENT_FOR_S = 300.0
"""How long the replica keeps the request without a word: far past the test's own timeout."""

received = threading.Event()


async def silent(request: Request) -> Response:
    received.set()
    await asyncio.sleep(SILENT_FOR_S)
    return JSONResponse({"choices": []})


class Ready:
    """The replica's actor: ready at ``url``, whatever happens to the network."""

    def __init__(self, url: str):
        from actor_calls import ActorCall

        info = {"url": url, "pid": 1, "node": "here", "phase": "ready", "error": None, "page_size": 16}
        self.info = ActorCall(lambda: info)
        self.tokenizer_json = ActorCall(lambda: None)


async def main(idle: int, interval: int, probes: int) -> dict:
    ray_serve.UPSTREAM_PROBE_IDLE_S, ray_serve.UPSTREAM_PROBE_INTERVAL_S = idle, interval
    ray_serve.UPSTREAM_PROBES = probes
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/completions", silent, methods=["POST"])]),
                                           log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    ingress = ray_serve.Ingress(ServeSettings(model="unused"), [Ready(f"http://127.0.0.1:{sock.getsockname()[1]}")])
    for _ in range(600):  # (bounded: the test's own timeout ends this process anyway)
        if server.started:
            break
        await asyncio.sleep(0.05)
    await ingress.start()
    await ingress.watch_once()
    transport = httpx.ASGITransport(app=ray_serve.create_ingress_app(ingress))
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress", timeout=None) as client:
        asked = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x"}))
        await asyncio.to_thread(received.wait, 30)
        subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
        answer = await asked
    await ingress.close()
    return {"status": answer.status_code, "body": answer.json()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*(int(arg) for arg in sys.argv[1:4])))), flush=True)
