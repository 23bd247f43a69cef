"""An HTTP body as the routing pipeline's input: its model, its prompt (text or the engine's
token ids), the prompt's block hashes and their namespace. Bad input is an ApiError here, before
anything is routed.

Precise mode (routing.mode: precise) hashes the engine's token ids (the pool's tokenizer and chat
template, gateway/engines/tokenizer.py) in the namespace gateway/engines/events.py explains;
approximate mode hashes the prompt's text (routing/hashing.py).
"""

from __future__ import annotations

import logging
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import xxhash

from gateway.config import MAX_TTFT_SLO_MS, ConfigError, GatewayConfig
from gateway.engines.events import precise_namespace
from gateway.fleet.registry import Registry
from gateway.http.errors import ApiError, bad_request, retry_later
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.hashing import PrefixHasher, token_block_hashes
from routing.prompt import (
    PromptError,
    approx_tokens,
    chat_text,
    completion_text,
    embedding_text,
    responses_messages,
)

if TYPE_CHECKING:  # precise mode only: jinja2 and tokenizers are the [precise] extra
    from gateway.engines.tokenizer import PromptTokenizer

log = logging.getLogger("cachelane.planner")

PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "responses": "input"}

TTFT_SLO_HEADER = "x-slo-ttft-ms"
# The request's own TTFT objective, in milliseconds: the header the Gateway API Inference
# Extension reads for it (kubernetes-sigs/gateway-api-inference-extension,
# pkg/epp/framework/plugins/flowcontrol/ordering/slo_deadline.go).


def ttft_slo_of(headers: Mapping[str, str] | None) -> float | None:
    """The request's `x-slo-ttft-ms`: a positive number of milliseconds, at most
    MAX_TTFT_SLO_MS; None when absent. Anything else is a 400 naming the header."""
    raw = None if headers is None else headers.get(TTFT_SLO_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw.strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= MAX_TTFT_SLO_MS):
        raise bad_request(
            f"the {TTFT_SLO_HEADER} header must be a number of milliseconds in "
            f"(0, {MAX_TTFT_SLO_MS:g}], got {raw[:40]!r}",
            code="invalid_ttft_objective",
            param=TTFT_SLO_HEADER,
        )
    return ms


def prompt_of(endpoint: str, body: dict[str, Any]) -> str:
    try:
        if endpoint == "chat":
            return chat_text(body.get("messages"))
        if endpoint == "responses":
            return chat_text(responses_messages(body.get("input"), body.get("instructions")))
        if endpoint == "embeddings":
            return embedding_text(body.get("input"))
        return completion_text(body.get("prompt"))
    except PromptError as err:
        raise bad_request(str(err), param=PROMPT_PARAM.get(endpoint, "input")) from None


def client_salt_of(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt` as the client sent it (a non-empty string, as vLLM requires)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request("'cache_salt' must be a non-empty string if provided", param="cache_salt")
    return salt


_HEADER_SAFE = "".join(c for c in string.punctuation if c != "%")


def namespace_of(model: str, tenant: Tenant, client_salt: str | None = None) -> str:
    """Hash namespace: prefixes are shared within one model and one tenant cache scope, and
    within one client `cache_salt` (the engine shares no prefix across salts).

    It travels to the replicas in a header (proxy.NAMESPACE_HEADER), whose values are ASCII: a
    tenant or share-group name is a label, not a header value, so everything but printable ASCII
    (and `%` itself, to stay one-to-one) is percent-encoded as UTF-8 (RFC 3986)."""
    namespace = quote(f"{model}|{tenant.cache_scope}", safe=_HEADER_SAFE, errors="surrogatepass")
    if client_salt is None:
        return namespace
    return f"{namespace}|salt:{quote(client_salt, safe='', errors='surrogatepass')}"


def engine_salt(tenant: Tenant, client_salt: str | None) -> str:
    """The cache_salt sent to a pool with `cache_salt: true`: the tenant scope's, and the
    client's own salt folded in when it sent one (so it still separates what the client
    separated)."""
    seed = tenant.cache_scope if client_salt is None else f"{tenant.cache_scope}\0{client_salt}"
    return xxhash.xxh3_128_hexdigest(seed.encode(errors="surrogatepass"))


def model_of(registry: Registry, config: GatewayConfig, body: dict[str, Any]) -> str:
    """The body's model, if a replica serves it: 400 without one, 404 for one nobody serves,
    503 while the replicas that may serve it have not answered yet."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    status = registry.model_status(model)
    if status == "pending":
        raise retry_later(
            503,
            f"no replica serving model {model!r} has answered yet; retry shortly",
            code="model_not_ready",
            param="model",
            retry_after_s=max(1, round(config.health.interval_s)),
        )
    if status == "unknown":
        raise ApiError(
            404,
            f"the model {model!r} does not exist; GET /v1/models lists the served models",
            code="model_not_found",
            param="model",
        )
    return model


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    namespace: str
    hashes: list[int]
    prompt_tokens: int


class PromptHasher:
    """A request's prompt as the index keys it (the module docstring has both modes)."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        metrics: Metrics,
        tokenizers: dict[str, PromptTokenizer],
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._block_size = config.routing.block_size_tokens
        self._precise = config.routing.mode == "precise"
        self._text = PrefixHasher()  # approximate mode: prompt text -> block hashes
        self.tokenizers = tokenizers

    def hashed(
        self,
        endpoint: str,
        body: dict[str, Any],
        model: str,
        tenant: Tenant,
        salts: tuple[str | None, str],
    ) -> HashedPrompt:
        """`salts`: the client's cache_salt (or None) and the engine's (engine_salt)."""
        client_salt, cache_salt = salts
        if endpoint == "embeddings":  # no prefix reuse: by load alone, nothing hashed
            prompt_tokens = approx_tokens(prompt_of(endpoint, body))
            return HashedPrompt(namespace_of(model, tenant, client_salt), [], prompt_tokens)
        if self._precise:
            return self._precise_prompt(endpoint, body, model, cache_salt, client_salt)
        text = prompt_of(endpoint, body)
        namespace = namespace_of(model, tenant, client_salt)
        limit = self._registry.max_prompt_tokens(model)
        if limit is not None and approx_tokens(text) > limit:  # refused: not worth hashing
            return HashedPrompt(namespace, [], approx_tokens(text))
        hashes = self._text.block_hashes(
            text, block_size_tokens=self._block_size, namespace=namespace
        )
        return HashedPrompt(namespace, hashes, approx_tokens(text))

    def _precise_prompt(
        self,
        endpoint: str,
        body: dict[str, Any],
        model: str,
        cache_salt: str,
        client_salt: str | None,
    ) -> HashedPrompt:
        """From the engine's own token ids. The salt the engine will hash with: the gateway's
        (pool `cache_salt: true`, the client's folded in), else the client's own, which then
        reaches the engine as it was sent."""
        from gateway.engines.tokenizer import UnsupportedPrompt

        pools = [r.pool for r in self._registry.replicas.values() if model in r.pool.models]
        salted = any(p.cache_salt for p in pools)
        namespace = precise_namespace(model, cache_salt if salted else client_salt)
        tokenizer = next((self.tokenizers[p.name] for p in pools), None)
        try:
            if tokenizer is None:
                raise UnsupportedPrompt(f"no pool names {model!r} with a tokenizer")
            if endpoint == "responses":  # the engine renders it as the chat it stands for
                messages = responses_messages(body.get("input"), body.get("instructions"))
                ids = tokenizer.chat_ids({**body, "messages": messages})
            elif endpoint == "chat":
                ids = tokenizer.chat_ids(body)
            else:
                ids = tokenizer.completion_ids(body)
        except UnsupportedPrompt as err:
            self._metrics.precise_fallbacks.labels("unsupported").inc()
            log.info("precise mode cannot tokenize this request (%s): routing without hits", err)
            return HashedPrompt(namespace, [], approx_tokens(prompt_of(endpoint, body)))
        except PromptError as err:
            raise bad_request(str(err), param=PROMPT_PARAM.get(endpoint, "input")) from None
        hashes = token_block_hashes(ids, block_size_tokens=self._block_size, namespace=namespace)
        return HashedPrompt(namespace, hashes, len(ids))


def load_tokenizers(config: GatewayConfig) -> dict[str, PromptTokenizer]:
    """Each pool's tokenizer, read at start-up; a file that does not load is a ConfigError."""
    from gateway.engines.tokenizer import PromptTokenizer

    out: dict[str, PromptTokenizer] = {}
    for i, pool in enumerate(config.pools):
        t = pool.tokenizer
        if t is None:
            continue
        try:
            out[pool.name] = PromptTokenizer.from_files(
                t.path, t.chat_template, bos_token=t.bos_token, eos_token=t.eos_token
            )
        except Exception as err:
            raise ConfigError(f"pools.{i}.tokenizer: cannot load {t.path!r}: {err}") from None
    return out
