"""Print deploy/CONFIG.md: every key of the gateway's config file, from the pydantic models.

    python deploy/gen_config_reference.py > deploy/CONFIG.md     # regenerate
    python deploy/gen_config_reference.py --check                # exit 1 if CONFIG.md is stale

Paths, types and defaults come from gateway.config.GatewayConfig (walked recursively); the meaning
of each key comes from the field's `description` or, failing that, from DESCRIPTIONS below. A key
with neither is printed as UNDOCUMENTED and fails --check and tests/deploy/test_config_reference.py,
so a new key cannot ship without a line here.
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.config import GatewayConfig  # noqa: E402

OUTPUT = ROOT / "deploy" / "CONFIG.md"
UNDOCUMENTED = "UNDOCUMENTED"

# Meaning of each key, by path ("[]" = every item of a list). Defaults' sources are in the code
# named here (routing/cost.py, routing/index.py, routing/hashing.py, gateway/config/).
DESCRIPTIONS: dict[str, str] = {
    "listen": "Where the gateway accepts client connections.",
    "listen.host": "Address to bind. 127.0.0.1 on a laptop; 0.0.0.0 in a container or pod.",
    "listen.port": "TCP port for the API, /health, /ready and /metrics. The image and manifests "
    "assume 8000.",
    "routing": "How a replica is chosen.",
    "routing.policy": "cache_aware (the cost model: HBM, CPU tier, remote tier, queue), or a "
    "baseline for comparison: round_robin, least_loaded, prefix_hash.",
    "routing.block_size_tokens": "Tokens per KV block when hashing prompts. Must equal the "
    "engines' block size (vLLM --block-size; 16 is vLLM's default, routing/hashing.py).",
    "routing.seed": "Seed of the random source that breaks near-ties, so runs are repeatable.",
    "index": "The KV index: which replica and tier holds which prefix blocks.",
    "index.backend": "memory: inside this gateway process (one gateway). redis: shared by every "
    "gateway instance (required for more than one).",
    "index.redis_url": "Redis URL when backend is redis. With redis_cluster, any one node. "
    "A password as redis://:PASSWORD@host:6379/0, an ACL user as redis://USER:PASSWORD@..., TLS "
    "as rediss://...?ssl_ca_certs=/path/ca.pem (URL-encode other characters than letters, "
    "digits and -._~). It holds a secret: give it as redis_url_file or ${VAR} "
    "(docs/security.md).",
    "index.redis_cluster": "true when redis_url points at a Redis Cluster (keys are cluster-safe).",
    "index.ttl_s": "Seconds a speculative index entry lives. 600: about vLLM's prefix-cache "
    "lifetime under steady load (routing/index.py); KV events refresh entries sooner.",
    "health": "Active health checks of every replica.",
    "health.interval_s": "Seconds between checks of each replica.",
    "health.timeout_s": "Seconds a check may take before it counts as failed.",
    "health.fail_after": "Consecutive failed checks before a replica is taken out of routing "
    "(2: one lost packet does not eject it; two intervals, ~4 s, do).",
    "health.eject_after_errors": "Passive health, like Envoy's outlier detection "
    "(consecutive_5xx, default 5): a replica whose own traffic gets this many 5xx answers or "
    "first-byte timeouts in a row is taken out of routing; a successful answer resets the count. "
    "0: off.",
    "health.ejection_s": "A replica ejected for its errors stays out at least this long, then the "
    "health check re-admits it (Envoy's base_ejection_time, 30 s). Metric: "
    "cachelane_replica_ejections_total by reason.",
    "engine_metrics": "Scraping each replica's /metrics for load that other gateways put on it.",
    "engine_metrics.enabled": "Scrape replicas' /metrics (vLLM or SGLang metric names).",
    "engine_metrics.interval_s": "Seconds between scrapes (vLLM updates its scheduler gauges "
    "every engine step, so 1 s is fresh).",
    "engine_metrics.timeout_s": "Seconds a scrape may take.",
    "engine_metrics.stale_after_s": "Scrapes older than this are ignored; the gateway then uses "
    "only its own in-flight counts.",
    "upstream": "Connections from the gateway to the replicas.",
    "upstream.connect_timeout_s": "Seconds to open a connection to a replica.",
    "upstream.read_timeout_s": "Seconds between bytes from a replica before the request fails "
    "(600: a long generation may stream for minutes).",
    "upstream.max_connections": "Connection pool size to all replicas together.",
    "upstream.retries": "Other replicas tried when one fails before sending its first byte "
    "(never after: a generation is not run twice).",
    "tenants": "API keys and their tenants. Clients send `Authorization: Bearer <key>`. With "
    "auth.mode keys (the default) a request needs the key of a live tenant, even when there is "
    "none: then every request is refused.",
    "tenants[].name": "Tenant name (metrics label, logs). Unique; 1 to 64 lower-case ASCII "
    "letters, digits, '-', '_', '.', the first a letter or digit.",
    "tenants[].api_key_sha256": "SHA-256 hex digest of the tenant's key (preferred in files: "
    "`python3 -c \"import hashlib; print(hashlib.sha256(b'KEY').hexdigest())\"`). Give this or "
    "api_key. The gateway cannot check the length of a key it only knows by digest: make it "
    "with `openssl rand -hex 16` or longer.",
    "tenants[].api_key": "The key itself, at least 32 characters (`openssl rand -hex 16`); "
    "shorter is a start-up error. Give this (or api_key_file) or api_key_sha256.",
    "tenants[].class": "critical (pinned HBM-only pools, predictable latency), standard (shared "
    "pools, full cost model) or batch (shed first under overload). A request may ask for a lower "
    "class with the x-cachelane-class header, never a higher one.",
    "tenants[].share_group": "Tenants in the same group share prefix cache; otherwise each "
    "tenant's cache is its own. A name as tenants[].name.",
    "admin": "The admin API key (tenants can be added at run time through the admin API).",
    "admin.api_key_sha256": "SHA-256 hex digest of the admin key. Give this or api_key; neither: "
    "no admin API.",
    "admin.api_key": "The admin key itself, at least 32 characters (or api_key_file).",
    "auth": "How requests are authenticated and what signs the tenant records in Redis "
    "(docs/security.md).",
    "critical": "Where critical tenants go when a model has a pinned pool.",
    "critical.fallback": "spill: use the shared pools with the full cost model (CPU and remote "
    "hits count: HBM-only is the pinned pool's property, not the tenant's); reject: 503 with "
    "Retry-After. Either way it is counted (cachelane_critical_fallbacks_total).",
    "critical.retry_after_s": "Retry-After seconds on a rejected critical request.",
    "overload": "Load shedding.",
    "classes": "Flow control per tenant class (when flow_control.enabled): requests wait in the "
    "gateway, critical first, round robin between tenants, while every replica's estimated TTFT "
    "is over the class's budget.",
    "classes.critical": "Critical: never held by default; with placement pinned_first and a "
    "ttft_budget_ms, a critical request whose best pinned replica is estimated over it spills to "
    "the shared pools if one is faster.",
    "classes.standard": "Standard: held while every replica is estimated over 1 s to first token.",
    "classes.batch": "Batch: held sooner (500 ms) than standard, so standard goes first.",
    "flow_control": "Class-aware flow control in the gateway (gateway/serving/flow.py).",
    "overload.batch_max_queue_s": "A batch request is shed (503) when even its best replica has "
    "more than this many seconds of prefill queued.",
    "tracing": "OpenTelemetry tracing (the [otel] extra): one span per request with the routing "
    "decision and its outcome, exported over OTLP/HTTP (gateway/telemetry/tracing.py). Off by "
    "default.",
    "capture": "Opt-in traffic capture for `cachelane plan` (docs/planning.md): prefix "
    "structure and outcomes, written off the event loop, bounded; off by default.",
    "prewarm": "Warming hot prefixes onto replicas before they are needed (never on the request "
    "path; rate-limited).",
    "prewarm.enabled": "Send prewarms: a critical tenant's hot prefix onto pinned replicas that "
    "lack it, a hot prefix whose holders are saturated onto another replica.",
    "prewarm.hot_after": "Requests of a prefix family within the reuse window before it counts "
    "as hot.",
    "prewarm.max_per_s": "Prewarms one gateway sends per second at most.",
    "prewarm.budget_tokens_per_min": "Prompt tokens one gateway may prewarm per minute (1M: "
    "~0.55 s of prefill per second at 30k tokens/s, about half of one GPU's prefill time).",
    "prewarm.method": "completion: a prefill-only request (max_tokens=1), works with any engine; "
    "prefetch: the simulator's prefetch call.",
    "prewarm.queue_size": "Prewarms waiting to be sent; more are dropped.",
    "prewarm.timeout_s": "Seconds one prewarm may take.",
    "rate_limits": "Per-tenant requests and tokens per minute (429 rate_limit_exceeded with "
    "Retry-After), and failed authentications per client address (docs/security.md).",
    "body_fields": "Request body fields clients may not set (docs/security.md).",
    "exposure": "Who may read /metrics, /ready and the OpenAPI pages (docs/security.md).",
    "max_body_bytes": "Largest request body accepted (8 MiB: a 128k-token prompt is ~512 KiB of "
    "text; the rest is headroom for base64 images).",
    "max_json_depth": "Deepest nesting of arrays and objects accepted in a request body; deeper is "
    "a 400 (json_too_deep). Default 128, serde_json's recursion limit; at most 512.",
    "max_number_chars": "Longest number literal accepted in a request body; longer is a 400 "
    "(number_too_large), refused before it is converted. Default 1000, Jackson's "
    "StreamReadConstraints default maxNumberLength.",
    "remote_tiers": "Shared remote KV tiers (LMCache server, Mooncake store, ...) that pools can "
    "read from.",
    "remote_tiers[].name": "Name that pools[].remote_tier refers to.",
    "remote_tiers[].url": "Only for the simulator's remote tier service; real tiers are reached "
    "by the engines, not by the gateway.",
    "remote_tiers[].capacity_tokens": "Tokens of KV the tier holds (its memory / KV bytes per "
    "token); bounds the index's entries for it.",
    "pools": "Groups of replicas with the same hardware, model and tiers. At least one.",
    "pools[].name": "Pool name (metrics, logs, /ready). Unique.",
    "pools[].replicas": "Base URLs of the pool's replicas (http://host:port, no /v1). A URL may "
    "appear in one pool only. Give replicas or discovery (in Kubernetes: discovery, from a "
    "headless Service).",
    "pools[].pinned": "Preferred by critical tenants (critical.placement); standard and batch "
    "borrow it while critical demand leaves it headroom (lend_below).",
    "pools[].hbm_only": "The replicas run without CPU or remote offload: only HBM hits count.",
    "pools[].admission": "Per-replica admission cap of a pinned pool: above either limit, "
    "critical traffic takes critical.fallback. Unset: no cap.",
    "pools[].admission.max_in_flight": "Requests in flight per replica.",
    "pools[].admission.max_prefill_tokens": "Prompt tokens waiting to be prefilled per replica "
    "(a TTFT budget times the prefill rate).",
    "pools[].lend_below": "Fraction of the admission cap below which a pinned replica also takes "
    "standard and batch traffic (no cap: always), except while a critical request found the "
    "pinned pool without a free replica. Default 1.0; null: never lent.",
    "pools[].remote_write": "Which prompts the replicas write to the remote tier: `reuse` (only "
    "where expected reuse pays for the write, routing/admission.py), `always` or `never` "
    "(baselines).",
    "pools[].first_byte_timeout_s": "Seconds to wait for a streamed answer's first byte (its "
    "first token). Past it the request is cancelled on that replica and retried on the next "
    "(it was never answered), and the replica counts a failure toward "
    "health.eject_after_errors. 60: nginx's proxy_read_timeout default; a 128k-token prefill "
    "takes ~4 s. A non-streamed answer's first byte is its whole answer, so it stays under "
    "upstream.read_timeout_s.",
    "pools[].models": "Models the pool serves. Empty: read from each replica's /v1/models.",
    "pools[].hbm_capacity_tokens": "Tokens of KV one replica's HBM holds. Unset: read from the "
    "engine's `vllm:cache_config_info` metric (num_gpu_blocks x block_size), and until the first "
    "scrape Llama-3.1-8B BF16 on one H200 (routing/cost.py).",
    "pools[].cpu_capacity_tokens": "Tokens of KV in one replica's CPU offload tier (e.g. "
    "LMCache max_local_cpu_size / KV bytes per token). 0: no CPU tier.",
    "pools[].remote_tier": "Name of the remote tier (remote_tiers[].name) the replicas read and "
    "write. Unset: none.",
    "pools[].max_prompt_tokens": "Longest prompt the replicas accept; longer requests get 400 "
    "from the gateway. Unset: no check.",
    "pools[].costs": "The cost model's constants for this pool; defaults describe Llama-3.1-8B "
    "BF16 on one H200, sources in routing/cost.py. With routing.calibration: fit they only seed "
    "each replica's fitted costs.",
    "pools[].costs.fixed_s": "Per-request overhead outside the prefill, seconds (~3 ms on "
    "loopback, routing/cost.py).",
    "pools[].costs.kv_bytes_per_token": "KV bytes per token (8B BF16: 32 layers x 8 KV heads x "
    "128 dims x 2 (K,V) x 2 bytes = 128 KiB).",
    "pools[].costs.prefill_tokens_per_s": "Prefill rate of uncached tokens (~30k/s for 8B on "
    "one H200).",
    "pools[].costs.pcie_gbps": "CPU-to-GPU copy bandwidth, GB/s (PCIe Gen5 x16: ~50 measured).",
    "pools[].costs.remote_gbps": "Remote tier to GPU bandwidth, GB/s (400 Gb/s RDMA: ~24 "
    "effective).",
    "pools[].costs.remote_fixed_s": "Fixed cost of one remote fetch, seconds (lookup, "
    "connection, first byte: ~26 ms).",
    "pools[].sim": "Read only by `cachelane sim --config`: how the simulator behaves for this "
    "pool.",
    "pools[].sim.itl_s": "Simulated decode time per output token: how long a step of decodes "
    "alone lasts (a step with prompt chunks lasts what they cost, and its decodes wait for it). "
    "Unset: the simulator's default (10 ms, loadtest/sim/config.py).",
    "pools[].sim.time_factor": "Multiplies every simulated delay (0.1 runs 10x faster).",
    "pools[].sim.scheduling_policy": "`fcfs` or `priority` (vLLM's --scheduling-policy): with "
    "`priority` the prefill queue is ordered by the request's `priority` (lower first), then "
    "arrival. Unset: the pool's engine.scheduling_policy (`priority` with engine_priority).",
}


def _strip(annotation: Any) -> tuple[Any, list[Any]]:
    """Unwrap Annotated[...] into (type, constraint metadata)."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata.extend(extra)
    return annotation, metadata


def _constraints(metadata: list[Any]) -> list[str]:
    out: list[str] = []
    for m in metadata:
        if isinstance(m, FieldInfo):
            out += _constraints(list(m.metadata))
            continue
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(m, attr, None)
            if value is not None and isinstance(
                m, annotated_types.Gt | annotated_types.Ge | annotated_types.Lt | annotated_types.Le
            ):
                out.append(f"{sym} {value}")
        if isinstance(m, annotated_types.MinLen):
            out.append(f"length >= {m.min_length}")
        if isinstance(m, annotated_types.MaxLen):
            out.append(f"length <= {m.max_length}")
        pattern = getattr(m, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    return out


def _type_name(annotation: Any) -> str:
    annotation, metadata = _strip(annotation)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        text = text + " or null" if type(None) in args else text
    elif origin is list:
        text = f"list of {_type_name(args[0])}"
    elif origin is dict:  # keys first: a class name, a tenant name, a replica URL
        key, value = (_type_name(a) for a in args)
        key = "class" if isinstance(args[0], type) and issubclass(args[0], enum.Enum) else key
        text = f"map of {key} to {value}"
    elif origin is typing.Literal:
        text = " \\| ".join(f"`{a}`" for a in args)
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        text = " \\| ".join(f"`{m.value}`" for m in annotation)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        text = "section"
    elif isinstance(annotation, type):
        text = {"HttpUrl": "URL", "str": "string", "bool": "boolean"}.get(
            annotation.__name__, annotation.__name__
        )
    else:
        text = str(annotation)
    constraints = _constraints(metadata)
    return f"{text} ({', '.join(constraints)})" if constraints else text


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[]`" if not value else f"`{value}`"
    return f"`{value}`"


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (directly, optionally, or as list items), and whether in a list."""
    annotation, _ = _strip(annotation)
    origin = typing.get_origin(annotation)
    if origin is list:
        inner, _ = _strip(typing.get_args(annotation)[0])
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner, True
        return None, False
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model, in_list = _model_of(arg)
            if model is not None:
                return model, in_list
        return None, False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, meaning) for every key under `model`, depth first."""
    out: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}{key}"
        meaning = field.description or DESCRIPTIONS.get(path, UNDOCUMENTED)
        sub, in_list = _model_of(field.annotation)
        kind = _type_name(field.annotation)
        constraints = _constraints(list(field.metadata))
        if constraints:
            kind = f"{kind} ({', '.join(constraints)})"
        if sub is not None and in_list:
            kind = kind.replace("list of section", "list of items")
        out.append((path, kind, _default(field), meaning))
        if sub is not None:
            out += rows(sub, f"{path}[]." if in_list else f"{path}.")
    return out


def undocumented() -> list[str]:
    return [path for path, _, _, meaning in rows(GatewayConfig) if meaning == UNDOCUMENTED]


def render() -> str:
    lines = [
        "# cachelane configuration reference",
        "",
        "<!-- Generated by deploy/gen_config_reference.py from gateway/config/: do not edit. -->",
        "<!-- Regenerate: python deploy/gen_config_reference.py > deploy/CONFIG.md -->",
        "",
        "The gateway reads one YAML file: `cachelane serve --config FILE`. Every key is below, "
        "with its type, default and meaning. Unknown keys are errors naming their path and the "
        "key closest to them; a removed or renamed key names what replaced it "
        "(`gateway/config/upgrades.py`). Any string value may use `${VAR}` or "
        "`${VAR:-default}` from the environment, and each secret field (`api_key`, `secret`, "
        "`redis_url`) may be given as `<field>_file: PATH` instead (`gateway/config_env.py`); "
        "`CACHELANE_CONFIG` names the file when `--config` is not given. `[]` in a path means "
        "every item of a list, e.g. `pools[].replicas`. Examples that are loaded and validated "
        "by the "
        "tests: `deploy/examples/`, `deploy/compose/gateway-*.yaml`, "
        "`deploy/k8s/**/config.yaml`.",
        "",
        "Defaults describe Llama-3.1-8B in BF16 on one H200; each number's source is in the "
        "module named in its row (mostly `routing/cost.py`).",
        "",
    ]
    sections: list[tuple[str, list[tuple[str, str, str, str]]]] = []
    top: list[tuple[str, str, str, str]] = []
    for row in rows(GatewayConfig):
        head = row[0].split(".")[0].split("[")[0]
        is_section = _model_of(GatewayConfig.model_fields[_field_name(head)].annotation)[0]
        if is_section is None:
            top.append(row)
        elif sections and sections[-1][0] == head:
            sections[-1][1].append(row)
        else:
            sections.append((head, [row]))
    if top:
        sections.insert(0, ("top level", top))
    for title, section_rows in sections:
        lines += [f"## `{title}`" if title != "top level" else "## Top-level keys", ""]
        lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for path, kind, default, meaning in section_rows:
            cells = (f"`{path}`", kind, default, meaning.replace("|", "\\|"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _field_name(key: str) -> str:
    for name, field in GatewayConfig.model_fields.items():
        if (field.alias or name) == key:
            return name
    raise KeyError(key)


def main(argv: list[str]) -> int:
    text = render()
    missing = undocumented()
    if "--check" in argv:
        if missing:
            print(
                f"undocumented config keys (add them to DESCRIPTIONS): {missing}", file=sys.stderr
            )
            return 1
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(
                f"{OUTPUT} is out of date: python deploy/gen_config_reference.py > {OUTPUT}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    if missing:
        print(f"warning: undocumented config keys: {missing}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
