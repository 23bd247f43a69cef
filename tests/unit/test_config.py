from pathlib import Path

import pytest

from gateway.config import (
    ConfigError,
    load_config,
    nameserver_address,
    parse_config,
    quick_config,
)
from tests.helpers.examples import EXAMPLE_ENV

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path, env=EXAMPLE_ENV)
    assert config.pools


MINIMAL = {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]}
DNS_A = {"name": "vllm.default.svc.cluster.local", "port": 8000}


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({**MINIMAL, "routnig": {}}, "routnig"),
        ({**MINIMAL, "routing": {"policy": "fastest"}}, "routing.policy"),
        (
            {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"], "cost": {}}]},
            "pools.0.cost",
        ),
        ({"pools": [{"name": "p", "replicas": []}]}, "pools.0: Value error, pool 'p': give"),
        (
            {"pools": [{"name": "p", "replicas": ["http://a:1"], "discovery": DNS_A}]},
            "give exactly one of replicas, discovery",
        ),
        (
            {"pools": [{"name": "p", "discovery": {"name": "v.ns"}}]},
            "type A needs the replicas' port",
        ),
        (
            {"pools": [{"name": "p", "discovery": {**DNS_A, "type": "SRV"}}]},
            "SRV takes each replica's port from its record",
        ),
        (
            {"pools": [{"name": "p", "discovery": {**DNS_A, "nameservers": ["dns.local"]}}]},
            "pools.0.discovery: Value error, nameserver 'dns.local'",
        ),
        (
            {"pools": [{"name": "p", "discovery": {**DNS_A, "nameservers": ["[::1]:99999"]}}]},
            "is not a port",
        ),
        ({"pools": [{"name": "p", "replicas": ["x"], "remote_tier": "nope"}]}, "pools.0.replicas"),
        (
            {"pools": [{"name": "p", "replicas": ["http://a:1"], "remote_tier": "nope"}]},
            "pools.0.remote_tier",
        ),
        ({**MINIMAL, "index": {"backend": "etcd"}}, "index.backend"),
        ({"pools": []}, "pools"),
        ({**MINIMAL, "classes": {"batch": {"ttft_slo_ms": 0}}}, "classes.batch.ttft_slo_ms"),
        ({**MINIMAL, "classes": {"batch": {"ttft_slo_ms": 1e9}}}, "classes.batch.ttft_slo_ms"),
        (
            {**MINIMAL, "critical": {"fallback": "reject", "placement": "cost"}},
            "placement: cost needs critical.fallback: spill",
        ),
    ],
    ids=[
        "typo-top-level",
        "bad-policy",
        "typo-in-pool",
        "no-replicas",
        "replicas-and-discovery",
        "discovery-a-without-port",
        "discovery-srv-with-port",
        "discovery-nameserver-not-an-ip",
        "discovery-nameserver-bad-port",
        "bad-url",
        "unknown-remote-tier",
        "bad-backend",
        "no-pools",
        "slo-zero",
        "slo-past-any-timeout",
        "cost-placement-with-reject",
    ],
)
def test_bad_config_names_the_key(data: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert names in str(err.value)


def test_unreadable_and_non_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("server", "address"),
    [
        ("10.96.0.10", ("10.96.0.10", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("[fd00::a]:53", ("fd00::a", 53)),
        ("[::1]", ("::1", 53)),
        ("fd00::a", ("fd00::a", 53)),
    ],
    ids=["ipv4", "ipv4-port", "ipv6-port", "ipv6-brackets", "ipv6-bare"],
)
def test_nameserver_addresses(server: str, address: tuple[str, int]) -> None:
    assert nameserver_address(server) == address


def test_discovered_pool_needs_no_replicas() -> None:
    config = parse_config({"pools": [{"name": "p", "discovery": {**DNS_A, "interval_s": 2}}]})
    (pool,) = config.pools
    assert pool.replicas == [] and pool.discovery is not None
    assert (pool.discovery.type, pool.discovery.port, pool.discovery.interval_s) == ("A", 8000, 2)


def test_a_discovered_precise_pool_takes_its_event_ports_by_offset(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")  # only its existence is checked here
    pool = {
        "name": "p",
        "models": ["m"],
        "discovery": DNS_A,
        "tokenizer": {"path": str(tokenizer)},
        "kv_events": {"endpoints": {"http://10.0.0.1:8000": "tcp://10.0.0.1:5557"}},
    }
    data = {"routing": {"mode": "precise"}, "pools": [pool]}
    with pytest.raises(ConfigError, match="use port_offset"):
        parse_config(data)
    pool["kv_events"] = {"port_offset": 1}
    assert parse_config(data).pools[0].kv_events is not None


REPLICA_KEY = "replica-secret-" + "9" * 30


def _pool(**extra: object) -> dict[str, object]:
    return {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"], **extra}]}


def test_a_pools_api_key_is_never_shown(tmp_path: Path) -> None:
    key_file = tmp_path / "replica-key"
    key_file.write_text(REPLICA_KEY + "\n")
    path = tmp_path / "c.yaml"
    path.write_text(
        f"pools:\n  - name: p\n    replicas: ['http://127.0.0.1:1']\n    api_key_file: {key_file}\n"
    )
    config = load_config(path)
    pool = config.pools[0]
    assert pool.api_key is not None and pool.api_key.get_secret_value() == REPLICA_KEY
    assert REPLICA_KEY not in repr(config) and REPLICA_KEY not in str(
        config.model_dump(mode="json")
    )
    with pytest.raises(ConfigError) as err:  # an error elsewhere in the pool never echoes it
        parse_config(_pool(api_key=REPLICA_KEY, first_byte_timeout_s=-1))
    assert REPLICA_KEY not in str(err.value)


@pytest.mark.parametrize(
    "name", ["authorization", "Cookie", "content-length", "x-cachelane-class", "connection", "a b"]
)
def test_forward_headers_refuse_credentials_the_gateways_own_and_hop_by_hop(name: str) -> None:
    with pytest.raises(ConfigError, match="forward_headers"):
        parse_config(_pool(forward_headers=[name]))


def test_forward_headers_are_lowercased() -> None:
    config = parse_config(_pool(forward_headers=["OpenAI-Organization", "x-user-id"]))
    assert config.pools[0].forward_headers == ["openai-organization", "x-user-id"]


@pytest.mark.parametrize(
    ("given", "uvicorn"),
    [([], ""), (["10.0.0.0/8", "::1"], "10.0.0.0/8,::1"), (["*"], "*")],
    ids=["none", "networks", "any"],
)
def test_forwarded_allow_ips_become_uvicorns(given: list[str], uvicorn: str) -> None:
    config = parse_config({**MINIMAL, "listen": {"forwarded_allow_ips": given}})
    assert config.listen.trusted_proxies == uvicorn


def test_forwarded_allow_ips_refuse_a_name() -> None:
    with pytest.raises(ConfigError, match="forwarded_allow_ips"):
        parse_config({**MINIMAL, "listen": {"forwarded_allow_ips": ["nginx"]}})


def test_a_published_example_replica_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"pools.0 \('p'\).api_key"):
        parse_config(_pool(api_key="change-me-vllm-api-key-000000000000000000"))


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (_pool(engine={"max_num_batched_token": 512}), "pools.0.engine.max_num_batched_token"),
        (_pool(engine={"max_num_batched_tokens": 0}), "pools.0.engine.max_num_batched_tokens"),
        (
            _pool(engine={"long_prefill_token_threshold": -1}),
            "pools.0.engine.long_prefill_token_threshold",
        ),
        (_pool(engine={"scheduling_policy": "lifo"}), "pools.0.engine.scheduling_policy"),
        (
            _pool(engine_priority=True, engine={"scheduling_policy": "fcfs"}),
            "engine.scheduling_policy is 'fcfs' but engine_priority",
        ),
        (_pool(costs={"prefill_chunk_tokens": 8192}), "pools.0.costs.prefill_chunk_tokens"),
    ],
    ids=["typo", "zero-budget", "negative-threshold", "policy", "priority-on-fcfs", "old-chunk"],
)
def test_bad_engine_keys_are_named(data: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert names in str(err.value)


def test_the_engine_flags_reach_the_cost_model() -> None:
    """vLLM's defaults unless given; engine_priority and the priority policy imply each other."""
    from gateway.fleet.registry import Registry
    from routing.cost import EngineSettings

    default = parse_config(_pool()).pools[0]
    assert default.engine.to_settings() == EngineSettings(8192, 0, "fcfs", 1024)
    assert parse_config(_pool(engine_priority=True)).pools[0].engine.scheduling_policy == (
        "priority"
    )
    # and engines declared to schedule by priority are sent it, unless the config says not to
    priority = {"scheduling_policy": "priority"}
    assert parse_config(_pool(engine=priority)).pools[0].engine_priority is True
    assert parse_config(_pool(engine=priority, engine_priority=False)).pools[0].engine_priority is (
        False
    )
    assert default.engine_priority is False
    engine = {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 64}
    config = parse_config(_pool(engine=engine, costs={"step_s": 0.02}))
    replica = next(iter(Registry(config).replicas.values()))
    assert replica.costs.engine == EngineSettings(256, 64, "fcfs", 1024)
    assert replica.costs.step_s == 0.02


@pytest.mark.parametrize(
    ("critical", "placement"),
    [
        ({}, "cost"),
        ({"fallback": "reject"}, "pinned_first"),
        ({"placement": "pinned_first"}, "pinned_first"),
    ],
    ids=["default-cost", "reject-pinned-first", "explicit"],
)
def test_critical_placement_defaults_to_cost_unless_the_pool_is_a_wall(
    critical: dict[str, str], placement: str
) -> None:
    assert parse_config({**MINIMAL, "critical": critical}).critical.placement == placement


def test_class_objectives_and_lending_defaults() -> None:
    config = parse_config({**MINIMAL, "classes": {"batch": {"ttft_slo_ms": 2000}}})
    assert config.classes.batch.ttft_slo_ms == 2000
    assert config.classes.critical.ttft_slo_ms is None
    assert config.pools[0].lend_below == 1.0  # a pinned pool is lent by default


def test_the_production_example_keeps_the_decision_for_admins_and_the_quick_start_shows_it() -> (
    None
):
    vllm = load_config(Path(EXAMPLES[0]).with_name("vllm.yaml")).exposure
    assert (vllm.decision_headers, vllm.estimate_headers) == ("admin", "admin")
    quick = quick_config(["http://127.0.0.1:1"], host="127.0.0.1", port=8000).exposure
    assert (quick.decision_headers, quick.estimate_headers) == ("all", "all")


def test_decision_headers_take_all_admin_or_none() -> None:
    with pytest.raises(ConfigError, match=r"exposure\.decision_headers"):
        parse_config(MINIMAL | {"exposure": {"decision_headers": "tenants"}})
