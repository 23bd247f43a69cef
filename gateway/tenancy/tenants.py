"""Tenants: who a request is served as (name, class, cache share group).

Which key belongs to which tenant is gateway/tenancy/store.py's job; ANONYMOUS is the tenant of
every request in `auth.mode: open`.

A tenant name is an identifier that goes into logs, metric labels, Redis fields and cache scopes,
so it is held to one rule (name_problem), in config files and the admin API alike:
1 to MAX_TENANT_NAME_CHARS characters, each a letter, a combining mark or a decimal digit (any
script) or one of `-_.`, the first a letter or digit; in Unicode NFC. Control, format (bidi
overrides, zero-width spaces and joiners), space and symbol characters are thereby excluded. Two
names equal after NFKC case-folding (`Acme`, `ACME`, `acme` in full-width letters) are one name:
the second is refused (name_key gives the folded form), so no tenant can look like another.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from routing.types import TenantClass

CLASS_HEADER = "x-cachelane-class"
MAX_TENANT_NAME_CHARS = 64  # as a DNS label (RFC 1035, 2.3.4): room for a team or customer id
_NAME_PUNCTUATION = frozenset("-_.")
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


def _name_char(c: str) -> bool:
    category = unicodedata.category(c)
    return category[0] in "LM" or category == "Nd" or c in _NAME_PUNCTUATION


def name_problem(name: str) -> str | None:
    """Why `name` is not a valid tenant name (the module's rule), or None."""
    if not 1 <= len(name) <= MAX_TENANT_NAME_CHARS:
        return f"must have 1 to {MAX_TENANT_NAME_CHARS} characters, not {len(name)}"
    bad = next((c for c in name if not _name_char(c)), None)
    if bad is not None:
        return (
            f"character {bad!a} is not allowed: only letters, digits and '-', '_', '.' "
            "(no spaces, control, bidi or zero-width characters)"
        )
    if unicodedata.category(name[0])[0] not in "LN":
        return "must start with a letter or a digit"
    if unicodedata.normalize("NFC", name) != name:
        return "must be in Unicode NFC (composed) form"
    return None


def name_key(name: str) -> str:
    """The form two names are compared in: NFKC, case-folded (Unicode's NFKC_Casefold, close
    enough for names that passed name_problem)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())
