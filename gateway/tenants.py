"""Tenants: API key -> tenant (name, class, cache share group).

Keys are kept only as SHA-256 digests; a presented key is hashed, looked up, and the digest
compared with hmac.compare_digest. Tenants come from the config file and from the admin API; with
the Redis index, admin changes are stored in one Redis hash that every gateway re-reads every
`REFRESH_S`, so a change made on one gateway reaches all of them without a restart.

Authentication is required as soon as one tenant exists; with none, every request is served as
the anonymous standard tenant (a quick start without keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any

from gateway.config import TenantConfig
from routing.types import TenantClass

log = logging.getLogger("cachelane.tenants")

REFRESH_S = 1.0  # admin changes reach other gateways within ~1 s: one HGETALL per second each
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


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: str
    tenant: Tenant


class TenantStore:
    def __init__(
        self,
        configured: list[TenantConfig],
        redis: Any | None = None,
        redis_key: str = "cl:tenants",
    ) -> None:
        self._configured = {t.name: _entry(t) for t in configured}
        self._managed: dict[str, _Entry] = {}
        self._redis = redis
        self._redis_key = redis_key
        self._by_digest: dict[str, _Entry] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        entries = {**self._configured, **self._managed}
        self._by_digest = {e.digest: e for e in entries.values()}

    @property
    def auth_required(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, api_key: str | None) -> Tenant | None:
        if not self.auth_required:
            return ANONYMOUS
        if not api_key:
            return None
        digest = key_digest(api_key)
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(entry.digest, digest):
            return None
        return entry.tenant

    def list(self) -> list[Tenant]:
        return sorted((e.tenant for e in self._by_digest.values()), key=lambda t: t.name)

    async def put(self, config: TenantConfig) -> Tenant:
        entry = _entry(config)
        if self._redis is not None:
            await self._redis.hset(self._redis_key, entry.tenant.name, _dump(entry))
        self._managed[entry.tenant.name] = entry
        self._rebuild()
        return entry.tenant

    async def remove(self, name: str) -> bool:
        existed = name in self._managed or name in self._configured
        if self._redis is not None:
            await self._redis.hdel(self._redis_key, name)
        self._managed.pop(name, None)
        self._configured.pop(name, None)
        self._rebuild()
        return existed

    async def refresh(self) -> None:
        if self._redis is None:
            return
        raw = await self._redis.hgetall(self._redis_key)
        managed = {}
        for name, value in raw.items():
            try:
                managed[_text(name)] = _load(_text(name), _text(value))
            except (ValueError, KeyError) as err:
                log.warning("ignoring malformed tenant %r in Redis: %r", name, err)
        self._managed = managed
        self._rebuild()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as err:  # Redis down: keep the last view
                log.warning("tenant refresh failed, keeping the last view: %r", err)


def _entry(t: TenantConfig) -> _Entry:
    digest = t.api_key_sha256 or key_digest(t.api_key or "")
    return _Entry(digest, Tenant(t.name, t.tenant_class, t.share_group))


def _dump(e: _Entry) -> str:
    return json.dumps(
        {
            "digest": e.digest,
            "class": e.tenant.tenant_class.value,
            "share_group": e.tenant.share_group,
        }
    )


def _load(name: str, value: str) -> _Entry:
    d = json.loads(value)
    return _Entry(d["digest"], Tenant(name, TenantClass(d["class"]), d.get("share_group")))


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
