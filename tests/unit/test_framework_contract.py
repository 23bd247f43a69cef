"""What the gateway relies on inside its web framework, beyond the frameworks' documented APIs.

gateway/http/exposure.py's header deadline subclasses uvicorn's HttpToolsProtocol (uvicorn has no
setting for a deadline on a request's headers), and gateway/http/app.py's ASGI entry wraps the hot
endpoints in the app's `user_middleware`. pyproject.toml bounds uvicorn, starlette and fastapi to
the versions these were tested on; when an upgrade moves what they use, these tests say what moved
before the integration tests (tests/integration/test_exposure.py) show only a symptom."""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version

import pytest
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.http.exposure import POLICY_STATE_KEY, ConnectionPolicy

httptools_impl = pytest.importorskip("uvicorn.protocols.http.httptools_impl")
from gateway.http.exposure import DeadlineHttpToolsProtocol  # noqa: E402  (needs httptools)

MOVED = (
    "uvicorn {version} changed HttpToolsProtocol.{name}, which gateway/http/exposure.py's header "
    "deadline overrides or reads: adapt DeadlineHttpToolsProtocol, or keep uvicorn within the "
    "range pyproject.toml names"
)
OVERRIDDEN = ("connection_made", "on_headers_complete", "on_response_complete", "connection_lost")
READ_AFTER_CONNECTING = ("pipeline", "app_state", "loop", "transport")
BOUND_S = 5.0  # the longest any step here may take before the test gives up


def _moved(name: str) -> str:
    return MOVED.format(version=version("uvicorn"), name=name)


def test_the_uvicorn_protocol_methods_the_deadline_overrides_are_there() -> None:
    base = httptools_impl.HttpToolsProtocol
    assert issubclass(DeadlineHttpToolsProtocol, base)
    for name in OVERRIDDEN:
        assert callable(getattr(base, name, None)), _moved(name)
    # the arguments the overrides pass on
    assert list(inspect.signature(base.connection_made).parameters)[:2] == [
        "self",
        "transport",
    ], _moved("connection_made")
    assert list(inspect.signature(base.connection_lost).parameters) == ["self", "exc"], _moved(
        "connection_lost"
    )
    init = inspect.signature(base.__init__).parameters
    assert {"config", "server_state", "app_state"} <= set(init), _moved("__init__")


async def _answer(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def test_the_deadline_closes_a_silent_connection_and_spares_an_answered_request() -> None:
    """The protocol state the deadline reads (pipeline, app_state, loop, transport) is where it
    was: a request is answered, then the idle connection is closed at the header deadline."""
    timeouts: list[str] = []
    app_state = {POLICY_STATE_KEY: ConnectionPolicy(0.2, timeouts.append)}
    config = Config(app=_answer, http=DeadlineHttpToolsProtocol, log_level="warning")
    config.load()
    made: list[DeadlineHttpToolsProtocol] = []

    def protocol() -> DeadlineHttpToolsProtocol:
        made.append(
            DeadlineHttpToolsProtocol(
                config=config, server_state=ServerState(), app_state=app_state
            )
        )
        return made[-1]

    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for name in READ_AFTER_CONNECTING:
            assert hasattr(made[0], name), _moved(name)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), BOUND_S)
        assert status.startswith(b"HTTP/1.1 204"), status
        await asyncio.wait_for(reader.read(), BOUND_S)  # EOF: closed once idle past 0.2 s
        assert timeouts == ["headers"], _moved("on_response_complete")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


def test_the_app_middlewares_the_hot_entry_wraps_are_where_starlette_keeps_them() -> None:
    class Marker:
        def __init__(self, app: ASGIApp, *, tag: str) -> None:
            self.app, self.tag = app, tag

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            await self.app(scope, receive, send)

    app = FastAPI()
    app.add_middleware(Marker, tag="outer")
    assert app.middleware_stack is None  # built at the first call: the hot entry builds it too
    assert all(isinstance(m, Middleware) for m in app.user_middleware)
    cls, args, kwargs = app.user_middleware[0]
    assert (cls, args, kwargs) == (Marker, (), {"tag": "outer"}), (
        f"starlette {version('starlette')} changed FastAPI.user_middleware, which "
        "gateway/http/app.py's hot entry wraps its endpoints in"
    )
