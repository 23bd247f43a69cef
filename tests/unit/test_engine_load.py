import pytest

from gateway.config import parse_config
from gateway.registry import Registry
from gateway.scraper import EngineLoad, parse_engine_load
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


def replica():  # type: ignore[no-untyped-def]
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
    r.in_flight, r.pending_prefill_tokens, r.awaiting_first_byte = 1, 1000, 1
    r.engine = engine
    assert r.load(now_s, stale_after_s=5.0) == expected
