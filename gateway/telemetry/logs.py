"""Request ids, the access log and the log format (`cachelane serve --log-format text|json`).

- `x-request-id`: taken from the client when it is 1..128 safe characters (letters, digits,
  `.`, `_`, `-`, `:`), otherwise a new one is generated; it is echoed on the response, forwarded
  to the replica (`upstream_headers`), and put on every log record written while the request is
  handled (`RequestIdFilter`, from a context variable set by `AccessWatch`).
- One access line per request (logger `cachelane.access`), written when the response has ended
  (for a stream, when the stream ends), errors included: request id, method, path, status and
  error code (a stream that broke after its 200 head: the error it ended with), tenant, class,
  model, replica, reason, TTFT ms (streams: from arrival to the first byte sent), e2e ms, prompt
  tokens (the engine's usage, else the gateway's count), cached tokens (the engine's usage),
  expected cached tokens. Probes (/health, /ready, /metrics) log it at DEBUG.
- httpx's and httpcore's per-request INFO lines (every health check and scrape) are silenced.
- No client can write a line of its own (a forged record) into the log. In the text format a
  record is one line: every access field that holds anything but printable ASCII other than
  space, `"`, `=` and `\\` is written as a JSON string (control characters, newlines, tabs,
  quotes and every non-ASCII character escaped), and control, format (bidi, zero-width) and
  line-separator characters in any other message are escaped (`\\n`, `\\x1b`, `\\u202e`); a
  traceback's lines follow indented, so a line that starts with a timestamp is always a record.
  The JSON format writes one JSON object a line, its strings escaped by json.dumps.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Scope

if TYPE_CHECKING:
    from gateway.serving.plan import Plan
    from gateway.tenancy.tenants import Tenant

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_SAFE_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
LOG_FORMATS = ("text", "json")
QUIET_LOGGERS = ("httpx", "httpcore")  # a line per health check and scrape at INFO
_ERROR_BODY_LIMIT = 65_536  # an error body is read this far for its code

access_log = logging.getLogger("cachelane.access")


@dataclass
class Access:
    """What the access line says of one request; filled in while it is handled."""

    request_id: str
    method: str
    path: str
    started_s: float = field(default_factory=time.perf_counter)
    status: int | None = None
    code: str | None = None
    tenant: str | None = None
    tenant_class: str | None = None
    model: str | None = None
    replica: str | None = None
    reason: str | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    expected_cached_tokens: int | None = None

    def fields(self, e2e_s: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "code": self.code,
            "tenant": self.tenant,
            "class": self.tenant_class,
            "model": self.model,
            "replica": self.replica,
            "reason": self.reason,
            "ttft_ms": self.ttft_ms,
            "e2e_ms": round(e2e_s * 1000, 3),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "expected_cached_tokens": self.expected_cached_tokens,
        }


_current: contextvars.ContextVar[Access | None] = contextvars.ContextVar(
    "cachelane_request", default=None
)


def current_access() -> Access | None:
    """The access record of the request being handled, if any."""
    return _current.get()


def current_request_id() -> str | None:
    access = _current.get()
    return access.request_id if access is not None else None


def clean_request_id(given: str | None) -> str:
    """The client's id if it is safe to log and forward, else a new one (32 hex digits)."""
    if given is not None and _SAFE_REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def upstream_headers() -> dict[str, str]:
    """Headers for the replica: the request's id, when a request is being handled."""
    request_id = current_request_id()
    return {REQUEST_ID_HEADER: request_id} if request_id is not None else {}


def note_tenant(tenant: Tenant) -> None:
    access = _current.get()
    if access is not None:
        access.tenant = tenant.name
        access.tenant_class = tenant.tenant_class.value


def note_plan(plan: Plan) -> None:
    """The routing decision, for the access line (the replica that answered wins over it)."""
    access = _current.get()
    if access is None:
        return
    note_tenant(plan.tenant)
    d = plan.decision
    access.model = plan.model
    access.replica = d.replica
    access.reason = d.reason.value
    access.prompt_tokens = plan.prompt_tokens
    access.expected_cached_tokens = d.expected_cached_tokens


def note_usage(prompt_tokens: int | None, cached_tokens: int | None) -> None:
    """The engine's usage of the answer (read from its events or body: gateway/serving/usage.py)."""
    access = _current.get()
    if access is None:
        return
    if prompt_tokens is not None:
        access.prompt_tokens = prompt_tokens
    if cached_tokens is not None:
        access.cached_tokens = cached_tokens


def note_stream_failed(status: int, code: str) -> None:
    """A stream that broke after its 200 head went out: the line says how it really ended."""
    access = _current.get()
    if access is not None:
        access.status, access.code = status, code


class AccessWatch:
    """One request's access record while it is answered: opened from its scope (the request id
    taken or made, the context variable set), fed every message sent (`seen`), closed when the
    response has ended (the access line written, the variable reset); gateway/http/request_layer.py
    calls it from its one layer."""

    __slots__ = ("_error_body", "_stream", "_token", "access")

    def __init__(self, scope: Scope) -> None:
        given = None
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        self.access = Access(
            clean_request_id(given), scope.get("method", ""), scope.get("path", "")
        )
        self._token = _current.set(self.access)
        self._stream = False
        self._error_body = bytearray()

    def seen(self, message: Message) -> Message:
        """The message as it is sent on (a head gets the request id), noted in the record."""
        access = self.access
        if message["type"] == "http.response.start":
            access.status = message["status"]
            headers = [(k, v) for k, v in message.get("headers", ()) if k != b"x-request-id"]
            headers.append((b"x-request-id", access.request_id.encode()))
            message = {**message, "headers": headers}
            for k, v in headers:
                if k == b"x-cachelane-replica":
                    access.replica = v.decode("latin-1")
                elif k == b"content-type":
                    self._stream = v.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            body: bytes = message.get("body", b"")
            if body and self._stream and access.ttft_ms is None:
                access.ttft_ms = round((time.perf_counter() - access.started_s) * 1000, 3)
            error_body = self._error_body
            if (access.status or 0) >= 400 and len(error_body) < _ERROR_BODY_LIMIT:
                error_body.extend(body[: _ERROR_BODY_LIMIT - len(error_body)])
        return message

    @property
    def began(self) -> bool:
        """Whether a response began: its head was sent."""
        return self.access.status is not None

    def failed(self) -> None:
        """The app raised: a response that never began is logged as a 500."""
        if self.access.status is None:
            self.access.status = 500

    def close(self) -> None:
        access = self.access
        if access.code is None and self._error_body:
            access.code = _error_code(bytes(self._error_body))
        level = logging.DEBUG if access.path in PROBE_PATHS else logging.INFO
        if access_log.isEnabledFor(level):  # the line is built only when it is written
            fields = access.fields(time.perf_counter() - access.started_s)
            access_log.log(level, key_values(fields), extra={"access": fields})
        _current.reset(self._token)


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return str(code) if code is not None else None
    return None


_BARE_VALUE = re.compile(r"[!#-<>-\[\]-~]+")  # printable ASCII but space, `"`, `=`, `\`


def key_values(fields: dict[str, Any]) -> str:
    """`k=v` pairs: None as `-`, a value with a space, quote, `=`, `\\` or anything but
    printable ASCII as a JSON string. An int or float is written as str() writes it, always
    bare, without the pattern's test (most of an access line's values are numbers)."""
    parts = []
    for k, value in fields.items():
        if value is None:
            parts.append(f"{k}=-")
        elif type(value) is int or type(value) is float:
            parts.append(f"{k}={value}")
        else:
            text = str(value)
            if not _BARE_VALUE.fullmatch(text):
                text = json.dumps(text, ensure_ascii=True)
            parts.append(f"{k}={text}")
    return " ".join(parts)


_UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """`text` with every control, format (bidi, zero-width), line or paragraph separator and
    surrogate character escaped: it cannot end its log line or make the rest read otherwise."""
    if text.isascii() and text.isprintable():
        return text
    out = []
    for c in text:
        if c.isascii() and c.isprintable():
            out.append(c)
        elif c in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[c])
        elif unicodedata.category(c) in _UNPRINTABLE_CATEGORIES:
            code = ord(c)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(c)
    return "".join(out)


class RequestIdFilter(logging.Filter):
    """Puts the request id of the request being handled (or None) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


class TextFormatter(logging.Formatter):
    """`2026-01-01 12:00:00,000 INFO cachelane.proxy: message request_id=...`, one line a record
    (one_line); the access line's message is already its key=value fields. A traceback follows
    on lines indented by TRACE_INDENT, each escaped the same way."""

    TRACE_INDENT = "  "

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        line = f"{record.asctime} {record.levelname} {record.name}: {one_line(record.message)}"
        request_id = getattr(record, "request_id", None)
        if request_id is not None and not hasattr(record, "access"):
            line += f" request_id={one_line(str(request_id))}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        stack = self.formatStack(record.stack_info) if record.stack_info else ""
        for text in (record.exc_text or "", stack):
            for extra in text.splitlines():
                line += "\n" + self.TRACE_INDENT + one_line(extra)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601), level, logger, msg, request_id (when handling
    a request), exc (a traceback), and the access line's fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out["msg"] = f"{access['method']} {access['path']} {access['status']}"
            out.update(access)
        else:
            out["msg"] = record.getMessage()
            request_id = getattr(record, "request_id", None)
            if request_id is not None:
                out["request_id"] = request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str)


def configure_logging(level: str, log_format: str = "text") -> logging.Handler:
    """One handler on the root logger (stderr) in `log_format`, with the request id filter;
    httpx's and httpcore's per-request lines below WARNING dropped."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet_http_clients()
    return handler


def quiet_http_clients() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
