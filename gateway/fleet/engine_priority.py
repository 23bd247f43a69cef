"""Whether a replica's engine schedules by `priority`, asked rather than assumed.

vLLM takes a request's `priority` only when it runs `--scheduling-policy priority`; under its
default, fcfs, a non-zero priority is refused with 400 "Got priority -1 but Priority scheduling
is not enabled." (its v1 engine's input processor; the simulator answers the same words). A
pool that sends each class as `priority` (pools[].engine_priority) therefore has every replica
asked with a one-token generation carrying the critical class's priority when a health check
admits it (gateway/fleet/health_checks.py), and a refusal of a proxied request tells the same
(gateway/serving/proxy.py sends that request again without it): the client never sees it.

A replica whose engine refuses is sent no priority (`record`: its routing rules lose
engine_priority); the gateway's flow control still orders the classes. /ready shows
each replica's answer, `cachelane check-config --probe` asks the config's replicas the same.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from routing.types import ENGINE_PRIORITY, TenantClass

log = logging.getLogger("cachelane.registry")

PRIORITY_REFUSED = b"Priority scheduling is not enabled"
# vLLM's v1 input processor: ValueError(f"Got priority {priority} but Priority scheduling is not
# enabled."), which its OpenAI server answers with 400 (loadtest/sim/server.py copies the words).

PROBE_PROMPT = "ping"  # any prompt: one token is generated, and thrown away
PROBE_PRIORITY = ENGINE_PRIORITY[TenantClass.CRITICAL]  # non-zero: an fcfs engine refuses it


def refuses_priority(status: int, content: bytes) -> bool:
    """Whether an engine's answer is its refusal of a `priority` (never the client's fault)."""
    return status == 400 and PRIORITY_REFUSED in content


def probe_body(model: str) -> dict[str, Any]:
    """A one-token completion carrying a non-zero priority (completions: every
    OpenAI-compatible engine serves it without a chat template)."""
    return {
        "model": model,
        "prompt": PROBE_PROMPT,
        "max_tokens": 1,
        "stream": False,
        "priority": PROBE_PRIORITY,
    }


async def accepts_priority(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    headers: dict[str, str],
    timeout_s: float,
) -> bool:
    """Ask the engine at `url` (a replica's base URL) with one generation: True if it answered
    a prioritised request, False if it refused the field; raises httpx.HTTPError for any other
    failure (unreachable, another 4xx or a 5xx: the question stays open)."""
    resp = await client.post(
        f"{url}/v1/completions", json=probe_body(model), headers=headers, timeout=timeout_s
    )
    if refuses_priority(resp.status_code, resp.content):
        return False
    resp.raise_for_status()
    return True


def record(replica: Replica, accepted: bool, how: str) -> None:
    """What the replica's engine did with a `priority` (`how`: "probe" or "request"): it is
    sent one only while it has not refused one; a change is said in the log."""
    if replica.accepts_priority is accepted:
        return
    before, replica.accepts_priority = replica.accepts_priority, accepted
    Registry.move(replica, replica.pool)  # its rules follow
    if not accepted:
        log.warning(
            "replica %s refused a request's `priority` (%s): its engine does not run "
            "--scheduling-policy priority, though pool %r sets engine_priority; it is sent no "
            "priority (the gateway's flow control still orders the classes): start its engine "
            "with --scheduling-policy priority, or set engine_priority: false",
            replica.name,
            how,
            replica.pool.name,
        )
    elif before is False:
        log.info("replica %s takes `priority` again (%s)", replica.name, how)
