"""gateway/telemetry/metrics.py: cost terms exported in the gauge of their unit, and a share that is
absent until it is known."""

from __future__ import annotations

from gateway.telemetry.metrics import Metrics
from routing.learn import TERMS


def test_each_cost_term_goes_to_the_gauge_of_its_unit_and_leaves_with_its_replica() -> None:
    m = Metrics()
    for i, term in enumerate(TERMS):
        m.set_cost_fit("r1", term, float(i + 1))
    value = m.registry.get_sample_value
    assert value("cachelane_cost_fit_seconds", {"replica": "r1", "term": "fixed"}) == 1.0
    per_token = "cachelane_cost_fit_seconds_per_token"
    assert value(per_token, {"replica": "r1", "term": "prefill"}) == 2.0
    assert value(per_token, {"replica": "r1", "term": "swap"}) == 3.0
    assert value(per_token, {"replica": "r1", "term": "fetch"}) == 4.0
    m.forget_replica("r1", TERMS)
    assert value("cachelane_cost_fit_seconds", {"replica": "r1", "term": "fixed"}) is None
    assert value(per_token, {"replica": "r1", "term": "prefill"}) is None


def test_the_pinned_share_is_absent_until_set() -> None:
    m = Metrics()
    assert m.registry.get_sample_value("cachelane_pinned_share_ratio") is None
    m.pinned_share.set(0.0)
    assert m.registry.get_sample_value("cachelane_pinned_share_ratio") == 0.0


def test_the_dashboard_mapping_names_only_series_the_gateway_exports() -> None:
    """docs/metrics.md maps vLLM's dashboard panels to cachelane's series: each one it names
    exists (a histogram's or a counter's family name, or a sample name)."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    named = set(re.findall(r"\bcachelane_[a-z0-9_]+", doc))
    families = {f.name for f in Metrics().registry.collect()}
    samples = families | {f"{name}_total" for name in families}
    assert named and named <= samples, sorted(named - samples)
