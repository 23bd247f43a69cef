"""The Responses API's state. An engine keeps a stored response in its own process (vLLM:
its OpenAIServingResponses response_store, vllm/entrypoints/openai/serving_responses.py), so
reading one, deleting one, cancelling one and continuing one (`previous_response_id`) must reach
the replica that created it.

- Learning: the id of each answer to POST /v1/responses is read from the answer as it passes
  (a whole answer: its JSON `id`; a stream: its first event, `response.created`) and remembered
  as id -> (replica, tenant) for RESPONSE_TTL_S, in the index's key-value
  (gateway/index/keyvalue.py): in this gateway's memory, and in Redis when the index lives
  there, so every gateway finds it. The relay does not wait for the write (Redis's is sent in
  the background; the local copy is written at once and answers while Redis is away).
- Continuing: a request with a remembered `previous_response_id` is pinned to its replica:
  the planner routes it on that replica alone (`pinned`, called on the planner's candidates).
  An id the gateway does not know is never sent on (fail closed: an engine's store has no
  tenants, and the id may be another tenant's there).
- GET, DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel (vLLM's routes; the
  engines have no input_items route) are relayed to that replica as they are; an error answer
  becomes the gateway's own (gateway/http/errors.py replica_answer_error).

Errors: an id not remembered (never seen, expired, lost with Redis's data), or remembered for
another tenant, is 404 `response_not_found` in every route, continuations included
(another tenant's responses are not there for it); a replica that left the fleet is 410
`response_replica_gone` (what it stored is gone with it); one that is down is 503
`response_replica_unavailable` with Retry-After (it may come back with its store).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterable, AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.http.errors import ApiError, replica_answer_error, retry_later
from gateway.index.keyvalue import MemoryKeyValue, RedisKeyValue
from gateway.telemetry import logs

if TYPE_CHECKING:
    from gateway.fleet.registry import Registry
    from gateway.fleet.replica import Replica
    from gateway.tenancy.tenants import Tenant

log = logging.getLogger("cachelane.responses")

RESPONSE_TTL_S = 30 * 24 * 3600.0
# OpenAI keeps a stored response 30 days (platform.openai.com/docs/guides/conversation-state,
# "Response objects are saved for 30 days by default"); an engine may forget it sooner (vLLM's
# store lives as long as its process), and then answers 404 itself.
KEY_PREFIX = "cl:resp"
HEAD_LIMIT_BYTES = 64 * 1024  # a stream's `response.created` is its first event: well within
RETRY_AFTER_S = 1  # a replica that is down is checked again by the health checker within this
_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")  # what a path segment may hold before it is relayed
_EVENT_SPLIT = re.compile(rb"\r?\n\r?\n")

_pinned: ContextVar[str | None] = ContextVar("cachelane_pinned_replica", default=None)


def pinned(replicas: list[Replica]) -> list[Replica]:
    """The planner's candidates for the request being handled: only the replica that stored
    the response it continues, when it continues one."""
    name = _pinned.get()
    return replicas if name is None else [r for r in replicas if r.name == name]


def created_id(head: bytes) -> str | None:
    """The id in a Responses stream's `response.created` event, from the stream's first bytes;
    "" when its first event is complete and is not that one (nothing to learn), None while the
    first event is still incomplete."""
    frames = _EVENT_SPLIT.split(head)
    if len(frames) < 2:
        return None
    data = b"".join(
        line[5:].strip() for line in frames[0].splitlines() if line.startswith(b"data:")
    )
    try:
        event = orjson.loads(data)
        found = event["response"]["id"] if event.get("type") == "response.created" else ""
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return ""
    return found if isinstance(found, str) else ""


class ResponseOwners:
    """Which replica stored each response, and for which tenant."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        *,
        redis: Any | None = None,
        ttl_s: float = RESPONSE_TTL_S,
    ) -> None:
        self._registry = registry
        self._client = client
        self._local = MemoryKeyValue()
        self._shared = RedisKeyValue(redis, KEY_PREFIX) if redis is not None else None
        self._ttl_s = ttl_s
        self._pending: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ the id -> replica map

    def remember(self, response_id: str, replica: str, tenant: Tenant) -> None:
        value = orjson.dumps({"replica": replica, "tenant": tenant.name}).decode()
        self._local.put_now(response_id, value, self._ttl_s)
        if self._shared is not None:
            self._background(self._shared.put(response_id, value, self._ttl_s))

    async def owner(self, response_id: str, tenant: Tenant) -> str | None:
        """The replica that stored the tenant's response, None if the gateway knows none."""
        entry = await self._entry(response_id)
        if entry is None or entry.get("tenant") != tenant.name:
            return None
        return str(entry["replica"])

    async def _entry(self, response_id: str) -> dict[str, Any] | None:
        """What the gateway remembers of a response: its replica and tenant."""
        value = None
        if self._shared is not None:
            try:
                value = await self._shared.get(response_id)
            except Exception as err:  # the local copy answers for what this gateway learnt
                log.warning("response owners in Redis unreadable: %r", err)
        value = value or self._local.get_now(response_id)
        if value is None:
            return None
        entry: dict[str, Any] = orjson.loads(value)
        return entry

    async def forget(self, response_id: str) -> None:
        await self._local.delete(response_id)
        if self._shared is not None:
            self._background(self._shared.delete(response_id))

    def _background(self, write: Any) -> None:
        async def guarded() -> None:
            try:
                await write
            except Exception as err:  # the local copy still answers in this gateway
                log.warning("response owners in Redis not updated: %r", err)

        task = asyncio.ensure_future(guarded())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    # ------------------------------------------------------------------ a request's side

    async def pin(self, body: dict[str, Any], tenant: Tenant) -> None:
        """Pin the request being handled (this task) to the replica that stored the response
        it continues; raise when that replica cannot answer."""
        previous = body.get("previous_response_id")
        if previous is None:
            return
        entry = (
            await self._entry(previous)
            if isinstance(previous, str) and _ID.match(previous)
            else None
        )
        # an id the gateway does not know (expired, lost, stored before a restart or through a
        # gateway whose record is gone) may be another tenant's on some replica: as another
        # tenant's, it is not there for this one
        if entry is None or entry.get("tenant") != tenant.name:
            raise ApiError(
                404,
                f"No response found with id {previous!r}.",
                code="response_not_found",
                param="previous_response_id",
            )
        name = str(entry["replica"])
        self.replica_of(name, previous)
        _pinned.set(name)

    def replica_of(self, name: str, response_id: str) -> Replica:
        replica = self._registry.replicas.get(name)
        if replica is None:
            raise ApiError(
                410,
                f"response {response_id!r} was stored on replica {name!r}, which has left the "
                "fleet: it is gone",
                code="response_replica_gone",
            )
        if not replica.healthy:
            raise retry_later(
                503,
                f"response {response_id!r} is stored on replica {name!r}, which is down; "
                "retry later",
                code="response_replica_unavailable",
                retry_after_s=RETRY_AFTER_S,
            )
        return replica

    def learn(self, response: Response, tenant: Tenant) -> None:
        """Remember the id of an answer to POST /v1/responses, read as it passes."""
        replica = response.headers.get("x-cachelane-replica")
        if replica is None or response.status_code >= 400:
            return
        if isinstance(response, StreamingResponse):  # a RelayResponse: a relayed stream
            response.body_iterator = self._watch(response.body_iterator, replica, tenant)
            return
        try:
            found = orjson.loads(response.body).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(found, str) and _ID.match(found):
            self.remember(found, replica, tenant)

    async def _watch(
        self, chunks: AsyncIterable[Any], replica: str, tenant: Tenant
    ) -> AsyncIterator[Any]:
        head = b""
        looking = True
        try:
            async for chunk in chunks:
                if looking:
                    head += chunk if isinstance(chunk, bytes) else str(chunk).encode()
                    found = created_id(head)
                    if found:
                        self.remember(found, replica, tenant)
                    looking = found is None and len(head) < HEAD_LIMIT_BYTES
                yield chunk
        finally:
            closing = getattr(chunks, "aclose", None)
            if closing is not None:
                await closing()

    # ------------------------------------------------------------------ GET, DELETE, cancel

    async def relay(
        self, request: Request, tenant: Tenant, response_id: str, suffix: str = ""
    ) -> Response:
        """The request relayed to the replica that stored `response_id` (`suffix`: "" or
        "/cancel"), its answer as it is."""
        name = await self.owner(response_id, tenant) if _ID.match(response_id) else None
        if name is None:
            raise ApiError(
                404, f"No response found with id {response_id!r}.", code="response_not_found"
            )
        replica = self.replica_of(name, response_id)
        upstream = self._client.build_request(
            request.method,
            f"{replica.url}/v1/responses/{response_id}{suffix}",
            params=request.query_params,
            headers=replica.request_headers(logs.upstream_headers()),
        )
        try:
            answer = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as err:
            raise retry_later(
                502,
                f"replica {name} failed: {type(err).__name__}",
                code="upstream_unavailable",
                retry_after_s=RETRY_AFTER_S,
            ) from err
        headers = {"x-cachelane-replica": name}
        if "content-type" in answer.headers:
            headers["content-type"] = answer.headers["content-type"]
        if request.method == "DELETE" and answer.status_code < 400:
            await self.forget(response_id)
        refused = answer.status_code >= 400
        if headers.get("content-type", "").startswith("text/event-stream") and not refused:
            return StreamingResponse(  # GET ?stream=true: a background response's events
                answer.aiter_raw(),
                status_code=answer.status_code,
                headers=headers,
                background=BackgroundTask(answer.aclose),
            )
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
        if answer.status_code == 404:  # the engine forgot it (a restart): as the gateway says
            raise ApiError(
                404, f"No response found with id {response_id!r}.", code="response_not_found"
            )
        if refused:  # the gateway's own error, never the replica's body
            error = replica_answer_error(name, answer.status_code, content)
            error.headers["x-cachelane-replica"] = name
            raise error
        return Response(content, status_code=answer.status_code, headers=headers)
