"""The admin key's check, for every admin endpoint (tenants, reload, costs): a bearer key whose
digest is config `admin`'s; without an admin key configured the admin API answers 404. The
debug views (/debug/route, /debug/costs) are open in auth.mode open, as every endpoint is there
(a development set-up, which may not have an admin key: gateway/config/root.py)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request

from gateway.http.errors import ApiError


def require_admin(request: Request) -> Any:
    """The running gateway when the request carries the admin key; ApiError 404 or 401 if not."""
    gw = request.app.state.gw
    expected = gw.admin_digest
    if expected is None:
        raise ApiError(
            404, "the admin API is disabled: no admin key is configured", code="not_found"
        )
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    presented = gw.keyring.digest(key.strip()) if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(presented, expected):
        raise ApiError(401, "invalid or missing admin key", code="invalid_api_key")
    return gw


def require_admin_or_open(request: Request) -> Any:
    """The running gateway for a debug view: open in auth.mode open, else require_admin."""
    gw = request.app.state.gw
    return gw if gw.tenants.open_mode else require_admin(request)
