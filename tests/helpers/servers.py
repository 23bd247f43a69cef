"""Real uvicorn servers on loopback for integration tests: `async with running_app(app) as url`.

The server runs in the test's own event loop on a socket bound here (port 0 unless told), so there
is no race for a free port; leaving the block shuts it down gracefully (lifespan shutdown included)
and awaits its task, so nothing leaks into the next test.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn

from loadtest.sim.fleet import QuietServer, bind_socket, serve_app

STARTUP_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 10.0
GRACEFUL_SHUTDOWN_S = 2  # open streams get this long before uvicorn cancels them


@asynccontextmanager
async def running_app(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    http: str = "auto",
    forwarded_allow_ips: str = "",
) -> AsyncIterator[str]:
    """Serve an ASGI app until the block exits; yields its base URL, e.g. http://127.0.0.1:41234.
    `http`: uvicorn's HTTP protocol (gateway.http.exposure.HTTP_PROTOCOL: as `cachelane serve`);
    `forwarded_allow_ips`: peers whose X-Forwarded-For is taken ("": none, as `cachelane serve`
    by default: config listen.trusted_proxies)."""
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        host=host,
        port=bound_port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        http=http,
        forwarded_allow_ips=forwarded_allow_ips,
    )
    server = QuietServer(config)
    task = asyncio.create_task(serve_app(server, sock), name=f"uvicorn {host}:{bound_port}")
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError(f"server on {host}:{bound_port} exited before starting")
                await asyncio.sleep(0.005)
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        await asyncio.wait([task], timeout=SHUTDOWN_TIMEOUT_S)  # never raises, never cancels
        if not task.done():
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()  # uvicorn closes it on shutdown; this covers a failed start (idempotent)
        crash = None if task.cancelled() else task.exception()
        if crash is not None and sys.exc_info()[1] is None:
            raise crash


async def until_serve_ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Waits, at most `timeout_s`, for a `cachelane serve` process at `url` to answer /ready with
    200; fails the test where it exits first or never does."""
    async with httpx.AsyncClient(timeout=1.0) as h:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.returncode is None, "cachelane serve exited"
            try:
                if (await h.get(f"{url}/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "cachelane serve never became ready"
            await asyncio.sleep(0.1)
