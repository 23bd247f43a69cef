"""gateway/serving/upstream.py's aiohttp client against real loopback servers (raw asyncio sockets,
so each test controls every byte the replica sends and sees when the gateway hangs up)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.serving.upstream import (
    AiohttpUpstream,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamTimeout,
)

BOUND_S = 10.0  # a hung test fails instead of hanging; nothing here is timed
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


@contextlib.asynccontextmanager
async def replica(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def upstream(read_timeout_s: float = BOUND_S) -> AsyncIterator[AiohttpUpstream]:
    client = AiohttpUpstream(
        max_connections_per_replica=8,
        connect_timeout_s=2.0,
        read_timeout_s=read_timeout_s,
        keepalive_s=60.0,
    )
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_stream_is_relayed_as_it_arrives_byte_for_byte() -> None:
    """The replica sends its second chunk only after the client has the first: a client that
    buffered would wait forever."""
    got_first = asyncio.Event()
    pieces = [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(pieces[0]))
        await writer.drain()
        await got_first.wait()
        writer.write(chunk(pieces[1]) + chunk(pieces[2]) + b"0\r\n\r\n")
        await writer.drain()

    async with asyncio.timeout(BOUND_S), replica(handler) as url, upstream() as client:
        resp = await client.post(url + "/v1/chat/completions", b"{}", {"x-a": "1"})
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        chunks = resp.chunks()
        received = [await anext(chunks)]
        assert received == pieces[:1]
        got_first.set()
        received += [c async for c in chunks]
        assert b"".join(received) == b"".join(pieces)
        await resp.aclose()


async def test_the_request_goes_out_as_given_and_the_connection_has_tcp_nodelay() -> None:
    seen: list[bytes] = []
    checked = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(STREAM_HEAD + chunk(b"{"))
        await writer.drain()
        await checked.wait()  # the connection stays the answer's until its body ends
        writer.write(chunk(b"}") + b"0\r\n\r\n")
        await writer.drain()

    body = b'{ "model":  "m", "messages": [] }'
    async with asyncio.timeout(BOUND_S), replica(handler) as url, upstream() as client:
        resp = await client.post(url + "/v1/completions", body, {"content-type": "x"})
        connection = resp.raw.connection  # type: ignore[attr-defined]
        assert connection is not None and connection.transport is not None
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        checked.set()
        assert await resp.read() == b"{}"
        await resp.aclose()
    assert seen == [body]


async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    async with upstream() as client:
        with pytest.raises(UpstreamConnectError):
            await client.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})


async def test_a_replica_that_hangs_up_before_answering_is_a_disconnect() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async with asyncio.timeout(BOUND_S), replica(handler) as url, upstream() as client:
        with pytest.raises(UpstreamDisconnected):
            await client.post(url + "/v1/completions", b"{}", {})


async def test_a_stream_broken_mid_way_is_a_disconnect() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        writer.transport.abort()

    async with asyncio.timeout(BOUND_S), replica(handler) as url, upstream() as client:
        resp = await client.post(url + "/v1/chat/completions", b"{}", {})
        with pytest.raises(UpstreamDisconnected):
            async for _ in resp.chunks():
                pass
        await resp.aclose()


async def test_a_replica_silent_past_the_read_timeout_is_a_timeout() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD)
        await writer.drain()
        await release.wait()

    async with asyncio.timeout(BOUND_S), replica(handler) as url:
        async with upstream(read_timeout_s=0.2) as client:
            resp = await client.post(url + "/v1/chat/completions", b"{}", {})
            with pytest.raises(UpstreamTimeout):
                await anext(resp.chunks())
            await resp.aclose()
        release.set()


async def test_closing_an_answer_not_read_whole_hangs_up_on_the_replica() -> None:
    """What makes an engine abort a request whose client left: its connection closes."""
    hung_up = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(STREAM_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        if await reader.read() == b"":  # EOF: the gateway closed the connection
            hung_up.set()

    async with asyncio.timeout(BOUND_S), replica(handler) as url, upstream() as client:
        resp = await client.post(url + "/v1/chat/completions", b"{}", {})
        assert await anext(resp.chunks()) == b"data: 1\n\n"
        await resp.aclose()
        await hung_up.wait()
