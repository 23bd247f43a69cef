"""The step loop's asyncio driver (loadtest/sim/step_loop.py), its steps ended by hand: a step's
sleep waits until the test lets it end, so no assertion depends on a wall clock."""

from __future__ import annotations

import asyncio
import dataclasses

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
    assert len(steps.durations) == 2  # it decodes now: a step of its decode token
    loop.leave(loading)
    await steps.end_step()
    assert len(steps.durations) == 2  # gone: idle again


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
    loop.leave(short)  # answered with its first token
    await steps.end_step()
    assert steps.durations == [
        SETTINGS.step_s(100),  # the step under way keeps the long one's chunk
        SETTINGS.step_s(50),
        SETTINGS.step_s(1),  # formed before the short one left: its decode token
    ]
    assert (loop.steps, loop.step_tokens) == (3, 151)


async def test_a_decoding_request_gets_a_token_per_step_and_waits_for_a_prefill_step() -> None:
    steps, firsts = Steps(), list[str]()
    loop = StepLoop(dataclasses.replace(SETTINGS, decode_step_s=0.02), steps.sleep)
    tokens: list[str] = []
    first, second = request(10, firsts, "first"), request(150, firsts, "second")
    first.on_token = lambda: tokens.append("first")
    loop.submit(first)
    await settle()
    await steps.end_step()
    assert firsts == ["first"] and tokens == []
    loop.submit(second)  # arrives during first's decode step: waits for its end
    await settle()
    await steps.end_step()
    assert tokens == ["first"]
    await steps.end_step()  # second's first chunk: first's next token waits for it
    assert tokens == ["first", "first"]
    loop.leave(first)  # its response ends during the step that computed its decode token
    await steps.end_step()
    assert firsts == ["first", "second"]
    assert tokens == ["first", "first"]  # gone before the step ended: no token
    loop.leave(second)
    await steps.end_step()
    assert steps.durations == [
        SETTINGS.step_s(10),
        0.02,  # decodes only: the decode step
        SETTINGS.step_s(100),  # its decode and 99 of second's
        SETTINGS.step_s(52),  # first's decode (it left during the step) and second's rest
        0.02,  # second's decode token, formed before it left
    ]
