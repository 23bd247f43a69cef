"""gateway/serving/proxy.py against fake replicas answering in process through the Upstream
interface (gateway/serving/upstream.py, whose aiohttp implementation tests/unit/test_upstream.py
tests on real sockets)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from gateway.accounting.calibration import CostLearner
from gateway.config import GatewayConfig, UpstreamConfig, parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.http.errors import ApiError
from gateway.index.reuse import ReuseCounter
from gateway.serving.planner import Plan, Planner
from gateway.serving.proxy import Proxy, expected_tiers
from gateway.serving.settlement import observers
from gateway.serving.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.cost import Estimate, Overlap
from routing.decide import Score
from routing.index import MemoryIndex
from routing.types import Location, TenantClass, Tier

MODEL = "m"
URLS = ["http://replica-a:8000", "http://replica-b:8000", "http://replica-c:8000"]
STANDARD = Tenant("acme", TenantClass.STANDARD)
FIRST_BYTE_DELAY_S = 0.01  # the fake's prefill: over routing/learn.py's 1 ms usable minimum
SSE = [
    b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":0}}}\n\n',
    b"data: [DONE]\n\n",
]
ASKS_USAGE = {"stream_options": {"include_usage": True}}  # the usage chunk then passes through


@dataclass
class Sent:
    replica: str  # host:port
    path: str
    content: bytes
    headers: Mapping[str, str]

    def json(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.content)
        return body


@dataclass
class Answer:
    """A fake replica's answer: status, content type, and its body in chunks (an async iterator
    that may raise an UpstreamError mid-way, as a broken connection does)."""

    status: int
    content_type: str | None
    body: AsyncIterator[bytes]
    closed: bool = False

    def chunks(self) -> AsyncIterator[bytes]:
        return self.body

    async def read(self) -> bytes:
        return b"".join([c async for c in self.body])

    async def aclose(self) -> None:
        self.closed = True


def json_answer(status: int, body: Any) -> Answer:
    return Answer(status, "application/json", delayed([json.dumps(body).encode()]))


Behaviour = Callable[[Sent], Answer]


async def delayed(chunks: list[bytes], *, then: Exception | None = None) -> AsyncIterator[bytes]:
    await asyncio.sleep(FIRST_BYTE_DELAY_S)
    for chunk in chunks:
        yield chunk
    if then is not None:
        raise then


def answers(request: Sent) -> Answer:
    """A replica that works: SSE when asked to stream, else one JSON completion."""
    if request.json().get("stream"):
        return Answer(200, "text/event-stream", delayed(SSE))
    return json_answer(200, {"choices": [{"message": {"content": "Hello"}}]})


def refuses(request: Sent) -> Answer:
    raise UpstreamConnectError("connection refused")


@dataclass
class FakeFleet:
    """Replicas by name; each answers with its behaviour (default: `answers`)."""

    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    sent: list[Sent] = field(default_factory=list)
    answered: list[Answer] = field(default_factory=list)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        parts = urlsplit(url)
        sent = Sent(parts.netloc, parts.path, body, dict(headers))
        self.sent.append(sent)
        answer = self.behaviour.get(sent.replica, answers)(sent)
        self.answered.append(answer)
        return answer

    async def aclose(self) -> None:
        return None


class Setup:
    def __init__(self, cfg: GatewayConfig, *, retries: int = 2) -> None:
        self.metrics = Metrics()
        self.registry = Registry(cfg)
        self.index = MemoryIndex()
        self.planner = Planner(
            cfg, self.registry, self.index, ReuseCounter(self.metrics), self.metrics
        )
        self.learner = CostLearner("fit", self.registry.replicas.values(), self.metrics)
        self.fleet = FakeFleet()
        settlement = observers(self.planner, self.metrics, self.learner)
        self.proxy = Proxy(
            self.fleet, self.registry, self.metrics, settlement, UpstreamConfig(retries=retries)
        )

    async def admit_all(self) -> Setup:
        for replica in self.registry.replicas.values():
            await self.registry.mark_ok(replica, frozenset())
        return self

    async def plan(self, body: dict[str, Any], tenant: Tenant = STANDARD) -> Plan:
        return await self.planner.plan("chat", body, tenant)

    async def forward(
        self, raw: bytes, tenant: Tenant = STANDARD, *, received_s: float | None = None
    ) -> tuple[Plan, Response]:
        plan = await self.planner.plan("chat", json.loads(raw), tenant, received_s=received_s)
        return plan, await self.proxy.forward("chat", raw, plan)

    def replica(self, name: str) -> Replica:
        return self.registry.replicas[name]

    def assert_all_released(self) -> None:
        for r in self.registry.replicas.values():
            assert (r.in_flight, r.pending_prefill_tokens, r.awaiting_first_byte) == (0, 0, 0), (
                r.name
            )
            assert not r.joining, r.name
            assert r.steps.streams == 0, r.name  # no stream counts as decoding any more
        assert all(a.closed for a in self.fleet.answered)  # every upstream answer let go of

    def samples(self, name: str) -> int:
        n: int = self.learner.describe()["replicas"][name]["samples"]
        return n


def config(**pool: Any) -> GatewayConfig:
    return parse_config(
        {
            "engine_metrics": {"enabled": False},
            "pools": [{"name": "p", "replicas": URLS, "models": [MODEL], **pool}],
        }
    )


async def setup(*, retries: int = 2, **pool: Any) -> Setup:
    return await Setup(config(**pool), retries=retries).admit_all()


def raw_chat(*, stream: bool = False, **extra: Any) -> bytes:
    # spacing and key order no json.dumps of the parsed body would reproduce
    messages = '[{"role": "system",   "content": "Be brief. ' + "x" * 600 + '"},'
    messages += ' {"role": "user", "content": "Hi"}]'
    tail = "".join(f', "{k}": {json.dumps(v)}' for k, v in extra.items())
    return (
        f'{{ "stream": {json.dumps(stream)},"messages": {messages}, "model": "{MODEL}"{tail} }}'
    ).encode()


def stream_of(response: Response) -> AsyncGenerator[bytes, None]:
    assert isinstance(response, StreamingResponse)
    it = response.body_iterator
    assert isinstance(it, AsyncGenerator)
    return it


async def read_all(response: Response) -> bytes:
    return b"".join([bytes(c) async for c in stream_of(response)])


def metric(s: Setup, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


# -- the body sent upstream ----------------------------------------------------------------------


async def test_the_clients_bytes_go_upstream_unchanged_when_no_pool_option_applies() -> None:
    s = await setup(cache_salt=False)  # an engine that takes no cache_salt
    raw = raw_chat(temperature=0.25, priority=3)
    _, response = await s.forward(raw)
    assert response.status_code == 200
    [sent] = s.fleet.sent
    assert sent.content == raw
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("klass", "priority"),
    [(TenantClass.CRITICAL, -1), (TenantClass.STANDARD, 0), (TenantClass.BATCH, 1)],
)
async def test_a_priority_pool_receives_the_class_priority(
    klass: TenantClass, priority: int
) -> None:
    s = await setup(engine_priority=True, cache_salt=False)
    raw = raw_chat(temperature=0.25, priority=-100)  # a client cannot pick its own priority
    await s.forward(raw, Tenant("t", klass))
    [sent] = s.fleet.sent
    body = sent.json()
    assert body["priority"] == priority
    assert "cache_salt" not in body
    assert {k: v for k, v in body.items() if k != "priority"} == {
        k: v for k, v in json.loads(raw).items() if k != "priority"
    }


async def test_a_salted_pool_receives_one_salt_per_tenant_cache_scope() -> None:
    s = await setup()  # salted by default
    raw = raw_chat()
    tenants = [
        Tenant("a", TenantClass.STANDARD),
        Tenant("a", TenantClass.STANDARD),
        Tenant("b", TenantClass.STANDARD),
        Tenant("c", TenantClass.STANDARD, share_group="team"),
        Tenant("d", TenantClass.BATCH, share_group="team"),
    ]
    for tenant in tenants:
        await s.forward(raw, tenant)
    bodies = [sent.json() for sent in s.fleet.sent]
    salts = [b["cache_salt"] for b in bodies]
    assert all(isinstance(salt, str) and salt for salt in salts)
    assert salts[0] == salts[1]  # one tenant, one salt
    assert salts[2] not in (salts[0], salts[3])  # another tenant, another salt
    assert salts[3] == salts[4]  # one share group, one salt
    assert all("priority" not in b for b in bodies)
    assert {k: v for k, v in bodies[0].items() if k != "cache_salt"} == json.loads(raw)


async def test_a_body_the_pool_changes_keeps_an_integer_past_64_bits_exact() -> None:
    s = await setup(engine_priority=True)
    await s.forward(raw_chat(seed=10**30))
    [sent] = s.fleet.sent
    assert sent.json()["seed"] == 10**30


# -- retries ---------------------------------------------------------------------------------------


async def test_a_refused_connection_is_retried_on_the_next_replica_and_marked_failed() -> None:
    s = await setup()
    plan = await s.plan(json.loads(raw_chat()))
    first, second = plan.decision.ranking[:2]
    s.fleet.behaviour[first] = refuses
    response = await s.proxy.forward("chat", raw_chat(), plan)

    assert response.status_code == 200
    assert [sent.replica for sent in s.fleet.sent] == [first, second]
    assert response.headers["x-cachelane-replica"] == second
    assert not s.replica(first).healthy
    assert s.replica(first).last_error is not None
    assert s.replica(second).healthy
    assert metric(s, "cachelane_upstream_retries_total", replica=first) == 1
    s.assert_all_released()


async def test_a_replica_that_dropped_the_request_is_not_indexed_as_its_holder() -> None:
    """A stale keep-alive connection (RemoteProtocolError) is retried elsewhere without ejecting
    the replica: the prompt is recorded only on the replica that took it."""
    s = await setup()
    plan = await s.plan(json.loads(raw_chat()))
    first, second = plan.decision.ranking[:2]

    def drops(request: Sent) -> Answer:
        raise UpstreamDisconnected("server disconnected")

    s.fleet.behaviour[first] = drops
    response = await s.proxy.forward("chat", raw_chat(), plan)
    assert response.headers["x-cachelane-replica"] == second
    holders = (await s.index.lookup(plan.model, list(plan.hashes)))[0]
    assert Location(second, Tier.HBM) in holders
    assert Location(first, Tier.HBM) not in holders
    assert s.replica(first).healthy  # one dropped connection does not eject it


async def test_every_replica_refusing_is_502_after_the_configured_retries() -> None:
    s = await setup(retries=1)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = refuses
    plan = await s.plan(json.loads(raw_chat()))
    with pytest.raises(ApiError) as caught:
        await s.proxy.forward("chat", raw_chat(), plan)
    assert caught.value.status == 502
    assert caught.value.code == "upstream_unavailable"
    assert [sent.replica for sent in s.fleet.sent] == list(plan.decision.ranking[:2])
    s.assert_all_released()


# -- every reservation released ----------------------------------------------------------------


async def test_a_first_choice_reserved_with_its_decision_is_seen_by_the_next_and_then_sent() -> (
    None
):
    """Two requests decided in one step of the event loop (a burst read at once): the second
    one's estimate counts the first one's prefill, reserved with its decision (as queue, or as
    the engine step the two would share: either way its TTFT there is above an idle replica's);
    forward() sends the first on that reservation rather than taking a second one."""
    s = await setup()
    long_body = json.loads(raw_chat(stream=True))
    # ~1 s of prefill at the default rate: still ahead when the second is decided, however
    # slowly this machine runs the two plans
    long_body["messages"][1]["content"] = "word " * 30_000
    first = await s.plan(long_body)
    reserved = s.proxy.reserve_first(first)
    second = await s.plan(json.loads(raw_chat(stream=True)))
    busy = second.decision.score(first.decision.replica).estimate
    idle = [
        second.decision.score(name).estimate
        for name in second.decision.ranking
        if name != first.decision.replica
    ]
    assert all(busy.ttft_s > other.ttft_s for other in idle), (busy, idle)
    assert s.replica(first.decision.replica).in_flight == 1
    response = await s.proxy.forward("chat", raw_chat(stream=True), first, reserved=reserved)
    assert s.fleet.sent[0].replica == first.decision.replica.split("//")[-1]
    assert reserved is not None and not reserved.held  # forward() took it over
    assert s.replica(first.decision.replica).in_flight == 1  # the one reservation, not two
    await read_all(response)
    s.assert_all_released()


async def test_a_whole_response_releases_its_reservation() -> None:
    s = await setup()
    _, response = await s.forward(raw_chat())
    assert response.status_code == 200
    assert json.loads(bytes(response.body))["choices"][0]["message"]["content"] == "Hello"
    s.assert_all_released()


async def test_an_upstream_error_status_is_the_gateways_own_error_and_releases() -> None:
    s = await setup()
    error = {"error": {"message": "bad", "type": "invalid_request_error", "code": "x"}}
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = lambda _: json_answer(400, error)
    _, response = await s.forward(raw_chat(stream=True))
    assert response.status_code == 400
    mapped = {"message": "bad", "type": "invalid_request_error", "param": None}
    assert json.loads(bytes(response.body)) == {"error": mapped | {"code": "invalid_request"}}
    assert len(s.fleet.sent) == 1  # an answer, even an error, is not retried
    s.assert_all_released()


async def test_an_upstream_timeout_before_the_first_byte_is_504_and_releases() -> None:
    s = await setup()

    def times_out(request: Sent) -> Answer:
        raise UpstreamTimeout("no answer")

    for name in s.registry.replicas:
        s.fleet.behaviour[name] = times_out
    with pytest.raises(ApiError) as caught:
        await s.forward(raw_chat(stream=True))
    assert caught.value.status == 504
    assert caught.value.code == "upstream_timeout"
    s.assert_all_released()


async def test_a_stream_holds_its_slot_until_it_ends_then_releases() -> None:
    s = await setup()
    plan, response = await s.forward(raw_chat(stream=True, **ASKS_USAGE))
    chosen = s.replica(plan.decision.replica)
    it = stream_of(response)
    assert await it.__anext__() == SSE[0]
    # the first byte came before the response was returned (within the first-byte timeout):
    # the prefill is done, the decode still holds its slot
    assert (chosen.in_flight, chosen.pending_prefill_tokens, chosen.awaiting_first_byte) == (
        1,
        0,
        0,
    )
    assert chosen.steps.streams == 1  # decoding: its tokens mark the replica's engine steps
    rest = [chunk async for chunk in it]
    assert rest == SSE[1:]
    assert chosen.steps.streams == 0
    s.assert_all_released()


async def test_a_stream_the_client_closes_early_releases() -> None:
    s = await setup()
    _, response = await s.forward(raw_chat(stream=True))
    it = stream_of(response)
    await it.__anext__()
    await it.aclose()  # what the server does when the client goes away mid-stream
    s.assert_all_released()


ASGI_23 = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}  # uvicorn's


def disconnect_once(event: asyncio.Event) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI receive() whose next message, once `event` is set, is the disconnect."""

    async def receive() -> dict[str, Any]:
        await event.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_a_stream_sent_whole_ends_normally_and_releases() -> None:
    """Under an ASGI 2.3 server the relay watches receive() for the disconnect, which uvicorn
    also sends once the response is complete: that one must not cancel anything."""
    s = await setup()
    _, response = await s.forward(raw_chat(stream=True, **ASKS_USAGE))
    done = asyncio.Event()
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)
        if not message.get("more_body", True):
            done.set()

    await response(ASGI_23, disconnect_once(done), send)
    await asyncio.sleep(0)  # the watcher sees the disconnect after the end
    assert [m["body"] for m in sent[1:-1]] == SSE
    s.assert_all_released()


async def test_a_stream_whose_client_leaves_mid_way_stops_and_releases() -> None:
    s = await setup()
    _, response = await s.forward(raw_chat(stream=True))
    first = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            sent.append(message["body"])
            first.set()
            await asyncio.sleep(1)  # a slow client: the disconnect comes while this waits

    receive = disconnect_once(first)
    await asyncio.wait_for(response(ASGI_23, receive, send), timeout=0.5)  # no exception
    assert sent == SSE[:1]
    s.assert_all_released()


async def test_a_stream_cancelled_from_above_stays_cancelled() -> None:
    """A cancellation that is not the client's (the server shutting down) propagates."""
    s = await setup()
    _, response = await s.forward(raw_chat(stream=True))

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        await asyncio.sleep(1)

    task = asyncio.ensure_future(response(ASGI_23, receive, send))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s.assert_all_released()


async def test_a_stream_whose_client_left_before_the_first_chunk_releases() -> None:
    """The server may never iterate the body: the client is gone before the response starts
    (the send fails at once). The reservation is released and the upstream closed anyway."""
    s = await setup()
    _, response = await s.forward(raw_chat(stream=True))

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        raise OSError("client went away")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):  # Starlette's name for a send that failed
        await response(scope, receive, send)
    s.assert_all_released()


async def test_a_stream_broken_upstream_ends_with_an_error_event_and_releases() -> None:
    s = await setup()

    def breaks(request: Sent) -> Answer:
        return Answer(
            200,
            "text/event-stream",
            delayed(SSE[:1], then=UpstreamDisconnected("connection reset")),
        )

    for name in s.registry.replicas:
        s.fleet.behaviour[name] = breaks
    _, response = await s.forward(raw_chat(stream=True))
    chunks = [bytes(c) async for c in stream_of(response)]
    assert chunks[0] == SSE[0]
    last = chunks[-1]
    assert last.startswith(b"data: ")
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "upstream_unavailable"
    assert metric(s, "cachelane_errors_total", code="upstream_unavailable") == 1
    s.assert_all_released()


# -- decision headers and learning ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decision_headers_name_the_replica_and_its_estimate(stream: bool) -> None:
    s = await setup()
    received_s = time.perf_counter() - 0.05  # the body took 50 ms to arrive
    plan, response = await s.forward(raw_chat(stream=stream), received_s=received_s)
    if stream:
        await read_all(response)
    [sent] = s.fleet.sent
    h = response.headers
    assert h["x-cachelane-replica"] == sent.replica == plan.decision.replica
    est_ms = float(h["x-cachelane-est-ttft-ms"])
    terms = {
        k: float(v) for k, v in (p.split("=") for p in h["x-cachelane-est-terms-ms"].split(","))
    }
    assert set(terms) == {"gateway", "fixed", "load", "queue", "prefill", "relay"}
    # the client's TTFT: the time in the gateway before the request was sent, then the replica's
    assert 50 <= terms["gateway"] < 50 + 1000
    assert terms["relay"] == 0  # no stream was handed on before this one
    assert est_ms == pytest.approx(terms["gateway"] + plan.decision.est_ttft_s * 1000, abs=0.15)
    assert sum(terms.values()) == pytest.approx(est_ms, abs=0.25)
    assert h["x-cachelane-tenant-class"] == "standard"
    # where the reused tokens are expected to come from; a cold fleet: nowhere
    split = (p.split("=") for p in h["x-cachelane-expected-tiers"].split(","))
    tiers = {k: int(v) for k, v in split}
    assert tiers == {"hbm": 0, "cpu": 0, "remote": 0}
    assert sum(tiers.values()) == int(h["x-cachelane-expected-cached-tokens"])


@pytest.mark.parametrize(("fetch", "header"), [(True, "remote=320"), (False, "remote=0")])
def test_the_expected_tiers_are_the_estimates_split(fetch: bool, header: str) -> None:
    """A remote prefix the estimate would recompute is not expected to be reused."""
    e = Estimate(0.0, 0.0, 0.01, 0.02 if fetch else 0.0, 0.03, fetch)
    score = Score("r", Overlap(1000, 480, 160, 320), e)
    assert expected_tiers(score) == f"hbm=480,cpu=160,{header}"


async def test_a_streamed_estimate_adds_the_measured_way_back() -> None:
    """After streams were handed on, a streamed estimate ends with `relay`: the median time from
    a replica's first byte to the first chunk given to the server; a whole answer's has none."""
    s = await setup()
    for _ in range(3):
        _, response = await s.forward(raw_chat(stream=True))
        await read_all(response)
    relay_s = s.proxy._relay_time.seconds  # in-process replica: tens of us, may round to 0.0
    assert relay_s > 0
    _, response = await s.forward(raw_chat(stream=True))
    await read_all(response)
    terms = dict(p.split("=") for p in response.headers["x-cachelane-est-terms-ms"].split(","))
    est_ms = float(response.headers["x-cachelane-est-ttft-ms"])
    assert float(terms["relay"]) == pytest.approx(relay_s * 1000, abs=0.05)
    assert sum(float(v) for v in terms.values()) == pytest.approx(est_ms, abs=0.35)
    _, whole = await s.forward(raw_chat(stream=False))
    assert "relay=0.0" in whole.headers["x-cachelane-est-terms-ms"]
    s.assert_all_released()


async def test_without_an_arrival_time_the_estimate_is_the_replicas() -> None:
    s = await setup()
    plan, response = await s.forward(raw_chat())
    assert float(response.headers["x-cachelane-est-ttft-ms"]) == pytest.approx(
        plan.decision.est_ttft_s * 1000, abs=0.05
    )


async def test_a_streamed_request_teaches_its_replicas_cost_fit() -> None:
    s = await setup()
    plan, response = await s.forward(raw_chat(stream=True))
    chosen = plan.decision.replica
    assert s.samples(chosen) == 0  # learned when the stream ends, not before
    await read_all(response)
    assert s.samples(chosen) == 1
    assert all(s.samples(n) == 0 for n in s.registry.replicas if n != chosen)
    hist = "cachelane_ttft_seconds_count"
    assert metric(s, hist, replica=chosen, model=MODEL, mode="stream") == 1

    _, again = await s.forward(raw_chat(stream=True))
    await read_all(again)
    assert sum(s.samples(n) for n in s.registry.replicas) == 2


async def test_a_whole_response_teaches_only_when_prefill_only() -> None:
    s = await setup()
    plan, _ = await s.forward(raw_chat(max_tokens=64))  # its first byte came after the decode
    assert sum(s.samples(n) for n in s.registry.replicas) == 0
    plan, _ = await s.forward(raw_chat(max_tokens=1))  # a prefill: its TTFT is an observation
    assert s.samples(plan.decision.replica) == 1


# -- failing replicas: first-byte timeout, passive health, clients that leave ----------------------


async def never() -> AsyncIterator[bytes]:
    await asyncio.sleep(3600)
    yield b""


def stalls(request: Sent) -> Answer:
    """Headers at once, then no first token (a hung engine behind vLLM's server)."""
    return Answer(200, "text/event-stream", never())


async def test_a_stream_without_a_first_byte_in_time_is_retried_on_the_next_replica() -> None:
    s = await setup(first_byte_timeout_s=0.05)
    plan = await s.plan(json.loads(raw_chat(stream=True, **ASKS_USAGE)))
    first, second = plan.decision.ranking[:2]
    s.fleet.behaviour[first] = stalls
    response = await s.proxy.forward("chat", raw_chat(stream=True, **ASKS_USAGE), plan)
    assert response.headers["x-cachelane-replica"] == second
    assert await read_all(response) == b"".join(SSE)
    assert [sent.replica for sent in s.fleet.sent] == [first, second]
    assert s.replica(first).consecutive_errors == 1
    assert s.replica(first).healthy  # one timeout is not yet eject_after_errors (5)
    assert metric(s, "cachelane_upstream_retries_total", replica=first) == 1
    assert s.samples(first) == 0
    s.assert_all_released()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "failing",
    [
        pytest.param(lambda _: json_answer(500, {"error": {}}), id="5xx"),
        pytest.param(
            lambda r: Answer(200, "application/json", delayed([b"\x00garbage"])), id="garbage"
        ),
        pytest.param(stalls, id="stalled"),
    ],
)
async def test_a_failure_before_the_first_byte_is_retried_on_the_next_replica(
    failing: Behaviour, stream: bool
) -> None:
    s = await setup(first_byte_timeout_s=0.05, min_decode_tokens_per_s=1000.0)
    raw = raw_chat(stream=stream, max_tokens=4)
    plan = await s.plan(json.loads(raw))
    first, second = plan.decision.ranking[:2]
    s.fleet.behaviour[first] = failing
    response = await s.proxy.forward("chat", raw, plan)
    assert response.status_code == 200
    assert response.headers["x-cachelane-replica"] == second
    if stream:
        await read_all(response)
    assert [sent.replica for sent in s.fleet.sent] == [first, second]
    assert s.replica(first).consecutive_errors == 1
    assert metric(s, "cachelane_upstream_retries_total", replica=first) == 1
    s.assert_all_released()


async def test_every_replica_silent_is_504_and_releases() -> None:
    s = await setup(first_byte_timeout_s=0.05)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = stalls
    with pytest.raises(ApiError) as caught:
        await s.forward(raw_chat(stream=True))
    assert caught.value.status == 504
    s.assert_all_released()


async def test_consecutive_5xx_of_two_tenants_eject_and_a_success_resets_the_count() -> None:
    cfg = parse_config(
        {
            "engine_metrics": {"enabled": False},
            "health": {"eject_after_errors": 2},
            "pools": [{"name": "p", "replicas": URLS, "models": [MODEL]}],
        }
    )
    s = await Setup(cfg).admit_all()
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = lambda _: json_answer(500, {"error": {}})
    target = s.replica(URLS[0].removeprefix("http://"))
    await s.registry.answered(target, 500, tenant="a")
    await s.registry.answered(target, 200, tenant="b")  # an answer resets the count
    await s.registry.answered(target, 503, tenant="a")
    assert target.healthy
    await s.registry.answered(target, 502, tenant="a")  # one tenant's: a suspect, still in
    assert target.healthy and target.suspect is not None
    await s.registry.answered(target, 502, tenant="b")
    assert not target.healthy
    assert target.ejection_reason == "5xx"
    await s.registry.mark_ok(target, frozenset())  # within health.ejection_s: stays out
    assert not target.healthy
    _, response = await s.forward(raw_chat(max_tokens=1))
    assert response.status_code == 500  # passes through, teaches the cost model nothing
    assert sum(s.samples(n) for n in s.registry.replicas) == 0
    s.assert_all_released()


def gone_at_poll(n: int) -> Callable[[], Awaitable[bool]]:
    """A client_gone check that finds the client still there until its `n`-th poll."""
    polls = 0

    async def gone() -> bool:
        nonlocal polls
        polls += 1
        return polls >= n

    return gone


async def test_a_client_that_leaves_before_the_answer_cancels_it_and_releases() -> None:
    s = await setup()
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = lambda _: Answer(200, None, never())
    plan = await s.plan(json.loads(raw_chat()))
    with pytest.raises(ApiError) as caught:
        await s.proxy.forward("chat", raw_chat(), plan, client_gone=gone_at_poll(2))
    assert caught.value.status == 499
    assert metric(s, "cachelane_client_gone_total") == 1
    s.assert_all_released()


# -- the usage, read from the stream's events ----------------------------------------------------

USAGE_SSE = [
    b'data: {"choices":[{"delta":{"content":"Hel"}}],"usage":null}\n\n',
    b'data: {"choices":[{"delta":{"content":"lo"}}],"usage":null}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":158,"completion_tokens":3,"total_tokens":161,',
    b'"prompt_tokens_details":{"cached_tokens":64}}}\n\ndata: [DONE]\n\n',  # split mid-object
]


def with_usage(request: Sent) -> Answer:
    return Answer(200, "text/event-stream", delayed(USAGE_SSE))


async def test_a_stream_is_asked_for_its_usage_and_the_client_that_did_not_ask_gets_none() -> None:
    s = await setup(cache_salt=False)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = with_usage
    plan, response = await s.forward(raw_chat(stream=True))
    assert await read_all(response) == USAGE_SSE[0] + USAGE_SSE[1] + b"data: [DONE]\n\n"
    [sent] = s.fleet.sent
    assert sent.json()["stream_options"] == {"include_usage": True}
    chosen = plan.decision.replica
    labels = {"replica": chosen, "tenant": STANDARD.name, "model": MODEL}
    assert metric(s, "cachelane_prompt_tokens_total", **labels) == 158
    assert metric(s, "cachelane_cached_tokens_total", **labels) == 64
    assert metric(s, "cachelane_output_tokens_total", **labels) == 3
    tpot = "cachelane_time_per_output_token_seconds_count"
    assert metric(s, tpot, replica=chosen, model=MODEL) == 1


async def test_a_client_that_asked_for_the_usage_gets_every_byte() -> None:
    s = await setup(cache_salt=False)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = with_usage
    raw = raw_chat(stream=True, **ASKS_USAGE)
    _, response = await s.forward(raw)
    assert await read_all(response) == b"".join(USAGE_SSE)
    [sent] = s.fleet.sent
    assert sent.content == raw  # nothing to add: its bytes as they came


async def test_a_whole_answers_ttft_is_its_response_head_labelled_whole() -> None:
    s = await setup()
    plan, _ = await s.forward(raw_chat(max_tokens=64))
    labels = {"replica": plan.decision.replica, "model": MODEL}
    assert metric(s, "cachelane_ttft_seconds_count", **labels, mode="whole") == 1
    assert metric(s, "cachelane_ttft_seconds_sum", **labels, mode="whole") > 0
    assert metric(s, "cachelane_ttft_seconds_count", **labels, mode="stream") == 0


@pytest.mark.parametrize("probe_error", [None, "answered 500"], ids=["probe passes", "probe fails"])
async def test_one_tenants_errors_make_a_suspect_that_its_probe_clears_or_ejects(
    probe_error: str | None,
) -> None:
    cfg = parse_config(
        {
            "engine_metrics": {"enabled": False},
            "health": {"eject_after_errors": 2},
            "pools": [{"name": "p", "replicas": URLS, "models": [MODEL]}],
        }
    )
    s = await Setup(cfg).admit_all()
    target = s.replica(URLS[0].removeprefix("http://"))
    for _ in range(10):
        await s.registry.errored(target, "no first byte", reason="timeout", tenant="a")
    assert target.healthy
    assert target.suspect == ("timeout", "10 errors in a row, last: no first byte")
    await s.registry.confirmed(target, probe_error)
    assert target.healthy is (probe_error is None)
    assert target.suspect is None
    assert target.consecutive_errors == (0 if probe_error is None else 10)
