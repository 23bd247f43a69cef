"""What the gateway exposes to whoever can connect: how long a client may take to send a request,
how many bad keys an address may try, and who may read /metrics and /ready.

Read deadlines. uvicorn closes an idle keep-alive connection (timeout_keep_alive) but sets no
deadline on a request being sent: measured with `python -m loadtest.bench.read_deadlines`
(uvicorn 0.55), a socket that sends nothing, one that sends a request line and a header without
the blank line, and one that sends 10 of the 100 body bytes its headers promise were all still
open after 60 s, under h11 and httptools alike. Two deadlines close that:

- headers (`listen.header_timeout_s`): DeadlineHttpToolsProtocol, uvicorn's httptools protocol
  with one timer, armed when a connection opens and after each answer (unless a pipelined request
  is already parsed), disarmed when a request's headers are complete; when it fires the
  connection is closed. `cachelane serve` runs uvicorn with it (HTTP_PROTOCOL).
- body (`listen.body_timeout_s`): `deadline_receive`, applied by the request layer
  (gateway/http/request_layer.py), gives each request's body reads one deadline from when its
  headers were complete; past it the read raises
  BodyTimeout, answered 408 `request_timeout` with `connection: close` (uvicorn then closes the
  connection).

Failed authentication: AuthFailures, applied by the request layer, counts 401 answers per client
address and per credential presented (routing/ratelimit.py's GCRA, `rate_limits.failed_auth_per_min`
a minute); once one has used its budget, its failures are answered 429 with Retry-After (a request
without a key from a held address unread) until one more failure would fit, at most
MAX_AUTH_HOLD_S after its last failure. A valid key is never refused by it, nor are /health,
/ready and /metrics (UNHELD_PATHS).

Monitoring endpoints: `exposure.metrics_auth` / `ready_auth` put /metrics and /ready behind the
monitoring key (`exposure.api_key`) or the admin key (require_monitoring).

Decision headers: `exposure.decision_headers` (which replica, why: it names the fleet's
replicas) and `exposure.estimate_headers` (the TTFT estimate and its terms) are `all`, `admin` or
`none`; `admin` keeps them for requests that present the admin key, as their bearer (auth mode
open) or in ADMIN_KEY_HEADER beside a tenant's key (hide_decision).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope

from gateway.http.errors import ApiError
from routing.ratelimit import charge

if TYPE_CHECKING:
    from fastapi import Request
    from starlette.datastructures import MutableHeaders

log = logging.getLogger("cachelane.exposure")

POLICY_STATE_KEY = "cachelane_connections"  # the lifespan state entry the protocol reads
MAX_TRACKED_ADDRESSES = 100_000
# A party that keeps failing is held at most this long after its last failure: one minute, the
# limit's own window (failed_auth_per_min), so it is served again within a minute of stopping
MAX_AUTH_HOLD_S = 60.0
FORGET_PER_FAILURE = 2  # parties whose state ran out, dropped per failure: the map shrinks
# Keyless endpoints: liveness and readiness probes and scrapes, often from a load balancer that
# shares its address with clients; no failed-auth hold applies to them
UNHELD_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Failed-auth state kept for at most this many client addresses and credential hashes (least
# recently failed dropped): ~100 bytes each, ~10 MB at most, whatever a flood of source addresses
# or of keys does.


@dataclass(frozen=True)
class ConnectionPolicy:
    """What the HTTP protocol reads from the app's lifespan state (uvicorn hands every
    connection that dict)."""

    header_timeout_s: float
    on_timeout: Callable[[str], None]  # counts a closed connection, by part ("headers")


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn[standard] without httptools (PyPy, Windows): no header deadline
    HTTP_PROTOCOL = "auto"
else:
    HTTP_PROTOCOL = "gateway.http.exposure:DeadlineHttpToolsProtocol"

    class DeadlineHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with a deadline on receiving a request's headers."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # its headers are in: the next request starts now
            super().on_response_complete()
            if not pipelined and not self.transport.is_closing():
                self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            policy = self.app_state.get(POLICY_STATE_KEY)
            if isinstance(policy, ConnectionPolicy):
                self._header_timer = self.loop.call_later(
                    policy.header_timeout_s, self._header_deadline_passed, policy
                )

        def _disarm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline_passed(self, policy: ConnectionPolicy) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                policy.on_timeout("headers")
                self.transport.close()


class BodyTimeout(ApiError):
    """Raised from a request's receive (so inside the handler, where the app's ApiError handler
    answers it) when its body is late."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            headers={"connection": "close"},  # uvicorn closes the connection after the answer
        )


def deadline_receive(
    receive: Receive, timeout_s: float, on_timeout: Callable[[str], None]
) -> Receive:
    """`receive` whose body reads raise BodyTimeout past `timeout_s` from now; receives after the
    body (a disconnect poll) pass through untouched."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    body_done = False

    async def timed_receive() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            on_timeout("body")
            raise BodyTimeout(timeout_s) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return timed_receive


class AuthFailures:
    """Failed authentications per client address and per credential presented (its SHA-256), as
    routing/ratelimit.py's GCRA state: each failure moves a party's state 60 / per_min seconds on;
    the party is held while one more failure would not fit in the minute, and at most
    MAX_AUTH_HOLD_S after its last failure however many it sent (the hold decays with time).
    At most MAX_TRACKED_ADDRESSES parties are kept, the least recently failed dropped first, and
    any whose hold is over as new failures come."""

    def __init__(self, per_min: int) -> None:
        self.per_min = per_min
        self._tat: OrderedDict[str, float] = OrderedDict()  # party -> GCRA state

    def held_for_s(self, party: str) -> float:
        """0 if the party (an address, or a credential's hash) may go on, else the seconds
        until it may."""
        tat = self._tat.get(party)
        if tat is None or self.per_min == 0:
            return 0.0
        window_s = 60.0 - 60.0 / self.per_min  # past it, one more failure would not fit
        return max(tat - time.time() - window_s, 0.0)

    def failed(self, party: str) -> None:
        now = time.time()
        window_s = 60.0 - 60.0 / self.per_min
        tat = charge(self._tat.get(party, 0.0), now, 1, self.per_min)
        self._tat[party] = min(tat, now + window_s + MAX_AUTH_HOLD_S)
        self._tat.move_to_end(party)
        while len(self._tat) > MAX_TRACKED_ADDRESSES:
            self._tat.popitem(last=False)
        for _ in range(FORGET_PER_FAILURE):  # the oldest, if it needs no state any more
            oldest = next(iter(self._tat))
            if oldest == party or self._tat[oldest] > now:
                break
            del self._tat[oldest]

    def __len__(self) -> int:
        """The parties it keeps state for."""
        return len(self._tat)

    def held_unread_s(self, address: str, token: bytes | None) -> float:
        """How long a request is refused unread: one without a credential from a held address."""
        return self.held_for_s(address) if token is None else 0.0

    def answered_401(self, address: str, token: bytes | None) -> float:
        """A 401 answered: counted against the address and the credential presented; returns
        how long the 401 is to be replaced by a 429 (0: sent as it is)."""
        credential = None if token is None else credential_party(token)
        held_s = self.held_for_s(address)
        if credential is not None:
            held_s = max(held_s, self.held_for_s(credential))
        self.failed(address)
        if credential is not None:
            self.failed(credential)
        return held_s


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""


def bearer_token(scope: Scope) -> bytes | None:
    """The bearer token a request presents, or None when it presents none."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


def credential_party(token: bytes) -> str:
    """A credential as the failures know it: its SHA-256, never the token."""
    return "key:" + hashlib.sha256(token).hexdigest()


def auth_refusal(held_s: float) -> ApiError:
    """The 429 a held address or credential gets instead of its 401."""
    wait_s = max(1, math.ceil(held_s))
    return ApiError(
        429,
        f"too many failed authentications: retry after {wait_s} s",
        code="too_many_failed_auth",
        type="requests",
        headers={"retry-after": str(wait_s)},
    )


def require_monitoring(request: Request, gw: Any) -> None:
    """401 unless the request carries the monitoring key or the admin key."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        presented = gw.keyring.digest(key.strip())
        for expected in (gw.monitoring_digest, gw.admin_digest):
            if expected is not None and hmac.compare_digest(presented, expected):
                return
    raise ApiError(401, "invalid or missing monitoring key", code="invalid_api_key")


ADMIN_KEY_HEADER = "x-cachelane-admin-key"  # an operator's request: the decision shown to it
DECISION_HEADERS = (
    "x-cachelane-replica",
    "x-cachelane-reason",
    "x-cachelane-fallback",
    "x-cachelane-tenant-class",
    "x-cachelane-remote-write",
)
ESTIMATE_HEADERS = (
    "x-cachelane-est-ttft-ms",
    "x-cachelane-est-terms-ms",
    "x-cachelane-expected-cached-tokens",
    "x-cachelane-expected-tiers",
)


def presents_admin_key(request: Request, gw: Any) -> bool:
    """The request carries the admin key, as its bearer or in ADMIN_KEY_HEADER."""
    if gw.admin_digest is None:
        return False
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    for key in (
        bearer if scheme.lower() == "bearer" else "",
        request.headers.get(ADMIN_KEY_HEADER),
    ):
        if key and hmac.compare_digest(gw.keyring.digest(key.strip()), gw.admin_digest):
            return True
    return False


def hide_decision(headers: MutableHeaders, request: Request, gw: Any) -> None:
    """Remove the decision and estimate headers an answer's audience may not see."""
    exposure = gw.config.exposure
    admin: bool | None = None
    for audience, names in (
        (exposure.decision_headers, DECISION_HEADERS),
        (exposure.estimate_headers, ESTIMATE_HEADERS),
    ):
        if audience == "admin" and admin is None:
            admin = presents_admin_key(request, gw)
        if audience == "all" or (audience == "admin" and admin):
            continue
        for name in names:
            if name in headers:
                del headers[name]
