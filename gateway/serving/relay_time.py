"""The gateway's own part of a streamed TTFT after the replica's first byte.

A client's time to first token ends when the first chunk reaches it: after the replica's first
byte the gateway still hands the chunk on (its response headers, the server's write, its event
loop's other work). The TTFT estimate (x-cachelane-est-ttft-ms) adds this measured time, as it
adds the time the request spent in the gateway before it was sent; the cost fit does not learn
it (it learns the replica's TTFT, sent to first byte).
"""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 64  # recent streamed requests; the median of these is the term
EVERY = 8  # the median is recomputed after this many new observations (a sort of 64 floats)


class RelayTime:
    """The median over the last WINDOW streamed requests of the time from the replica's first
    byte to the first chunk handed to the server for the client; 0 until one was seen."""

    def __init__(self, window: int = WINDOW, every: int = EVERY) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._every = every
        self._since = 0
        self.seconds = 0.0

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            return
        self._recent.append(seconds)
        self._since += 1
        if self._since >= self._every or len(self._recent) < self._every:
            self._since = 0
            self.seconds = statistics.median(self._recent)
