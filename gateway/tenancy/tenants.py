"""Tenants: who a request is served as (name, class, cache share group).

Which key belongs to which tenant is gateway/tenancy/store.py's job; ANONYMOUS is the tenant of
every request in `auth.mode: open`.

A tenant name and a share group are identifiers that go into logs, metric labels, Redis fields
and cache scopes, so both are held to one rule (name_problem), in config files and the admin API
alike: 1 to MAX_TENANT_NAME_CHARS characters, each a lower-case ASCII letter, a digit or one of
`-_.`, the first a letter or a digit (Kubernetes' names, RFC 1123 labels, with `_` and `.`). No
other script, no case: no name can look like another (a Cyrillic `a` (U+0430), a zero-width or
variation selector, a combining overlay, a Hangul filler are all refused, and `Acme` is no twin
of `acme` because it is refused too).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from routing.types import TenantClass

CLASS_HEADER = "x-cachelane-class"
MAX_TENANT_NAME_CHARS = 64  # as a DNS label (RFC 1035, 2.3.4): room for a team or customer id
_NAME_PUNCTUATION = frozenset("-_.")
_NAME_CHARS = frozenset(string.ascii_lowercase + string.digits) | _NAME_PUNCTUATION
_RANK = {TenantClass.CRITICAL: 0, TenantClass.STANDARD: 1, TenantClass.BATCH: 2}


@dataclass(frozen=True, slots=True)
class Tenant:
    """`tenant_class`: the class a request is served at (its own, or a lower one it asked
    for); `account_class`: its own, when it asked for a lower one (limits and accounting)."""

    name: str
    tenant_class: TenantClass
    share_group: str | None = None
    account_class: TenantClass | None = None

    @property
    def own_class(self) -> TenantClass:
        """The tenant's own class, whatever class the request asked for."""
        return self.account_class or self.tenant_class

    @property
    def cache_scope(self) -> str:
        """Prefix caches are shared within a scope and never across scopes."""
        return f"group:{self.share_group}" if self.share_group else f"tenant:{self.name}"

    def lowered_to(self, requested: TenantClass) -> Tenant | None:
        """The tenant served as `requested`, or None if that is a higher class than its own."""
        if _RANK[requested] < _RANK[self.tenant_class]:
            return None
        return Tenant(self.name, requested, self.share_group, self.own_class)


ANONYMOUS = Tenant("anonymous", TenantClass.STANDARD, share_group="anonymous")


def name_problem(name: str) -> str | None:
    """Why `name` (a tenant's or a share group's) breaks the module's rule, or None."""
    if not 1 <= len(name) <= MAX_TENANT_NAME_CHARS:
        return f"must have 1 to {MAX_TENANT_NAME_CHARS} characters, not {len(name)}"
    bad = next((c for c in name if c not in _NAME_CHARS), None)
    if bad is not None:
        return (
            f"character {bad!a} is not allowed: only lower-case ASCII letters, digits and "
            "'-', '_', '.'"
        )
    if name[0] in _NAME_PUNCTUATION:
        return "must start with a letter or a digit"
    return None
