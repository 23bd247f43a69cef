"""Reloading the pools and their replicas from the config file, on SIGHUP or POST /admin/reload.

The file is read and validated as at start-up (`${VAR}`, `*_file` secrets, every check; in precise
mode the tokenizers are loaded too) before anything changes: an invalid file is rejected with
every error, logged and returned, and the running config stays. A valid one replaces `pools`
(gateway/fleet/membership.py: replicas join and leave, requests in flight on a leaving replica
finish there; gateway/fleet/discovery.py follows the discovered pools). Other sections are read at
start-up only: those that differ from the running config are reported as not applied (a restart
applies them).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from gateway.accounting.ledger import CostAccounting
from gateway.config import ConfigError, GatewayConfig, load_config, parse_config
from gateway.fleet.discovery import Discovery
from gateway.fleet.membership import Fleet
from gateway.serving.planner import Planner, load_tokenizers
from gateway.telemetry.metrics import Metrics

log = logging.getLogger("cachelane.reload")


class NoConfigFile(Exception):
    """The gateway was started without a config file (`serve --replicas`): nothing to reload."""


@dataclass(frozen=True)
class ReloadReport:
    """What a reload changed (replica names), and the sections it left as they were."""

    source: str
    pools: list[str]
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    not_applied: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Reloadable(Protocol):
    """What a reload reads and replaces on the running gateway (gateway/state.py's Gateway)."""

    config: GatewayConfig
    metrics: Metrics
    fleet: Fleet
    discovery: Discovery
    planner: Planner
    costs: CostAccounting


class Reloader:
    def __init__(self, gw: Reloadable, path: str | None) -> None:
        self._gw = gw
        self.path = path
        self._lock = asyncio.Lock()  # one reload at a time
        self._signalled: set[asyncio.Task[None]] = set()

    async def reload(self) -> ReloadReport:
        """Read the file again and apply its pools. Raises ConfigError (nothing changed) when
        it is invalid, NoConfigFile when there is no file."""
        if self.path is None:
            raise NoConfigFile("the gateway was started without a config file (--replicas)")
        gw, metrics = self._gw, self._gw.metrics
        async with self._lock:
            try:
                running = gw.config
                new = load_config(self.path)
                # the running config with the file's pools, checked as a whole (remote tiers,
                # precise mode) and with its tokenizers loaded, before anything changes
                merged = parse_config({**dict(running), "pools": new.pools}, self.path)
                tokenizers = load_tokenizers(merged) if merged.routing.mode == "precise" else {}
            except ConfigError as err:
                metrics.reloads.labels("invalid").inc()
                log.error("config reload rejected, the running config is kept: %s", err)
                raise
            changes = await gw.fleet.set_pools(merged.pools)
            await gw.discovery.sync(merged.pools)
            gw.planner.set_pools(merged, tokenizers)
            gw.costs.set_pools(merged.pools)
            gw.config = merged
            metrics.reloads.labels("ok").inc()
        report = ReloadReport(
            source=self.path,
            pools=[p.name for p in merged.pools],
            added=changes.added,
            removed=changes.removed,
            moved=changes.moved,
            not_applied=_differing_sections(running, new),
        )
        log.info(
            "config reloaded from %s: pools %s; replicas added %s, removed %s, reconfigured %s%s",
            report.source,
            report.pools,
            report.added,
            report.removed,
            report.moved,
            f"; not applied until a restart: {report.not_applied}" if report.not_applied else "",
        )
        return report

    def on_signal(self) -> None:
        """SIGHUP: reload in the background (a rejected file is logged by reload)."""
        task = asyncio.create_task(self._reload_quietly(), name="config-reload")
        self._signalled.add(task)
        task.add_done_callback(self._signalled.discard)

    async def _reload_quietly(self) -> None:
        try:
            await self.reload()
        except (ConfigError, NoConfigFile):
            pass  # logged
        except Exception:
            log.exception("config reload failed")


def _differing_sections(running: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Top-level sections other than pools where the file and the running config differ (the
    running values may come from command-line flags: --host, --port, --policy)."""
    names = [n for n in GatewayConfig.model_fields if n != "pools"]
    return [n for n in names if getattr(running, n) != getattr(new, n)]


def install_sighup(reloader: Reloader) -> Callable[[], None]:
    """Reload on SIGHUP; returns the function that stops it. Where signals cannot be handled
    (not the main thread, not Unix) nothing is installed."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGHUP, reloader.on_signal)
    except (NotImplementedError, RuntimeError, ValueError, AttributeError):
        log.info("SIGHUP is not handled here; POST /admin/reload reloads the config")
        return lambda: None

    def stop() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return stop
