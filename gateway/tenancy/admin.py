"""Admin API: add, change and remove tenants without a restart.

    GET    /admin/tenants          list (never keys)
    PUT    /admin/tenants/{name}   create or replace: {"api_key", "class", "share_group"}
    DELETE /admin/tenants/{name}   file-configured tenants too, on every gateway
    POST   /admin/reload           pools and replicas from the config file again
                                   (gateway/fleet/reload.py); 400 with every error when it is
                                   invalid

Guarded by its own key (config `admin`); without one configured the admin API answers 404.
A new key has at least MIN_API_KEY_CHARS characters and belongs to no other tenant (409). A name
and a share group follow gateway/tenancy/tenants.py's rule, as in config files (400
`invalid_request`, param `name` or `share_group`).
With the Redis index, changes are stored in Redis and every gateway sees them within ~1 s; while
Redis cannot be written, changes answer 503 with Retry-After and nothing changes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from gateway.config import ConfigError, TenantConfig
from gateway.fleet.reload import NoConfigFile, Reloader
from gateway.http.body import BodyError, parse_body
from gateway.http.errors import ApiError, bad_request, retry_later
from gateway.tenancy.admin_auth import require_admin
from gateway.tenancy.store import KeyInUse, StoreUnavailable
from gateway.tenancy.tenants import Tenant

admin_router = APIRouter(prefix="/admin")

STORE_RETRY_AFTER_S = 1  # the tenant refresh retries Redis every second (tenant_store.REFRESH_S)
_PUT_FIELDS = ("api_key", "class", "share_group")
MAX_BODY_BYTES = 64 * 1024  # a tenant is three short fields; 64 KiB is generous


def _public(t: Tenant) -> dict[str, Any]:
    return {"name": t.name, "class": t.tenant_class.value, "share_group": t.share_group}


def _store_down(err: StoreUnavailable) -> ApiError:
    return retry_later(
        503,
        f"the tenant store (Redis) did not take the change; retry it: {err}",
        code="store_unavailable",
        retry_after_s=STORE_RETRY_AFTER_S,
    )


async def _tenant_body(request: Request, name: str) -> TenantConfig:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise bad_request(f"invalid tenant: body over {MAX_BODY_BYTES} bytes", param="body")
    try:
        body = parse_body(raw)
    except BodyError as err:
        raise bad_request(
            f"invalid tenant: {err}; expected an object with {', '.join(_PUT_FIELDS)}",
            code=err.code,
            param="body",
        ) from None
    if "api_key" not in body:
        raise bad_request(
            "invalid tenant: give api_key (the gateway checks its length; api_key_sha256 is for "
            "config files)",
            param="api_key",
        )
    unknown = sorted(str(k) for k in body if k not in _PUT_FIELDS)
    if unknown:
        raise bad_request(f"invalid tenant: unknown field(s) {unknown}", param=unknown[0])
    try:
        return TenantConfig.model_validate({**body, "name": name})
    except ValidationError as err:
        first = err.errors()[0]  # the message only: the input (a key) is never echoed
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise bad_request(f"invalid tenant: {where}: {first['msg']}", param=where) from None


@admin_router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    return {"data": [_public(t) for t in gw.tenants.list()]}


@admin_router.put("/tenants/{name}")
async def put_tenant(name: str, request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    config = await _tenant_body(request, name)
    try:
        tenant = await gw.tenants.put(config)
    except KeyInUse:
        raise ApiError(
            409, "this API key belongs to another tenant; give a new one", code="key_in_use"
        ) from None
    except StoreUnavailable as err:
        raise _store_down(err) from None
    return _public(tenant)


@admin_router.delete("/tenants/{name}", status_code=204)
async def delete_tenant(name: str, request: Request) -> Response:
    gw = require_admin(request)
    try:
        removed = await gw.tenants.remove(name)
    except StoreUnavailable as err:
        raise _store_down(err) from None
    if not removed:
        raise ApiError(404, f"no tenant named {name!a}", code="not_found")
    return Response(status_code=204)


@admin_router.post("/reload")
async def reload_config(request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    reloader: Reloader = gw.reloader
    try:
        report = await reloader.reload()
    except NoConfigFile as err:
        raise ApiError(409, f"{err}: nothing to reload", code="no_config_file") from None
    except ConfigError as err:
        raise bad_request(
            f"not reloaded, the running config is kept: {err}", code="invalid_config"
        ) from None
    return report.as_dict()
