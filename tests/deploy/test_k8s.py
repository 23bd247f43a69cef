"""deploy/k8s: the kustomize base and overlays render (kubectl kustomize where installed, a Python
check everywhere), every object is well-formed, every embedded gateway config validates, and the
gateway's ports in the manifests are the port its config listens on."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser as cli_parser
from gateway.config import GatewayConfig, load_config, parse_config
from tests.deploy import kustomize_check
from tests.deploy.util import COMPOSE_DIR, K8S_DIR, load_docs, load_one, rel, yaml_files

TARGETS = [K8S_DIR / "base", *sorted(p for p in (K8S_DIR / "overlays").iterdir() if p.is_dir())]
GATEWAY = ("Deployment", "cachelane-gateway")


def _kustomize_cli() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl")
    if (
        kubectl
        and subprocess.run(
            [kubectl, "kustomize", "--help"], capture_output=True, check=False
        ).returncode
        == 0
    ):
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
    assert "cachelane-config" in tree.generators and "cachelane-tenants" in tree.generators


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


def _gateway_config(target: Path) -> GatewayConfig:
    """config.yaml merged with tenants.yaml, as the gateway's init container does."""
    tree = kustomize_check.check(target)
    config = load_one(tree.generators["cachelane-config"][-1])
    config.update(load_one(tree.generators["cachelane-tenants"][-1]) or {})
    return parse_config(config, f"{rel(target)} config")


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_gateway_config_validates(target: Path) -> None:
    _gateway_config(target)


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
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
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
    container = _gateway_container(deployment)
    args = cli_parser().parse_args(container["args"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert str(Path(args.config).parent) in mounts
    assert "env" not in container, "the gateway reads no environment variables"
    assert container["resources"]["requests"]


def test_replicas_config_names_stateful_set_pods() -> None:
    """vllm overlay: each replica URL is <statefulset>-<i>.<headless service>.<ns>.svc:<port> of a
    pod that exists, and the pool's size is the StatefulSet's replicas."""
    target = K8S_DIR / "overlays" / "vllm"
    objects = _objects(target)
    namespace = load_one(K8S_DIR / "base" / "kustomization.yaml")["namespace"]
    for pool in _gateway_config(target).pools:
        sets = set()
        for url in pool.replicas:
            pod, service, ns, svc = (url.host or "").split(".")
            assert (ns, svc) == (namespace, "svc"), str(url)
            statefulset, _, index = pod.rpartition("-")
            sts = objects[("StatefulSet", statefulset)]
            assert sts["spec"]["serviceName"] == service
            assert int(index) < sts["spec"]["replicas"]
            headless = objects[("Service", service)]
            assert headless["spec"]["clusterIP"] == "None"
            (container,) = sts["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            assert args[args.index("--port") + 1] == str(url.port)
            assert "--enable-prefix-caching" in args and "--kv-events-config" in args
            sets.add(statefulset)
        (statefulset,) = sets
        assert objects[("StatefulSet", statefulset)]["spec"]["replicas"] == len(pool.replicas)


def test_rendered_objects_are_well_formed(rendered: list[dict[str, Any]]) -> None:
    assert rendered
    for obj in rendered:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert obj.get("metadata", {}).get("name"), obj


def test_rendered_configs_validate(rendered: list[dict[str, Any]]) -> None:
    """The ConfigMap and Secret kustomize generates, merged as the init container merges them."""
    by_kind = {(o["kind"], o["metadata"]["name"].rsplit("-", 1)[0]): o for o in rendered}
    config = yaml.safe_load(by_kind[("ConfigMap", "cachelane-config")]["data"]["config.yaml"])
    secret = by_kind[("Secret", "cachelane-tenants")]["data"]["tenants.yaml"]
    config.update(yaml.safe_load(base64.b64decode(secret)) or {})
    parsed = parse_config(config)
    (deployment,) = [o for o in rendered if (o["kind"], o["metadata"]["name"]) == GATEWAY]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert (
        volumes["config-base"]["configMap"]["name"]
        == by_kind[("ConfigMap", "cachelane-config")]["metadata"]["name"]
    ), "the hashed name is referenced"
    container = _gateway_container(deployment)
    assert container["ports"][0]["containerPort"] == parsed.listen.port


@pytest.mark.parametrize("target", TARGETS, ids=rel)
def test_init_container_merge_gives_a_valid_config(target: Path, tmp_path: Path) -> None:
    """Run the init container's own script on this target's files, then load what it wrote."""
    pod = _objects(target)[GATEWAY]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["python", "-c"]
    script = init["command"][2]
    tree = kustomize_check.check(target)
    paths = {
        "/config/base/config.yaml": tree.generators["cachelane-config"][-1],
        "/config/tenants/tenants.yaml": tree.generators["cachelane-tenants"][-1],
        "/etc/cachelane/config.yaml": tmp_path / "config.yaml",
    }
    for inside, outside in paths.items():
        assert inside in script, inside
        script = script.replace(inside, str(outside))
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    assert {str(Path(p).parent) for p in paths} <= mounts
    exec(compile(script, "merge-config", "exec"), {})  # the image's python runs the same code
    merged = load_config(tmp_path / "config.yaml")
    assert merged.tenants, "tenants from the Secret reached the gateway's config"


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
