"""The step loop's asyncio driver (loadtest/sim/step_loop.py), its steps ended by hand: a step's
sleep waits until the test lets it end, so no assertion depends on a wall clock."""

from __future__ import annotations

import asyncio

from loadtest.sim.step_loop import StepLoop
from loadtest.sim.steps import StepRequest, StepSettings

SETTINGS = StepSettings(prefill_tokens_per_s=1_000.0, max_num_batched_tokens=100)
SETTLE_TURNS = 50  # event-loop turns for the driver to reach its next sleep


class Steps:
    """A sleep the test ends: each call records the step's duration and waits for end_step()."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self._gate = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.durations.append(seconds)
        await self._gate.wait()
        self._gate.clear()

    async def end_step(self) -> None:
        self._gate.set()
        await settle()


async def settle() -> None:
    for _ in range(SETTLE_TURNS):
        await asyncio.sleep(0)


def request(tokens: int, firsts: list[str], name: str, *, loading: bool = False) -> StepRequest:
    return StepRequest(tokens, loading=loading, on_first_token=lambda: firsts.append(name))


async def test_the_loop_idles_while_every_request_loads_and_wakes_when_one_is_loaded() -> None:
    steps, firsts = Steps(), list[str]()
    loop = StepLoop(SETTINGS, steps.sleep)
    loading = request(50, firsts, "loading", loading=True)
    loop.submit(loading)
    await settle()
    assert steps.durations == []  # nothing to compute: no step
    loop.loaded(loading)
    await settle()
    assert len(steps.durations) == 1
    await steps.end_step()
    assert firsts == ["loading"]
    assert len(steps.durations) == 1  # and idle again


async def test_a_request_that_leaves_during_a_step_frees_the_next_step() -> None:
    steps, firsts = Steps(), list[str]()
    loop = StepLoop(SETTINGS, steps.sleep)
    long, short = request(300, firsts, "long"), request(50, firsts, "short")
    loop.submit(long)
    loop.submit(short)
    await settle()
    loop.leave(long)  # cancelled while its first chunk is computed
    await steps.end_step()
    await steps.end_step()
    assert firsts == ["short"]
    assert steps.durations == [
        SETTINGS.step_s(100),  # the step under way keeps the long one's chunk
        SETTINGS.step_s(50),
    ]
    assert (loop.steps, loop.step_tokens) == (2, 150)


async def test_a_decoding_request_takes_a_token_until_it_leaves() -> None:
    steps, firsts = Steps(), list[str]()
    loop = StepLoop(SETTINGS, steps.sleep)
    first, second = request(10, firsts, "first"), request(150, firsts, "second")
    loop.submit(first)
    await settle()
    await steps.end_step()
    loop.submit(second)
    await settle()
    loop.leave(first)  # its response ends during the step that computed its decode token
    await steps.end_step()
    await steps.end_step()
    assert firsts == ["first", "second"]
    assert steps.durations == [SETTINGS.step_s(10), SETTINGS.step_s(100), SETTINGS.step_s(51)]
