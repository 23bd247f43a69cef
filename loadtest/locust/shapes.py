"""Load shapes for loadtest/locust/locustfile.py; load them next to it to take over users over time:

    locust -f loadtest/locust/locustfile.py,loadtest/locust/shapes.py --headless --host ...

A shape replaces -u / -r / -t: it says how many users of which classes run at each moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from locust import LoadTestShape, User

from loadtest.locust import users as locust_users


@dataclass(frozen=True)
class Stage:
    until_s: float
    users: int
    spawn_rate: float
    classes: tuple[type[locust_users.StreamingUser], ...]


VOICE_USERS = 4  # a handful of concurrent callers: the critical tenant's steady load
BURST_USERS = 24  # standard users during the burst: several times the fleet's comfortable load


class VoiceUnderBurst(LoadTestShape):
    """A critical voice tenant runs throughout; a burst of standard traffic comes and goes.

    0-20 s voice alone (its baseline TTFT), 20-50 s voice plus a burst of chat, agent, RAG and
    unique users, 50-70 s voice alone again (recovery); then stop. Compare the voice tenant's
    TTFT rows across the phases, with and without a pinned pool in the gateway's config.
    """

    stages = (
        Stage(20, VOICE_USERS, VOICE_USERS, (locust_users.VoiceUser,)),
        Stage(50, VOICE_USERS + BURST_USERS, 8, locust_users.ALL_USERS),
        Stage(70, VOICE_USERS, 8, (locust_users.VoiceUser,)),
    )

    def tick(self) -> tuple[int, float, list[type[User]] | None] | None:
        run_time: float = self.get_run_time()  # type: ignore[no-untyped-call]
        for stage in self.stages:
            if run_time < stage.until_s:
                return stage.users, stage.spawn_rate, list(stage.classes)
        return None
