"""gateway/fleet/outliers.py: the back-off of a replica ejected for how its requests went, and
gateway/serving/deadline.py: how long a replica has to begin its answer."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import parse_config
from gateway.fleet.outliers import Backoff
from gateway.serving.deadline import first_byte_deadline_s, output_limit_tokens

BACKOFF = Backoff(base_s=30.0, factor=2.0, max_s=300.0)


@pytest.mark.parametrize(
    ("count", "seconds"),
    [(1, 30.0), (2, 60.0), (3, 120.0), (4, 240.0), (5, 300.0), (200, 300.0)],
    ids=["first", "second", "third", "fourth", "capped", "far-past-the-cap"],
)
def test_each_ejection_in_a_row_doubles_the_time_out_up_to_the_cap(
    count: int, seconds: float
) -> None:
    assert BACKOFF.seconds(count) == seconds


def test_a_replica_that_stayed_in_as_long_as_it_was_out_starts_from_the_base_again() -> None:
    first = BACKOFF.eject(None, "5xx", "answered 500", stayed_s=0.0)
    assert (first.count, first.reason) == (1, "5xx")
    again = BACKOFF.eject(first, "timeout", "no first byte", stayed_s=5.0)  # back in briefly
    assert again.count == 2
    assert again.since_s == first.since_s  # one run of ejections
    forgiven = BACKOFF.eject(again, "5xx", "answered 500", stayed_s=60.0)  # in as long as out
    assert forgiven.count == 1


def test_a_failed_probe_is_one_more_ejection_in_a_row() -> None:
    ejection = BACKOFF.eject(None, "5xx", "answered 500", stayed_s=0.0)
    first_probe_at = ejection.probe_at_s
    BACKOFF.probe_failed(ejection, "answered 500")
    assert ejection.count == 2
    assert ejection.probe_at_s >= first_probe_at + 30.0  # 60 s from the failed probe
    view = ejection.view(ejection.probe_at_s - 10.0)
    assert (view["reason"], view["ejections_in_a_row"], view["next_probe_in_s"]) == ("5xx", 2, 10.0)


def test_no_base_means_no_time_out() -> None:
    assert Backoff(0.0, 2.0, 300.0).seconds(7) == 0.0


POOL = parse_config(
    {
        "pools": [
            {
                "name": "p",
                "replicas": ["http://a:8000"],
                "models": ["m"],
                "first_byte_timeout_s": 3.0,
                "min_decode_tokens_per_s": 20.0,
            }
        ]
    }
).pools[0]


@pytest.mark.parametrize(
    ("body", "card", "limit"),
    [
        ({"max_tokens": 100}, None, 100),
        ({"max_completion_tokens": 50, "max_tokens": 100}, None, 50),
        ({"max_output_tokens": 7}, None, 7),
        ({}, {"max_model_len": 4096}, 4096),
        ({"max_tokens": None}, {"max_model_len": 4096}, 4096),
        ({}, None, None),
        ({"max_tokens": True}, None, None),
    ],
    ids=[
        "max_tokens",
        "max_completion_tokens-first",
        "responses",
        "model-context",
        "null",
        "none",
        "bool",
    ],
)
def test_the_output_limit(
    body: dict[str, Any], card: dict[str, Any] | None, limit: int | None
) -> None:
    assert output_limit_tokens(body, card) == limit


def test_a_streamed_answer_has_the_pools_first_byte_timeout() -> None:
    deadline = first_byte_deadline_s(
        POOL, stream=True, endpoint="chat", body={"max_tokens": 1000}, card=None
    )
    assert deadline == 3.0


def test_a_whole_answer_has_its_output_at_the_slowest_decode_on_top() -> None:
    deadline = first_byte_deadline_s(
        POOL, stream=False, endpoint="chat", body={"max_tokens": 1000}, card=None
    )
    assert deadline == 3.0 + 1000 / 20.0


def test_a_whole_answer_without_a_known_bound_has_only_the_read_timeout() -> None:
    assert first_byte_deadline_s(POOL, stream=False, endpoint="chat", body={}, card=None) is None


@pytest.mark.parametrize("tokens", [10**7 + 1, 10**400], ids=["past-any-context", "past-float"])
def test_an_output_past_any_models_context_has_only_the_read_timeout(tokens: int) -> None:
    body = {"max_tokens": tokens}
    assert first_byte_deadline_s(POOL, stream=False, endpoint="chat", body=body, card=None) is None


def test_an_embedding_has_no_decode() -> None:
    deadline = first_byte_deadline_s(POOL, stream=False, endpoint="embeddings", body={}, card=None)
    assert deadline == 3.0
