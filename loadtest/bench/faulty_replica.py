"""A replica that fails, as its own process, for the fault probe (loadtest/bench/faults.py).

    python -m loadtest.bench.faulty_replica --mode error|hang|midgarbage --port PORT --model M

A raw asyncio HTTP/1.1 server on loopback (an ASGI server never sends broken framing): GET
/health and /v1/models answer as an engine does, so health checks pass and only its answers to
generations can take it out. A POST is answered by `--mode`:

- error: 500 with an OpenAI error body at once (an engine whose every request fails fast);
- hang: never answers, until the caller leaves (a wedged process that still accepts);
- midgarbage: 200 and an event stream in chunked encoding, EVENTS events, then a chunk header
  that is not hexadecimal and the connection closed (a proxy or engine that crashed mid-write).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

EVENTS = 3
CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
EVENT = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"
BAD_CHUNK_HEADER = b"zz\x00garbage\r\n"
MODES = ("error", "hang", "midgarbage")


def _json(status: str, data: object) -> bytes:
    body = json.dumps(data).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class FaultyReplica:
    def __init__(self, mode: str, model: str) -> None:
        self.mode = mode
        self.model = model

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request; whether the connection stays open for the next."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        if head.startswith(b"GET /v1/models"):
            data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            writer.write(_json("200 OK", data))
        elif head.startswith(b"GET "):
            writer.write(_json("200 OK", {"status": "ok"}))
        elif self.mode == "error":
            error = {"message": "engine failure", "type": "server_error", "code": None}
            writer.write(_json("500 Internal Server Error", {"error": error}))
        elif self.mode == "hang":
            await reader.read()  # until the caller closes its connection
            return False
        else:
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
            return False
        await writer.drain()
        return True


async def serve(mode: str, port: int, model: str) -> None:
    replica = FaultyReplica(mode, model)
    server = await asyncio.start_server(replica.handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.faulty_replica")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.mode, args.port, args.model))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
