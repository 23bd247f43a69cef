"""What the gateway records: OpenTelemetry traces and the opt-in traffic capture."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway import extras
from gateway.config.base import PositiveInt, Strict
from gateway.extras import OTEL_MODULES, missing_message


class TracingConfig(Strict):
    """OpenTelemetry spans, one per request (gateway/telemetry/tracing.py; the [otel] extra)."""

    enabled: bool = Field(
        default=False,
        description="Trace every request: a span with the routing decision and its outcome, "
        "continuing the client's W3C traceparent and sending its own to the replica. Needs the "
        "[otel] extra.",
    )
    endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://localhost:4318/v1/traces (the OTLP "
        "exporter's defaults; OTEL_EXPORTER_OTLP_HEADERS adds headers such as a token).",
    )
    service_name: str = Field(
        default="cachelane", min_length=1, description="The spans' service.name resource."
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces sampled (1.0: every one, the OpenTelemetry SDK's "
        "default sampler). A trace whose traceparent says sampled is always sampled.",
    )

    @model_validator(mode="after")
    def _check_installed(self) -> TracingConfig:
        missing = extras.missing_modules(OTEL_MODULES) if self.enabled else []
        if missing:
            raise ValueError(missing_message("tracing", "otel", missing))
        return self


DEFAULT_CAPTURE_MAX_BYTES = 256 * 1024 * 1024
# 256 MiB: a request is ~20 bytes per 16-token block (its hash in hex) plus ~600 bytes of fields,
# ~7 KB for a 6k-token prompt, so ~35k long requests: an hour at 10 requests/s.
DEFAULT_CAPTURE_MAX_RECORDS = 1_000_000
# Bounds a capture of short prompts (~1 KB each): max_bytes stops it first for long ones.


class CaptureConfig(Strict):
    """Opt-in traffic capture for `cachelane plan` (gateway/accounting/capture.py; format:
    routing/whatif/capture.py)."""

    path: str | None = Field(
        default=None,
        description="Write one JSON line per answered request to this file: the prompt's block "
        "hashes and token counts, arrival time, tenant, class, model, pool, replica, observed "
        "TTFT, cached tokens and the tier of the hit; never prompt text. Unset: no capture. "
        "A file already there is moved to PATH.1.",
    )
    max_bytes: PositiveInt = Field(
        default=DEFAULT_CAPTURE_MAX_BYTES,
        description="The capture stops (later requests are counted as dropped in "
        "cachelane_capture_records_total) when its next line would pass this size. 256 MiB: "
        "~35k requests of 6k-token prompts.",
    )
    max_records: PositiveInt = Field(
        default=DEFAULT_CAPTURE_MAX_RECORDS,
        description="The capture stops after this many requests.",
    )
