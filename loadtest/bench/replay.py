"""Open-loop replay of a trace against an OpenAI-compatible base URL, and its summary.

Every record is sent at its arrival offset whether or not earlier requests have finished (an
open-loop client, so a slow server builds a queue instead of slowing the offered load). Two bounds
keep it finite: at most `max_in_flight` requests at once (a request over the cap waits, and its
lateness is recorded as `send_lag_s`), and an overall deadline after which whatever is still
running is cancelled and counted as an error.

Every request streams (`stream: true`, `stream_options.include_usage`), and per request we keep:
TTFT (to the first chunk carrying generated text; the role-only first chat chunk does not count),
end-to-end latency, prompt and cached tokens from the usage chunk, the status, and which replica
served it (the gateway's x-cachelane-replica header, or the base URL when going direct).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from loadtest.workloads.traces import DEFAULT_MODEL, TraceRecord
from routing.whatif.summary import percentile

MAX_IN_FLIGHT = 512
# Far above what the demo reaches (rate x latency ~ 15/s x 1 s); it only stops a runaway.

DRAIN_TIMEOUT_S = 60.0
# After the last arrival, how long the replay waits for stragglers before cancelling them.

CONNECT_TIMEOUT_S = 5.0  # loopback connects take microseconds; 5 s means something is wrong

REPLICA_HEADER = "x-cachelane-replica"
REASON_HEADER = "x-cachelane-reason"

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class RequestResult:
    index: int  # position in the trace
    tenant: str
    endpoint: str
    scheduled_s: float  # the record's arrival offset
    send_lag_s: float = 0.0  # how late it was sent (waiting for an in-flight slot)
    status: int = 0  # HTTP status; 0 when no response arrived (connection error, deadline)
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str = ""
    reason: str = ""  # the gateway's routing reason, when behind the gateway
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


ResultCallback = Callable[[RequestResult], None]


def request_body(record: TraceRecord, model: str) -> dict[str, Any]:
    return streaming_body(record, model, record["max_tokens"])


def streaming_body(request: Mapping[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """The OpenAI body of a streamed request (usage in its last chunk) for a trace record or a
    session's request: its messages for chat, its prompt for completions."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request["endpoint"] == "chat":
        body["messages"] = request["messages"]
    else:
        body["prompt"] = request["prompt"]
    return body


def has_text(chunk: dict[str, Any], endpoint: str) -> bool:
    """Does this streamed chunk carry generated text (not just the role, or usage)?"""
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            if (choice.get("delta") or {}).get("content"):
                return True
        elif choice.get("text"):
            return True
    return False


def sse_chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an httpx response's OpenAI server-sent event stream."""
    return sse_data(resp.aiter_lines())


async def sse_data(lines: AsyncIterable[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI server-sent event stream, line by line as they arrive (str
    from httpx's aiter_lines, bytes from aiohttp's content), up to `data: [DONE]`."""
    async for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_into(
    client: httpx.AsyncClient,
    record: TraceRecord,
    body: dict[str, Any],
    result: RequestResult,
    *,
    headers: dict[str, str] | None = None,
    default_replica: str = "",
    on_headers: Callable[[httpx.Response], None] | None = None,
) -> None:
    """Stream one record's request and fill `result`: status, replica and reason from the
    headers (then `on_headers` reads any others), TTFT, end-to-end time, usage or the error.
    The benchmarks' one streaming client."""
    started = time.perf_counter()
    endpoint = record["endpoint"]
    async with client.stream("POST", PATHS[endpoint], json=body, headers=headers) as resp:
        result.status = resp.status_code
        result.replica = resp.headers.get(REPLICA_HEADER, default_replica)
        result.reason = resp.headers.get(REASON_HEADER, "")
        if on_headers is not None:
            on_headers(resp)
        if resp.status_code != 200:
            body_text = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {body_text[:300]}"
            return
        async for chunk in sse_chunks(resp):
            if "error" in chunk:
                result.error = f"stream error: {str(chunk['error'])[:300]}"
                break
            if result.ttft_s is None and has_text(chunk, endpoint):
                result.ttft_s = time.perf_counter() - started
            usage = chunk.get("usage")
            if usage:
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                result.completion_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = int(details.get("cached_tokens") or 0)
    result.e2e_s = time.perf_counter() - started
    if result.error is None and not result.prompt_tokens:
        result.error = "no usage chunk in the stream"


def open_client(
    base_url: str,
    connections: int,
    timeout: httpx.Timeout,
    *,
    headers: dict[str, str] | None = None,
    trust_env: bool = True,
) -> httpx.AsyncClient:
    """A replay's client: up to `connections` connections, all kept alive between requests."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, headers=headers, trust_env=trust_env
    )


@contextlib.contextmanager
def errors_into(result: RequestResult, cancelled: str) -> Iterator[None]:
    """A request's failure becomes its result's error instead of ending the replay; a
    cancellation (the deadline) is recorded as `cancelled` and goes on."""
    try:
        yield
    except asyncio.CancelledError:
        result.error = cancelled
        raise
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"


async def replay(
    trace: Sequence[TraceRecord],
    base_url: str,
    *,
    model: str = DEFAULT_MODEL,
    max_in_flight: int = MAX_IN_FLIGHT,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    on_result: ResultCallback | None = None,
    api_key: str | None = None,
) -> list[RequestResult]:
    """Send every record at its offset; returns one result per record, in trace order."""
    results = [RequestResult(i, r["tenant"], r["endpoint"], r["t_s"]) for i, r in enumerate(trace)]
    slots = asyncio.Semaphore(max_in_flight)
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=drain_timeout_s, write=drain_timeout_s, pool=None
    )
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async with open_client(base_url, max_in_flight, timeout, headers=headers) as client:
        loop = asyncio.get_running_loop()

        async def one(i: int, record: TraceRecord, due_s: float) -> None:
            result = results[i]
            try:
                with errors_into(result, "cancelled at the replay deadline"):
                    async with slots:
                        result.send_lag_s = max(0.0, loop.time() - due_s)
                        await stream_into(
                            client,
                            record,
                            request_body(record, model),
                            result,
                            default_replica=str(client.base_url),
                        )
            finally:
                if on_result is not None:
                    on_result(result)

        await at_offsets(trace, one, drain_timeout_s=drain_timeout_s)
    return results


async def at_offsets(
    trace: Sequence[TraceRecord],
    send: Callable[[int, TraceRecord, float], Coroutine[Any, Any, None]],
    *,
    drain_timeout_s: float,
) -> None:
    """Open loop: start `send(i, record, due_s)` at each record's offset (`due_s`: the event
    loop's time it was due), wait at most `drain_timeout_s` after the last start, then cancel
    what is left. Every benchmark's sender shares this loop."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks: list[asyncio.Task[None]] = []
    try:
        for i, record in enumerate(trace):
            due_s = t0 + record["t_s"]
            delay = due_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i, record, due_s)))
        if tasks:
            await asyncio.wait(tasks, timeout=drain_timeout_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- summary ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    ok: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float  # cached / prompt tokens over successful requests
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    send_lag_p99_ms: float  # > 0 means the client could not keep the schedule
    duration_s: float
    throughput_req_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    per_replica: dict[str, int]
    max_mean_ratio: float  # busiest replica's requests / mean requests per replica (1.0 = even)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    replicas: Sequence[str] = (),
) -> Summary:
    """`replicas`: every replica of the fleet, so one that served nothing counts as 0 in the
    balance ratio (without it, a full hot spot on one replica would read as perfectly even)."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft_ms = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    e2e_ms = [r.e2e_s * 1000 for r in ok if r.e2e_s is not None]
    counts = Counter({name: 0 for name in replicas})
    counts.update(r.replica for r in ok)
    per_replica = dict(sorted(counts.items()))
    mean = sum(per_replica.values()) / len(per_replica) if per_replica else 0.0
    duration_s = max(duration_s, 1e-9)
    return Summary(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        ttft_p50_ms=percentile(ttft_ms, 50),
        ttft_p90_ms=percentile(ttft_ms, 90),
        ttft_p99_ms=percentile(ttft_ms, 99),
        e2e_p50_ms=percentile(e2e_ms, 50),
        e2e_p99_ms=percentile(e2e_ms, 99),
        send_lag_p99_ms=percentile([r.send_lag_s * 1000 for r in results], 99),
        duration_s=duration_s,
        throughput_req_per_s=len(ok) / duration_s,
        prompt_tokens_per_s=prompt / duration_s,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / duration_s,
        per_replica=per_replica,
        max_mean_ratio=max(per_replica.values()) / mean if mean else 0.0,
    )
