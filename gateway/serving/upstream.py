"""The HTTP client of the proxied requests: aiohttp, behind a small interface the proxy uses.

Why aiohttp and not httpx (which the gateway keeps for health checks, scrapes and warming):
httpx's connection pool scans every connection for every queued request (encode/httpcore#1035),
so at the proxy's concurrency its CPU per request is an order of magnitude above aiohttp's.
`python -m loadtest.bench.upstream` measures the three clients side by side (httpx, httpx over
the aiohttp transport, aiohttp); docs/bench/upstream.md has the current figures.

What the proxy relies on, and where it comes from:
- byte for byte, unbuffered: `UpstreamResponse.chunks()` yields each piece as it arrives
  (aiohttp's StreamReader.iter_any), compressed bodies stay compressed (auto_decompress off);
- TCP_NODELAY on every connection (aiohttp's BaseProtocol.connection_made sets it);
- keep-alive: one connection pool, keyed by host and port, at most `max_connections` per
  replica (aiohttp's TCPConnector limit_per_host; a lookup by key, not a scan);
- no wait without end: aiohttp 3.14's read timeout never fires on a chunked body whose next
  chunk header is not hexadecimal and whose connection then closes (seen with a fake replica,
  loadtest/bench/faulty_replica.py); the proxy bounds every read itself
  (gateway/serving/deadline.py: the first byte's deadline, then idle_deadline_s between
  chunks), so no client waits on it;
- failures as four exceptions, mapped from aiohttp's in one place (`_mapped`):
  UpstreamConnectError (no connection could be made), UpstreamDisconnected (the connection
  broke or the answer was not HTTP), UpstreamTimeout (nothing read for `read_timeout_s`), all
  UpstreamError.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Protocol

import aiohttp


class UpstreamError(Exception):
    """Talking to a replica failed."""


class UpstreamConnectError(UpstreamError):
    """No connection to the replica could be made (refused, unresolvable, connect timeout)."""


class UpstreamDisconnected(UpstreamError):
    """The connection broke (reset, closed by the replica) or the answer was not valid HTTP."""


class UpstreamTimeout(UpstreamError):
    """The replica sent nothing for the read timeout (or the caller's first-byte timeout)."""


class UpstreamResponse(Protocol):
    """A replica's answer whose headers have arrived; the body is read with `chunks()` or
    `read()`. `aclose()` is idempotent and safe under cancellation; a response closed before its
    body was read whole closes its connection (the engine aborts the request)."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str | None: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Sends one POST to a replica. `post` returns once the answer's status and headers are in,
    or raises an UpstreamError; the caller must `aclose()` what it returned."""

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    """aiohttp's exceptions as UpstreamError (the one place that maps them)."""
    try:
        yield
    except aiohttp.ClientConnectorError as err:  # refused, DNS, unreachable: before any byte
        raise UpstreamConnectError(str(err) or type(err).__name__) from err
    except aiohttp.ConnectionTimeoutError as err:  # sock_connect
        raise UpstreamConnectError(f"connect timed out: {err}") from err
    except aiohttp.ServerTimeoutError as err:  # sock_read
        raise UpstreamTimeout(f"read timed out: {err}") from err
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
        raise UpstreamDisconnected(f"{type(err).__name__}: {err}") from err
    except aiohttp.ClientResponseError as err:  # not HTTP (a bad status line or headers)
        raise UpstreamDisconnected(f"{type(err).__name__}: {err}") from err


class _AiohttpResponse:
    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def content_type(self) -> str | None:
        return self._resp.headers.get("content-type")

    @property
    def raw(self) -> aiohttp.ClientResponse:
        """aiohttp's own response (its connection, for tests of the socket options)."""
        return self._resp

    async def chunks(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for chunk in self._resp.content.iter_any():
                yield chunk

    async def read(self) -> bytes:
        with _mapped():
            return await self._resp.read()

    async def aclose(self) -> None:
        if not self._resp.closed:
            # release() would keep a connection whose body was not read whole; close() drops it
            if self._resp.content.is_eof():
                self._resp.release()
            else:
                self._resp.close()


class AiohttpUpstream:
    """One aiohttp session for every replica. Create it inside the running event loop (the
    lifespan does); `aclose()` closes every connection."""

    def __init__(
        self,
        *,
        max_connections_per_replica: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_s: float,
    ) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # no cap across replicas; each replica has its own
            limit_per_host=max_connections_per_replica,
            keepalive_timeout=keepalive_s,
            use_dns_cache=True,
        )
        # Waiting for a free connection has no bound of its own (aiohttp's `connect` timeout
        # would report it as a connect failure, which ejects a replica): the first-byte timeout
        # and the client leaving bound it.
        timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,  # bytes pass as the replica sent them
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            trust_env=False,  # replica traffic never goes through an HTTP(S)_PROXY from the env
            raise_for_status=False,
        )

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        with _mapped():
            resp = await self._session.post(url, data=body, headers=headers)
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        await self._session.close()
