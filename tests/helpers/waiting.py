"""Bounded waits for tests: a condition polled a bounded number of times, never forever."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def poll_until(
    condition: Callable[[], bool], what: str, *, timeout_s: float, poll_s: float
) -> None:
    """Polls `condition` every `poll_s` until it holds; fails the test (AssertionError naming
    `what`) after timeout_s / poll_s polls."""
    for _ in range(int(timeout_s / poll_s)):
        if condition():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
