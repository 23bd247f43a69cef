"""The traffic capture (capture.path) on real servers: simulated replicas and a gateway on
loopback, the official openai client. What the file holds is the prompts' structure and the
outcomes, never their text; it is bounded; `cachelane plan` reads it."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from gateway.cli.plan import run as plan_run
from gateway.serving.planner import namespace_of
from gateway.tenancy.tenants import ANONYMOUS
from routing.hashing import block_hashes
from routing.prompt import chat_text
from routing.whatif.capture import hex_hashes, parse_capture
from routing.whatif.replay import replay
from routing.whatif.setup import Setup
from tests.helpers.completions import streamed_usage
from tests.integration.fleet import CACHE_VISIBLE_COSTS, MODEL, fleet

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]  # slow: `make check` leaves it out

SECRET_WORDS = ["xylophonic", "quokkabridge", "marzipanlattice", "vorticular", "plumbago"]


def _prompt(rng: random.Random, words: int) -> str:
    """A distinctive prompt: the secret words and random nonsense tokens, ~4 chars per token."""
    out = [rng.choice(SECRET_WORDS) for _ in range(words // 4)]
    out += ["".join(rng.choice("bcdfghjklmnpqrstvwz") for _ in range(7)) for _ in range(words)]
    rng.shuffle(out)
    return " ".join(out)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _send(url: str, prompts: list[str], *, stream: bool) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for text in prompts:
        messages: Any = [{"role": "system", "content": text}, {"role": "user", "content": "go"}]
        if stream:
            await streamed_usage(client, MODEL, messages)
        else:
            await client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    await client.close()


async def test_capture_has_structure_and_outcomes_but_no_prompt_text(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    rng = random.Random(1)
    shared = _prompt(rng, 400)
    prompts = [shared, shared, _prompt(rng, 300)]
    async with fleet(2, capture={"path": str(path)}) as f:
        await _send(f.gateway_url, prompts, stream=True)
        await _send(f.gateway_url, [_prompt(rng, 200)], stream=False)
    # the gateway stopped: the writer flushed and closed the file, with a last fit line
    raw = path.read_text()
    lines = _lines(path)
    for word in SECRET_WORDS:
        assert word not in raw
    nonsense = [w for p in prompts for w in p.split() if w not in SECRET_WORDS]
    assert not any(w in raw for w in nonsense)

    assert lines[0]["type"] == "header"
    assert lines[-1]["type"] == "fit" and set(lines[-1]["replicas"]) == set(f.gw.registry.replicas)
    requests = [line for line in lines if line["type"] == "request"]
    assert len(requests) == 4
    for r in requests:
        for key in (
            "t_s", "tenant", "class", "model", "pool", "replica", "prompt_tokens", "hashes",
            "ttft_s", "e2e_s", "cached_tokens", "hit", "est_ttft_s", "stream",
        ):  # fmt: skip
            assert key in r, key
        assert r["model"] == MODEL and r["pool"] == "default"
        assert r["replica"] in f.gw.registry.replicas
        assert r["e2e_s"] > 0
    chats = [r for r in requests if r["endpoint"] == "chat"]
    assert all(r["ttft_s"] is not None and r["ttft_s"] > 0 for r in chats)
    completion = next(r for r in requests if r["endpoint"] == "completions")
    assert completion["ttft_s"] is None  # a whole answer's first byte is not a TTFT
    # the structure is the router's: the hashes of the prompt's blocks, in its namespace
    assert chats[0]["hashes"] == chats[1]["hashes"]
    text = chat_text([{"role": "system", "content": shared}, {"role": "user", "content": "go"}])
    namespace = namespace_of(MODEL, ANONYMOUS)
    hashes = block_hashes(text, block_size_tokens=16, namespace=namespace)
    assert chats[0]["hashes"] == hex_hashes(hashes)
    # the second turn of the shared prompt reused the first's KV, and the capture says where
    second = chats[1]
    assert second["cached_tokens"] > 0 and second["hit"]["hbm"] == second["cached_tokens"]
    assert second["replica"] == chats[0]["replica"]
    # the planner reads it back
    capture = parse_capture(lines)
    assert len(capture.requests) == 4 and capture.fit
    assert capture.requests[0].hashes == tuple(int(h, 16) for h in chats[0]["hashes"])
    assert hex_hashes(capture.requests[0].hashes) == chats[0]["hashes"]


async def test_capture_stops_at_max_records_and_counts_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    path.write_text("an older capture\n")
    rng = random.Random(2)
    async with fleet(1, capture={"path": str(path), "max_records": 3}) as f:
        await _send(f.gateway_url, [_prompt(rng, 100) for _ in range(5)], stream=True)
        metrics = f.gw.metrics.capture_records
        written = metrics.labels("written")._value.get()
        dropped = metrics.labels("dropped")._value.get()
    assert (tmp_path / "capture.jsonl.1").read_text() == "an older capture\n"  # moved aside
    requests = [line for line in _lines(path) if line["type"] == "request"]
    assert len(requests) == 3
    assert written == 3 and dropped == 2


async def test_capture_stops_at_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    rng = random.Random(3)
    async with fleet(1, capture={"path": str(path), "max_bytes": 6_000}) as f:
        await _send(f.gateway_url, [_prompt(rng, 300) for _ in range(6)], stream=True)
    assert 0 < path.stat().st_size <= 6_000
    requests = [line for line in _lines(path) if line["type"] == "request"]
    assert 0 < len(requests) < 6


def test_no_capture_by_default() -> None:
    from gateway.config import GatewayConfig

    assert GatewayConfig.model_fields["capture"].default.path is None


async def test_cachelane_plan_reads_a_real_capture(tmp_path: Path) -> None:
    path = tmp_path / "capture.jsonl"
    rng = random.Random(4)
    doc = _prompt(rng, 300)
    async with fleet(2, capture={"path": str(path)}) as f:
        await _send(f.gateway_url, [doc, _prompt(rng, 200), doc, doc], stream=True)
    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    code = plan_run(
        [str(path), "--scenarios", "captured,hbm,cpu", "--json", str(out), "--png", str(png)]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["scenarios"]) == {"captured", "hbm", "cpu"}
    captured = result["scenarios"]["captured"]["summary"]["classes"]["all"]
    assert captured["requests"] == 4 and captured["hit_rate"] > 0
    assert png.stat().st_size > 10_000


async def test_cachelane_plan_reads_a_live_capture_with_a_gateways_fit(tmp_path: Path) -> None:
    """While the gateway runs: the capture is readable (flushed) and --gateway takes the fitted
    terms routing uses now."""
    path = tmp_path / "capture.jsonl"
    rng = random.Random(5)
    out = tmp_path / "plan.json"
    async with fleet(2, capture={"path": str(path), "max_records": 2}) as f:
        await _send(f.gateway_url, [_prompt(rng, 200) for _ in range(3)], stream=True)
        for _ in range(100):  # the writer thread flushes once its queue is empty
            if len(path.read_text().splitlines()) >= 3:  # the header and two requests
                break
            await asyncio.sleep(0.05)
        args = ["--scenarios", "captured", "--no-search", "--json", str(out)]
        code = await asyncio.to_thread(plan_run, [str(path), *args, "--gateway", f.gateway_url])
    assert code == 0
    assert json.loads(out.read_text())["fit_source"] == "gateway"


async def test_the_replay_routes_and_hits_as_the_gateway_did(tmp_path: Path) -> None:
    """Requests one after another (no queue): the replay of the capture on the set-up it was
    served on sends each request where the gateway sent it (up to the replicas' names) and
    finds the cached tokens the engine reported."""
    path = tmp_path / "capture.jsonl"
    rng = random.Random(6)
    docs = [_prompt(rng, 600) for _ in range(4)]
    prompts = [rng.choice(docs) + " " + _prompt(rng, 20) for _ in range(16)]
    async with fleet(3, costs=CACHE_VISIBLE_COSTS, capture={"path": str(path)}) as f:
        await _send(f.gateway_url, prompts, stream=True)
    capture = parse_capture(_lines(path))
    outcome = replay(capture.requests, Setup.from_capture(capture), seed=0)
    assert len(outcome.requests) == len(capture.requests) == 16
    planned = {r.arrived_s: r for r in outcome.requests}
    names: dict[str, str] = {}
    for c in capture.requests:
        p = planned[c.t_s]
        assert names.setdefault(p.replica, c.replica) == c.replica, "routed elsewhere"
        assert p.hbm_tokens + p.cpu_tokens + p.remote_tokens == c.cached_tokens
    assert sum(c.cached_tokens or 0 for c in capture.requests) > 0
