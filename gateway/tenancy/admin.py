"""Admin API: add, change and remove tenants without a restart (docs/admin.md has examples).

    GET    /admin/tenants          list (never keys)
    POST   /admin/tenants          create: {"name", "api_key"?, "class"?, "share_group"?}; 201;
                                   without api_key the gateway makes one and answers it, once;
                                   409 `tenant_exists` if the name is live
    GET    /admin/tenants/{name}   one tenant (404 if none)
    PUT    /admin/tenants/{name}   create or replace: {"api_key", "class"?, "share_group"?}
    PATCH  /admin/tenants/{name}   change some of {"api_key", "class", "share_group"}; the rest
                                   (the key included) stays; 404 if none
    DELETE /admin/tenants/{name}   file-configured tenants too, on every gateway
    POST   /admin/reload           pools and replicas from the config file again
                                   (gateway/fleet/reload.py), in every worker of --workers N;
                                   400 with every error when it is invalid

Guarded by its own key (config `admin`); without one configured the admin API answers 404.
A new key has at least MIN_API_KEY_CHARS characters and belongs to no other tenant (409). A name
and a share group follow gateway/tenancy/tenants.py's rule, as in config files (400
`invalid_request`, param `name` or `share_group`).
With the Redis index, changes are stored in Redis and every gateway sees them within ~1 s; while
Redis cannot be written, changes answer 503 with Retry-After and nothing changes.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from gateway.config import ConfigError, TenantConfig
from gateway.fleet.reload import NoConfigFile, Reloader
from gateway.http.body import BodyError, parse_body
from gateway.http.errors import ApiError, bad_request, retry_later
from gateway.tenancy.admin_auth import require_admin
from gateway.tenancy.keys import MIN_API_KEY_CHARS
from gateway.tenancy.store import KeyInUse, StoreUnavailable
from gateway.tenancy.tenants import Tenant
from routing.types import TenantClass

admin_router = APIRouter(prefix="/admin")

STORE_RETRY_AFTER_S = 1  # the tenant refresh retries Redis every second (tenant_store.REFRESH_S)
_PUT_FIELDS = ("api_key", "class", "share_group")
MAX_BODY_BYTES = 64 * 1024  # a tenant is three short fields; 64 KiB is generous
NEW_KEY_BYTES = 32  # 256 bits in 64 hex characters, as `openssl rand -hex 32` makes

_TENANT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "api_key": {"type": "string", "minLength": MIN_API_KEY_CHARS},
        "class": {"enum": [c.value for c in TenantClass]},
        "share_group": {"type": ["string", "null"]},
    },
}
_NAMED_TENANT_SCHEMA: dict[str, Any] = {
    **_TENANT_SCHEMA,
    "required": ["name"],
    "properties": {"name": {"type": "string"}, **_TENANT_SCHEMA["properties"]},
}


def _body_doc(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """A route's request body in the OpenAPI schema (the handlers read the body themselves)."""
    body = {"required": required, "content": {"application/json": {"schema": schema}}}
    return {"requestBody": body}


def _public(t: Tenant) -> dict[str, Any]:
    return {"name": t.name, "class": t.tenant_class.value, "share_group": t.share_group}


def _store_down(err: StoreUnavailable) -> ApiError:
    return retry_later(
        503,
        f"the tenant store (Redis) did not take the change; retry it: {err}",
        code="store_unavailable",
        retry_after_s=STORE_RETRY_AFTER_S,
    )


async def _read_fields(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The body: a JSON object of `allowed` fields (400 otherwise)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise bad_request(f"invalid tenant: body over {MAX_BODY_BYTES} bytes", param="body")
    try:
        body = parse_body(raw)
    except BodyError as err:
        raise bad_request(
            f"invalid tenant: {err}; expected an object with {', '.join(allowed)}",
            code=err.code,
            param="body",
        ) from None
    unknown = sorted(str(k) for k in body if k not in allowed)
    if unknown:
        raise bad_request(f"invalid tenant: unknown field(s) {unknown}", param=unknown[0])
    return body


def _tenant_config(fields: dict[str, Any]) -> TenantConfig:
    try:
        return TenantConfig.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]  # the message only: the input (a key) is never echoed
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise bad_request(f"invalid tenant: {where}: {first['msg']}", param=where) from None


async def _tenant_body(request: Request, name: str) -> TenantConfig:
    body = await _read_fields(request, _PUT_FIELDS)
    if "api_key" not in body:
        raise bad_request(
            "invalid tenant: give api_key (the gateway checks its length; api_key_sha256 is for "
            "config files)",
            param="api_key",
        )
    return _tenant_config({**body, "name": name})


async def _put(gw: Any, config: TenantConfig) -> Tenant:
    """Create or replace the tenant in the store, its failures as the API's errors."""
    try:
        tenant: Tenant = await gw.tenants.put(config)
    except KeyInUse:
        raise ApiError(
            409, "this API key belongs to another tenant; give a new one", code="key_in_use"
        ) from None
    except StoreUnavailable as err:
        raise _store_down(err) from None
    return tenant


def _no_tenant(name: str) -> ApiError:
    return ApiError(404, f"no tenant named {name!a}", code="not_found")


@admin_router.get("/tenants")
async def list_tenants(request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    return {"data": [_public(t) for t in gw.tenants.list()]}


@admin_router.post("/tenants", status_code=201, openapi_extra=_body_doc(_NAMED_TENANT_SCHEMA))
async def create_tenant(request: Request) -> dict[str, Any]:
    """Create a tenant; without `api_key` the gateway makes one (answered here, once)."""
    gw = require_admin(request)
    body = await _read_fields(request, ("name", *_PUT_FIELDS))
    name = body.get("name")
    if not isinstance(name, str):
        raise bad_request("invalid tenant: give name (a string)", param="name")
    if gw.tenants.get(name) is not None:
        raise ApiError(
            409,
            f"tenant {name!a} exists: PUT /admin/tenants/{{name}} replaces it, PATCH changes it",
            code="tenant_exists",
        )
    made = None if "api_key" in body else secrets.token_hex(NEW_KEY_BYTES)
    config = _tenant_config(body if made is None else {**body, "api_key": made})
    tenant = _public(await _put(gw, config))
    return tenant if made is None else {**tenant, "api_key": made}


@admin_router.get("/tenants/{name}")
async def get_tenant(name: str, request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    tenant = gw.tenants.get(name)
    if tenant is None:
        raise _no_tenant(name)
    return _public(tenant)


@admin_router.put("/tenants/{name}", openapi_extra=_body_doc(_TENANT_SCHEMA))
async def put_tenant(name: str, request: Request) -> dict[str, Any]:
    gw = require_admin(request)
    config = await _tenant_body(request, name)
    return _public(await _put(gw, config))


@admin_router.patch("/tenants/{name}", openapi_extra=_body_doc(_TENANT_SCHEMA))
async def patch_tenant(name: str, request: Request) -> dict[str, Any]:
    """Change some of a tenant's fields; those not given (its key included) stay."""
    gw = require_admin(request)
    body = await _read_fields(request, _PUT_FIELDS)
    if not body:
        raise bad_request(f"nothing to change: give any of {', '.join(_PUT_FIELDS)}")
    current: Tenant | None = gw.tenants.get(name)
    if current is None:
        raise _no_tenant(name)
    merged = {"class": current.tenant_class.value, "share_group": current.share_group, **body}
    if "api_key" in body:  # a new key: the tenant is replaced with it
        return _public(await _put(gw, _tenant_config({**merged, "name": name})))
    try:
        klass = TenantClass(merged["class"])
    except (ValueError, TypeError):
        classes = ", ".join(c.value for c in TenantClass)
        raise bad_request(f"invalid tenant: class: one of {classes}", param="class") from None
    group = merged["share_group"]
    if group is not None and not isinstance(group, str):
        raise bad_request("invalid tenant: share_group: a string or null", param="share_group")
    try:
        tenant = await gw.tenants.update(name, klass, group)
    except StoreUnavailable as err:
        raise _store_down(err) from None
    if tenant is None:  # removed meanwhile
        raise _no_tenant(name)
    return _public(tenant)


@admin_router.delete("/tenants/{name}", status_code=204)
async def delete_tenant(name: str, request: Request) -> Response:
    gw = require_admin(request)
    try:
        removed = await gw.tenants.remove(name)
    except StoreUnavailable as err:
        raise _store_down(err) from None
    if not removed:
        raise _no_tenant(name)
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
    answer = report.as_dict()
    if gw.siblings is not None:  # --workers N: the others reload the same file (SIGHUP)
        answer["workers_told"] = gw.siblings.reload_siblings()
    return answer
