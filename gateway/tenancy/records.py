"""Tenant records as kept in the shared Redis hash: one field per tenant, a signed JSON value.

    {"v": 1, "digest": HMAC digest of the key | null, "class": "standard", "share_group": null,
     "at": 1764750000.123, "deleted": false, "sig": HMAC of all the above and the name}

A deletion is a record too (a tombstone: "deleted": true, no digest), so every gateway learns of
it, including the deletion of a tenant its config file names. `at` (seconds since the epoch, as
written by the gateway that made the change) orders two records of one name: the later wins.

`load` raises RecordError with a short reason for anything it cannot trust: not JSON, wrong shape,
an unknown class, a name that is not a tenant name (gateway/tenancy/tenants.py), no signature or a
bad one (written by someone without the secret).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gateway.tenancy.keys import Keyring
from gateway.tenancy.tenants import name_problem
from routing.types import TenantClass

VERSION = 1


class RecordError(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # a metric label: malformed, unsigned, bad_signature


@dataclass(frozen=True, slots=True)
class Record:
    name: str
    digest: str | None  # None for a tombstone
    tenant_class: TenantClass
    share_group: str | None
    at: float
    deleted: bool = False

    def newer_than(self, other: Record) -> bool:
        """Later `at` wins; a tie (two gateways in the same instant) goes to the tombstone, then to
        the larger digest, so every gateway picks the same record."""
        return (self.at, self.deleted, self.digest or "") > (
            other.at,
            other.deleted,
            other.digest or "",
        )


def tombstone(name: str, at: float) -> Record:
    return Record(name, None, TenantClass.STANDARD, None, at, deleted=True)


def _signed_part(r: Record) -> bytes:
    fields = [VERSION, r.name, r.digest, r.tenant_class.value, r.share_group, r.at, r.deleted]
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()


def dump(record: Record, keyring: Keyring) -> str:
    return json.dumps(
        {
            "v": VERSION,
            "digest": record.digest,
            "class": record.tenant_class.value,
            "share_group": record.share_group,
            "at": record.at,
            "deleted": record.deleted,
            "sig": keyring.sign(_signed_part(record)),
        }
    )


def load(name: str, value: str, keyring: Keyring) -> Record:
    try:
        d = json.loads(value)
    except ValueError:
        raise RecordError("malformed", "not JSON") from None
    if not isinstance(d, dict):
        raise RecordError("malformed", f"a JSON {type(d).__name__}, not an object")
    record = _fields(name, d)
    sig = d.get("sig")
    if not isinstance(sig, str) or not sig:
        raise RecordError("unsigned", "no signature")
    if not keyring.verify(_signed_part(record), sig):
        raise RecordError("bad_signature", "signature does not match (written without the secret?)")
    return record


def _fields(name: str, d: dict[str, Any]) -> Record:
    problem = name_problem(name)
    if problem is not None:
        raise RecordError("malformed", f"the name {problem}")
    if d.get("v") != VERSION:
        raise RecordError("malformed", f"version {d.get('v')!r}, expected {VERSION}")
    deleted, at = d.get("deleted", False), d.get("at")
    if not isinstance(deleted, bool):
        raise RecordError("malformed", "deleted is not a boolean")
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise RecordError("malformed", "at is not a number")
    digest, share_group = d.get("digest"), d.get("share_group")
    if deleted:
        if digest is not None:
            raise RecordError("malformed", "a tombstone with a digest")
    elif not isinstance(digest, str) or len(digest) != 64:
        raise RecordError("malformed", "digest is not 64 hex characters")
    if share_group is not None and (
        not isinstance(share_group, str) or name_problem(share_group) is not None
    ):
        raise RecordError("malformed", "share_group is not a valid name")
    try:
        tenant_class = TenantClass(str(d.get("class")))
    except ValueError:
        raise RecordError("malformed", f"unknown class {d.get('class')!r}") from None
    return Record(name, digest, tenant_class, share_group, float(at), deleted)
