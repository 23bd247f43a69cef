"""loadtest/locust: TTFT and hit rate kept beside Locust's request stats, and tag filtering."""

from __future__ import annotations

import subprocess
import sys

from loadtest.locust.outcomes import Outcomes, rounded_ms

# Importing locust monkey-patches the standard library with gevent for the whole process: the
# tag-filtering check runs in a subprocess, outcomes.py imports no locust.
TAG_CHECK = """
from argparse import Namespace
from locust.env import Environment
from loadtest.locust.locustfile import _drop_users_without_tasks
from loadtest.locust.users import ALL_USERS

def kept(tags, exclude):
    env = Environment(user_classes=list(ALL_USERS),
                      parsed_options=Namespace(tags=tags, exclude_tags=exclude))
    _drop_users_without_tasks(env)
    return sorted(u.__name__ for u in env.user_classes)

print(kept(["voice"], None), kept(None, ["standard"]), kept(["chat", "rag"], None))
"""


def test_rounding_is_exact_below_100_ms_then_two_significant_digits() -> None:
    assert [rounded_ms(x) for x in (7.4, 99.4, 123.0, 1_567.0, 23_456.0)] == [
        7,
        99,
        120,
        1_600,
        23_000,
    ]


def test_workers_reports_merge_into_the_masters_figures() -> None:
    worker_a, worker_b, master = Outcomes(), Outcomes(), Outcomes()
    for ms in (10.0, 20.0, 30.0):
        worker_a.add("chat", ms, prompt_tokens=1000, cached=900)
    worker_b.add("chat", 200.0, prompt_tokens=1000, cached=0)
    worker_b.add("chat", None, prompt_tokens=500, cached=0)  # no text before the stream ended
    master.merge(worker_a.take())
    master.merge(worker_b.take())
    assert worker_a.take() == {}  # a take clears what was sent
    row = master.summary()["chat"]
    assert row["requests"] == 5
    assert row["hit_rate"] == 2700 / 4500
    assert row["ttft_p50_ms"] == 20
    assert row["ttft_p99_ms"] == 200


def test_tags_keep_only_users_with_a_selected_task() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TAG_CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[-2] == ("['VoiceUser'] ['VoiceUser'] ['ChatUser', 'RagUser']")
