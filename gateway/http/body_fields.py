"""Request body fields clients must not set: the engines' own control fields, which the gateway
either sets itself (`priority`, from the tenant's class) or which would let a client steer the
engine past the gateway. A request that sends one is refused (400 `field_not_allowed`, naming the
field) rather than silently changed, so a client learns that its field had no effect.

The default list and its sources: gateway/config/exposure.py ENGINE_CONTROL_FIELDS.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from gateway.http.errors import ApiError
from routing.types import TenantClass

if TYPE_CHECKING:
    from gateway.config.exposure import BodyFieldsConfig


def check_fields(body: Mapping[str, Any], denied: Collection[str]) -> None:
    """Raise 400 field_not_allowed for the first denied top-level field the body sets."""
    for name in denied:
        if name in body:
            raise ApiError(
                400,
                f"{name!r} is set by the gateway or the engine, not by clients",
                code="field_not_allowed",
                param=name,
            )


def denied_fields(config: BodyFieldsConfig) -> dict[TenantClass, tuple[str, ...]]:
    """The fields each class may not send: `deny` less the class's `allow`."""
    return {
        klass: tuple(f for f in config.deny if f not in config.allow.get(klass, ()))
        for klass in TenantClass
    }
