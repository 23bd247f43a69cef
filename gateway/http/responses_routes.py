"""The Responses API's stored-response routes: GET, DELETE and cancel of a response, sent to
the replica that created it (gateway/serving/responses.py keeps which one)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.fleet import replica_auth
from gateway.serving.handling import authenticate
from gateway.state import Gateway

responses_router = APIRouter()


async def _relayed(request: Request, response_id: str, suffix: str = "") -> Response:
    gw: Gateway = request.app.state.gw
    tenant = authenticate(gw, request)
    replica_auth.remember_client_headers(request.headers)  # pools[].forward_headers
    return await gw.responses.relay(request, tenant, response_id, suffix)


@responses_router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    return await _relayed(request, response_id)


@responses_router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    return await _relayed(request, response_id)


@responses_router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    return await _relayed(request, response_id, "/cancel")
