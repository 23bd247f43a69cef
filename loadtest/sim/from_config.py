"""`cachelane sim --config FILE`: simulate every loopback replica and remote tier a gateway config
names, with that config's pool capacities and cost constants (one file for both sides). The engine
model and vLLM's scheduler flags other than the scheduling policy are the command's own
(fleet.py: --engine-model, --max-num-batched-tokens, ...); unset, vLLM's defaults (steps.py). The
scheduling policy is pools[].sim.scheduling_policy, else the pool's engine.scheduling_policy (a
pool with engine_priority is simulated as engines run --scheduling-policy priority), unless
--scheduling-policy is given."""

from __future__ import annotations

import httpx

from gateway.config import GatewayConfig
from loadtest.sim.config import (
    ITL_S,
    MAX_MODEL_LEN_TOKENS,
    SIM_MODEL,
    RemoteTierSpec,
    SimReplicaSpec,
)
from routing.cost import HBM_CAPACITY_TOKENS

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _host_port(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    if u.port is None:
        raise ValueError(f"{url}: a simulated replica needs an explicit port")
    return u.host, u.port


def _zmq_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def specs_from_config(config: GatewayConfig) -> tuple[list[SimReplicaSpec], RemoteTierSpec | None]:
    remote: RemoteTierSpec | None = None
    remote_urls: dict[str, str] = {}
    for tier in config.remote_tiers:
        if tier.url is None:
            continue
        host, port = _host_port(str(tier.url))
        if host in LOCAL_HOSTS and remote is None:
            remote = RemoteTierSpec(
                name=tier.name,
                host=host,
                port=port,
                capacity_tokens=tier.capacity_tokens,
                block_size_tokens=config.routing.block_size_tokens,
            )
            remote_urls[tier.name] = remote.url
    replicas: list[SimReplicaSpec] = []
    for pool in config.pools:
        for raw in pool.replicas:
            host, port = _host_port(str(raw))
            if host not in LOCAL_HOSTS:
                continue
            events, tok = pool.kv_events, pool.tokenizer
            replay = events.replay_endpoint_for(str(raw)) if events else None
            replicas.append(
                SimReplicaSpec(
                    name=f"{pool.name}-{len(replicas)}",
                    host=host,
                    port=port,
                    model=pool.models[0] if pool.models else SIM_MODEL,
                    block_size_tokens=config.routing.block_size_tokens,
                    hbm_capacity_tokens=pool.hbm_capacity_tokens or HBM_CAPACITY_TOKENS,
                    cpu_capacity_tokens=pool.cpu_capacity_tokens,
                    remote_url=remote_urls.get(pool.remote_tier or ""),
                    costs=pool.costs.to_pool_costs(),
                    itl_s=pool.sim.itl_s if pool.sim.itl_s is not None else ITL_S,
                    time_factor=pool.sim.time_factor,
                    scheduling_policy=pool.sim.scheduling_policy or pool.engine.scheduling_policy,
                    max_model_len_tokens=pool.max_prompt_tokens or MAX_MODEL_LEN_TOKENS,
                    kv_events_port=_zmq_port(events.endpoint_for(str(raw))) if events else None,
                    kv_replay_port=_zmq_port(replay) if replay else None,
                    kv_topic=events.topic if events else "",
                    tokenizer_path=tok.path if tok else None,
                    chat_template=tok.chat_template if tok else None,
                    bos_token=tok.bos_token if tok else None,
                    eos_token=tok.eos_token if tok else None,
                    api_key=pool.api_key.get_secret_value() if pool.api_key else None,
                )
            )
    if not replicas:
        raise ValueError("the config names no replica on 127.0.0.1/localhost to simulate")
    return replicas, remote
