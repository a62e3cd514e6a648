"""The ingress's HTTP/1.1 client for its replicas, against a scripted server: bodies whole and chunked,
kept-alive connections reused, an idle connection the server closed replaced, a body cut off an error."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import pytest

if os.environ.get("CI") == "true":
    import ray  # noqa: F401  (CI installs the ray extra: missing there is a failure, not a skip)
else:
    pytest.importorskip("ray", reason="pie serve --ray needs the ray extra")
from pie.serve.ray import Upstream, UpstreamError  # noqa: E402

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


def _run(handler: Handler, client: Callable[[str, list[int]], Awaitable[None]]) -> list[int]:
    """Serve ``handler`` on a loopback port, run ``client(url, connections)``; the count of connections made."""
    connections: list[int] = []

    async def main() -> None:
        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(1)
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(counted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await asyncio.wait_for(client(f"http://127.0.0.1:{port}", connections), 20)

    asyncio.run(main())
    return connections


def test_whole_and_chunked_bodies_over_one_kept_alive_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        assert request.startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n") and request.endswith(b'{"a": 1}')
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"b\":2}")
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\ndata:\r\n3;ext=1\r\n ok\r\n0\r\nx-trailer: 1\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client goes

    async def client(url: str, connections: list[int]) -> None:
        upstream = Upstream()
        first = await upstream.request("POST", f"{url}/v1/completions?x=1", {"content-type": "application/json"},
                                       b'{"a": 1}')
        assert (first.status, first.headers["content-type"], await first.read()) == (200, "application/json",
                                                                                       b'{"b":2}')
        await first.close()
        second = await upstream.request("POST", f"{url}/v1/completions", {}, b"{}")
        assert [piece async for piece in second.chunks()] == [b"data:", b" ok"]
        await second.close()
        await upstream.close()

    assert len(_run(handler, client)) == 1


def test_an_idle_connection_the_server_closed_is_replaced_and_a_cut_body_is_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if len(served) == 0:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\npart")  # then the replica dies
        served.append(1)
        await writer.drain()

    served: list[int] = []

    async def client(url: str, connections: list[int]) -> None:
        upstream = Upstream()
        answer = await upstream.request("GET", f"{url}/health", {})
        assert await answer.read() == b"ok"
        await answer.close()  # back in the pool; the server closes its end
        await asyncio.sleep(0.1)
        answer = await upstream.request("GET", f"{url}/health", {})
        with pytest.raises(UpstreamError, match="closed inside the body"):
            await answer.read()
        await answer.close()
        await upstream.close()

    assert len(_run(handler, client)) == 2


def test_a_refused_connection_is_an_upstream_error() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError):
            await Upstream().request("GET", f"http://127.0.0.1:{port}/health", {})

    asyncio.run(main())
