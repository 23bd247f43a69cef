"""Replicas from DNS: each discovered pool's name resolved on an interval
(gateway/fleet/membership.py applies what changed).

`type: A`: the name's A and AAAA records, each address one replica on the configured port (a
Kubernetes headless Service lists its ready pods' addresses under its name). `type: SRV`: each
SRV target's addresses on the record's port (a headless Service's named port:
_PORTNAME._tcp.SERVICE.NAMESPACE.svc.cluster.local). Addresses become the replica URLs, so the
replicas are reached without resolving names again.

A name that does not exist (NXDOMAIN) or has no record means no replica (a Service scaled to
zero). A resolution that fails (timeout, SERVFAIL, refused) changes nothing: the pool keeps its
replicas, and health checks still take out the ones that stopped answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from gateway.config import DiscoveryConfig, PoolConfig, nameserver_address
from gateway.fleet.membership import Fleet
from gateway.telemetry.metrics import Metrics

log = logging.getLogger("cachelane.discovery")


class DiscoveryFailed(Exception):
    """The name could not be resolved now; what was known stays."""


def make_resolver(d: DiscoveryConfig) -> dns.asyncresolver.Resolver:
    """A resolver asking `d.nameservers` (else the system's), giving up after `d.timeout_s`;
    no cache: every resolution asks."""
    resolver = dns.asyncresolver.Resolver(configure=not d.nameservers)
    if d.nameservers:
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(*nameserver_address(s)) for s in d.nameservers
        ]
    resolver.lifetime = d.timeout_s
    resolver.cache = None
    return resolver


async def resolve(d: DiscoveryConfig, resolver: dns.asyncresolver.Resolver) -> list[str]:
    """The replicas' base URLs the name stands for now, sorted; DiscoveryFailed if it cannot be
    told."""
    if d.type == "A":
        assert d.port is not None  # DiscoveryConfig: type A has a port
        return sorted({_url(d.scheme, a, d.port) for a in await _addresses(resolver, d.name)})
    answer = await _query(resolver, d.name, "SRV")
    if answer is None:
        return []
    known = _additional_addresses(answer)
    urls: set[str] = set()
    for srv in answer:
        target = srv.target
        if target == dns.name.root:  # "." : the service is decidedly not available
            continue
        addresses = known.get(target) or await _addresses(resolver, target)
        urls |= {_url(d.scheme, a, srv.port) for a in addresses}
    return sorted(urls)


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str | dns.name.Name) -> set[str]:
    answers = await asyncio.gather(*(_query(resolver, name, t) for t in ("A", "AAAA")))
    return {rr.address for answer in answers if answer is not None for rr in answer}


async def _query(
    resolver: dns.asyncresolver.Resolver, name: str | dns.name.Name, rdtype: str
) -> dns.resolver.Answer | None:
    """The answer, or None when the name or the record type does not exist."""
    try:
        answer = await resolver.resolve(name, rdtype, raise_on_no_answer=False, search=False)
    except dns.resolver.NXDOMAIN:
        return None
    except dns.exception.DNSException as err:
        raise DiscoveryFailed(f"{rdtype} {name}: {err}") from None
    return answer if answer.rrset is not None else None


def _additional_addresses(answer: dns.resolver.Answer) -> dict[dns.name.Name, set[str]]:
    """The targets' addresses a server sent along with the SRV records (CoreDNS does)."""
    out: dict[dns.name.Name, set[str]] = {}
    for rrset in answer.response.additional:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            out.setdefault(rrset.name, set()).update(rr.address for rr in rrset)
    return out


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


class Discovery:
    """One resolution loop per discovered pool, owned by the gateway's lifespan."""

    def __init__(self, fleet: Fleet, metrics: Metrics) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._loops: dict[str, tuple[DiscoveryConfig, asyncio.Task[None]]] = {}
        self._failing: set[str] = set()  # pools whose last resolution failed (said once)
        self._empty: set[str] = set()  # pools whose name stands for no replica (said once)

    async def sync(self, pools: Sequence[PoolConfig]) -> None:
        """Follow these pools (at start-up, after a reload): a new or changed discovery is
        resolved before this returns, then every `interval_s`; a pool gone stops."""
        wanted = {p.name: p.discovery for p in pools if p.discovery is not None}
        stopped = []
        for name, (d, task) in list(self._loops.items()):
            if wanted.get(name) != d:
                task.cancel()
                stopped.append(task)
                del self._loops[name]
        await asyncio.gather(*stopped, return_exceptions=True)
        new = [(name, d, make_resolver(d)) for name, d in wanted.items() if name not in self._loops]
        await asyncio.gather(*(self.resolve_once(name, d, r) for name, d, r in new))
        for name, d, r in new:
            task = asyncio.create_task(self._loop(name, d, r), name=f"discovery {name}")
            self._loops[name] = (d, task)

    async def _loop(self, pool: str, d: DiscoveryConfig, r: dns.asyncresolver.Resolver) -> None:
        while True:
            await asyncio.sleep(d.interval_s)
            await self.resolve_once(pool, d, r)

    async def resolve_once(
        self, pool: str, d: DiscoveryConfig, resolver: dns.asyncresolver.Resolver
    ) -> None:
        """Resolve the pool's name and apply the answer; a failure is logged (once until it
        recovers) and changes nothing."""
        try:
            urls = await resolve(d, resolver)
        except DiscoveryFailed as err:
            if pool not in self._failing:
                self._failing.add(pool)
                log.warning("pool %r: cannot resolve its replicas (%s); keeping them", pool, err)
            self._metrics.discovery_resolutions.labels(pool, "failed").inc()
            return
        if pool in self._failing:
            self._failing.discard(pool)
            log.info("pool %r: %s %s resolves again", pool, d.type, d.name)
        if not urls and pool not in self._empty:
            log.warning("pool %r: %s %s stands for no address: no replica", pool, d.type, d.name)
        self._empty = self._empty - {pool} if urls else self._empty | {pool}
        await self._fleet.discovered(pool, urls)
        self._metrics.discovery_resolutions.labels(pool, "ok").inc()

    async def aclose(self) -> None:
        tasks = [task for _, task in self._loops.values()]
        self._loops.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
