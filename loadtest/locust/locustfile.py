"""Locust scenarios for cachelane (or any OpenAI-compatible endpoint).

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

Stats: per shape, "POST" is the full streamed response, "TTFT" the time to first token, and
"cached_tokens" has cached tokens as its response time and prompt tokens as its content size;
at the end the prefix hit rate per shape is logged. With --csv they are rows of *_stats.csv.
"""

from __future__ import annotations

import logging
from typing import Any

from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner

from loadtest.locust.users import (
    CACHED_TYPE,
    AgentUser,
    ChatUser,
    RagUser,
    SharedSystemUser,
    UniqueUser,
    VoiceUser,
)
from loadtest.workloads.traces import DEFAULT_MODEL

__all__ = ["AgentUser", "ChatUser", "RagUser", "SharedSystemUser", "UniqueUser", "VoiceUser"]

TENANT_KEY_OPTIONS = ("chat", "agent", "rag", "unique", "voice")

log = logging.getLogger("cachelane.locust")


def _add_options(parser: Any) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, env_var="CACHELANE_MODEL")
    parser.add_argument("--seed", type=int, default=1, env_var="CACHELANE_SEED")
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


def _drop_users_without_tasks(environment: Environment, **_: Any) -> None:
    """With --tags / --exclude-tags, users whose every task is filtered out do not spawn
    (Locust would spawn them and fail with "No tasks defined")."""
    options = environment.parsed_options
    if options is None or not (options.tags or options.exclude_tags):
        return
    environment._filter_tasks_by_tags()
    environment.user_classes[:] = [u for u in environment.user_classes if u.tasks]
    if not environment.user_classes:
        log.error("no user class has a task left after --tags / --exclude-tags")


def _log_hit_rates(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or environment.stats is None:
        return
    for (name, method), entry in sorted(environment.stats.entries.items()):
        if method != CACHED_TYPE or not entry.total_content_length:
            continue
        rate = entry.total_response_time / entry.total_content_length
        log.info(
            "%s: prefix hit rate %.1f%% (%d requests, %d cached / %d prompt tokens)",
            name,
            100 * rate,
            entry.num_requests,
            entry.total_response_time,
            entry.total_content_length,
        )


events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]
events.init.add_listener(_drop_users_without_tasks)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_log_hit_rates)  # type: ignore[no-untyped-call]
