"""What an engine integration provides to the KV event feed: the seam between an engine's event
stream and the index.

The feed (gateway/engines/feed.py) owns everything an engine does not decide: one ZMQ SUB socket
per replica, the sequence check (0, 1, 2, ... per engine process; a gap asks for a replay, a step
back is a restart), the engine-hash -> gateway-key map, and applying the events to the index. An
engine brings two things, as an `EventSource`:

  decode    one multipart message from its PUB socket -> a `Message` (topic, seq, and a batch of
            the event types in gateway/engines/events.py), or EventDecodeError;
  replayer  how to ask a replica for the batches from a seq on (frames `decode` accepts), or None
            on failure.

vLLM (gateway/engines/vllm.py, `VLLM_EVENTS`) is the one implementation. docs/extending.md walks
through adding another (SGLang, LMCache).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from gateway.engines.events import Message

if TYPE_CHECKING:
    import zmq.asyncio

ReplayFn = Callable[[int], Awaitable[list[list[bytes]] | None]]
"""Ask for batches from a seq on: `[topic, seq, payload]` frames in order, or None on failure."""


class EventSource(Protocol):
    """An engine's KV event stream, as the feed consumes it."""

    name: str  # for logs and docs: "vllm"

    def decode(self, frames: Sequence[bytes]) -> Message:
        """One multipart message as received (or as a replay returns it) -> its Message; raises
        EventDecodeError (gateway/engines/events.py) when the frames are not a batch."""
        ...

    def replayer(self, ctx: zmq.asyncio.Context, endpoint: str) -> ReplayFn:
        """A function that asks the replica's replay endpoint for the batches from a seq on."""
        ...
