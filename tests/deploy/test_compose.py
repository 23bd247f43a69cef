"""deploy/compose: the compose file, its gateway configs, nginx, Prometheus and Grafana agree with
each other and with what the gateway and the simulator actually accept."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import build_parser as cli_parser
from gateway.config import GatewayConfig, load_config
from gateway.telemetry.metrics import Metrics
from loadtest.sim.fleet import build_parser as sim_parser
from tests.deploy.util import COMPOSE_DIR, DEPLOY, cli_answers, load_one, rel, yaml_files
from tests.helpers.examples import EXAMPLE_ENV

COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yaml"
GATEWAY_CONFIGS = sorted(COMPOSE_DIR.glob("gateway-*.yaml"))
EXAMPLES = sorted((DEPLOY / "examples").glob("*.yaml"))
CACHELANE_IMAGE = "cachelane:local"  # the Dockerfile's runtime target: `cachelane ...`
SIM_IMAGE = "cachelane-sim:local"  # its sim target: `cachelane sim ...`
ENTRYPOINTS = {CACHELANE_IMAGE: [], SIM_IMAGE: ["sim"]}  # after `cachelane`


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = load_one(COMPOSE_FILE)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    services: dict[str, Any] = compose["services"]
    return services


@pytest.mark.parametrize("path", yaml_files(DEPLOY), ids=rel)
def test_every_yaml_under_deploy_parses(path: Path) -> None:
    from tests.deploy.util import load_docs

    assert load_docs(path), f"{rel(path)} is empty"


def _gateway_env() -> dict[str, str]:
    """The environment compose gives the gateways (x-gateway's, its ${VAR:-default}s resolved as
    on a machine that sets none of them): what their configs' ${...} values read."""
    environment = load_one(COMPOSE_FILE)["x-gateway"]["environment"]
    defaults = {k: re.sub(r"\$\{[A-Z_]+:-(.*?)\}", r"\1", str(v)) for k, v in environment.items()}
    return {**os.environ, **defaults}


@pytest.mark.parametrize("path", GATEWAY_CONFIGS + EXAMPLES, ids=rel)
def test_gateway_configs_validate(path: Path) -> None:
    load_config(path, _gateway_env() | EXAMPLE_ENV)  # raises ConfigError naming the bad key


def test_redis_takes_a_password_keeps_its_state_and_only_the_gateways_reach_it(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    redis = services["redis"]
    command = [str(c) for c in redis["command"]]
    password = command[command.index("--requirepass") + 1]
    environment = load_one(COMPOSE_FILE)["x-gateway"]["environment"]
    assert password == environment["CACHELANE_REDIS_PASSWORD"]  # one variable for both
    password = _gateway_env()["CACHELANE_REDIS_PASSWORD"]
    assert command[command.index("--save") + 1] not in ("", '""')  # snapshots: tenants persist
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert compose["networks"]["redis"]["internal"] is True
    on_redis_net = {n for n, svc in services.items() if "redis" in svc.get("networks", [])}
    assert on_redis_net == {"redis", "gateway-a", "gateway-b"}
    for path in GATEWAY_CONFIGS:
        config = load_config(path, _gateway_env())
        assert f":{password}@redis:" in config.index.redis_url
        assert config.auth.secret == _gateway_env()["CACHELANE_AUTH_SECRET"]


def _command(service: dict[str, Any]) -> list[str]:
    """`cachelane`'s arguments: the image's entry point's, then the service's command."""
    serve = ["serve", "--config", "/etc/cachelane/config.yaml"]
    command = service.get(
        "command", ["--host", "0.0.0.0"] if service["image"] == SIM_IMAGE else serve
    )
    assert isinstance(command, list), "commands are lists: no shell splitting surprises"
    return ENTRYPOINTS[service["image"]] + [str(c) for c in command]


def _cachelane_services(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s.get("image") in ENTRYPOINTS}


def test_gateways_run_the_serve_only_image_and_sims_the_sim_image(
    services: dict[str, Any],
) -> None:
    for name, service in _cachelane_services(services).items():
        target = "sim" if _command(service)[0] == "sim" else "runtime"
        assert service["build"]["target"] == target, name
        assert service["image"] == (SIM_IMAGE if target == "sim" else CACHELANE_IMAGE), name


def test_cachelane_services_build_this_repository(services: dict[str, Any]) -> None:
    ours = _cachelane_services(services)
    assert {"gateway-a", "gateway-b", "sim-pinned", "sim-offload"} <= set(ours)
    for name, service in ours.items():
        build = service["build"]
        assert (COMPOSE_DIR / build["context"]).resolve() == DEPLOY.parent, name
        assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).is_file(), name


def test_cachelane_commands_parse(services: dict[str, Any]) -> None:
    """Every `cachelane ...` command in the compose file is accepted by the real CLI parsers."""
    for name, service in _cachelane_services(services).items():
        argv = _command(service)
        args = cli_parser().parse_args(argv)
        if argv[0] == "sim":  # the CLI hands every argument to the simulator's own parser
            assert args.argv == argv[1:]
            sim = sim_parser().parse_args(args.argv)
            assert sim.host == "0.0.0.0", f"{name}: must listen beyond the container's loopback"


def _gateway_config_for(service: dict[str, Any]) -> GatewayConfig:
    (volume,) = [v for v in service["volumes"] if v.endswith(":/etc/cachelane/config.yaml:ro")]
    source = volume.removesuffix(":/etc/cachelane/config.yaml:ro")
    default = re.fullmatch(r"\$\{CACHELANE_CONFIG:-(.+)\}", source)
    assert default, f"config volume {source!r}: expected ${{CACHELANE_CONFIG:-...}}"
    return load_config(COMPOSE_DIR / default.group(1), _gateway_env())


def _sim_replica_urls(services: dict[str, Any]) -> set[str]:
    urls = set()
    for name, service in _cachelane_services(services).items():
        argv = _command(service)
        if argv[0] != "sim":
            continue
        args = sim_parser().parse_args(argv[1:])
        urls |= {f"http://{name}:{args.port + i}/" for i in range(args.replicas)}
    return urls


def test_sim_config_names_exactly_the_simulated_replicas(services: dict[str, Any]) -> None:
    config = load_config(COMPOSE_DIR / "gateway-sim.yaml", _gateway_env())
    configured = {str(u) for p in config.pools for u in p.replicas}
    assert configured == _sim_replica_urls(services)
    assert _gateway_config_for(services["gateway-a"]) == config  # the default of both gateways


def test_sim_pools_match_the_simulators(services: dict[str, Any]) -> None:
    config = load_config(COMPOSE_DIR / "gateway-sim.yaml", _gateway_env())
    sims = {
        name: sim_parser().parse_args(_command(s)[1:])
        for name, s in _cachelane_services(services).items()
        if _command(s)[0] == "sim"
    }
    for pool in config.pools:
        hosts = {u.host for u in pool.replicas}
        assert len(hosts) == 1, pool.name
        sim = sims[str(hosts.pop())]
        assert pool.cpu_capacity_tokens == sim.cpu_capacity_tokens, pool.name
        assert config.routing.block_size_tokens == sim.block_size_tokens, pool.name
        # unset: the gateway reads it from the simulator's vllm:cache_config_info
        assert pool.hbm_capacity_tokens in (None, sim.hbm_capacity_tokens), pool.name
        if pool.hbm_only:
            assert sim.cpu_capacity_tokens == 0 and sim.remote_port is None, pool.name
        if pool.remote_tier:
            (tier,) = [t for t in config.remote_tiers if t.name == pool.remote_tier]
            assert tier.url is not None and tier.url.port == sim.remote_port, pool.name
            assert tier.capacity_tokens == sim.remote_capacity_tokens, pool.name


def test_vllm_config_names_the_vllm_services(services: dict[str, Any]) -> None:
    config = load_config(COMPOSE_DIR / "gateway-vllm.yaml", _gateway_env())
    for url in (u for p in config.pools for u in p.replicas):
        service = services[str(url.host)]
        assert "gpu" in service["profiles"]
        command = [str(c) for c in service["command"]]
        assert command[command.index("--port") + 1] == str(url.port)
        assert command[command.index("--block-size") + 1] == str(config.routing.block_size_tokens)
        for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
            assert flag in command, (url, flag)
        events = json.loads(command[command.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert events["endpoint"].startswith("tcp://*:"), "vLLM binds only with '*'"


def test_offload_pool_uses_lmcache(services: dict[str, Any]) -> None:
    service = services["vllm-offload"]
    command = [str(c) for c in service["command"]]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    config_path = service["environment"]["LMCACHE_CONFIG_FILE"]
    (mount,) = [v for v in service["volumes"] if v.split(":")[1] == config_path]
    lmcache = load_one(COMPOSE_DIR / mount.split(":")[0])
    assert lmcache["local_cpu"] is True
    host_port = lmcache["remote_url"].removeprefix("lm://")
    host, port = host_port.split(":")
    assert port in services[host]["entrypoint"]
    gib_tokens = lmcache["max_local_cpu_size"] * 2**30 // 131_072
    config = load_config(COMPOSE_DIR / "gateway-vllm.yaml", _gateway_env())
    (offload,) = [p for p in config.pools if p.name == "offload"]
    assert offload.cpu_capacity_tokens == gib_tokens


def test_gateways_listen_where_nginx_and_prometheus_look(services: dict[str, Any]) -> None:
    nginx = (COMPOSE_DIR / "nginx.conf").read_text()
    upstreams = set(re.findall(r"^\s*server\s+([\w-]+):(\d+)", nginx, re.MULTILINE))
    prometheus = load_one(COMPOSE_DIR / "prometheus.yml")
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "cachelane"]
    scraped = {tuple(t.split(":")) for sc in job["static_configs"] for t in sc["targets"]}
    for name in ("gateway-a", "gateway-b"):
        port = str(_gateway_config_for(services[name]).listen.port)
        assert (name, port) in upstreams
        assert (name, port) in scraped
        for path in GATEWAY_CONFIGS:
            assert str(load_config(path, _gateway_env()).listen.port) == port, path
            assert load_config(path, _gateway_env()).listen.host == "0.0.0.0", path
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    assert "EXPOSE 8000" in dockerfile and "127.0.0.1:8000/health" in dockerfile


def test_prometheus_scrapes_every_replica(services: dict[str, Any]) -> None:
    prometheus = load_one(COMPOSE_DIR / "prometheus.yml")
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    for path in GATEWAY_CONFIGS:
        for pool in load_config(path, _gateway_env()).pools:
            for url in pool.replicas:
                assert f"{url.host}:{url.port}" in targets, (path.name, str(url))
    for target in targets:
        assert target.split(":")[0] in services, target


def _exported_metric_names() -> set[str]:
    names = set()
    for family in Metrics().registry.collect():
        if family.type in ("counter",):
            names |= {f"{family.name}_total"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
        else:
            names.add(family.name)
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((COMPOSE_DIR / "grafana" / "dashboards" / "cachelane.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(cachelane_[a-z0-9_]+)", e)}
    missing = used - _exported_metric_names()
    assert not missing, (
        f"the dashboard queries metrics gateway/telemetry/metrics.py lacks: {missing}"
    )
    for required in (
        "cachelane_decisions_total",
        "cachelane_expected_cached_tokens_total",
        "cachelane_prompt_tokens_total",
        "cachelane_cached_tokens_total",
        "cachelane_ttft_seconds_bucket",
        "cachelane_output_tokens_total",
        "cachelane_time_per_output_token_seconds_bucket",
        "cachelane_e2e_seconds_bucket",
        "cachelane_replica_healthy",
        "cachelane_replica_in_flight",
        "cachelane_errors_total",
        "cachelane_index_errors_total",
        "cachelane_decision_seconds_bucket",
    ):
        assert required in used, required
    vllm_names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    )
    for vllm in vllm_names:
        assert any(vllm in e for e in exprs), vllm
    # the hit rate is the engines' observed one, not the router's expectation
    (hit_rate,) = [p for p in dashboard["panels"] if p["title"].startswith("Cache hit rate")]
    for target in hit_rate["targets"]:
        assert "cachelane_cached_tokens_total" in target["expr"]
        assert "cachelane_prompt_tokens_total" in target["expr"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_provisioning_points_at_the_dashboard(services: dict[str, Any]) -> None:
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = load_one(COMPOSE_DIR / "grafana/provisioning/dashboards/cachelane.yaml")
    path = provider["providers"][0]["options"]["path"]
    (host_dir,) = [h for h, c in mounts.items() if c == path]
    assert (COMPOSE_DIR / host_dir / "cachelane.json").is_file()
    datasource = load_one(COMPOSE_DIR / "grafana/provisioning/datasources/prometheus.yaml")
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_mounted_files_exist(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = re.sub(r"\$\{[A-Z_]+:-(.+?)\}", r"\1", volume).split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), (name, volume)


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and cli_answers(docker, "compose", "version"):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_config_renders() -> None:
    """`docker compose config` needs no Docker engine: it validates and renders the file."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` (plugin) nor `docker-compose` is installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    for profiles in ([], ["--profile", "gpu"]):
        done = subprocess.run(
            [*cli, "-f", str(COMPOSE_FILE), *profiles, "config"],
            capture_output=True,
            text=True,
            check=False,
            env=env,
            cwd=COMPOSE_DIR,
        )
        assert done.returncode == 0, done.stderr
        assert "gateway-a" in done.stdout and "sim-offload" in done.stdout
        if profiles:
            assert "vllm-offload" in done.stdout


def test_gateways_trust_forwarded_for_from_nginxs_network_only(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    """nginx sets X-Forwarded-For; the gateways believe it from the `edge` network alone, and
    only nginx and the gateways are on that network."""
    (subnet,) = [c["subnet"] for c in compose["networks"]["edge"]["ipam"]["config"]]
    on_edge = {name for name, s in services.items() if "edge" in s.get("networks", [])}
    on_edge |= {"gateway-a", "gateway-b"} if "edge" in compose["x-gateway"]["networks"] else set()
    assert on_edge == {"lb", "gateway-a", "gateway-b"}
    assert services["lb"]["networks"] == ["edge"]
    for path in GATEWAY_CONFIGS:
        assert load_config(path, _gateway_env()).listen.forwarded_allow_ips == [subnet], path


def test_engine_images_name_a_release() -> None:
    """No `latest` (or untagged) image: the default of every ${..._TAG} is a release."""
    text = COMPOSE_FILE.read_text()
    images = re.findall(r"^\s*image:\s*(\S+)", text, re.MULTILINE)
    assert images
    for image in images:
        tag = re.sub(r"\$\{[A-Z_]+:-(.*?)\}", r"\1", image).rpartition(":")[2]
        assert tag and tag != "latest" and "/" not in tag, image
