"""`cachelane plan --redis URL`: the cost fits the gateways share in Redis
(gateway/accounting/fit_store.py) price the replay, on a real redis-server of the test session."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from rich.console import Console

from gateway.accounting.fit_store import FITS_KEY
from gateway.cli.plan import build_parser, plan, read_capture, redis_fit
from routing.cost import CostTerms, PoolCosts
from routing.learn import OnlineFit, Sample
from tests.unit.test_whatif import _header_obj, _request_obj

POOL = "plan-redis-fit"  # a pool name no other test shares: the hash is one key for all


def _fit_of(costs: PoolCosts, slower: float, n: int) -> OnlineFit:
    """A fit that saw `n` requests prefilling `slower` times slower than the seed says."""
    fit = OnlineFit(CostTerms.seed(costs))
    for i in range(n):
        tokens = 500.0 + 100 * (i % 7)
        fit.update(
            Sample(
                0.0, tokens, 0.0, 0.0, costs.fixed_s + slower * tokens / costs.prefill_tokens_per_s
            )
        )
    return fit


def test_plan_takes_the_shared_fits_from_redis(redis_url: str, tmp_path: Path) -> None:
    header = _header_obj(name=POOL, replicas=["r1:1", "r2:1"])
    costs = PoolCosts(prefill_tokens_per_s=10_000.0)
    path = tmp_path / "capture.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(_request_obj(1.0, [1, 2, 3])) + "\n")
    own = _fit_of(costs, slower=3.0, n=30)
    pooled = _fit_of(costs, slower=3.0, n=60)
    foreign = OnlineFit(CostTerms.seed(PoolCosts(prefill_tokens_per_s=1.0)))  # other constants
    client = redis.Redis.from_url(redis_url)
    fields = {"r1:1": own, f"pool:{POOL}": pooled, "r2:1": foreign}
    client.hset(FITS_KEY, mapping={k: json.dumps(v.to_dict()) for k, v in fields.items()})
    try:
        capture = redis_fit(redis_url, read_capture(path))
        assert set(capture.fit) == {"r1:1", f"pool:{POOL}"}  # the foreign seed is skipped
        terms = capture.pool_terms()[POOL]
        assert terms.samples == 60  # the pool's fit: the most observations
        assert 2.0 < terms.prefill_s_per_token * costs.prefill_tokens_per_s < 4.0
        args = build_parser().parse_args([str(path), "--redis", redis_url, "--no-search"])
        result = plan(args, Console(quiet=True))
        assert result["fit_source"] == "redis"
    finally:
        client.hdel(FITS_KEY, *fields)
        client.close()
