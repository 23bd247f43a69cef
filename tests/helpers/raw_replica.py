"""A replica that breaks HTTP itself, for what an ASGI server never sends: a streamed answer whose
chunked framing goes wrong mid-way. An asyncio server on loopback, in the test's event loop.

GET /v1/models lists its model (it passes the health check); any POST is answered 200 with an
event stream in chunked encoding: EVENTS events, one a chunk, then a chunk header that is not
hexadecimal, and the connection closed (what a proxy or engine that crashed mid-write leaves).
`requests` counts the POSTs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

EVENTS = 3
EVENT = (
    b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
)
BAD_CHUNK_HEADER = b"zz\x00garbage\r\n"


@dataclass
class MidGarbage:
    model: str
    requests: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if head.startswith(b"GET /v1/models"):
                    data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
                    body = json.dumps(data).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(body), body)
                    )
                    await writer.drain()
                    continue
                self.requests += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for _ in range(EVENTS):
                    writer.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(BAD_CHUNK_HEADER)
                await writer.drain()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@asynccontextmanager
async def mid_garbage(model: str) -> AsyncIterator[tuple[str, MidGarbage]]:
    """Serve a MidGarbage replica until the block exits; yields its base URL and itself."""
    replica = MidGarbage(model)
    server = await asyncio.start_server(replica.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", replica
    finally:
        server.close()
        await server.wait_closed()
