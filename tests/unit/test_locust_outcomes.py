"""loadtest/locust: TTFT and hit rate kept beside Locust's request stats, and tag filtering."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.locust.outcomes import (
    MAX_RETRY_AFTER_S,
    Outcomes,
    failure_name,
    retry_after_s,
    rounded_ms,
)

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
    assert row["ttft_p50_ms"] == 25  # between 20 and 30 (linear, as every report's)
    assert row["ttft_p99_ms"] == pytest.approx(30 + 0.97 * 170)


def test_tags_keep_only_users_with_a_selected_task() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TAG_CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[-2] == ("['VoiceUser'] ['VoiceUser'] ['ChatUser', 'RagUser']")


def test_a_failure_is_named_by_status_and_code_never_by_its_changing_message() -> None:
    def refusal(wait_s: int) -> str:
        message = f"rate limit reached for requests per minute: retry after {wait_s} s"
        return json.dumps(
            {"error": {"message": message, "type": "requests", "code": "rate_limit_exceeded"}}
        )

    assert {failure_name(429, refusal(s)) for s in (19, 18, 3)} == {"HTTP 429 rate_limit_exceeded"}
    assert (
        failure_name(503, '{"error": {"type": "server_error", "code": null}}')
        == "HTTP 503 server_error"
    )
    assert failure_name(502, "<html>bad gateway</html>") == "HTTP 502"


def test_retry_after_is_honoured_in_seconds_and_bounded() -> None:
    assert retry_after_s({"retry-after": "20"}) == 20.0
    assert retry_after_s({"retry-after": "3600"}) == MAX_RETRY_AFTER_S
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert retry_after_s({}) is None


def test_the_shape_percentiles_use_the_projects_one_definition() -> None:
    """Linear interpolation between the kept times, as routing/whatif/summary.py's percentile and
    statistics.quantiles(method="inclusive") compute it."""
    import statistics

    from loadtest.locust.outcomes import ShapeOutcomes

    shape = ShapeOutcomes()
    for ms in (10, 20, 20, 40, 90):
        shape.add(ms, 100, 0)
    kept = [10.0, 20.0, 20.0, 40.0, 90.0]
    cuts = statistics.quantiles(kept, n=100, method="inclusive")
    assert shape.ttft_percentile(0.5) == 20.0
    assert shape.ttft_percentile(0.99) == pytest.approx(cuts[98])
    assert shape.ttft_percentile(0.95) == pytest.approx(cuts[94])
