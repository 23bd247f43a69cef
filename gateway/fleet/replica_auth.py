"""What the gateway tells a replica about who is calling: its pool's credentials, and the client
headers the pool lets through.

- `credentials(pool)`: `Authorization: Bearer <pools[].api_key>` (the key vLLM's `--api-key`
  checks), for every call to the pool's replicas: proxied requests, health checks, scrapes, warms.
  The key lives only in the config's SecretStr and in these headers: it is never logged, never in
  an error and never in /debug output.
- `forwarded(pool)`: the client headers named in `pools[].forward_headers` (which names may be
  forwarded: gateway/config/pools.py `forwardable`), taken from the
  request being handled. The app notes the client's headers with `remember_client_headers` when
  it starts serving a request (a context variable, as the request id in gateway/telemetry/logs.py),
  so the proxy needs no argument for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.config.pools import PoolConfig

_client_headers: ContextVar[Mapping[str, str] | None] = ContextVar(
    "cachelane_client_headers", default=None
)


def remember_client_headers(headers: Mapping[str, str]) -> None:
    """The headers of the request this task serves (Starlette's Headers: case-insensitive)."""
    _client_headers.set(headers)


def credentials(pool: PoolConfig) -> dict[str, str]:
    """The pool's Authorization header, or none when its replicas take no key."""
    if pool.api_key is None:
        return {}
    return {"authorization": f"Bearer {pool.api_key.get_secret_value()}"}


def forwarded(pool: PoolConfig) -> dict[str, str]:
    """The client headers the pool lets through, from the request being handled."""
    if not pool.forward_headers:
        return {}
    client = _client_headers.get()
    if client is None:
        return {}
    return {name: value for name in pool.forward_headers if (value := client.get(name)) is not None}
