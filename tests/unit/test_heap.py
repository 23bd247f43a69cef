import gc

from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry.heap import CollectionTimer


def samples(timer: CollectionTimer) -> dict[tuple[str, str, str], float]:
    out = {}
    for family in timer.collect():
        for s in family.samples:
            out[(s.name, s.labels.get("generation", ""), s.labels.get("le", ""))] = s.value
    return out


def test_a_full_collection_is_timed_while_installed_and_not_after() -> None:
    timer = CollectionTimer()
    timer.install()
    try:
        gc.collect()
    finally:
        timer.uninstall()
    seen = samples(timer)
    count = seen[("cachelane_gc_pause_seconds_count", "2", "")]
    assert count >= 1
    assert seen[("cachelane_gc_pause_seconds_bucket", "2", "+Inf")] == count
    assert seen[("cachelane_gc_pause_seconds_sum", "2", "")] > 0
    gc.collect()
    assert samples(timer)[("cachelane_gc_pause_seconds_count", "2", "")] == count
    timer.uninstall()  # twice: no error


def test_it_exposes_a_histogram_per_generation() -> None:
    registry = CollectorRegistry()
    registry.register(CollectionTimer())
    text = generate_latest(registry).decode()
    assert "# TYPE cachelane_gc_pause_seconds histogram" in text
    for generation in ("0", "1", "2"):
        assert f'cachelane_gc_pause_seconds_count{{generation="{generation}"}} 0.0' in text
