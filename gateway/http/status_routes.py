"""The gateway's own endpoints: the models it serves, /health, /ready (each replica's state, the
index's, the tenants' and flow control's) and /metrics; HEAD on /health and /ready."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.fleet.replica import Replica
from gateway.http.exposure import require_monitoring
from gateway.serving.handling import authenticate
from gateway.state import Gateway

status_router = APIRouter()


@status_router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gw: Gateway = request.app.state.gw
    authenticate(gw, request)
    return {"object": "list", "data": list(gw.registry.model_cards().values())}


@status_router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> dict[str, Any]:
    gw: Gateway = request.app.state.gw
    authenticate(gw, request)
    card = gw.registry.model_cards().get(model)
    if card is None:
        gw.planner.model_of({"model": model})  # 503 while it may yet be served, else 404
    return card or {}


@status_router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@status_router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    gw: Gateway = request.app.state.gw
    if gw.config.exposure.ready_auth:
        require_monitoring(request, gw)
    replicas = {r.name: _replica_view(r) for r in gw.registry.replicas.values()}
    refusing = [r.name for r in gw.registry.replicas.values() if r.accepts_priority is False]
    # no key is served before the tenants in Redis were read once (gateway/tenancy/store.py)
    ok = gw.tenants.loaded and any(r.healthy for r in gw.registry.replicas.values())
    body = {
        "ready": ok,
        "index": gw.index_status(),
        "tenants": gw.tenants.status(),
        "replicas": replicas,
    }
    if refusing:  # the config says engine_priority, these engines say fcfs
        body["warnings"] = [
            f"replicas {', '.join(sorted(refusing))} refuse `priority` (their engines do not run "
            "--scheduling-policy priority) though their pool sets engine_priority: they are "
            "sent none"
        ]
    if gw.kv_events is not None:
        body["kv_events"] = gw.kv_events.status()
    if gw.flow is not None:
        body["flow_control"] = gw.flow.stats()
    if any(p.pinned for p in gw.config.pools):  # undersized or not (gateway/serving/pinning.py)
        body["pinned_pool"] = gw.planner.pinned.status()
    if gw.siblings is not None:
        body["workers"] = gw.siblings.status()
    return JSONResponse(body, status_code=200 if ok else 503)


def _replica_view(r: Replica) -> dict[str, Any]:
    view = {
        "healthy": r.healthy,
        "pool": r.pool.name,
        "models": sorted(r.models),
        "in_flight": r.in_flight,
        "last_error": r.last_error,
        "ejected": None if r.ejection is None else r.ejection.view(time.monotonic()),
    }
    if r.pool.engine_priority:  # what its engine did with a `priority`
        view["priority"] = {True: "accepted", False: "refused", None: "not asked"}[
            r.accepts_priority
        ]
    return view


for path, probe in (("/health", health), ("/ready", ready)):  # HEAD: its status, no body
    status_router.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)


@status_router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gw
    if gw.config.exposure.metrics_auth:
        require_monitoring(request, gw)
    text = gw.exposition()
    if gw.siblings is not None:  # --workers N: every worker's, merged
        text = await gw.siblings.merged_metrics(text)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
