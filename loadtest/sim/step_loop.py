"""A replica's step loop on asyncio: runs steps.py's StepScheduler, each step a real sleep.

The loop runs while some step would compute a token (a prompt chunk or a decode) and stops
itself otherwise; any change that may give it work (a request added, its KV loaded, a request
gone, which frees a seat under max_num_seqs) starts it again. All the scheduling is the pure
class's: this module only sleeps for each step's duration and calls the requests' callbacks at
its start and end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from loadtest.sim.steps import Phase, StepRequest, StepScheduler, StepSettings


class StepLoop:
    def __init__(self, settings: StepSettings, sleep: Callable[[float], Awaitable[None]]) -> None:
        self.scheduler = StepScheduler(settings)
        self._sleep = sleep  # modelled seconds; the engine applies its time factor
        self._driving = False
        self._task: asyncio.Task[None] | None = None
        self.steps = 0  # steps run since start (exported as a counter)
        self.step_tokens = 0  # tokens they computed, prompt and decode

    @property
    def settings(self) -> StepSettings:
        return self.scheduler.settings

    def submit(self, request: StepRequest) -> None:
        """The request arrives: it takes its place in arrival order now, loading or not."""
        self.scheduler.add(request)
        self._kick()

    def loaded(self, request: StepRequest) -> None:
        self.scheduler.loaded(request)
        self._kick()

    def leave(self, request: StepRequest) -> None:
        """The request is done or cancelled: from the next step its budget and seat are free."""
        if request.phase is not Phase.GONE:
            self.scheduler.finish(request)
            self._kick()

    def _kick(self) -> None:
        if not self._driving:
            self._driving = True
            self._task = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        try:
            while (step := self.scheduler.schedule()) is not None:
                for r in step.started:
                    if r.on_start is not None:
                        r.on_start()
                self.steps += 1
                self.step_tokens += step.total_tokens
                await self._sleep(step.duration_s)
                await asyncio.sleep(0)  # with no modelled time, still let arrivals in
                decoding = [r for r in step.tokens if r.phase is Phase.DECODING]  # none gone
                for r in self.scheduler.complete(step):
                    if r.on_first_token is not None:
                        r.on_first_token()
                for r in decoding:
                    if r.on_token is not None:
                        r.on_token()
        finally:
            # no await between the last schedule() and here: a kick from now on starts a new task
            self._driving = False
