"""Request body fields clients must not set: the engines' own control fields, which the gateway
either sets itself (`priority`, from the tenant's class) or which would let a client steer the
engine past the gateway. A request that sends one is refused (400 `field_not_allowed`, naming the
field) rather than silently changed, so a client learns that its field had no effect.

The default list, from the engines' OpenAI request models:
- vLLM (vllm/entrypoints/openai/protocol.py, ChatCompletionRequest / CompletionRequest):
  `priority` (the scheduler's order under --scheduling-policy priority), `kv_transfer_params`
  (where a disaggregated engine fetches or sends KV), `vllm_xargs` (arguments for plugins),
  `request_id` (the engine's id of the request).
- SGLang (python/sglang/srt/entrypoints/openai/protocol.py): `rid` (its request id),
  `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (prefill-decode disaggregation's
  hand-off).
`cache_salt` is not in it: a client's salt only narrows its own sharing, and the gateway folds it
into the tenant's (gateway/serving/planner.py engine_salt).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from gateway.http.errors import ApiError
from routing.types import TenantClass

if TYPE_CHECKING:
    from gateway.config import BodyFieldsConfig

ENGINE_CONTROL_FIELDS = (
    "priority",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)


def check_fields(body: Mapping[str, Any], denied: Collection[str]) -> None:
    """Raise 400 field_not_allowed for the first denied top-level field the body sets."""
    for name in denied:
        if name in body:
            raise ApiError(
                400,
                f"{name!r} is set by the gateway or the engine, not by clients",
                code="field_not_allowed",
                param=name,
            )


def denied_fields(config: BodyFieldsConfig) -> dict[TenantClass, tuple[str, ...]]:
    """The fields each class may not send: `deny` less the class's `allow`."""
    return {
        klass: tuple(f for f in config.deny if f not in config.allow.get(klass, ()))
        for klass in TenantClass
    }
