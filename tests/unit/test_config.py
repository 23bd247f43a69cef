from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, nameserver_address, parse_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
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
