"""Which API key belongs to which tenant: the config file's tenants, changed by the admin API.

Authentication fails closed: in `auth.mode: keys` (the default) a request is served only with a
key of a live tenant, however few tenants there are (none: every request is refused). Only
`auth.mode: open` serves requests without a key, as the anonymous tenant, and then no key is
checked at all.

With the Redis index, admin changes go to one Redis hash (gateway/tenant_records.py: signed
records, deletions as tombstones) that every gateway re-reads every REFRESH_S. Each gateway keeps
every record it has seen; a record missing from Redis, older there, or replaced by one that fails
its signature is written back, so a Redis restarted empty (or a hash deleted or tampered with) is
refilled by the first gateway that notices, and no change is lost while one gateway that saw it
lives. An admin record, tombstone included, overrides the file's tenant of the same name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gateway.config import TenantConfig
from gateway.keys import Keyring
from gateway.tenant_records import Record, RecordError, dump, load, tombstone
from gateway.tenants import ANONYMOUS, Tenant

log = logging.getLogger("cachelane.tenants")

REFRESH_S = 1.0  # admin changes reach other gateways within ~1 s: one HGETALL per second each
FILE_AT = 0.0  # a file's tenants are older than any admin change
_REJECTED_REMEMBERED = 1024  # bad records logged once each; the memory of them stays bounded


class KeyInUse(Exception):
    """PUT of a key another tenant (or the admin) already has."""


class StoreUnavailable(Exception):
    """The shared store (Redis) did not confirm a write. This gateway changed nothing; a write
    that timed out may still have reached Redis, and then every gateway adopts it."""


def record_of(config: TenantConfig, keyring: Keyring, at: float) -> Record:
    digest = (
        keyring.digest_of_sha256(config.api_key_sha256)
        if config.api_key_sha256
        else keyring.digest(config.api_key or "")
    )
    return Record(config.name, digest, config.tenant_class, config.share_group, at)


class TenantStore:
    def __init__(
        self,
        configured: Iterable[TenantConfig],
        keyring: Keyring,
        *,
        open_mode: bool = False,
        redis: Any | None = None,
        redis_key: str = "cl:tenants",
        reserved_digests: Iterable[str] = (),
        on_rejected: Callable[[str], None] = lambda _reason: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`reserved_digests`: keys no tenant may take (the admin key's digest)."""
        self._keyring = keyring
        self._open = open_mode
        self._file = {t.name: record_of(t, keyring, FILE_AT) for t in configured}
        self._known: dict[str, Record] = {}  # admin records (and tombstones) this gateway has seen
        self._redis = redis
        self._redis_key = redis_key
        self._reserved = frozenset(reserved_digests)
        self._on_rejected = on_rejected
        self._clock = clock
        self._rejected: set[tuple[str, str]] = set()
        self._verified: dict[tuple[bytes | str, bytes | str], Record] = {}
        self._by_digest: dict[str, Record] = {}
        self._rebuild()

    @property
    def open_mode(self) -> bool:
        return self._open

    def authenticate(self, api_key: str | None) -> Tenant | None:
        if self._open:
            return ANONYMOUS
        if not api_key:
            return None
        record = self._by_digest.get(self._keyring.digest(api_key))
        return None if record is None else _tenant(record)

    def list(self) -> list[Tenant]:
        return sorted((_tenant(r) for r in self._by_digest.values()), key=lambda t: t.name)

    async def put(self, config: TenantConfig) -> Tenant:
        """Create or replace a tenant. Raises KeyInUse, or StoreUnavailable (see there)."""
        record = record_of(config, self._keyring, self._next_at(config.name))
        owner = self._by_digest.get(record.digest or "")
        if record.digest in self._reserved or (owner is not None and owner.name != config.name):
            raise KeyInUse(config.name)
        await self._write([record])
        self._known[record.name] = record
        self._rebuild()
        return _tenant(record)

    async def remove(self, name: str) -> bool:
        """Delete a live tenant (file or admin) on every gateway. False: there was none."""
        if not any(r.name == name for r in self._by_digest.values()):
            return False
        record = tombstone(name, self._next_at(name))
        await self._write([record])
        self._known[name] = record
        self._rebuild()
        return True

    async def refresh(self) -> None:
        """Adopt newer records from Redis; write back those it lacks, holds older, or garbled.
        Open mode checks no key, so it reads no record either."""
        if self._redis is None or self._open:
            return
        raw = await self._redis.hgetall(self._redis_key)
        stored: dict[str, Record] = {}
        verified: dict[tuple[bytes | str, bytes | str], Record] = {}
        for field, value in raw.items():
            # A value seen last time is not parsed and verified again: ~20 us per record
            # (`python -m loadtest.bench.tenant_refresh`), so 1000 tenants would hold the event
            # loop ~20 ms every second.
            record = self._verified.get((field, value)) or self._trusted(field, value)
            if record is not None:
                stored[record.name] = verified[(field, value)] = record
        self._verified = verified  # only what the hash holds now: bounded by its size
        for name, record in stored.items():
            mine = self._known.get(name)
            if mine is None or record.newer_than(mine):
                self._known[name] = record
        behind = [r for name, r in self._known.items() if stored.get(name) != r]
        if behind:
            log.warning(
                "re-writing %d tenant record(s) missing, older or unreadable in Redis "
                "(restarted without persistence, or changed by hand)",
                len(behind),
            )
            await self._write(behind)
        self._rebuild()

    async def load(self) -> None:
        """The first refresh, before the gateway serves: a tenant deleted elsewhere stays deleted
        from the first request on. Redis down: the file's tenants until it answers."""
        try:
            await self.refresh()
        except Exception as err:
            log.warning("could not read the tenants in Redis at start: %r", err)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as err:  # Redis down: keep the last view
                log.warning("tenant refresh failed, keeping the last view: %r", err)

    def _trusted(self, field: bytes | str, value: bytes | str) -> Record | None:
        try:
            name, text = _text(field), _text(value)
            return load(name, text, self._keyring)
        except UnicodeDecodeError:
            reason, detail = "malformed", "malformed: not UTF-8"
        except RecordError as err:
            reason, detail = err.reason, str(err)
        seen = (repr(field), repr(value))
        if seen not in self._rejected:
            if len(self._rejected) >= _REJECTED_REMEMBERED:
                self._rejected.clear()
            self._rejected.add(seen)
            self._on_rejected(reason)
            log.warning("ignoring tenant record %s in Redis: %s", seen[0], detail)
        return None

    async def _write(self, records: Sequence[Record]) -> None:
        if self._redis is None:
            return
        mapping = {r.name: dump(r, self._keyring) for r in records}
        try:
            await self._redis.hset(self._redis_key, mapping=mapping)
        except Exception as err:
            raise StoreUnavailable(repr(err)) from err

    def _next_at(self, name: str) -> float:
        """Now, or just after this name's last record if the clock says otherwise."""
        last = self._known.get(name)
        now = self._clock()
        return now if last is None or now > last.at else last.at + 0.001

    def _rebuild(self) -> None:
        live = {**self._file, **self._known}
        by_digest: dict[str, Record] = {}
        # one key, two tenants (a race between gateways): the first to take it keeps it
        for record in sorted(live.values(), key=lambda r: (r.at, r.name)):
            if not record.deleted and record.digest is not None:
                by_digest.setdefault(record.digest, record)
        self._by_digest = by_digest


def _tenant(record: Record) -> Tenant:
    return Tenant(record.name, record.tenant_class, record.share_group)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
