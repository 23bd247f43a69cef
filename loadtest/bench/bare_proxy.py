"""The floor under cachelane: the smallest streaming proxy on the same stack, as a process.

    python -m loadtest.bench.bare_proxy --port 8100 --replicas http://127.0.0.1:9001,...
    python -m loadtest.bench.bare_proxy --route ...   # the routing floor, below

Round robin over the replicas, no routing, no parsing, no metrics, no logs: the request's body
is read whole and POSTed to the next replica; the answer's status, content type and bytes are
relayed as they arrive. What it shares with `cachelane serve` is everything under the gateway's
own code: uvicorn with the same settings (gateway/cli/main.py: uvloop when installed, the httptools
protocol with its header deadline, no access log) and the same upstream client
(gateway/serving/upstream.py's AiohttpUpstream with the gateway's default timeouts and pool). So
cachelane's time minus this proxy's is what cachelane's own code adds
(loadtest/bench/overhead_floor.py runs the two side by side).

`--route` (RoutingFloor) adds the work no cache-aware router can skip, done by cachelane's own
routing/ code: the body parsed (orjson, as gateway/http/body.py), the chat prompt's canonical
text and block hashes (routing/prompt.py, routing/hashing.py's PrefixHasher), the index lookup
and the record of where the prompt went (routing/index.py's MemoryIndex), decide(cache_aware)
over the replicas with their requests in flight (routing/decide.py). No tenants, checks,
metrics, logs, accounting or learning: what cachelane costs above this arm is its product's
work, what this arm costs above the bare proxy is routing by KV cache itself.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.config import UpstreamConfig
from gateway.serving.upstream import AiohttpUpstream, Upstream, UpstreamError
from routing.cost import Load
from routing.decide import Candidate, Policy, RouteRequest, decide
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS, PrefixHasher
from routing.index import MemoryIndex
from routing.prompt import approx_tokens, chat_text
from routing.types import Location, Tier

Scope = dict[str, Any]
Message = dict[str, Any]
KEEPALIVE_S = 60.0  # what gateway/wiring.py gives AiohttpUpstream


class BareProxy:
    """A raw ASGI app: GET /health and /ready answer 200, every POST goes to the next replica."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self._next_replica = itertools.cycle(list(replicas)).__next__
        self._upstream: Upstream | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["method"] == "POST":
                await self._proxy(scope, receive, send)
            else:
                await _answer(send, 200, b'{"status":"ok"}')

    async def _lifespan(self, receive: Any, send: Any) -> None:
        defaults = UpstreamConfig()  # the gateway's defaults, so both pools behave alike
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._upstream = AiohttpUpstream(
                    max_connections_per_replica=defaults.max_connections,
                    connect_timeout_s=defaults.connect_timeout_s,
                    read_timeout_s=defaults.read_timeout_s,
                    keepalive_s=KEEPALIVE_S,
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._upstream is not None:
                    await self._upstream.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _proxy(self, scope: Scope, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await self._relay(scope["path"], body, self._choose(body), send)

    def _choose(self, _body: bytes) -> str:
        return self._next_replica()

    async def _relay(self, path: str, body: bytes, replica: str, send: Any) -> None:
        assert self._upstream is not None  # set by the lifespan before any request
        url = replica + path
        try:
            resp = await self._upstream.post(url, body, {"content-type": "application/json"})
        except UpstreamError as err:
            await _answer(send, 502, str(err).encode())
            return
        try:
            content_type = (resp.content_type or "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [(b"content-type", content_type)],
                }
            )
            async for chunk in resp.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()


class RoutingFloor(BareProxy):
    """The bare proxy routing by KV cache with cachelane's routing/ code (the module docstring)."""

    NAMESPACE = "bench|default"  # one model, one cache scope

    def __init__(self, replicas: Sequence[str]) -> None:
        super().__init__(replicas)
        self._in_flight = dict.fromkeys(replicas, 0)
        self._hasher = PrefixHasher()
        self._index = MemoryIndex()
        self._rng = random.Random(0)
        self._seq = 0

    async def _relay(self, path: str, body: bytes, replica: str, send: Any) -> None:
        self._in_flight[replica] += 1
        try:
            await super()._relay(path, body, replica, send)
        finally:
            self._in_flight[replica] -= 1

    def _choose(self, body: bytes) -> str:
        text = chat_text(orjson.loads(body)["messages"])
        hashes = self._hasher.block_hashes(text, namespace=self.NAMESPACE)
        hits = self._index.lookup_now(self.NAMESPACE, hashes)
        candidates = [Candidate(name, Load(in_flight=n)) for name, n in self._in_flight.items()]
        request = RouteRequest(hashes, approx_tokens(text), DEFAULT_BLOCK_SIZE_TOKENS)
        decision = decide(
            request, candidates, hits, Policy.CACHE_AWARE, seq=self._seq, rng=self._rng
        )
        self._seq += 1
        self._index.record_now(self.NAMESPACE, hashes[::-1], Location(decision.replica, Tier.HBM))
        return decision.replica


async def _answer(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    from gateway.http.exposure import HTTP_PROTOCOL

    p = argparse.ArgumentParser(prog="python -m loadtest.bench.bare_proxy", description=__doc__)
    p.add_argument("--replicas", required=True, help="comma-separated base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--route", action="store_true", help="route by KV cache (RoutingFloor)")
    args = p.parse_args(argv)
    replicas = [u.rstrip("/") for u in args.replicas.split(",") if u]
    app = RoutingFloor(replicas) if args.route else BareProxy(replicas)
    # gateway/cli/main.py's settings: no uvicorn access log, its HTTP protocol, loop "auto" (uvloop)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", log_config=None,
        access_log=False, http=HTTP_PROTOCOL,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
