"""gateway/accounting/findings.py: merging gateways' windows, and each rule at its threshold."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.accounting import findings as f
from gateway.cli.report import as_json, parse_window
from routing.accounting import FIELDS

GIB = 2**30


def window(rows: list[tuple[str, str, str, dict[str, float]]], **extra: Any) -> dict[str, Any]:
    return {
        "window_s": 900.0,
        "rows": [
            {"tenant": t, "tenant_class": k, "pool": p, "sums": {**dict.fromkeys(FIELDS, 0.0), **s}}
            for t, k, p, s in rows
        ],
        "pools": extra.get("pools", []),
        "remote_tiers": extra.get("remote_tiers", []),
    }


def rules(merged: dict[str, Any]) -> dict[str, str]:
    return {x.rule: x.text for x in f.findings(merged)}


def test_merge_adds_rows_and_evictions_keeps_capacity() -> None:
    pool = {"pool": "p", "hbm_capacity_blocks": 100, "hbm_evicted_blocks": 30.0}
    tier = {
        "name": "kv",
        "resident_unread_bytes": [
            {"tenant": "bulk", "tenant_class": "batch", "pool": "p", "bytes": 5.0}
        ],
    }
    a = window([("web", "standard", "p", {"requests": 2})], pools=[pool], remote_tiers=[tier])
    b = window([("web", "standard", "p", {"requests": 3})], pools=[pool], remote_tiers=[tier])
    merged = f.merge([a, b])
    assert merged["rows"][("web", "standard", "p")]["requests"] == 5
    assert merged["pools"]["p"]["hbm_evicted_blocks"] == 60
    assert merged["pools"]["p"]["hbm_capacity_blocks"] == 100
    assert merged["remote_tiers"]["kv"]["resident_unread_bytes"][("bulk", "batch", "p")] == 10
    out = as_json(merged, f.findings(merged))  # JSON-ready: string keys only
    assert out["rows"][0]["tenant"] == "web" and out["findings"][-1]["rule"] == "avoided"


@pytest.mark.parametrize(
    ("never_read_gib", "fires"), [(2.9, False), (3.0, True)], ids=["29%", "30%"]
)
def test_remote_waste_at_its_threshold(never_read_gib: float, fires: bool) -> None:
    bulk = {"remote_written_bytes": 6 * GIB, "remote_never_read_bytes": never_read_gib * GIB}
    web = {"remote_written_bytes": 4 * GIB, "remote_tokens": 10.0, "prompt_tokens": 20.0}
    merged = f.merge([window([("bulk", "batch", "p", bulk), ("web", "standard", "p", web)])])
    got = rules(merged)
    assert ("remote_waste" in got) is fires
    if fires:
        assert "30% of the bytes written in 15 min" in got["remote_waste"]
        assert "tenant bulk's prompts are 100% of them" in got["remote_waste"]


def test_remote_waste_ignores_small_volumes() -> None:
    tiny = {"remote_written_bytes": 1e6, "remote_never_read_bytes": 1e6}
    assert "remote_waste" not in rules(f.merge([window([("bulk", "batch", "p", tiny)])]))


def timed(ttft_s: float, **layers: float) -> dict[str, float]:
    return {"requests": 10, "timed_requests": 10, "observed_ttft_s": ttft_s, **layers}


@pytest.mark.parametrize(
    ("sums", "rule", "fires"),
    [
        (timed(1.0, swap_s=0.15, swap_ins=4, shared_swap_ins=2, swap_link_sharers=6), "pcie", 1),
        (timed(1.0, swap_s=0.14, swap_ins=4), "pcie", 0),
        (timed(1.0, queue_s=0.5), "queue", 1),
        (timed(1.0, queue_s=0.49), "queue", 0),
        ({**timed(1.0, queue_s=0.9), "requests": 4}, "queue", 0),  # too few requests
    ],
    ids=["pcie-15%", "pcie-14%", "queue-50%", "queue-49%", "queue-few"],
)
def test_class_rules_at_their_thresholds(sums: dict[str, float], rule: str, fires: int) -> None:
    got = rules(f.merge([window([("web", "standard", "p", sums)])]))
    assert (rule in got) is bool(fires)


def test_pcie_finding_says_how_the_link_was_shared() -> None:
    sums = timed(1.0, swap_s=0.3, swap_ins=4, shared_swap_ins=2, swap_link_sharers=6)
    text = rules(f.merge([window([("web", "standard", "p", sums)])]))["pcie"]
    assert "30% of its TTFT" in text and "50% of its 4 swap-ins" in text and "1.5 at once" in text


def test_pcie_finding_without_sharing_blames_the_link() -> None:
    sums = timed(1.0, swap_s=0.3, swap_ins=4, swap_link_sharers=4)
    text = rules(f.merge([window([("web", "standard", "p", sums)])]))["pcie"]
    assert "none of its 4 swap-ins shared the link: the link itself is slow" in text


def test_critical_load_only_for_the_critical_class() -> None:
    sums = timed(1.0, swap_s=0.06, fetch_s=0.05)
    assert "critical_load" in rules(f.merge([window([("voice", "critical", "p", sums)])]))
    assert "critical_load" not in rules(f.merge([window([("web", "standard", "p", sums)])]))


def test_fetch_pays() -> None:
    slow = {"fetch_s": 2.0, "avoided_remote_s": 1.0}
    fast = {"fetch_s": 1.0, "avoided_remote_s": 2.0}
    assert "fetch_pays" in rules(f.merge([window([("web", "standard", "p", slow)])]))
    assert "fetch_pays" not in rules(f.merge([window([("web", "standard", "p", fast)])]))


@pytest.mark.parametrize(("evicted", "fires"), [(99.0, False), (100.0, True)])
def test_hbm_churn_names_who_inserts(evicted: float, fires: bool) -> None:
    pool = {"pool": "p", "hbm_capacity_blocks": 100, "hbm_evicted_blocks": evicted}
    rows = [
        ("bulk", "batch", "p", {"hbm_inserted_blocks": 80.0}),
        ("web", "standard", "p", {"hbm_inserted_blocks": 20.0}),
    ]
    got = rules(f.merge([window(rows, pools=[pool])]))
    assert ("hbm_churn" in got) is fires
    if fires:
        assert "turned over 1.0x" in got["hbm_churn"] and "tenant bulk's" in got["hbm_churn"]
        assert "80% of the blocks" in got["hbm_churn"]


def test_avoided_is_always_said() -> None:
    sums = {"avoided_hbm_s": 1.0, "avoided_cpu_s": 0.5, "avoided_remote_s": 0.25, "swap_s": 0.1}
    text = rules(f.merge([window([("web", "standard", "p", sums)])]))["avoided"]
    assert "avoided 1.75 GPU-s" in text and "took 0.10 s" in text


@pytest.mark.parametrize(
    ("text", "seconds"), [("60s", 60), ("15m", 900), ("1h", 3600), ("90", 90), ("2min", 120)]
)
def test_parse_window(text: str, seconds: float) -> None:
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["2h", "0", "soon", "-5m"])
def test_parse_window_rejects(text: str) -> None:
    with pytest.raises(Exception, match="window"):
        parse_window(text)
