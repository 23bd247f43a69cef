"""The kinds of metric family Metrics (gateway/telemetry/metrics.py) declares, and the shorthand
it declares them with: one class attribute a family, built in each instance's own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar, overload

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _KeptChildren:
    """labels() with positional values, each child kept after its first lookup: prometheus_client
    validates the values, takes a lock and builds a key on every call, which made it the top entry
    of the gateway's CPU profile (docs/bench/overhead.md); a request calls labels() ~16 times."""

    _kept: dict[tuple[Any, ...], Any]

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if by_name or not values:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        kept = self.__dict__.setdefault("_kept", {})
        child = kept.get(values)
        if child is None:
            child = kept[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self.__dict__.get("_kept", {}).pop(tuple(values), None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.get("_kept", {}).clear()
        super().clear()  # type: ignore[misc]


class Counter(_KeptChildren, prometheus_client.Counter):
    pass


class Gauge(_KeptChildren, prometheus_client.Gauge):
    pass


class Histogram(_KeptChildren, prometheus_client.Histogram):
    pass


class UnsetGauge(Collector):
    """A gauge without labels that is absent from the exposition until it is first set: a
    value not known yet reads as no data on a dashboard, not as 0."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = value

    def collect(self) -> Iterable[Metric]:
        if self.value is None:
            return []
        return [GaugeMetricFamily(self._name, self._documentation, value=self.value)]


class NoCreatedRegistry(CollectorRegistry):
    """A registry whose exposition has no `_created` samples (prometheus_client's
    disable_created_metrics() does this process-wide; this does it for this registry alone)."""

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


Family = TypeVar("Family", Counter, Gauge, Histogram, UnsetGauge)


class Declared(Generic[Family]):
    """One metric family declared in a class body: `build_all` builds it in an instance's
    registry, in declaration order (the exposition's order), as the instance attribute of the
    same name. The descriptor gives that attribute its type."""

    def __init__(self, build: Callable[[CollectorRegistry], Family]) -> None:
        self.build: Callable[[CollectorRegistry], Family] = build
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = name

    @overload
    def __get__(self, instance: None, owner: type) -> Declared[Family]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> Family: ...
    def __get__(self, instance: object, owner: type) -> Declared[Family] | Family:
        if instance is None:
            return self
        # build_all puts the family in the instance's __dict__, which a non-data descriptor
        # yields to: this is reached only before build_all
        raise AttributeError(f"{self.attr} is built by build_all")


def build_all(instance: object, registry: CollectorRegistry) -> None:
    """Build every family declared on `instance`'s class in `registry`."""
    for declared in vars(type(instance)).values():
        if isinstance(declared, Declared):
            vars(instance)[declared.attr] = declared.build(registry)


# The declarations' shorthand: labels are one space-separated string ("" for none).
def counter(name: str, documentation: str, labels: str = "") -> Declared[Counter]:
    return Declared(lambda r: Counter(name, documentation, labels.split(), registry=r))


def gauge(name: str, documentation: str, labels: str = "") -> Declared[Gauge]:
    return Declared(lambda r: Gauge(name, documentation, labels.split(), registry=r))


def histogram(
    name: str, documentation: str, labels: str = "", *, buckets: tuple[float, ...]
) -> Declared[Histogram]:
    return Declared(
        lambda r: Histogram(name, documentation, labels.split(), buckets=buckets, registry=r)
    )


def unset_gauge(name: str, documentation: str) -> Declared[UnsetGauge]:
    return Declared(lambda r: UnsetGauge(name, documentation, registry=r))
