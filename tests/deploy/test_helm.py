"""deploy/helm/cachelane: the chart renders (tests/deploy/helm_render.py, a renderer of the Go
template subset the chart uses, since no helm binary installs here from apt, pip or npm, and the
Go module proxy that would build one cannot be reached from this machine; with
`helm` on the PATH its own `helm template` must agree), every object is well-formed, the gateway's
config validates as the pod reads it, and with default values the chart deploys what the
Kustomize base does (deploy/k8s/base): the same objects, specs, config and keys."""

from __future__ import annotations

import copy
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError
from tests.deploy import kustomize_check
from tests.deploy.helm_render import TemplateError, render, render_chart, render_notes
from tests.deploy.test_k8s import (
    GATEWAY,
    OPERATOR_VALUE,
    alert_rules,
    load_as_the_pod,
)
from tests.deploy.util import HELM_DIR, K8S_DIR, load_one

CHART = HELM_DIR / "cachelane"
BASE = K8S_DIR / "base"
NOT_IN_THE_CHART = {
    ("Namespace", "cachelane"),  # helm install --create-namespace
    ("ConfigMap", "cachelane-grafana-dashboard"),  # the dashboard ships with the Kustomize base
}


def _by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture(scope="module")
def chart() -> dict[tuple[str, str], dict[str, Any]]:
    return _by_key(render_chart(CHART))


def test_rendered_objects_are_well_formed(chart: dict[tuple[str, str], dict[str, Any]]) -> None:
    for (kind, name), obj in chart.items():
        assert obj["apiVersion"] and kind and name
        assert obj["metadata"]["namespace"] == "cachelane", (kind, name)


def _pod_files(chart: dict[tuple[str, str], dict[str, Any]], *, as_shipped: bool) -> Any:
    def files_of(volume: dict[str, Any]) -> dict[str, str]:
        if "configMap" in volume:
            return dict(chart[("ConfigMap", volume["configMap"]["name"])]["data"])
        data = chart[("Secret", volume["secret"]["secretName"])]["stringData"]
        return {
            k: v if as_shipped else v.replace("change-me", OPERATOR_VALUE) for k, v in data.items()
        }

    return files_of


def test_the_gateway_config_validates_as_the_pod_reads_it(
    chart: dict[tuple[str, str], dict[str, Any]],
) -> None:
    with tempfile.TemporaryDirectory() as root:
        config = load_as_the_pod(chart[GATEWAY], _pod_files(chart, as_shipped=False), Path(root))
    assert config.tenants and config.admin.api_key
    with tempfile.TemporaryDirectory() as root, pytest.raises(ConfigError, match="example value"):
        load_as_the_pod(chart[GATEWAY], _pod_files(chart, as_shipped=True), Path(root))


INSTANCE = "app.kubernetes.io/instance"  # the release's label, on every selector


def _without_release_marks(obj: Any) -> Any:
    """The object without what only a Helm release adds: the instance label and the
    CACHELANE_RELEASE variable (the base's config takes its default, the release "cachelane")."""
    if isinstance(obj, dict):
        return {k: _without_release_marks(v) for k, v in obj.items() if k != INSTANCE}
    if isinstance(obj, list):
        return [
            _without_release_marks(v)
            for v in obj
            if not (isinstance(v, dict) and v.get("name") == "CACHELANE_RELEASE")
        ]
    return obj


def _base() -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, list[Path]]]:
    tree = kustomize_check.check(BASE)
    return _by_key(tree.objects), tree.generators


def test_with_default_values_the_chart_is_the_kustomize_base(
    chart: dict[tuple[str, str], dict[str, Any]],
) -> None:
    objects, generators = _base()
    kustomization = load_one(BASE / "kustomization.yaml")
    expected = set(objects) - NOT_IN_THE_CHART
    generated = {("ConfigMap", "cachelane-config"), ("Secret", "cachelane-secrets")}
    assert set(chart) == expected | generated
    for key in expected:
        ours, theirs = (
            _without_release_marks(copy.deepcopy(chart[key])),
            copy.deepcopy(objects[key]),
        )
        if key == GATEWAY:
            template = ours["spec"]["template"]
            assert set(template["metadata"].pop("annotations")) == {
                "checksum/config",
                "checksum/secrets",
            }
            (image,) = [i for i in kustomization["images"] if i["name"] == "cachelane"]
            (container,) = template["spec"]["containers"]
            assert container["image"] == f"{image['newName']}:{image['newTag']}"
            container["image"] = "cachelane"
        assert ours.get("spec") == theirs.get("spec"), key
    (config_file,) = generators["cachelane-config"]
    config_text = chart[("ConfigMap", "cachelane-config")]["data"]["config.yaml"]
    assert yaml.safe_load(config_text) == yaml.safe_load(config_file.read_text())
    secrets = chart[("Secret", "cachelane-secrets")]["stringData"]
    assert secrets == {f.name: f.read_text().strip() for f in generators["cachelane-secrets"]}


def test_the_alerts_are_the_kustomize_bases(chart: dict[tuple[str, str], dict[str, Any]]) -> None:
    objects, _ = _base()
    key = ("PrometheusRule", "cachelane-gateway")
    assert alert_rules(chart[key]) == alert_rules(objects[key])
    summary = alert_rules(chart[key])["CachelaneNoHealthyReplica"]["annotations"]["summary"]
    assert "{{ $labels.pod }}" in summary  # Prometheus's template, not Helm's


def test_values_switch_the_optional_objects_and_set_the_image() -> None:
    off = {
        "autoscaling": {"enabled": False},
        "serviceMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "image": {"repository": "registry.example/cachelane", "tag": "9.9.9"},
    }
    objects = _by_key(render_chart(CHART, off))
    kinds = {kind for kind, _ in objects}
    assert not {"HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule"} & kinds
    (container,) = objects[GATEWAY]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/cachelane:9.9.9"


def test_a_config_change_rolls_the_pods() -> None:
    def checksum(overrides: dict[str, Any]) -> str:
        deployment = _by_key(render_chart(CHART, overrides))[GATEWAY]
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) != checksum({"config": {"routing": {"policy": "round_robin"}}})


@pytest.mark.parametrize(
    "template",
    ["{{ range .Values.x }}{{ end }}", "{{ if .Values.x }}", "{{ lower .Values.x }}", "{{ end }}"],
)
def test_the_renderer_refuses_what_it_does_not_know(template: str) -> None:
    with pytest.raises(TemplateError):
        render(template, {"Values": {"x": "y"}})


@pytest.mark.skipif(shutil.which("helm") is None, reason="no helm binary installed")
def test_helm_template_agrees() -> None:
    done = subprocess.run(
        ["helm", "template", "cachelane", str(CHART), "--namespace", "cachelane"],
        capture_output=True,
        text=True,
        check=True,
    )
    theirs = _by_key([d for d in yaml.safe_load_all(done.stdout) if d])
    assert theirs == _by_key(render_chart(CHART))


def _schema_validator() -> Any:
    import json

    import jsonschema_rs

    return jsonschema_rs.validator_for(json.loads((CHART / "values.schema.json").read_text()))


@pytest.mark.parametrize(
    "overrides",
    [
        {"replicaCount": 0},
        {"serviceMonitor": {"enabled": "yes"}},
        {"replicacount": 2},  # a typo: Helm refuses unknown values before rendering
        {"secrets": {"admin-key": "short"}},
        {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": 170}},
    ],
    ids=["no-replica", "not-a-boolean", "typo", "short-key", "over-100-percent"],
)
def test_the_values_schema_refuses_what_the_chart_cannot_deploy(overrides: dict[str, Any]) -> None:
    from tests.deploy.helm_render import load_chart

    validator = _schema_validator()
    assert validator.is_valid(load_chart(CHART)["Values"])
    assert not validator.is_valid(load_chart(CHART, overrides)["Values"])


def test_monitors_only_where_their_crds_are() -> None:
    from tests.deploy.helm_render import KUBERNETES_API_VERSIONS

    plain = _by_key(render_chart(CHART, api_versions=KUBERNETES_API_VERSIONS))
    assert not {"ServiceMonitor", "PrometheusRule"} & {kind for kind, _ in plain}
    assert ("Deployment", "cachelane-gateway") in plain
    notes = render_notes(CHART, api_versions=KUBERNETES_API_VERSIONS)
    assert "The ServiceMonitor and PrometheusRule were left out" in notes


def test_an_existing_secret_is_mounted_and_none_rendered() -> None:
    objects = _by_key(render_chart(CHART, {"existingSecret": "my-keys"}))
    assert "Secret" not in {kind for kind, _ in objects}
    volumes = objects[GATEWAY]["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in volumes}["secrets"]["secret"]["secretName"] == "my-keys"
    notes = render_notes(CHART, {"existingSecret": "my-keys"})
    assert "Secret my-keys" in notes and "WARNING" not in notes


def test_the_notes_say_how_to_reach_it_and_what_to_change() -> None:
    notes = render_notes(CHART)
    assert "kubectl -n cachelane port-forward svc/cachelane 8000:8000" in notes
    assert "WARNING: the keys are the chart's published examples" in notes
    assert "more than one gateway pod with the in-memory index" in notes
    redis = {"config": {"index": {"backend": "redis"}}}
    assert "in-memory index" not in render_notes(CHART, redis)
    one = {"autoscaling": {"enabled": False}, "replicaCount": 1}
    assert "in-memory index" not in render_notes(CHART, one)


def test_two_releases_in_one_namespace_share_no_name_and_no_pod() -> None:
    ours, theirs = render_chart(CHART), render_chart(CHART, release="second")
    assert not {o["metadata"]["name"] for o in ours} & {o["metadata"]["name"] for o in theirs}
    objects = _by_key(theirs)
    deployment = objects[("Deployment", "second-gateway")]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector[INSTANCE] == "second"
    assert objects[("Service", "second")]["spec"]["selector"] == selector
    assert objects[("PodDisruptionBudget", "second-gateway")]["spec"]["selector"][
        "matchLabels"
    ] == (selector)
    assert deployment["spec"]["template"]["metadata"]["labels"][INSTANCE] == "second"
    # the pod reads its own release's replicas, Secret and ConfigMap
    with tempfile.TemporaryDirectory() as root:
        config = load_as_the_pod(deployment, _pod_files(objects, as_shipped=False), Path(root))
    discovery = config.pools[0].discovery
    assert discovery is not None and discovery.name.startswith("second-replicas.")
    assert ("Service", "second-replicas") in objects
    assert "port-forward svc/second 8000:8000" in render_notes(CHART, release="second")
