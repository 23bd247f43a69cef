"""loadtest/bench/peer_routers.py: how each arm is launched, the bare proxy included."""

from __future__ import annotations

import sys

from loadtest.bench.peer_routers import READY_PATHS, RouterSpec, ensure_installed, router_args

REPLICAS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def test_the_bare_proxy_runs_from_this_checkout_on_the_given_port() -> None:
    args = router_args(RouterSpec("bare", "round_robin"), REPLICAS, 8123)
    assert args == [
        sys.executable, "-m", "loadtest.bench.bare_proxy",
        "--replicas", ",".join(REPLICAS), "--port", "8123",
    ]  # fmt: skip
    assert READY_PATHS["bare"] == "/health"


def test_arms_from_this_checkout_need_no_install() -> None:
    assert ensure_installed("bare") is None
    assert ensure_installed("cachelane") is None
