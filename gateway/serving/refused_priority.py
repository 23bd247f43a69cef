"""An engine's refusal of the class's `priority`, which is never the client's fault: the replica
is sent none from then on (gateway/fleet/engine_priority.py) and the request goes again without
it, on the same replica, within the same try."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from gateway.fleet import engine_priority
from gateway.fleet.replica import Replica
from gateway.serving.upstream import Upstream, UpstreamResponse


async def without_refused_priority(
    upstream: Upstream,
    resp: UpstreamResponse,
    replica: Replica,
    path: str,
    body_again: Callable[[], bytes],
    headers: Mapping[str, str],
) -> UpstreamResponse:
    """`resp`: a 400 to a request that carried `priority`. The answer to the same request sent
    again (`body_again()`, built once the replica is marked) if the 400 is the engine's refusal
    of the field; else `resp` as it was, its body already read."""
    content = await resp.read()
    if not engine_priority.refuses_priority(resp.status, content):
        return _ReadAnswer(resp, content)
    await resp.aclose()
    engine_priority.record(replica, False, "request")
    return await upstream.post(replica.url + path, body_again(), headers)


class _ReadAnswer:
    """An answer whose body was read already: it hands the body out again."""

    def __init__(self, resp: UpstreamResponse, content: bytes) -> None:
        self._resp = resp
        self._content = content

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def content_type(self) -> str | None:
        return self._resp.content_type

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self._content

    async def read(self) -> bytes:
        return self._content

    async def aclose(self) -> None:
        await self._resp.aclose()
