"""What Locust's request statistics cannot hold: time to first token and the prefix hit rate.

Locust's stats are for requests; recording TTFT or cached tokens as extra "requests" multiplies
the request rate of the Aggregated row, skews its response times and trips `--check-*`
thresholds. Here they are kept beside it, per shape:

  TTFT           a histogram of the time to the first generated text, in ms, rounded like
                 Locust rounds response times (so it is bounded and merges across workers);
  cached tokens  usage.prompt_tokens_details.cached_tokens and prompt_tokens, summed: their
                 ratio is the prefix hit rate the engines actually gave.

Workers send theirs to the master with every stats report (Locust's report_to_master /
worker_report events); the master (or a local runner) logs a table when the test stops, writes
`<--csv prefix>_outcomes.csv` when --csv is set, and serves the live figures as JSON at
/cachelane/outcomes in the web UI.

Failures: Locust groups its error rows by message, so a failure is named by its status and the
error envelope's `code` only (failure_name): a 429 whose message says "retry after 19 s", then
"18 s", is one row. A refused user waits what the answer's Retry-After asks (retry_after_s)
before its next request, as the OpenAI SDKs do.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routing.whatif.summary import percentile

MAX_RETRY_AFTER_S = 60.0
# The longest wait a user honours: the gateway's rate limits and failed-auth limit are a minute's
# budgets (gateway/tenancy/rate_limits.py, gateway/http/exposure.py), so none of its Retry-After
# values is longer.


def failure_name(status: int, body: str) -> str:
    """A failed answer as one Locust error row: "HTTP 429 rate_limit_exceeded" (the envelope's
    code, else its type), never its message, which may change from one answer to the next."""
    code = None
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict):
            code = error.get("code") or error.get("type")
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status} {code}" if isinstance(code, str) and code else f"HTTP {status}"


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The seconds an answer's Retry-After asks for (its delay-seconds form), at most
    MAX_RETRY_AFTER_S; None without one."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: the gateway sends none
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def rounded_ms(ms: float) -> int:
    """Locust's rounding of a response time: exact below 100 ms, then 2 significant digits."""
    value = round(ms)
    if value < 100:
        return value
    digits = 10 ** (len(str(value)) - 2)
    return int(round(value / digits) * digits)


@dataclass
class ShapeOutcomes:
    ttft_ms: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    requests: int = 0  # with a usage chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, ttft_ms: float | None, prompt_tokens: int, cached_tokens: int) -> None:
        if ttft_ms is not None:
            self.ttft_ms[rounded_ms(ttft_ms)] += 1
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def merge(self, data: dict[str, Any]) -> None:
        for ms, count in data["ttft_ms"].items():
            self.ttft_ms[int(ms)] += int(count)
        self.requests += int(data["requests"])
        self.prompt_tokens += int(data["prompt_tokens"])
        self.cached_tokens += int(data["cached_tokens"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_ms": {str(ms): n for ms, n in self.ttft_ms.items()},
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def ttft_percentile(self, q: float) -> float:
        """The q-quantile (0-1) of the times kept (rounded as Locust rounds them), by the one
        definition the project's reports use (routing/whatif/summary.py); NaN when empty."""
        return percentile([float(ms) for ms, n in self.ttft_ms.items() for _ in range(n)], q * 100)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else math.nan

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "ttft_p50_ms": self.ttft_percentile(0.5),
            "ttft_p95_ms": self.ttft_percentile(0.95),
            "ttft_p99_ms": self.ttft_percentile(0.99),
            "hit_rate": self.hit_rate,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }


class Outcomes:
    """TTFT and hit rate per shape, for one process (a worker's are sent on and cleared)."""

    def __init__(self) -> None:
        self.shapes: dict[str, ShapeOutcomes] = defaultdict(ShapeOutcomes)

    def add(self, shape: str, ttft_ms: float | None, prompt_tokens: int, cached: int) -> None:
        self.shapes[shape].add(ttft_ms, prompt_tokens, cached)

    def take(self) -> dict[str, Any]:
        """This process's figures since the last take (what a worker reports), then cleared."""
        out = {shape: s.to_dict() for shape, s in self.shapes.items()}
        self.shapes.clear()
        return out

    def merge(self, report: dict[str, Any]) -> None:
        for shape, data in report.items():
            self.shapes[shape].merge(data)

    def reset(self) -> None:
        self.shapes.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        return {shape: s.summary() for shape, s in sorted(self.shapes.items())}

    def write_csv(self, path: Path) -> None:
        rows = self.summary()
        columns = ["shape", *next(iter(rows.values()), {}).keys()]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for shape, row in rows.items():
                writer.writerow({"shape": shape, **row})


OUTCOMES = Outcomes()  # this process's; Locust runs one environment per process
