"""Which API key belongs to which tenant: the config file's tenants, changed by the admin API.

Authentication fails closed: in `auth.mode: keys` (the default) a request is served only with a
key of a live tenant, however few tenants there are (none: every request is refused). Only
`auth.mode: open` serves requests without a key, as the anonymous tenant, and then no key is
checked at all.

With the Redis index, admin changes go to one Redis hash (gateway/tenancy/records.py: signed
records, deletions as tombstones) that every gateway re-reads every REFRESH_S. Each gateway keeps
every record it has seen; a record missing from Redis, older there, or replaced by one that fails
its signature is written back, so a Redis restarted empty (or a hash deleted or tampered with) is
refilled by the first gateway that notices, and no change is lost while one gateway that saw it
lives. An admin record, tombstone included, overrides the file's tenant of the same name.

Revocations hold while Redis is away: until the first read of the hash succeeds, a gateway with
Redis serves no key at all (503 `tenants_not_loaded`, not ready in /ready, the gauge
cachelane_tenants_loaded at 0), since any file tenant may have been deleted there. Redis refusing
the gateway's credentials at start is a start-up error (TenantStoreRefused), not a retry loop.
After the first read, a failed refresh keeps the last view; failures are counted
(cachelane_tenant_refresh_errors_total{kind}), shown in /ready, and logged once when they start,
then at most once every REFRESH_LOG_EVERY_S, and once when Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from gateway.config import TenantConfig
from gateway.http.errors import ApiError
from gateway.tenancy.keys import Keyring
from gateway.tenancy.records import Record, RecordError, dump, load, tombstone
from gateway.tenancy.tenants import ANONYMOUS, Tenant
from routing.types import TenantClass

log = logging.getLogger("cachelane.tenants")

REFRESH_S = 1.0  # admin changes reach other gateways within ~1 s: one HGETALL per second each
REFRESH_LOG_EVERY_S = 60.0  # a Redis down for an hour writes ~60 lines, not 3600
NOT_LOADED_RETRY_AFTER_S = 1  # the next read of the tenants is REFRESH_S away
FILE_AT = 0.0  # a file's tenants are older than any admin change
_REJECTED_REMEMBERED = 1024  # bad records logged once each; the memory of them stays bounded


class KeyInUse(Exception):
    """PUT of a key another tenant (or the admin) already has."""


class TenantStoreRefused(RuntimeError):
    """Redis refused the gateway's credentials (a wrong password or ACL user): a start-up error,
    since no retry will ever succeed and the tenant table could never be read."""


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
        on_refresh: Callable[[str | None], None] = lambda _kind: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`reserved_digests`: keys no tenant may take (the admin key's digest); `on_refresh`
        hears of every read of Redis: None when it succeeded, else the kind of failure."""
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
        self._health = RefreshHealth(loaded=redis is None or open_mode, on_refresh=on_refresh)
        self._rebuild()

    @property
    def open_mode(self) -> bool:
        return self._open

    @property
    def loaded(self) -> bool:
        """False until the tenants in Redis were read once: no key is served before."""
        return self._health.loaded

    def status(self) -> dict[str, Any]:
        return self._health.status()

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The key's tenant, None for no or an unknown key; TenantsNotLoaded before the first
        read of Redis (any tenant may have been revoked there)."""
        if self._open:
            return ANONYMOUS
        if not self._health.loaded:
            raise TenantsNotLoaded()
        if not api_key:
            return None
        record = self._by_digest.get(self._keyring.digest(api_key))
        return None if record is None else _tenant(record)

    def list(self) -> list[Tenant]:
        return sorted((_tenant(r) for r in self._by_digest.values()), key=lambda t: t.name)

    async def put(self, config: TenantConfig) -> Tenant:
        """Create or replace a tenant. Raises KeyInUse or StoreUnavailable."""
        record = record_of(config, self._keyring, self._next_at(config.name))
        owner = self._by_digest.get(record.digest or "")
        if record.digest in self._reserved or (owner is not None and owner.name != config.name):
            raise KeyInUse(config.name)
        await self._write([record])
        self._known[record.name] = record
        self._rebuild()
        return _tenant(record)

    def get(self, name: str) -> Tenant | None:
        record = self._live_record(name)
        return None if record is None else _tenant(record)

    async def update(
        self, name: str, tenant_class: TenantClass, share_group: str | None
    ) -> Tenant | None:
        """Change a live tenant's class and share group, keeping its key. None: there is no
        tenant of that name. Raises StoreUnavailable."""
        record = self._live_record(name)
        if record is None:
            return None
        changed = replace(
            record, tenant_class=tenant_class, share_group=share_group, at=self._next_at(name)
        )
        await self._write([changed])
        self._known[name] = changed
        self._rebuild()
        return _tenant(changed)

    def _live_record(self, name: str) -> Record | None:
        record = {**self._file, **self._known}.get(name)
        return None if record is None or record.deleted else record

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
        self._rebuild()  # what was read is served, whether the write-back below works or not
        behind = [r for name, r in self._known.items() if stored.get(name) != r]
        if behind:
            await self._write(behind)
            log.warning(
                "re-wrote %d tenant record(s) missing, older or unreadable in Redis "
                "(restarted without persistence, or changed by hand)",
                len(behind),
            )

    async def load(self) -> None:
        """The first refresh, before the gateway serves: a tenant deleted elsewhere stays deleted
        from the first request on. Redis away: no key is served until it answers (run() keeps
        trying). Redis refusing the credentials: TenantStoreRefused. Open mode reads no record,
        but its PING still finds a wrong password at start."""
        if self._redis is None:
            return
        if self._open:
            try:
                await self._redis.ping()
            except Exception as err:
                _raise_if_refused(err)
                log.warning("Redis did not answer at start: %r", err)
            return
        failed = await self._refresh_once(
            "could not read the tenants in Redis at start; no API key is served until it answers"
        )
        if failed is not None:
            _raise_if_refused(failed)

    async def run(self) -> None:
        if self._redis is None or self._open:
            return
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._refresh_once(
                "tenant refresh failed, "
                + ("keeping the last view" if self._health.loaded else "no API key is served yet")
            )

    async def _refresh_once(self, failure: str) -> Exception | None:
        """One refresh, its outcome told to the health; returns the error, if any. A failed read
        is `failure`; a read that worked but whose write-back Redis refused counts as read."""
        try:
            await self.refresh()
        except StoreUnavailable as err:
            cause = err.__cause__ if isinstance(err.__cause__, Exception) else err
            self._health.read_not_written(cause)
            return cause
        except Exception as err:
            self._health.failed(err, failure)
            return err
        self._health.succeeded()
        return None

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

    def _live(self) -> tuple[Record, ...]:
        return tuple(r for r in {**self._file, **self._known}.values() if not r.deleted)

    def _rebuild(self) -> None:
        by_digest: dict[str, Record] = {}
        # one key, two tenants (a race between gateways): the first to take it keeps it
        for record in sorted(self._live(), key=lambda r: (r.at, r.name)):
            if record.digest is not None:
                by_digest.setdefault(record.digest, record)
        self._by_digest = by_digest


class TenantsNotLoaded(ApiError):
    """A key arrived before the first read of the tenants in Redis."""

    def __init__(self) -> None:
        super().__init__(
            503,
            "the gateway has not yet read the tenants from its store (Redis); retry shortly",
            code="tenants_not_loaded",
            type="server_error",
            headers={"retry-after": str(NOT_LOADED_RETRY_AFTER_S)},
        )


class RefreshHealth:
    """Whether the tenants were read once, and the current run of failed reads: what /ready
    shows, the metric hears, and the log says at a bounded rate."""

    def __init__(
        self,
        *,
        loaded: bool,
        on_refresh: Callable[[str | None], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loaded = loaded
        self._on_refresh = on_refresh
        self._clock = clock
        self.failures = 0  # in a row, since the last successful read
        self.last_error: str | None = None
        self._logged_at: float | None = None
        self._unlogged = 0

    def failed(self, err: Exception, what: str) -> None:
        self.failures += 1
        self.last_error = f"{type(err).__name__}: {err}"  # redis-py's repr drops the message
        self._on_refresh(_kind(err))
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < REFRESH_LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more failure(s) not logged)" if self._unlogged else ""
        log.warning("%s: %s%s", what, self.last_error, more)
        self._logged_at, self._unlogged = now, 0

    def read_not_written(self, err: Exception) -> None:
        """The tenants were read (and are served), but Redis refused the write-back."""
        if not self.loaded:
            self.loaded = True
            self._on_refresh(None)
        self.failed(err, "could not re-write tenant records to Redis")

    def succeeded(self) -> None:
        if self.failures:
            log.warning("tenant store (Redis) answers again after %d failed read(s)", self.failures)
        self.loaded = True
        self.failures, self.last_error, self._logged_at, self._unlogged = 0, None, None, 0
        self._on_refresh(None)

    def status(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "failures": self.failures, "last_error": self.last_error}


def _raise_if_refused(err: Exception) -> None:
    if _refused(err):
        raise TenantStoreRefused(
            f"Redis refused the gateway's credentials ({err}): check the password or user in "
            "index.redis_url (or index.redis_url_file)"
        ) from err


def _refused(err: Exception) -> bool:
    """Redis refused the credentials (WRONGPASS, NOAUTH, an ACL user without the rights)."""
    from redis.exceptions import AuthenticationError, NoPermissionError

    return isinstance(err, AuthenticationError | NoPermissionError)


def _kind(err: Exception) -> str:
    """A bounded label for a failed read: timeout, connection, auth or other."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if _refused(err):
        return "auth"
    if isinstance(err, RedisTimeoutError | TimeoutError):
        return "timeout"
    if isinstance(err, RedisConnectionError | OSError):
        return "connection"
    return "other"


def _tenant(record: Record) -> Tenant:
    return Tenant(record.name, record.tenant_class, record.share_group)


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
