"""The middleware on every request, as one ASGI layer.

From the outside in: the request id and the access line (gateway/telemetry/logs.py
AccessWatch), the failed-authentication limit (gateway/http/exposure.py AuthFailures), with
tracing on the request's span (gateway/telemetry/tracing.py RequestSpan: it reads the access
record and sees the 500s the catcher answers), the body's read deadline (`deadline_receive`) and
the 500 catcher (`unexpected`). As separate middlewares each request would pay a frame for each
and every message sent (a stream's head, each chunk, its end) a wrapper of send for each; here
it is one frame and one wrapper of send, and a second frame and wrapper only for a traced request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import ApiError
from gateway.http.exposure import (
    UNHELD_PATHS,
    AuthFailures,
    auth_refusal,
    bearer_token,
    client_address,
    deadline_receive,
)
from gateway.telemetry.logs import AccessWatch
from gateway.telemetry.tracing import RequestSpan

log = logging.getLogger("cachelane.app")


def unexpected(scope: Scope, err: Exception) -> ApiError:
    """Any other exception: its traceback logged once, and the 500 to answer, counted."""
    log.error("unexpected error on %s", scope.get("path"), exc_info=err)
    answer = ApiError(500, "internal gateway error", code="internal_error", type="server_error")
    gw = getattr(scope["app"].state, "gw", None)
    if gw is not None:
        gw.metrics.errors.labels(answer.code).inc()
    return answer


class RequestLayer:
    """The request id and access line, the failed-auth limit, the optional span, the body's
    deadline and the 500 catcher (the module docstring says in what order).

    - Failed authentication: every 401 counts against the client address and, when the request
      presented one, its credential (a hash of it). A request without a credential from an
      address that failed more than `failures.per_min` times a minute gets 429 with
      Retry-After, unread; one with a credential always reaches authentication, so a valid key
      is served whatever its address or other keys did (behind a proxy every client may share
      one address); an invalid one from a held address, or one itself held, gets the 429
      instead of its 401. The client address is the peer's, or the one a trusted proxy names in
      X-Forwarded-For: uvicorn rewrites it for peers in `listen.forwarded_allow_ips` only.
      /health, /ready and /metrics are never held (a load balancer's probes share the address
      of the clients behind it).
    - The body must arrive within `body_timeout_s` of the headers; receives after the body (a
      disconnect poll) pass through untouched.
    - Any other exception: its traceback logged once (here), and a 500 in the error envelope,
      counted. An exception handler for Exception would run in Starlette's
      ServerErrorMiddleware, which re-raises after it, so uvicorn logged each traceback a second
      time; this layer sits inside that one and does not re-raise. A response already under way
      cannot become a 500: it is cut off (uvicorn closes the connection)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        body_timeout_s: float,
        on_timeout: Callable[[str], None],
        failures: AuthFailures,
        on_refused: Callable[[], None],
        span: RequestSpan | None = None,
    ) -> None:
        self.app = app
        self._body_timeout_s = body_timeout_s
        self._on_timeout = on_timeout
        self._failures = failures
        self._on_refused = on_refused
        self._span = span

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self._span is not None:
                send = partial(self._span.lifespan_sent, send)
            await self.app(scope, receive, send)
            return
        watch = AccessWatch(scope)
        try:
            await self._serve(scope, receive, send, watch)
        except BaseException:
            watch.failed()
            raise
        finally:
            watch.close()

    async def _serve(self, scope: Scope, receive: Receive, send: Send, watch: AccessWatch) -> None:
        limited = self._failures.per_min != 0 and scope["path"] not in UNHELD_PATHS
        address, token = (client_address(scope), bearer_token(scope)) if limited else ("", None)
        if limited:
            held_s = self._failures.held_unread_s(address, token)
            if held_s > 1e-9:
                await self._refuse(held_s, scope, receive, send, watch)
                return
        refused = False

        async def sent(message: Message) -> None:
            nonlocal refused
            if limited and message["type"] == "http.response.start" and message["status"] == 401:
                held_s = self._failures.answered_401(address, token)
                if held_s > 1e-9:
                    refused = True
                    await self._refuse(held_s, scope, receive, send, watch)
                    return
            if refused:  # the rest of the 401 the 429 replaced
                return
            await send(watch.seen(message))

        timed = deadline_receive(receive, self._body_timeout_s, self._on_timeout)
        span = self._span
        if span is not None and span.traces(scope):
            await span.run(scope, sent, partial(self._answer, scope, timed, watch=watch))
        else:
            await self._answer(scope, timed, sent, watch=watch)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, *, watch: AccessWatch
    ) -> None:
        """The app, and the 500 catcher's answer for what it raised."""
        try:
            await self.app(scope, receive, send)
        except Exception as err:
            answer = unexpected(scope, err)
            if not watch.began:
                await answer.response()(scope, receive, send)

    async def _refuse(
        self, held_s: float, scope: Scope, receive: Receive, send: Send, watch: AccessWatch
    ) -> None:
        self._on_refused()

        async def logged(message: Message) -> None:
            await send(watch.seen(message))

        await auth_refusal(held_s).response()(scope, receive, logged)
