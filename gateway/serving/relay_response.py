"""A streamed answer's way to the client: the open stream (its lease, its upstream, its
settlement) and the ASGI response that sends it.

RelayResponse is a StreamingResponse (the body is its `body_iterator`, which /v1/responses
wraps) with its own ASGI `__call__`: it sends http.response.start, each chunk and the end
directly. Starlette's own `__call__` runs every response under an anyio task group whose second
task awaits receive() for the disconnect; in the request account of
`python -m loadtest.bench.request_account` (docs/bench/overhead.md) that machinery (the task
group, its cancel scopes, a task per response) was part of the largest phase, the one paid by
every streamed request however short. Here a client that leaves is noticed by:

- a send that fails: under an ASGI >= 2.4 server send raises OSError once the client is gone
  (Starlette's ClientDisconnect, as before);
- a watcher of receive() (gateway/http/disconnect.py's TaskWatch) started only for a stream still
  being sent WATCH_AFTER_S after it began (a timer, armed for every stream and cancelled at its end,
  costs a heap entry; a task costs a task). uvicorn (ASGI 2.3) does not raise from send once the
  client is gone: it drops the bytes, and its send blocks while a slow client's buffer is full, so
  only receive() says the client left. The watcher cancels the sending task, which stops the
  upstream read at once and releases the reservation in the `finally`s, and the response ends
  without an error, as Starlette's task group ended it. A stream that is over within WATCH_AFTER_S
  pays no watcher: the most a client that leaves such a stream costs is the rest of it, read from
  the replica, at most WATCH_AFTER_S of it, the same bound as a client that leaves before its first
  byte (gateway/http/disconnect.py).

Whatever ends the send (the last chunk, a client gone, a failed send, a cancellation from above),
the open stream is finished once: the lease released, the answer settled, the upstream closed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gateway.fleet.step_watch import last_token, mid_stream_token
from gateway.http.disconnect import DISCONNECT_POLL_S, TaskWatch
from gateway.serving.lease import Lease
from gateway.serving.settlement import Settled, Settlement
from gateway.serving.upstream import UpstreamResponse

WATCH_AFTER_S = DISCONNECT_POLL_S  # a stream still being sent this long watches receive()


class OpenStream:
    """A streamed answer on its way: it owns the try's lease and its upstream until `finish()`,
    which the relay's end and the response's close both call; the first releases, settles and
    closes, the second finds the lease gone and does nothing.

    The first byte's work that the client need not wait for (the acceptance's, when the replica
    answered before it was done; the first byte's observers) runs once the first chunk is sent
    (`first_sent`), or at `finish()` for a stream never sent."""

    __slots__ = (
        "_accepting",
        "_first_byte_pending",
        "_lease",
        "_previous_s",
        "_resp",
        "_settlement",
        "decoding",
        "failed_status",
        "settled",
        "tokens_left",
    )

    def __init__(
        self,
        lease: Lease,
        resp: UpstreamResponse,
        settled: Settled,
        settlement: Settlement,
        accepting: asyncio.Future[None] | None = None,
    ) -> None:
        self._lease = lease
        self._resp = resp
        self.settled = settled
        self._settlement = settlement
        self._accepting = accepting
        self._first_byte_pending = settled.ttft_s is not None
        self.failed_status: int | None = None  # the error a stream that broke mid-way ended with
        self.decoding = False  # counted in its replica's decoding streams (StepWatch.streams)
        self.tokens_left = 0.0  # tokens it may still get after the last one seen (max_tokens)
        self._previous_s = 0.0  # perf_counter of its last token

    @property
    def open(self) -> bool:
        return self._lease.held

    async def first_sent(self) -> None:
        """The first chunk is with the client: the acceptance's work ends (what was loaded is
        recorded after what was sent), then the first byte's observers run, once."""
        if self._accepting is not None:
            await asyncio.shield(self._accepting)  # a cancelled relay leaves it to finish()
            self._accepting = None
        if self._first_byte_pending:
            self._first_byte_pending = False
            s = self.settled
            assert s.ttft_s is not None  # pending only with a first byte
            await self._settlement.first_byte(s.plan, s.reservation, s.ttft_s)

    def start_decoding(self, first: bytes, at_s: float, max_tokens: int | None) -> None:
        """Its first chunk came at `at_s`; `max_tokens`: the most tokens it may get (None:
        unbounded). Unless that chunk ended it, it decodes, and its tokens mark its replica's
        engine steps (gateway/fleet/step_watch.py)."""
        if self.decoding or last_token(first):
            return
        self.decoding = True
        self._previous_s = at_s
        self.tokens_left = math.inf if max_tokens is None else max(0, max_tokens - 1)
        self.settled.replica.steps.stream_started(at_s, self.tokens_left)

    def read_tokens(self, chunk: bytes, at_s: float) -> None:
        """A chunk came at `at_s`: a token in it ended an engine step; a finish ends its decode."""
        if not self.decoding:
            return
        if mid_stream_token(chunk):
            replica = self.settled.replica
            replica.token_seen(at_s, self._previous_s)
            self._previous_s = at_s
            self.tokens_left = max(0.0, self.tokens_left - 1)
            replica.steps.decoding(at_s, self.tokens_left)
        if last_token(chunk):
            self.stop_decoding()

    def broke(self, status: int) -> None:
        """It broke mid-way and ended with an error of `status`: its first byte teaches nothing."""
        self.failed_status = status
        self.settled.broke = True

    def stop_decoding(self) -> None:
        """Its last token came (or it ended): its replica has one stream fewer decoding."""
        if self.decoding:
            self.decoding = False
            self.settled.replica.steps.stream_ended()

    async def finish(self) -> None:
        """Lets go of the stream; safe from a task being cancelled: the close, its one wait, is
        shielded (callers rely on it: keep every wait here shielded)."""
        self.stop_decoding()
        if not self._lease.held:
            return
        self._lease.release()
        try:
            if self._accepting is not None or self._first_byte_pending:
                with anyio.CancelScope(shield=True):
                    await self.first_sent()
        finally:
            try:
                self._settlement.settle(self.settled)
            finally:
                await close_shielded(self._resp)


class RelayResponse(StreamingResponse):
    """A streamed answer's response: sent by its own `__call__` (the module docstring says how a
    client that leaves is noticed); it lets go of its upstream however the send ends, also when
    the body is never iterated (a client gone before the first chunk), where the relay's own
    `finally` never runs."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        stream: OpenStream,
        status_code: int,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._stream = stream
        self._finished: list[Callable[[], None]] = []

    @property
    def final_status(self) -> int:
        """The status the answer really ended with: the head's, or the error's of a stream that
        broke after its head went out."""
        failed = self._stream.failed_status
        return failed if failed is not None else self.status_code

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the send has ended, however it ended."""
        self._finished.append(callback)

    async def close_upstream(self) -> None:
        """For a response that will never be sent: release its reservation, close its upstream."""
        await self._stream.finish()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None  # an ASGI app runs in a task
        watch = TaskWatch(task, partial(_disconnect, receive), WATCH_AFTER_S)
        try:
            await self._send_all(send)
        except asyncio.CancelledError:
            if not watch.left or task.uncancel() > 0:
                raise  # not the watcher's: the server's, or from above
        except OSError:
            if _spec_version(scope) < (2, 4):
                raise
            raise ClientDisconnect() from None  # as Starlette says a failed send
        finally:
            watch.stop()  # before any await: the watcher cancels only the sends above
            if self._stream.open:  # its one wait, the upstream's close, is shielded within
                await self._stream.finish()
            for callback in self._finished:
                callback()
        if self.background is not None:
            await self.background()

    async def _send_all(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnect(receive: Receive, _watch: TaskWatch) -> bool:
    """Awaits receive() until the client's disconnect (the stream's TaskWatch)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    return True


def _spec_version(scope: Scope) -> tuple[int, ...]:
    return tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))


async def close_shielded(resp: UpstreamResponse | None) -> None:
    if resp is not None:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
