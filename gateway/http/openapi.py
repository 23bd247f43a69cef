"""The gateway's OpenAPI schema (/openapi.json, served when `exposure.docs` is on): FastAPI's own
for the routes it declares, plus the request bodies of the OpenAI endpoints, which the gateway
reads itself (gateway/http/body.py) and FastAPI therefore cannot describe.

The bodies are the part of OpenAI's chat and completions requests the gateway reads (the prompt,
the model, the stream flag and the token limits) and the common sampling fields; like the
OpenAI API, the gateway passes every other field through to the engine
(engine-control fields excepted: gateway/http/body_fields.py), so the schemas allow more properties.
tests/integration/test_schemathesis.py generates requests from this schema against a running
gateway and asserts that none is answered 5xx.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_TEXT_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART: dict[str, Any] = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": {"type": "string"}, "detail": {"type": "string"}},
        },
    },
}
_TOOL_CALL: dict[str, Any] = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                {"type": "null"},
            ]
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
    },
}
_STOP: dict[str, Any] = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "A model the replicas serve (GET /v1/models)."},
    "max_tokens": {"type": "integer", "minimum": 1},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "stop": _STOP,
    "seed": {"type": "integer"},
    "user": {"type": "string"},
    "cache_salt": {
        "type": "string",
        "minLength": 1,
        "description": "vLLM's: requests share cached prefixes only within one salt (and one "
        "tenant: the gateway folds the tenant's in).",
    },
}
CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
    },
}
COMPLETIONS_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        },
    },
}
ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}


def _operation(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": ERROR}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "The engine's answer: JSON, or server-sent events when "
                    "`stream` is true.",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                **{
                    status: {"description": what, **error}
                    for status, what in (
                        ("400", "Bad request"),
                        ("401", "Missing or invalid API key"),
                        ("404", "No such model"),
                        ("413", "Body too large"),
                        ("429", "Rate limit reached (Retry-After)"),
                        ("503", "No replica can serve it now (Retry-After)"),
                    )
                },
            },
        }
    }


def schema_of(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """app.openapi: FastAPI's schema with the chat and completions bodies and bearer auth."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema["paths"]["/v1/chat/completions"] = _operation(
                "Create a chat completion", CHAT_BODY
            )
            schema["paths"]["/v1/completions"] = _operation("Create a completion", COMPLETIONS_BODY)
            components = schema.setdefault("components", {})
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
