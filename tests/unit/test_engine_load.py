import dataclasses
import time

import pytest

from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Joining, Replica
from gateway.fleet.scraper import EngineLoad, parse_engine_load
from routing.cost import Load

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
"""
SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
"""


@pytest.mark.parametrize(
    ("text", "running", "waiting", "usage"),
    [(VLLM, 3, 2, 0.5), (SGLANG, 4, 1, 0.0), ("", 0, 0, 0.0)],
    ids=["vllm", "sglang", "empty"],
)
def test_parse_engine_load(text: str, running: float, waiting: float, usage: float) -> None:
    load = parse_engine_load(text, now_s=10.0)
    assert (load.running, load.waiting, load.kv_usage) == (running, waiting, usage)


def replica() -> Replica:
    config = parse_config({"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]})
    return next(iter(Registry(config).replicas.values()))


@pytest.mark.parametrize(
    ("engine", "now_s", "expected"),
    [
        (None, 0.0, Load(1, 1000, 0)),
        (
            EngineLoad(running=5, waiting=3, kv_usage=0.1, scraped_at_s=0.0),
            1.0,
            Load(8, 1000 + 2 * 1000, 0),
        ),
        (EngineLoad(running=5, waiting=3, kv_usage=0.1, scraped_at_s=0.0), 60.0, Load(1, 1000, 0)),
        (EngineLoad(running=0, waiting=0, kv_usage=0.0, scraped_at_s=0.0), 1.0, Load(1, 1000, 0)),
    ],
    ids=["no-scrape", "fresh-scrape-adds-other-gateways", "stale-scrape-ignored", "engine-lags"],
)
def test_load_combines_own_and_engine(
    engine: EngineLoad | None, now_s: float, expected: Load
) -> None:
    r = replica()
    r.mean_prefill_tokens = 1000
    r.in_flight = 1
    r.joining[0] = Joining(time.perf_counter(), 1000, False)  # one request of ours, waiting
    r.engine = engine
    r.head_since_s = time.perf_counter()
    load = r.load(now_s, stale_after_s=5.0)
    assert 0 <= load.busy_s < 1.0
    assert dataclasses.replace(load, busy_s=0.0, queue=()) == expected


CACHE_CONFIG_TEXT = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048",num_cpu_blocks="None"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_engine_kv_layout_is_the_hbm_capacity_unless_configured() -> None:
    scraped = parse_engine_load(CACHE_CONFIG_TEXT, now_s=1.0)
    assert (scraped.gpu_blocks, scraped.block_size_tokens) == (2048, 16)
    r = replica()
    assert r.hbm_capacity_tokens() == 800_000, "the default until the engine has said"
    r.observe_engine(scraped, block_size_tokens=16)
    assert r.hbm_capacity_tokens() == 2048 * 16
    config = parse_config(
        {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"], "hbm_capacity_tokens": 99}]}
    )
    configured = next(iter(Registry(config).replicas.values()))
    configured.observe_engine(scraped)
    assert configured.hbm_capacity_tokens() == 99, "the config wins"


def test_a_block_size_mismatch_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    r = replica()
    with caplog.at_level("WARNING", logger="cachelane.registry"):
        r.observe_engine(parse_engine_load(CACHE_CONFIG_TEXT, now_s=1.0), block_size_tokens=32)
    assert "block size is 16 tokens, routing.block_size_tokens is 32" in caplog.text


def test_reservations_tell_when_they_reach_the_prefill() -> None:
    """A request sent with 0.5 s of KV loading joins the prefill queue 0.5 s later; it counts as
    a swap-in sharing PCIe until then, and leaves the queue at its first byte."""
    config = parse_config({"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]})
    registry = Registry(config)
    r = next(iter(registry.replicas.values()))
    swapping = registry.reserve(r, prefill_tokens=300, swaps=1, load_s=0.5)
    registry.reserve(r, prefill_tokens=200, swaps=0)
    load = r.load(now_s=0.0, stale_after_s=1.0)
    assert load.pending_prefill_tokens == 500
    assert load.swaps_in_flight == 1
    joins = sorted((round(q.joins_in_s, 1), q.tokens) for q in load.queue)
    assert joins == [(0.0, 200), (0.5, 300)]
    swapping.first_byte()
    after = r.load(now_s=0.0, stale_after_s=1.0)
    assert [q.tokens for q in after.queue] == [200]
    assert after.swaps_in_flight == 0
