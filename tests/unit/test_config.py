from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    config = load_config(path)
    assert config.pools


MINIMAL = {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]}


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({**MINIMAL, "routnig": {}}, "routnig"),
        ({**MINIMAL, "routing": {"policy": "fastest"}}, "routing.policy"),
        (
            {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"], "cost": {}}]},
            "pools.0.cost",
        ),
        ({"pools": [{"name": "p", "replicas": []}]}, "pools.0.replicas"),
        ({"pools": [{"name": "p", "replicas": ["x"], "remote_tier": "nope"}]}, "pools.0.replicas"),
        (
            {"pools": [{"name": "p", "replicas": ["http://a:1"], "remote_tier": "nope"}]},
            "pools.0.remote_tier",
        ),
        ({**MINIMAL, "index": {"backend": "etcd"}}, "index.backend"),
        ({"pools": []}, "pools"),
    ],
    ids=[
        "typo-top-level",
        "bad-policy",
        "typo-in-pool",
        "no-replicas",
        "bad-url",
        "unknown-remote-tier",
        "bad-backend",
        "no-pools",
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
