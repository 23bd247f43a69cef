"""How long a server keeps a connection whose client sends nothing, or half a request.

    .venv/bin/python -m loadtest.bench.read_deadlines [--wait-s 60]

Serves a trivial ASGI app with uvicorn's h11 and httptools protocols as they come, and with
cachelane's (gateway/http/exposure.py: DeadlineHttpToolsProtocol and `deadline_receive`, as the
request layer applies it, header and body deadlines of 5 s here), on loopback; opens three raw
sockets against each: one that sends nothing, one that sends a request line and a header but never
the blank line, and one that sends whole headers promising 100 body bytes and sends 10. Prints how
long each stayed open (at most --wait-s).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn

from gateway.http.exposure import (
    HTTP_PROTOCOL,
    POLICY_STATE_KEY,
    BodyTimeout,
    ConnectionPolicy,
    deadline_receive,
)
from loadtest.sim.fleet import QuietServer, bind_socket, serve_app

DEADLINE_S = 5.0
CASES = {
    "idle": b"",
    "half headers": b"POST / HTTP/1.1\r\nHost: x\r\n",
    "half body": b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n0123456789",
}


async def echo(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":  # hands the connection policy to cachelane's protocol
        await receive()
        scope["state"][POLICY_STATE_KEY] = ConnectionPolicy(DEADLINE_S, lambda _part: None)
        await send({"type": "lifespan.startup.complete"})
        await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serving(app: Any, http: str) -> AsyncIterator[int]:
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, log_level="error", http=http, lifespan="on")
    server = QuietServer(config)
    task = asyncio.create_task(serve_app(server, sock))
    for _ in range(1000):  # 10 s at most
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait([task], timeout=10)


async def open_for(port: int, payload: bytes, wait_s: float) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if payload:
        writer.write(payload)
        await writer.drain()
    started = time.monotonic()
    try:
        async with asyncio.timeout(wait_s):
            answer = await reader.read()  # until the server closes
    except TimeoutError:
        return f"open after {wait_s:g} s"
    finally:
        writer.close()
    status = answer.split(b"\r\n", 1)[0].decode() or "nothing sent"
    return f"closed after {time.monotonic() - started:.1f} s ({status})"


async def main(wait_s: float) -> None:

    async def cachelane_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await echo(scope, receive, send)
            return
        try:
            timed = deadline_receive(receive, DEADLINE_S, lambda _part: None)
            await echo(scope, timed, send)
        except BodyTimeout as err:  # as the gateway's ApiError handler answers it
            await err.response()(scope, receive, send)

    servers = [("h11", echo, "h11"), ("httptools", echo, "httptools")]
    servers.append(("cachelane", cachelane_app, HTTP_PROTOCOL))
    print(f"| server | {' | '.join(CASES)} |")
    print(f"| --- | {' | '.join('---' for _ in CASES)} |")
    for name, app, http in servers:
        async with serving(app, http) as port:
            results = await asyncio.gather(*(open_for(port, p, wait_s) for p in CASES.values()))
        print(f"| {name} | {' | '.join(results)} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait-s", type=float, default=60.0)
    asyncio.run(main(parser.parse_args().wait_s))
