"""The middleware on every request, as one ASGI layer.

The app's request path runs four middlewares, from the outside in: the request id and the access
line (gateway/telemetry/logs.py RequestContext), the failed-authentication limit
(gateway/http/exposure.py FailedAuthLimit), the body's read deadline (ReadDeadline) and the 500
catcher (Unexpected, below). As four layers each request pays four frames and every message sent
(a stream's head, each chunk, its end) three wrappers of send; RequestLayer does what the four do,
in the same order, in one frame and one wrapper of send. With tracing on, the span sits between
the failed-auth limit and the read deadline (it reads the access record and sees the 500s the
catcher answers), so the app runs the four as layers with tracing among them (gateway/http/app.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import ApiError
from gateway.http.exposure import (
    AuthFailures,
    auth_refusal,
    bearer_token,
    client_address,
    deadline_receive,
)
from gateway.telemetry.logs import AccessWatch

log = logging.getLogger("cachelane.app")


def unexpected(scope: Scope, err: Exception) -> ApiError:
    """Any other exception: its traceback logged once, and the 500 to answer, counted."""
    log.error("unexpected error on %s", scope.get("path"), exc_info=err)
    answer = ApiError(500, "internal gateway error", code="internal_error", type="server_error")
    gw = getattr(scope["app"].state, "gw", None)
    if gw is not None:
        gw.metrics.errors.labels(answer.code).inc()
    return answer


class Unexpected:
    """Any other exception: its traceback logged once (here), and a 500 in the error envelope,
    counted. An exception handler for Exception would run in Starlette's ServerErrorMiddleware,
    which re-raises after it, so uvicorn logged each traceback a second time; this middleware sits
    inside that one and does not re-raise. A response already under way cannot become a 500: it
    is cut off (uvicorn closes the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:
            answer = unexpected(scope, err)
            if not started:
                await answer.response()(scope, receive, send)


class RequestLayer:
    """RequestContext, FailedAuthLimit, ReadDeadline and Unexpected in one layer (the module
    docstring says why); each keeps its own contract."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        body_timeout_s: float,
        on_timeout: Callable[[str], None],
        failures: AuthFailures,
        on_refused: Callable[[], None],
    ) -> None:
        self.app = app
        self._body_timeout_s = body_timeout_s
        self._on_timeout = on_timeout
        self._failures = failures
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
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
        limited = self._failures.per_min != 0
        address, token = (client_address(scope), bearer_token(scope)) if limited else ("", None)
        if limited:
            held_s = self._failures.held_unread_s(address, token)
            if held_s > 1e-9:
                await self._refuse(held_s, scope, receive, send, watch)
                return
        started = refused = False

        async def sent(message: Message) -> None:
            nonlocal started, refused
            if message["type"] == "http.response.start":
                started = True
                if limited and message["status"] == 401:
                    held_s = self._failures.answered_401(address, token)
                    if held_s > 1e-9:
                        refused = True
                        await self._refuse(held_s, scope, receive, send, watch)
                        return
            if refused:  # the rest of the 401 the 429 replaced
                return
            await send(watch.seen(message))

        timed = deadline_receive(receive, self._body_timeout_s, self._on_timeout)
        try:
            await self.app(scope, timed, sent)
        except Exception as err:
            answer = unexpected(scope, err)
            if not started:
                await answer.response()(scope, timed, sent)

    async def _refuse(
        self, held_s: float, scope: Scope, receive: Receive, send: Send, watch: AccessWatch
    ) -> None:
        self._on_refused()

        async def logged(message: Message) -> None:
            await send(watch.seen(message))

        await auth_refusal(held_s).response()(scope, receive, logged)
