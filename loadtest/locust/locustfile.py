"""Locust scenarios for cachelane (or any OpenAI-compatible endpoint).

From an installed package (any directory), `cachelane locust` runs Locust on this file with the
rest of its arguments (loadtest/locust/run.py); `cachelane locust --help` lists the options
below with Locust's. From a checkout, `locust -f loadtest/locust/locustfile.py` as here:

A trace instead of the shapes (Mooncake's production traces, or a JSONL trace of this project's):
    locust -f loadtest/locust/locustfile.py --headless -u 64 -r 64 -t 120s --host ... \
        --trace mooncake:conversation_trace.jsonl@0:600 --trace-time-scale 0.1

Headless, every shape, weighted (chat 3, agent 3, rag 2, unique 1, shared_system 1, voice 1):
    locust -f loadtest/locust/locustfile.py --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8000

A mix by tags (tags: chat, agent, rag, unique, shared_system, voice; standard = all but voice,
critical = voice), or by user class names:
    locust -f loadtest/locust/locustfile.py --headless -u 10 -r 5 -t 60s --host ... --tags rag agent
    locust -f loadtest/locust/locustfile.py --headless -u 10 -r 5 -t 60s --host ... \
        VoiceUser ChatUser

A critical voice tenant under a burst of standard traffic (the shape sets users over time):
    locust -f loadtest/locust/locustfile.py,loadtest/locust/shapes.py --headless --host ...

Distributed: one master, several workers (same options on each, or env vars):
    locust -f loadtest/locust/locustfile.py --master --headless -u 200 -r 20 -t 5m \
        --expect-workers 4 \
        --host http://127.0.0.1:8000 --csv results/locust
    locust -f loadtest/locust/locustfile.py --worker --master-host 127.0.0.1     # x4, any machine

Tenant API keys: --api-key (every user) and per tenant --chat-api-key, --agent-api-key,
--rag-api-key, --unique-api-key, --voice-api-key, or the env vars CACHELANE_API_KEY,
CACHELANE_CHAT_API_KEY, ... --model (CACHELANE_MODEL) and --seed pick the model and the text.

Stats: Locust's request statistics hold the requests (POST per shape: the full streamed
response). Time to first token and the prefix hit rate per shape are kept beside them
(outcomes.py): logged as a table when the run ends, written to <--csv prefix>_outcomes.csv with
--csv, served as JSON at /cachelane/outcomes by the web UI, and merged from every worker.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner

from loadtest.locust.outcomes import OUTCOMES
from loadtest.locust.users import (
    AgentUser,
    ChatUser,
    RagUser,
    SharedSystemUser,
    TraceUser,
    UniqueUser,
    VoiceUser,
)
from loadtest.workloads.traces import DEFAULT_MODEL

__all__ = [
    "AgentUser",
    "ChatUser",
    "RagUser",
    "SharedSystemUser",
    "TraceUser",
    "UniqueUser",
    "VoiceUser",
]

TENANT_KEY_OPTIONS = ("chat", "agent", "rag", "unique", "voice")

log = logging.getLogger("cachelane.locust")


def _add_options(parser: Any) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, env_var="CACHELANE_MODEL",
        help="model name sent in every request (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=1, env_var="CACHELANE_SEED",
        help="seed of the shared prompts and the sessions' text (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--trace", default="", env_var="CACHELANE_TRACE",
        help="replay this trace instead of the shapes: mooncake:PATH[@START:COUNT] (Mooncake's "
        "FAST'25 format, scaled as loadtest/workloads/mooncake.py says) or a JSONL trace; one "
        "process (not distributed), -u at least the requests in flight",
    )  # fmt: skip
    parser.add_argument(
        "--trace-time-scale", type=float, default=1.0, env_var="CACHELANE_TRACE_TIME_SCALE",
        help="multiply the trace's arrival offsets by this (0.5: twice the rate)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default="", env_var="CACHELANE_API_KEY", is_secret=True,
        help="bearer token for every user without a tenant key of its own",
    )  # fmt: skip
    for tenant in TENANT_KEY_OPTIONS:
        parser.add_argument(
            f"--{tenant}-api-key",
            default="",
            env_var=f"CACHELANE_{tenant.upper()}_API_KEY",
            is_secret=True,
            help=f"bearer token of the {tenant} tenant (default: --api-key)",
        )


def _trace_or_shapes(environment: Environment, **_: Any) -> None:
    """--trace: replay it with TraceUser alone; without it, TraceUser never spawns."""
    options = environment.parsed_options
    trace = getattr(options, "trace", "") if options is not None else ""
    if trace:
        environment.user_classes[:] = [TraceUser]
    else:
        environment.user_classes[:] = [u for u in environment.user_classes if u is not TraceUser]


def _drop_users_without_tasks(environment: Environment, **_: Any) -> None:
    """With --tags / --exclude-tags, users none of whose tasks is selected do not spawn (Locust
    would spawn them and fail with "No tasks defined")."""
    options = environment.parsed_options
    if options is None or not (options.tags or options.exclude_tags):
        return
    tags = set(options.tags or ())
    excluded = set(options.exclude_tags or ())

    def selected(task: Any) -> bool:
        task_tags: set[str] = getattr(task, "locust_tag_set", set())  # set by @tag
        return (not tags or bool(task_tags & tags)) and not task_tags & excluded

    environment.user_classes[:] = [
        u for u in environment.user_classes if any(selected(t) for t in u.tasks)
    ]
    if not environment.user_classes:
        log.error("no user class has a task left after --tags / --exclude-tags")


def _serve_outcomes(environment: Environment, web_ui: Any = None, **_: Any) -> None:
    if web_ui is not None:
        web_ui.app.add_url_rule("/cachelane/outcomes", "cachelane_outcomes", OUTCOMES.summary)


def _send_outcomes(client_id: str, data: dict[str, Any]) -> None:
    data["cachelane_outcomes"] = OUTCOMES.take()


def _receive_outcomes(client_id: str, data: dict[str, Any]) -> None:
    OUTCOMES.merge(data.get("cachelane_outcomes") or {})


def _reset_outcomes(environment: Environment, **_: Any) -> None:
    if not isinstance(environment.runner, WorkerRunner):
        OUTCOMES.reset()


def _report_outcomes(environment: Environment, **_: Any) -> None:
    """At quitting (the master, or a lone runner): the CSV now, the per-shape table once Locust
    has printed its own (its `quit` event comes after its tables)."""
    if isinstance(environment.runner, WorkerRunner):
        return
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        OUTCOMES.write_csv(Path(f"{prefix}_outcomes.csv"))
    rows = OUTCOMES.summary()
    events.quit.add_listener(lambda **_: _print_outcomes(rows))  # type: ignore[no-untyped-call]


OUTCOMES_HEADER = (
    f"{'Shape':<12} {'# reqs':>7} {'TTFT p50':>9} {'p95':>7} {'p99':>7} {'hit rate':>9} "
    f"{'cached / prompt tokens':>24}"
)


def _print_outcomes(rows: dict[str, dict[str, Any]]) -> None:
    """The per-shape table, below Locust's, through Locust's own console logger (stdout)."""
    from locust.stats import console_logger

    console_logger.info("Time to first token and prefix hit rate per traffic shape (ms)")
    console_logger.info(OUTCOMES_HEADER)
    console_logger.info("-" * len(OUTCOMES_HEADER))
    for shape, row in rows.items():
        console_logger.info(
            f"{shape:<12} {row['requests']:>7} {row['ttft_p50_ms']:>9.0f} "
            f"{row['ttft_p95_ms']:>7.0f} {row['ttft_p99_ms']:>7.0f} "
            f"{100 * row['hit_rate']:>8.1f}% "
            f"{row['cached_tokens']:>11} / {row['prompt_tokens']:<10}"
        )
    console_logger.info("")


events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]
events.init.add_listener(_trace_or_shapes)  # type: ignore[no-untyped-call]
events.init.add_listener(_drop_users_without_tasks)  # type: ignore[no-untyped-call]
events.init.add_listener(_serve_outcomes)  # type: ignore[no-untyped-call]
events.report_to_master.add_listener(_send_outcomes)  # type: ignore[no-untyped-call]
events.worker_report.add_listener(_receive_outcomes)  # type: ignore[no-untyped-call]
events.test_start.add_listener(_reset_outcomes)  # type: ignore[no-untyped-call]
events.quitting.add_listener(_report_outcomes)  # type: ignore[no-untyped-call]
