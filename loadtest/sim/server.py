"""The simulated replica's HTTP face: the OpenAI API plus what vLLM, SGLang and their routers call.

  POST /v1/chat/completions, /v1/completions   stream or not; usage with cached_tokens
  GET  /v1/models, /health, /metrics             vLLM metric names with a model_name label
  POST /reset_prefix_cache                        clears HBM and the CPU tier (vLLM's name)
  GET  /get_load, /server_info, /model_info      for sglang-router (no model_path: it would fetch)
  POST /v1/completions/render, /v1/chat/completions/render   for vllm-router's cache_aware policy
  POST /prefetch                                  load a prompt's KV into HBM without generating

Request headers the gateway sends: x-cachelane-namespace (the block hashes' namespace, default the
model name) and x-cachelane-remote-write: 0 (do not write this prompt's KV to the remote tier).
The body's "priority" (an int, default 0) orders the prefill queue under spec.scheduling_policy
"priority"; under "fcfs" a non-zero one is refused, as vLLM does. /prefetch ignores it.

With spec.tokenizer_path the replica tokenizes like vLLM (chat template, token ids, the body's
cache_salt) and ignores the namespace header; with spec.kv_events_port it publishes vLLM-format
KV events (kv_publisher.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from gateway.engines.tokenizer import PromptTokenizer, UnsupportedPrompt
from loadtest.sim import protocol
from loadtest.sim.accounting import PrefillResult
from loadtest.sim.auth import RequireKey
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.engine import ContextLengthExceeded, Prompt, SimEngine
from loadtest.sim.kv_publisher import KvEventPublisher
from loadtest.sim.openai_extra import ResponseWriter, embeddings_response
from loadtest.sim.protocol import ApiError, ChunkWriter, Kind
from loadtest.sim.remote import REMOTE_TIMEOUT_S, RemoteClient
from routing.prompt import (
    PromptError,
    approx_tokens,
    chat_text,
    completion_text,
    embedding_text,
    responses_messages,
)

NAMESPACE_HEADER = (
    "x-cachelane-namespace"  # same names as the gateway's proxy (gateway/serving/proxy.py)
)
REMOTE_WRITE_HEADER = "x-cachelane-remote-write"

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default for max_tokens (API reference)

FINISH_REASON = "length"  # the simulator always generates exactly max_tokens
MAX_STORED_RESPONSES = 10_000  # a bound on the simulator's memory, not an engine's number


def create_sim_app(spec: SimReplicaSpec) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with AsyncExitStack() as stack:
            remote = None
            if spec.remote_url:
                http = httpx.AsyncClient(
                    base_url=spec.remote_url, timeout=REMOTE_TIMEOUT_S, trust_env=False
                )
                remote = RemoteClient(await stack.enter_async_context(http))
            tokenizer = None
            if spec.tokenizer_path:
                tokenizer = PromptTokenizer.from_files(
                    spec.tokenizer_path,
                    spec.chat_template,
                    bos_token=spec.bos_token,
                    eos_token=spec.eos_token,
                )
            publisher = None
            if spec.kv_events_port is not None:
                publisher = KvEventPublisher(
                    spec.host, spec.kv_events_port, spec.kv_replay_port, spec.kv_topic
                )
                await stack.enter_async_context(publisher.running())
            engine = SimEngine(
                spec,
                remote,
                tokenizer=tokenizer,
                events=publisher.publish if publisher is not None else None,
            )
            app.state.kv_publisher = publisher
            registry = CollectorRegistry(auto_describe=True)
            registry.register(_EngineCollector(engine))
            yield {"engine": engine, "registry": registry}

    app = FastAPI(title=f"cachelane simulated replica {spec.name}", lifespan=lifespan)
    if spec.api_key is not None:
        app.add_middleware(RequireKey, api_key=spec.api_key)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body, status_code=err.status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, Kind.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, Kind.COMPLETION)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(spec, body)
        raw = body.get("input")
        try:
            embedding_text(raw)  # validates it
        except PromptError as err:
            raise ApiError(400, str(err), code="invalid_value", param="input") from None
        inputs: list[Any] = [raw] if isinstance(raw, str) else list(raw or [])
        if all(isinstance(x, int) for x in inputs):
            inputs = [raw]
        texts = [x if isinstance(x, str) else json.dumps(x) for x in inputs]
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(
                400,
                f"Unsupported encoding_format {fmt!r}.",
                code="invalid_value",
                param="encoding_format",
            )
        tokens = sum(approx_tokens(t) for t in texts)
        return embeddings_response(spec.model, texts, fmt, tokens)

    # Responses kept for GET, DELETE and previous_response_id, as vLLM keeps them in its
    # process (its response_store): gone when the replica restarts; the oldest dropped first.
    stored: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def store(body: dict[str, Any], response: dict[str, Any]) -> None:
        if body.get("store", True) is not False:
            stored[response["id"]] = response
            while len(stored) > MAX_STORED_RESPONSES:
                stored.popitem(last=False)

    def stored_response(response_id: str, param: str | None = None) -> dict[str, Any]:
        found = stored.get(response_id)
        if found is None:
            raise ApiError(
                404, f"Response with id '{response_id}' not found.", code="not_found", param=param
            )
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        stored_response(response_id)
        del stored[response_id]
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        engine = _engine(request)
        body = await _json_body(request)
        _check_model(spec, body)
        previous = body.get("previous_response_id")
        if previous is not None:
            stored_response(str(previous), param="previous_response_id")
        try:
            messages = responses_messages(body.get("input"), body.get("instructions"))
            text = chat_text(messages)
        except PromptError as err:
            raise ApiError(400, str(err), code="invalid_value", param="input") from None
        chat_body = {**body, "messages": messages}
        max_tokens = _max_tokens(Kind.CHAT, {"max_tokens": body.get("max_output_tokens")})
        priority = _priority(spec, body)
        prompt = _fitting_prompt(engine, request, Kind.CHAT, text, max_tokens, chat_body)
        remote_write = request.headers.get(REMOTE_WRITE_HEADER, "1").strip() != "0"
        out = ResponseWriter(spec.model, body)

        async def run() -> AsyncIterator[bytes]:
            async with engine.admit(prompt, priority=priority, max_tokens=max_tokens) as req:
                result = await req.prefill(remote_write=remote_write)
                for event in out.opening():
                    yield event
                pieces = []
                async for i in req.decode(max_tokens):
                    pieces.append(protocol.token_text(i))
                    yield out.delta(pieces[-1])
            for event in out.closing("".join(pieces), _usage(result, max_tokens)):
                yield event
            store(body, out.response("".join(pieces), _usage(result, max_tokens)))

        if body.get("stream"):
            return StreamingResponse(run(), media_type="text/event-stream")
        async with engine.admit(prompt, priority=priority, max_tokens=max_tokens) as req:
            result = await req.prefill(remote_write=remote_write)
            text_out = "".join([protocol.token_text(i) async for i in req.decode(max_tokens)])
        whole = out.response(text_out, _usage(result, max_tokens))
        store(body, whole)
        return JSONResponse(whole)

    async def _generate(request: Request, kind: Kind) -> Response:
        engine = _engine(request)
        body = await _json_body(request)
        text = _prompt_text(spec, kind, body)
        max_tokens = _max_tokens(kind, body)
        priority = _priority(spec, body)
        prompt = _fitting_prompt(engine, request, kind, text, max_tokens, body)
        remote_write = request.headers.get(REMOTE_WRITE_HEADER, "1").strip() != "0"
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            chunks = _stream(
                engine, kind, prompt, max_tokens, priority, remote_write, include_usage
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        async with engine.admit(prompt, priority=priority, max_tokens=max_tokens) as req:
            result = await req.prefill(remote_write=remote_write)
            text_out = "".join([protocol.token_text(i) async for i in req.decode(max_tokens)])
        usage = _usage(result, max_tokens)
        rid = protocol.new_id(kind)
        return JSONResponse(
            protocol.response(kind, rid, spec.model, text_out, FINISH_REASON, usage)
        )

    async def _stream(
        engine: SimEngine,
        kind: Kind,
        prompt: Prompt,
        max_tokens: int,
        priority: int,
        remote_write: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        out = ChunkWriter(kind, spec.model, include_usage=include_usage)
        async with engine.admit(prompt, priority=priority, max_tokens=max_tokens) as req:
            result = await req.prefill(remote_write=remote_write)
            if kind is Kind.CHAT:
                yield out.role()
            async for i in req.decode(max_tokens):
                # the last token carries the finish reason, as vLLM's chat and completions
                # streams do (vllm/entrypoints/openai/serving_chat.py): its client knows the
                # decode is over before the KV write out ends the response
                finish = FINISH_REASON if i == max_tokens - 1 else None
                yield out.content(protocol.token_text(i), finish)
        if kind is Kind.CHAT and max_tokens < 1:
            yield out.finish(FINISH_REASON)
        if include_usage:
            yield out.usage(_usage(result, max_tokens))
        yield protocol.SSE_DONE

    @app.post("/prefetch")
    async def prefetch(request: Request) -> dict[str, int]:
        """Load a prompt's KV into HBM (from the CPU or remote tier, or by recomputing it)."""
        engine = _engine(request)
        body = await _json_body(request)
        kind = Kind.CHAT if "messages" in body else Kind.COMPLETION
        prompt = _fitting_prompt(engine, request, kind, _prompt_text(spec, kind, body), 0, body)
        remote_write = request.headers.get(REMOTE_WRITE_HEADER, "1").strip() != "0"
        async with engine.admit(prompt, max_tokens=1) as req:
            result = await req.prefill(remote_write=remote_write)
        return {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens_before": result.cached_tokens,
            "hbm_tokens": result.hbm_tokens,
            "cpu_tokens": result.cpu_tokens,
            "remote_tokens": result.remote_tokens,
            "computed_tokens": result.computed_tokens,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": spec.model,
            "object": "model",
            "created": protocol.now_s(),
            "owned_by": "cachelane-sim",
            "root": spec.model,
            "parent": None,
            "max_model_len": spec.max_model_len_tokens,
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry: CollectorRegistry = request.state.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        _engine(request).reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/get_load")
    async def get_load(request: Request) -> list[dict[str, int]]:
        engine = _engine(request)
        return [
            {
                "dp_rank": 0,
                "num_reqs": engine.running + engine.waiting,
                "num_waiting_reqs": engine.waiting,
                "num_tokens": engine.active_tokens,
            }
        ]

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "served_model_name": spec.model,
            "context_length": spec.max_model_len_tokens,
            "max_total_num_tokens": spec.hbm_capacity_tokens,
            "page_size": spec.block_size_tokens,
            "tp_size": 1,
            "dp_size": 1,
            "version": "cachelane-sim",
        }

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"served_model_name": spec.model, "is_generation": True}

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        text = _prompt_text(spec, Kind.CHAT, body)
        max_tokens = _max_tokens(Kind.CHAT, body)
        ids = protocol.fake_token_ids(text)
        return protocol.render_result(Kind.CHAT, ids, spec.model, body, max_tokens)

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> list[dict[str, Any]]:
        body = await _json_body(request)
        _prompt_text(spec, Kind.COMPLETION, body)  # validates model and prompt
        max_tokens = _max_tokens(Kind.COMPLETION, body)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompts: list[list[int]] = [protocol.fake_token_ids(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [protocol.fake_token_ids(p) for p in prompt]
        else:
            prompts = [list(prompt)]  # already token ids
        return [
            protocol.render_result(Kind.COMPLETION, ids, spec.model, body, max_tokens)
            for ids in prompts
        ]

    return app


def _engine(request: Request) -> SimEngine:
    engine: SimEngine = request.state.engine
    return engine


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise ApiError(
            400, "We could not parse the JSON body of your request.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def _check_model(spec: SimReplicaSpec, body: dict[str, Any]) -> None:
    model = body.get("model", spec.model)
    if model != spec.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist.",
            code="model_not_found",
            param="model",
        )


def _prompt_text(spec: SimReplicaSpec, kind: Kind, body: dict[str, Any]) -> str:
    _check_model(spec, body)
    if body.get("n", 1) != 1:
        raise ApiError(400, "The simulator only supports n=1.", code="invalid_value", param="n")
    try:
        if kind is Kind.CHAT:
            return chat_text(body.get("messages"))
        return completion_text(body.get("prompt"))
    except PromptError as err:
        param = "messages" if kind is Kind.CHAT else "prompt"
        raise ApiError(400, str(err), code="invalid_value", param=param) from None


def _usage(result: PrefillResult, max_tokens: int) -> dict[str, Any]:
    timing = {
        "hbm_tokens": result.hbm_tokens,
        "cpu_tokens": result.cpu_tokens,
        "remote_tokens": result.remote_tokens,
        "computed_tokens": result.computed_tokens,
        "queue_wait_ms": round(result.queue_wait_s * 1000, 3),
        "swap_sharers": result.swap_sharers,
    }
    located, loaded, started, first = result.phases_s
    if first:  # the step engine's wall-clock phases, from its arrival at the prefill
        timing |= {
            "located_ms": round(located * 1000, 3),
            "loaded_ms": round(loaded * 1000, 3),
            "started_ms": round(started * 1000, 3),
            "first_token_ms": round(first * 1000, 3),
            "arrived_at_ms": round(result.arrived_at_s * 1000, 3),
            "decode_steps": max(0, max_tokens - 1),
        }
    return protocol.usage(result.prompt_tokens, max_tokens, result.cached_tokens, timing)


def _max_tokens(kind: Kind, body: dict[str, Any]) -> int:
    key = "max_completion_tokens" if kind is Kind.CHAT and "max_completion_tokens" in body else None
    key = key or "max_tokens"
    value = body.get(key)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"'{key}' must be an integer >= 1.", code="invalid_value", param=key)
    return value


def _priority(spec: SimReplicaSpec, body: dict[str, Any]) -> int:
    value = body.get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(
            400, "'priority' must be an integer.", code="invalid_value", param="priority"
        )
    if value != 0 and spec.scheduling_policy != "priority":
        raise ApiError(  # vLLM's wording (its v1 engine's input processor)
            400,
            f"Got priority {value} but Priority scheduling is not enabled.",
            code="invalid_value",
            param="priority",
        )
    return value


def _fitting_prompt(
    engine: SimEngine,
    request: Request,
    kind: Kind,
    text: str,
    max_tokens: int,
    body: dict[str, Any],
) -> Prompt:
    param = "messages" if kind is Kind.CHAT else "prompt"
    if engine.tokenizer is not None:
        try:
            prompt = engine.token_prompt(kind is Kind.CHAT, body)
        except (PromptError, UnsupportedPrompt) as err:
            raise ApiError(400, str(err), code="invalid_value", param=param) from None
    else:
        namespace = request.headers.get(NAMESPACE_HEADER) or engine.spec.model
        prompt = engine.prompt(text, namespace=namespace)
    try:
        engine.check_fits(prompt, max_tokens)
    except ContextLengthExceeded as err:
        param = "messages" if kind is Kind.CHAT else "prompt"
        raise ApiError(400, str(err), code="context_length_exceeded", param=param) from None
    return prompt


class _EngineCollector:
    """Reads the engine's state at scrape time, under vLLM's metric names where vLLM has one."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine
        self._labels = ["model_name", "engine"]
        self._values = [engine.spec.model, "0"]
        spec, bs = engine.spec, engine.spec.block_size_tokens
        num_gpu_blocks = spec.hbm_capacity_tokens // bs
        num_cpu_blocks = spec.cpu_capacity_tokens // bs if engine.cpu is not None else None
        # vLLM labels this gauge with CacheConfig's fields (str() of each) and the engine index,
        # without model_name; these are the fields the simulator has.
        self._cache_config = {
            "block_size": str(bs),
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_cpu_blocks": str(num_cpu_blocks),  # "None" without a CPU tier, as vLLM's
            "kv_cache_size_tokens": str(num_gpu_blocks * bs),
            "engine": "0",
        }

    def collect(self) -> Iterator[Metric]:
        e, s = self._engine, self._engine.stats
        gauges = [
            ("vllm:num_requests_running", "Requests prefilling or decoding", e.running),
            ("vllm:num_requests_waiting", "Requests waiting to be prefilled", e.waiting),
            ("vllm:kv_cache_usage_perc", "HBM KV cache fill (1 = full)", e.hbm_usage),
            ("cachelane_sim_hbm_blocks", "Blocks held in HBM", len(e.hbm)),
            (
                "cachelane_sim_cpu_blocks",
                "Blocks held in the CPU tier",
                len(e.cpu) if e.cpu is not None else 0,
            ),
        ]
        counters = [
            ("vllm:prefix_cache_queries", "Prompt tokens looked up", s.prefix_cache_queries_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens found in HBM", s.prefix_cache_hits_tokens),
            (
                "vllm:external_prefix_cache_queries",
                "Prompt tokens looked up in the CPU and remote tiers",
                s.external_queries_tokens,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "Prompt tokens reused from the CPU and remote tiers",
                s.external_hits_tokens,
            ),
            ("vllm:prompt_tokens", "Prompt tokens prefilled or reused", s.prompt_tokens),
            ("vllm:generation_tokens", "Tokens generated", s.generation_tokens),
            ("cachelane_sim_swap_in_tokens", "Tokens swapped in from CPU", s.swap_in_tokens),
            ("cachelane_sim_swap_ins", "Requests that swapped in from CPU", s.swap_ins),
            (
                "cachelane_sim_swap_link_sharers",
                "Sum over swap-ins of the swap-ins sharing the PCIe link (itself included)",
                s.swap_link_sharers,
            ),
            (
                "cachelane_sim_hbm_evicted_blocks",
                "Blocks pushed out of HBM (to the CPU tier or dropped)",
                s.hbm_evicted_blocks,
            ),
            (
                "cachelane_sim_remote_fetch_tokens",
                "Tokens fetched from the remote tier",
                s.remote_fetch_tokens,
            ),
            (
                "cachelane_sim_remote_recompute_tokens",
                "Tokens held remotely but cheaper to recompute",
                s.remote_recompute_tokens,
            ),
            (
                "cachelane_sim_remote_bytes_written",
                "KV bytes newly written to the remote tier",
                s.remote_bytes_written,
            ),
            (
                "cachelane_sim_remote_bytes_skipped",
                "KV bytes not written because the request said x-cachelane-remote-write: 0",
                s.remote_bytes_skipped,
            ),
            (
                "cachelane_sim_remote_errors",
                "Failed calls to the remote tier",
                e.remote.errors if e.remote else 0,
            ),
            (
                "cachelane_sim_steps",
                "Engine steps run (forward passes that computed a prompt token; steps model)",
                e.step_loop.steps if e.step_loop else 0,
            ),
            (
                "cachelane_sim_step_tokens",
                "Tokens those steps computed, prompt chunks and decode tokens",
                e.step_loop.step_tokens if e.step_loop else 0,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=self._labels)
            gauge.add_metric(self._values, value)
            yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=self._labels)
            counter.add_metric(self._values, value)
            yield counter
        wait = SummaryMetricFamily(
            "cachelane_sim_queue_wait_seconds",
            "Wall time from a request's KV being loaded to the start of its prefill (scaled by "
            "time_factor like every modelled sleep)",
            labels=self._labels,
        )
        wait.add_metric(self._values, s.queue_wait_count, s.queue_wait_s_sum)
        yield wait
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_config),
        )
        info.add_metric(list(self._cache_config.values()), 1.0)
        yield info
