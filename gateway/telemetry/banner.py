"""The line a gateway logs once it serves: what it is and how it is set up (auth mode, pools and
their replicas, index, routing), so a quick start says that it checks no key."""

from __future__ import annotations

from collections.abc import Mapping

from gateway import __version__
from gateway.config import GatewayConfig

OPEN_WARNING = (
    "auth.mode is open: every request is served, without a key, as the anonymous tenant; "
    "for anything but a laptop give tenants keys (auth.mode: keys; `cachelane keygen NAME`)"
)


def startup_banner(
    config: GatewayConfig,
    healthy: Mapping[str, tuple[int, int]],
    tenants: int,
    worker_pid: int | None = None,
) -> str:
    """`healthy`: pool name -> (healthy replicas, replicas); `tenants`: live tenants;
    `worker_pid`: this process's, one of `serve --workers N` (each logs its own line)."""
    listen = config.listen
    if config.auth.mode == "open":
        auth = "auth open (no key checked)"
    else:
        admin = "admin API on" if config.admin.configured else "no admin key"
        auth = f"auth keys ({tenants} tenant{'s' * (tenants != 1)}, {admin})"
    pools = ", ".join(
        f"{p.name} {healthy.get(p.name, (0, 0))[0]}/{healthy.get(p.name, (0, 0))[1]} healthy"
        + (" (DNS)" if p.discovery is not None else "")
        + (" pinned" if p.pinned else "")
        + (" engine_priority" if p.engine_priority else "")
        for p in config.pools
    )
    routing = config.routing
    return (
        f"cachelane {__version__} serving on http://{listen.host}:{listen.port}: {auth}; "
        f"pools: {pools}; index {config.index.backend}; routing {routing.mode} "
        f"{routing.policy.value}" + (f"; worker {worker_pid}" if worker_pid is not None else "")
    )
