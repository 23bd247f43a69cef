"""Admin API: add, change and remove tenants without a restart.

    GET    /admin/tenants          list (never keys)
    PUT    /admin/tenants/{name}   create or replace: {"api_key" | "api_key_sha256", "class",
                                   "share_group"}
    DELETE /admin/tenants/{name}

Guarded by its own key (config `admin`); without one configured the admin API answers 404.
With the Redis index, changes are stored in Redis and every gateway sees them within ~1 s.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from gateway.config import TenantConfig
from gateway.errors import ApiError, bad_request
from gateway.tenants import Tenant, key_digest

admin_router = APIRouter(prefix="/admin")


def _require_admin(request: Request) -> Any:
    gw = request.app.state.gw
    admin = gw.config.admin
    expected = admin.api_key_sha256 or (key_digest(admin.api_key) if admin.api_key else None)
    if expected is None:
        raise ApiError(
            404, "the admin API is disabled: no admin key is configured", code="not_found"
        )
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    presented = key_digest(key.strip()) if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(presented, expected):
        raise ApiError(401, "invalid or missing admin key", code="invalid_api_key")
    return gw


def _public(t: Tenant) -> dict[str, Any]:
    return {"name": t.name, "class": t.tenant_class.value, "share_group": t.share_group}


@admin_router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    gw = _require_admin(request)
    return {"data": [_public(t) for t in gw.tenants.list()]}


@admin_router.put("/tenants/{name}")
async def put_tenant(name: str, request: Request) -> dict[str, Any]:
    gw = _require_admin(request)
    try:
        body = await request.json()
        config = TenantConfig.model_validate({**body, "name": name})
    except ValueError as err:
        message = str(err) if isinstance(err, ValidationError) else "body is not valid JSON"
        raise bad_request(f"invalid tenant: {message}", param="body") from None
    tenant = await gw.tenants.put(config)
    return _public(tenant)


@admin_router.delete("/tenants/{name}", status_code=204)
async def delete_tenant(name: str, request: Request) -> Response:
    gw = _require_admin(request)
    if not await gw.tenants.remove(name):
        raise ApiError(404, f"no tenant named {name!r}", code="not_found")
    return Response(status_code=204)
