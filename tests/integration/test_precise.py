"""Precise mode end to end: a gateway subscribed over real ZMQ (loopback) to simulated replicas
that tokenize like the engine and publish vLLM-format KV events; the official openai client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import parse_config
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from loadtest.sim.tiny_tokenizer import BOS, EOS, TinyTokenizerFiles, write_tiny_tokenizer
from routing.types import Location, Tier
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app
from tests.helpers.waiting import poll_until
from tests.integration.fleet import FAST_COSTS, MODEL, with_auth

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets in precise mode

BS = 16
SYSTEM = "You are a meticulous assistant for a logistics company. " * 30
WAIT_S = 5.0
CONNECT_TIMEOUT_S = 5.0


@dataclass
class PreciseFleet:
    gateway_url: str
    replica_urls: list[str]
    app: Any
    sims: list[Any]

    @property
    def gw(self) -> Any:
        return self.app.state.gw

    def name(self, i: int) -> str:
        return self.replica_urls[i].removeprefix("http://")

    def index_size(self, i: int, tier: Tier = Tier.HBM) -> int:
        size: int = self.gw.index.size(Location(self.name(i), tier))
        return size


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> TinyTokenizerFiles:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@asynccontextmanager
async def precise_fleet(
    files: TinyTokenizerFiles,
    n: int = 2,
    *,
    replay: bool = True,
    hbm_capacity_tokens: int = 100_000,
    cpu_capacity_tokens: int = 0,
    tenants: list[dict[str, str]] | None = None,
    **pool: Any,
) -> AsyncIterator[PreciseFleet]:
    async with AsyncExitStack() as stack:
        urls, sims, events, replays = [], [], {}, {}
        for i in range(n):
            spec = SimReplicaSpec(
                name=f"sim-{i}",
                port=0,
                costs=FAST_COSTS,
                itl_s=0.001,
                block_size_tokens=BS,
                hbm_capacity_tokens=hbm_capacity_tokens,
                cpu_capacity_tokens=cpu_capacity_tokens,
                kv_events_port=free_port(),
                kv_replay_port=free_port() if replay else None,
                tokenizer_path=str(files.tokenizer_json),
                chat_template=str(files.chat_template),
                bos_token=BOS,
                eos_token=EOS,
            )
            app = create_sim_app(spec)
            url = await stack.enter_async_context(running_app(app))
            urls.append(url)
            sims.append(app)
            events[url] = f"tcp://127.0.0.1:{spec.kv_events_port}"
            replays[url] = f"tcp://127.0.0.1:{spec.kv_replay_port}"
        kv_events: dict[str, Any] = {"endpoints": events}
        if replay:
            kv_events["replay_endpoints"] = replays
        config = parse_config(
            with_auth(
                {
                    "health": {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1},
                    "engine_metrics": {"enabled": False},
                    "routing": {"mode": "precise", "block_size_tokens": BS},
                    "pools": [
                        {
                            "name": "default",
                            "models": [MODEL],
                            "replicas": urls,
                            "hbm_capacity_tokens": hbm_capacity_tokens,
                            "cpu_capacity_tokens": cpu_capacity_tokens,
                            "costs": {"prefill_tokens_per_s": FAST_COSTS.prefill_tokens_per_s},
                            "kv_events": kv_events,
                            "tokenizer": {
                                "path": str(files.tokenizer_json),
                                "chat_template": str(files.chat_template),
                                "bos_token": BOS,
                                "eos_token": EOS,
                            },
                            **pool,
                        }
                    ],
                    "tenants": tenants or [],
                }
            )
        )
        gateway = create_app(config)
        gateway_url = await stack.enter_async_context(running_app(gateway))
        assert await gateway.state.gw.kv_events.wait_connected(CONNECT_TIMEOUT_S)
        yield PreciseFleet(gateway_url, urls, gateway, sims)


def client(url: str, api_key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)


def chat(user: str, system: str = SYSTEM) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


until = partial(poll_until, timeout_s=WAIT_S, poll_s=0.01)  # an event: a few ms on loopback


async def sim_blocks(url: str, tier: str = "hbm") -> int:
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"{url}/metrics")).text
    line = next(ln for ln in text.splitlines() if ln.startswith(f"cachelane_sim_{tier}_blocks{{"))
    return int(float(line.rsplit(" ", 1)[1]))


def replica_index(f: PreciseFleet, name: str) -> int:
    return [f.name(i) for i in range(len(f.replica_urls))].index(name)


async def served_by(f: PreciseFleet, c: AsyncOpenAI, text: str, *, max_tokens: int) -> int:
    """Sends one chat request; the index of the replica that answered it."""
    done = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(text), max_tokens=max_tokens
    )
    return replica_index(f, done.headers["x-cachelane-replica"])


async def test_index_follows_stored_blocks_and_a_shared_prefix_lands_there(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with precise_fleet(tokenizer_files) as f, client(f.gateway_url) as c:
        i = await served_by(f, c, "first question", max_tokens=2)
        held = await sim_blocks(f.replica_urls[i])
        assert held > 20
        await until(lambda: f.index_size(i) == held, "the index to hold the replica's blocks")
        assert f.index_size(1 - i) == 0, "precise mode records nothing speculatively"

        second = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat("a different second question"), max_tokens=2
        )
        assert second.headers["x-cachelane-replica"] == f.name(i)
        assert second.headers["x-cachelane-reason"] == "hbm_hit"
        usage = second.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached >= 20 * BS
        assert int(second.headers["x-cachelane-expected-cached-tokens"]) == cached
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(f"{f.gateway_url}/metrics")).text
            ready = (await h.get(f"{f.gateway_url}/ready")).json()
        assert f'cachelane_kv_events_total{{replica="{f.name(i)}",type="BlockStored"}}' in metrics
        assert ready["kv_events"][f.name(i)]["batches"] >= 1


async def test_evicted_and_demoted_blocks_follow_the_engine(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    cap = 24 * BS  # a prompt is ~14 blocks: the third one pushes the first one out
    async with (
        precise_fleet(tokenizer_files, 1, hbm_capacity_tokens=cap, cpu_capacity_tokens=cap) as f,
        client(f.gateway_url) as c,
    ):
        url = f.replica_urls[0]
        for topic in ("apples", "rivers", "engines"):
            system = f"Today we discuss {topic} in depth. " * 10
            await c.chat.completions.create(
                model=MODEL, messages=chat("go", system=system), max_tokens=1
            )
        hbm, cpu = await sim_blocks(url), await sim_blocks(url, "cpu")
        assert hbm == 24 and cpu > 0
        await until(
            lambda: (f.index_size(0), f.index_size(0, Tier.CPU)) == (hbm, cpu),
            "the index to follow evictions and demotions",
        )
        metrics = (await httpx.AsyncClient().get(f"{f.gateway_url}/metrics")).text
        assert 'type="BlockRemoved"}' in metrics
        explained = (
            await httpx.AsyncClient().post(
                f"{f.gateway_url}/debug/route",
                json={
                    "model": MODEL,
                    "messages": chat("go", system="Today we discuss apples in depth. " * 10),
                },
            )
        ).json()
        overlap = explained["candidates"][0]["overlap"]
        assert overlap["cpu_tokens"] > 0


async def test_reset_prefix_cache_empties_the_replicas_entries(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with precise_fleet(tokenizer_files) as f, client(f.gateway_url) as c:
        i = await served_by(f, c, "hello", max_tokens=1)
        await until(lambda: f.index_size(i) > 0, "blocks in the index")
        async with httpx.AsyncClient() as h:
            assert (await h.post(f"{f.replica_urls[i]}/reset_prefix_cache")).status_code == 200
        await until(lambda: f.index_size(i) == 0, "AllBlocksCleared to empty the replica")


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "resynced"])
async def test_a_lost_batch_is_replayed_or_resynced(
    tokenizer_files: TinyTokenizerFiles, replay: bool
) -> None:
    async with precise_fleet(tokenizer_files, 1, replay=replay) as f, client(f.gateway_url) as c:
        f.sims[0].state.kv_publisher.drop_next = 1  # numbered, buffered, never sent on PUB
        await c.chat.completions.create(model=MODEL, messages=chat("lost"), max_tokens=1)
        other = "Entirely different instructions for another agent. " * 10
        await c.chat.completions.create(
            model=MODEL, messages=chat("next", system=other), max_tokens=1
        )
        held = await sim_blocks(f.replica_urls[0])
        feed = f.gw.kv_events.feeds[f.name(0)]
        await until(lambda: feed.seq.expected == 2, "both batches to be handled")
        if replay:
            assert f.index_size(0) == held
        else:
            assert 0 < f.index_size(0) < held  # only what came after the gap
        sample = f.gw.metrics.registry.get_sample_value
        if replay:
            labels = {"replica": f.name(0), "outcome": "filled"}
            assert sample("cachelane_kv_event_replays_total", labels) == 1
        else:
            labels = {"replica": f.name(0), "cause": "gap"}
            assert sample("cachelane_kv_event_resyncs_total", labels) == 1


async def test_cache_salt_keeps_tenants_apart(tokenizer_files: TinyTokenizerFiles) -> None:
    tenants = [
        {"name": "a", "api_key": "key-of-a-123-0123456789abcdef0123456789"},
        {"name": "b", "api_key": "key-of-b-123-0123456789abcdef0123456789"},
    ]
    async with precise_fleet(tokenizer_files, 2, cache_salt=True, tenants=tenants) as f:
        async with (
            client(f.gateway_url, "key-of-a-123-0123456789abcdef0123456789") as a,
            client(f.gateway_url, "key-of-b-123-0123456789abcdef0123456789") as b,
        ):
            first = await a.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("q1"), max_tokens=1
            )
            i = replica_index(f, first.headers["x-cachelane-replica"])
            await until(lambda: f.index_size(i) > 0, "tenant a's blocks")
            other = await b.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("q1"), max_tokens=1
            )
            assert other.headers["x-cachelane-expected-cached-tokens"] == "0"
            usage = other.parse().usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens == 0
            again = await a.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("q2"), max_tokens=1
            )
            assert again.headers["x-cachelane-replica"] == f.name(i)
            assert int(again.headers["x-cachelane-expected-cached-tokens"]) > 0


def test_tokenizer_files_are_local(tokenizer_files: TinyTokenizerFiles) -> None:
    assert Path(tokenizer_files.tokenizer_json).stat().st_size > 0


@pytest.mark.parametrize("pool_salt", [False, True])
async def test_a_client_cache_salt_selects_the_engines_namespace(
    tokenizer_files: TinyTokenizerFiles, pool_salt: bool
) -> None:
    """vLLM folds the request's cache_salt into its block hashes: the client's own (a pool
    without `cache_salt`), or the gateway's with the client's folded in. Either way the router
    predicts the hits the engine gives, and none across salts."""
    async with precise_fleet(tokenizer_files, 2, cache_salt=pool_salt) as f:
        async with client(f.gateway_url) as c:

            async def ask(user: str, salt: str | None) -> Any:
                return await c.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=chat(user),
                    max_tokens=1,
                    extra_body={} if salt is None else {"cache_salt": salt},
                )

            first = await ask("q1", "alpha")
            i = replica_index(f, first.headers["x-cachelane-replica"])
            await until(lambda: f.index_size(i) > 0, "the salted blocks")
            for salt in ("beta", None):
                other = await ask("q1", salt)
                assert other.headers["x-cachelane-expected-cached-tokens"] == "0"
                usage = other.parse().usage
                assert usage.prompt_tokens_details.cached_tokens == 0
            again = await ask("q2", "alpha")
            assert again.headers["x-cachelane-replica"] == f.name(i)
            expected = int(again.headers["x-cachelane-expected-cached-tokens"])
            usage = again.parse().usage
            assert expected > 0 and expected == usage.prompt_tokens_details.cached_tokens
