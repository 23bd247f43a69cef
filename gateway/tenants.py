"""Tenants: who a request is served as (name, class, cache share group).

Which key belongs to which tenant is gateway/tenant_store.py's job; ANONYMOUS is the tenant of
every request in `auth.mode: open`.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.types import TenantClass

CLASS_HEADER = "x-cachelane-class"
_RANK = {TenantClass.CRITICAL: 0, TenantClass.STANDARD: 1, TenantClass.BATCH: 2}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tenant_class: TenantClass
    share_group: str | None = None

    @property
    def cache_scope(self) -> str:
        """Prefix caches are shared within a scope and never across scopes."""
        return f"group:{self.share_group}" if self.share_group else f"tenant:{self.name}"

    def lowered_to(self, requested: TenantClass) -> Tenant | None:
        """The tenant served as `requested`, or None if that is a higher class than its own."""
        if _RANK[requested] < _RANK[self.tenant_class]:
            return None
        return Tenant(self.name, requested, self.share_group)


ANONYMOUS = Tenant("anonymous", TenantClass.STANDARD, share_group="anonymous")
