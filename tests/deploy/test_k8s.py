"""deploy/k8s: the kustomize base and overlays render (kubectl kustomize where installed, a Python
check everywhere), every object is well-formed, the gateway's config validates as the pod reads it
(the ConfigMap and the Secret where the Deployment mounts them, `${VAR}` from the container's
environment, `*_file` from the Secret), the gateway's ports in the manifests are the port its
config listens on, and each discovered pool names a headless Service of ready pods."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli.main import build_parser as cli_parser
from gateway.config import ConfigError, GatewayConfig, load_config
from tests.deploy import kustomize_check
from tests.deploy.util import (
    COMPOSE_DIR,
    K8S_DIR,
    cli_answers,
    load_docs,
    load_one,
    rel,
    yaml_files,
)

pytestmark = pytest.mark.slow  # `make check` leaves it out: renders the manifests with kubectl

TARGETS = [K8S_DIR / "base", *sorted(p for p in (K8S_DIR / "overlays").iterdir() if p.is_dir())]
GATEWAY = ("Deployment", "cachelane-gateway")
CONFIG, SECRETS = "cachelane-config", "cachelane-secrets"
NAMESPACE = load_one(K8S_DIR / "base" / "kustomization.yaml")["namespace"]


def _kustomize_cli() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl")
    if kubectl and cli_answers(kubectl, "kustomize", "--help"):
        return [kubectl, "kustomize"]
    return None


@pytest.fixture(scope="module", params=TARGETS, ids=lambda p: rel(p))
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    cli = _kustomize_cli()
    if cli is None:
        pytest.skip("no kustomize or kubectl: test_python_kustomize_check covers the structure")
    done = subprocess.run([*cli, str(request.param)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


@pytest.mark.parametrize("path", yaml_files(K8S_DIR), ids=rel)
def test_every_manifest_parses(path: Path) -> None:
    assert load_docs(path)


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_python_kustomize_check(target: Path) -> None:
    tree = kustomize_check.check(target)
    assert not tree.errors, "\n".join(tree.errors)
    kinds = {o["kind"] for o in tree.objects}
    assert {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    } <= kinds
    assert CONFIG in tree.generators and SECRETS in tree.generators


def test_python_kustomize_check_catches_a_bad_overlay(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(K8S_DIR / "base"), "missing.yaml"],
                "configMapGenerator": [
                    {"name": "nope", "behavior": "replace", "files": ["c.yaml"]}
                ],
                "patches": [{"path": "p.yaml"}],
            }
        )
    )
    (overlay / "p.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n")
    errors = "\n".join(kustomize_check.check(overlay).errors)
    assert "missing.yaml" in errors and "nope" in errors and "'x'" in errors


Files = Callable[[dict[str, Any]], Mapping[str, str]]  # a volume -> its files' contents by name


def load_as_the_pod(deployment: dict[str, Any], files_of: Files, root: Path) -> GatewayConfig:
    """The gateway's config as its pod reads it: each ConfigMap and Secret volume's files laid out
    under `root` where the container mounts them, the config file's absolute paths taken there,
    `${VAR}` from the container's env (the namespace from the downward API), `*_file` read from
    those files. A variable the pod lacks or a secret file it does not mount fails to load."""
    pod = deployment["spec"]["template"]["spec"]
    container = _gateway_container(deployment)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {
        m["mountPath"]: volumes[m["name"]]
        for m in container["volumeMounts"]
        if {"configMap", "secret"} & volumes[m["name"]].keys()
    }
    for mount_path, volume in mounts.items():
        where = root / mount_path.lstrip("/")
        where.mkdir(parents=True, exist_ok=True)
        for name, text in files_of(volume).items():
            (where / name).write_text(text)
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", var
            env[var["name"]] = NAMESPACE
    args = cli_parser().parse_args(container["args"])
    path = args.config or env["CACHELANE_CONFIG"]
    text = (root / path.lstrip("/")).read_text()
    inside = re.compile("|".join(re.escape(f"{m}/") for m in mounts))
    text = inside.sub(lambda match: f"{root}{match.group(0)}", text)
    (root / "seen-by-the-gateway.yaml").write_text(text)
    return load_config(root / "seen-by-the-gateway.yaml", env=env)


OPERATOR_VALUE = "0f3a9c2b7"  # what a deployer writes over `change-me` (same length)


def _generated_files(target: Path, *, as_shipped: bool = False) -> Files:
    """The files of each volume; the Secrets' `change-me` values replaced as a deployer must
    (the gateway refuses to start with them), unless `as_shipped`."""
    generators = kustomize_check.check(target).generators

    def files_of(volume: dict[str, Any]) -> dict[str, str]:
        name = (
            volume["configMap"]["name"] if "configMap" in volume else volume["secret"]["secretName"]
        )
        return {
            f.name: f.read_text()
            if as_shipped
            else f.read_text().replace("change-me", OPERATOR_VALUE)
            for f in generators[name]
        }

    return files_of


def _gateway_config(target: Path, *, as_shipped: bool = False) -> GatewayConfig:
    with tempfile.TemporaryDirectory() as root:
        files = _generated_files(target, as_shipped=as_shipped)
        return load_as_the_pod(_objects(target)[GATEWAY], files, Path(root))


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_gateway_config_validates(target: Path) -> None:
    _gateway_config(target)


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_the_shipped_example_secrets_are_refused(target: Path) -> None:
    with pytest.raises(ConfigError, match="example value published in this repository"):
        _gateway_config(target, as_shipped=True)


def _objects(target: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize_check.check(target).objects}


def _resolve(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int):
        return port
    (match,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(match)


def _gateway_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if c["name"] == "gateway"]
    return container


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_ports_match_the_configs_listen_port(target: Path) -> None:
    port = _gateway_config(target).listen.port
    objects = _objects(target)
    container = _gateway_container(objects[GATEWAY])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert _resolve(container[probe]["httpGet"]["port"], container) == port, probe
    # ready while the process serves, even if only JSON 503s (deploy/README.md: readiness;
    # tests/integration/test_readiness.py); /ready's 503 would empty the Service in an outage
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    (service_port,) = objects[("Service", "cachelane")]["spec"]["ports"]
    assert _resolve(service_port["targetPort"], container) == port
    monitor = objects[("ServiceMonitor", "cachelane-gateway")]["spec"]["endpoints"][0]
    assert monitor["port"] == service_port["name"] and monitor["path"] == "/metrics"


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_gateway_pod_is_non_root_and_reads_its_config_file(target: Path) -> None:
    deployment = _objects(target)[GATEWAY]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert "initContainers" not in pod, "the gateway reads the mounted files themselves"
    container = _gateway_container(deployment)
    args = cli_parser().parse_args(container["args"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    config_path = Path(args.config or env["CACHELANE_CONFIG"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[str(config_path.parent)]]["configMap"]["name"] == CONFIG
    assert container["resources"]["requests"]


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_each_pool_discovers_the_ready_pods_of_a_headless_service(target: Path) -> None:
    """Every pool is found in DNS: an A name (<service>.<namespace>.svc.cluster.local, the pods
    on discovery.port) or an SRV name (_<port name>._tcp.<service>...), of a headless Service in
    the gateway's namespace that lists only ready pods; in the vllm overlay the Service selects a
    StatefulSet's pods, whose vLLM listens on that port."""
    objects = _objects(target)
    for pool in _gateway_config(target).pools:
        d = pool.discovery
        assert d is not None and not pool.replicas, pool.name
        labels = d.name.split(".")
        port_name = None
        if d.type == "SRV":
            port_name, proto, *labels = labels
            assert proto == "_tcp" and port_name.startswith("_"), d.name
            port_name = port_name[1:]
        service_name, namespace, *domain = labels
        assert (namespace, domain) == (NAMESPACE, ["svc", "cluster", "local"]), d.name
        service = objects[("Service", service_name)]["spec"]
        assert service["clusterIP"] == "None", "headless: one record per pod"
        assert service.get("publishNotReadyAddresses") is False, "ready pods only"
        (port,) = [p for p in service["ports"] if p["name"] == port_name or p["port"] == d.port]
        engines = [
            o
            for (kind, _), o in objects.items()
            if kind == "StatefulSet"
            and service["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        for sts in engines:  # the vllm overlay's: the container listens where DNS points
            (container,) = sts["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            assert args[args.index("--port") + 1] == str(port.get("targetPort", port["port"]))
            assert "--enable-prefix-caching" in args and "--kv-events-config" in args
        if target.name == "vllm":
            assert engines, f"pool {pool.name}: its Service selects no StatefulSet"


def test_rendered_objects_are_well_formed(rendered: list[dict[str, Any]]) -> None:
    assert rendered
    for obj in rendered:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert obj.get("metadata", {}).get("name"), obj


def test_rendered_configs_validate(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    """The ConfigMap and Secret kustomize generates (hashed names), read as the pod reads them."""
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in rendered}

    def files_of(volume: dict[str, Any]) -> dict[str, str]:
        if "configMap" in volume:
            return dict(by_name[("ConfigMap", volume["configMap"]["name"])]["data"])
        secret = by_name[("Secret", volume["secret"]["secretName"])]["data"]
        return {
            k: base64.b64decode(v).decode().replace("change-me", OPERATOR_VALUE)
            for k, v in secret.items()
        }

    (deployment,) = [o for o in rendered if (o["kind"], o["metadata"]["name"]) == GATEWAY]
    parsed = load_as_the_pod(deployment, files_of, tmp_path)
    assert parsed.tenants, "the keys in the Secret reached the gateway's config"
    container = _gateway_container(deployment)
    assert container["ports"][0]["containerPort"] == parsed.listen.port


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_the_pod_reads_its_keys_from_the_secret(target: Path, tmp_path: Path) -> None:
    """Every key of the config comes from a file of the Secret (none is written in the
    ConfigMap), and each one the Secret holds is used."""
    config = _gateway_config(target)
    assert config.tenants and config.admin.api_key
    text = load_one(kustomize_check.check(target).generators[CONFIG][-1])
    keys = [t.get("api_key_file") for t in text["tenants"]] + [text["admin"].get("api_key_file")]
    keys += [p.get("api_key_file") for p in text["pools"]]  # the replicas' key (overlays/vllm)
    secret_files = {f.name for f in kustomize_check.check(target).generators[SECRETS]}
    referenced = {Path(k).name for k in keys if k}
    referenced |= {Path(text["auth"]["secret_file"]).name} if "auth" in text else set()
    url_file = text["index"].get("redis_url_file")
    referenced |= {Path(url_file).name} if url_file else set()
    assert referenced == secret_files
    assert all("api_key" not in t for t in text["tenants"]), "no key in the ConfigMap"
    if config.index.backend == "redis":
        assert config.auth.secret, "tenant records in Redis are signed"


REDIS_TARGETS = [t for t in TARGETS if _gateway_config(t).index.backend == "redis"]


@pytest.mark.parametrize("target", REDIS_TARGETS, ids=rel)
def test_redis_needs_the_password_keeps_its_state_and_admits_only_the_gateways(
    target: Path,
) -> None:
    """The Redis pods require the password of the Secret cachelane-redis, the gateways' URL
    (a file of their Secret, never the ConfigMap) carries that same password, the pods snapshot
    to a persistent volume, and a NetworkPolicy admits the gateway pods to the client port."""
    config = _gateway_config(target)
    generators = kustomize_check.check(target).generators
    (password_file,) = generators["cachelane-redis"]
    password = password_file.read_text().strip().replace("change-me", OPERATOR_VALUE)
    assert f":{password}@" in config.index.redis_url
    assert "redis_url" not in load_one(generators[CONFIG][-1])["index"]
    objects = kustomize_check.check(target).objects
    pods = [
        o
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "index"
    ]
    assert pods
    for pod in pods:
        (redis,) = pod["spec"]["template"]["spec"]["containers"]
        args = [str(a) for a in redis["args"]]
        assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"] if "valueFrom" in e
               and "secretKeyRef" in e["valueFrom"]}  # fmt: skip
        assert env["REDIS_PASSWORD"] == {"name": "cachelane-redis", "key": password_file.name}
        assert args[args.index("--save") + 1] not in ("", '""'), "tenants and fits persist"
        volumes = pod["spec"]["template"]["spec"].get("volumes", [])
        claims = pod["spec"].get("volumeClaimTemplates") or [
            v for v in volumes if "persistentVolumeClaim" in v
        ]
        assert claims, f"{pod['metadata']['name']}: /data on a persistent volume"
        labels = pod["spec"]["template"]["metadata"]["labels"]
        (policy,) = [
            o
            for o in objects
            if o["kind"] == "NetworkPolicy"
            and o["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        ]
        admitted = [
            (peer["podSelector"]["matchLabels"], {p["port"] for p in rule["ports"]})
            for rule in policy["spec"]["ingress"]
            for peer in rule["from"]
        ]
        gateway = {"app.kubernetes.io/name": "cachelane", "app.kubernetes.io/component": "gateway"}
        assert (gateway, {6379}) in admitted
        for peer, _ports in admitted:  # nobody else but Redis's own pods
            assert (
                peer == gateway
                or peer["app.kubernetes.io/name"] == labels["app.kubernetes.io/name"]
            ), peer


DASHBOARD = "cachelane-grafana-dashboard"


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_the_grafana_dashboard_ships_as_a_config_map(target: Path) -> None:
    """The compose dashboard, unchanged, in a ConfigMap Grafana's sidecar picks up."""
    compose = (COMPOSE_DIR / "grafana" / "dashboards" / "cachelane.json").read_text()
    (source,) = kustomize_check.check(target).generators[DASHBOARD]
    assert source.read_text() == compose, f"copy {rel(source)} from the compose dashboard"
    (gen,) = [
        g
        for g in load_one(K8S_DIR / "base" / "kustomization.yaml")["configMapGenerator"]
        if g["name"] == DASHBOARD
    ]
    assert gen["options"]["labels"] == {"grafana_dashboard": "1"}


def test_rendered_dashboard_config_map(rendered: list[dict[str, Any]]) -> None:
    (cm,) = [o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == DASHBOARD]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["cachelane.json"])
    compose = COMPOSE_DIR / "grafana" / "dashboards" / "cachelane.json"
    assert dashboard == json.loads(compose.read_text())


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_the_gateway_trusts_forwarded_for_from_the_pod_network_only(target: Path) -> None:
    trusted = _gateway_config(target).listen.forwarded_allow_ips
    assert trusted and "*" not in trusted  # the ingress's pods, never any peer


def test_no_engine_image_floats() -> None:
    """Every image under deploy/k8s names a release tag, never `latest` (or none at all): in
    the manifest, or in the base kustomization's `images` (the gateway's own)."""
    tagged = {
        i["name"]: i["newTag"]
        for i in load_one(K8S_DIR / "base" / "kustomization.yaml")["images"]
        if i.get("newTag")
    }
    for path in yaml_files(K8S_DIR):
        for doc in load_docs(path):
            for image in _images(doc):
                if image in tagged:
                    image = f"{image}:{tagged[image]}"
                name, _, tag = image.rpartition(":")
                assert name and tag and tag != "latest", f"{rel(path)}: {image}"


def _images(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == "image" and isinstance(v, str)]
        return found + [i for v in node.values() for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


ALERTS = {
    "CachelaneNoHealthyReplica",
    "CachelaneIndexDegraded",
    "CachelaneEstimateErrorDrifting",
    "CachelanePinnedPoolUndersized",
    "CachelaneShedding",
}


def alert_rules(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_the_alerts_cover_the_documented_failures_with_exported_metrics() -> None:
    from tests.deploy.test_compose import _exported_metric_names

    (rule,) = [o for o in _objects(K8S_DIR / "base").values() if o["kind"] == "PrometheusRule"]
    rules = alert_rules(rule)
    assert set(rules) == ALERTS
    exported = _exported_metric_names()
    for name, r in rules.items():
        used = set(re.findall(r"\b(cachelane_[a-z0-9_]+)", r["expr"]))
        assert used and used <= exported, (name, used - exported)
        assert r["expr"].count("(") == r["expr"].count(")"), name
        assert r["for"] and r["labels"]["severity"] in ("critical", "warning"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name


def test_the_vllm_replicas_require_the_key_the_gateway_sends() -> None:
    """overlays/vllm: each engine takes --api-key from the Secret vllm-api-key, made of the file
    the gateway's pools read as api_key_file (from cachelane-secrets)."""
    target = K8S_DIR / "overlays" / "vllm"
    config = _gateway_config(target)
    generators = kustomize_check.check(target).generators
    (engine_file,) = generators["vllm-api-key"]
    assert engine_file in generators[SECRETS]
    expected = engine_file.read_text().strip().replace("change-me", OPERATOR_VALUE)
    for pool in config.pools:
        assert pool.api_key is not None and pool.api_key.get_secret_value() == expected
    engines = [o for o in _objects(target).values() if o["kind"] == "StatefulSet"]
    engines = [e for e in engines if e["metadata"]["name"].startswith("vllm-")]
    assert len(engines) == 2
    for engine in engines:
        (container,) = engine["spec"]["template"]["spec"]["containers"]
        args = [str(a) for a in container["args"]]
        assert args[args.index("--api-key") + 1] == "$(VLLM_API_KEY)"
        (env,) = [e for e in container["env"] if e["name"] == "VLLM_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "vllm-api-key", "key": "api-key"}
