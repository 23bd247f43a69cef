"""Run simulated replicas (and optionally the shared remote tier) in one process and one event loop.

    python -m loadtest.sim --replicas 4 --port 9001 --remote-port 9100 --cpu-capacity-tokens 2000000

Every server is a uvicorn.Server on its own loopback port; sockets are bound before anything starts,
so a port in use fails at once with its number. SIGINT / SIGTERM (or cancelling serve_fleet) shut
every server down gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any, get_args

import uvicorn
from fastapi import FastAPI

from loadtest.sim.config import (
    ITL_S,
    MAX_MODEL_LEN_TOKENS,
    REMOTE_CAPACITY_TOKENS,
    SIM_MODEL,
    EngineModel,
    RemoteTierSpec,
    SimReplicaSpec,
)
from loadtest.sim.remote import create_remote_app
from loadtest.sim.server import create_sim_app
from loadtest.sim.steps import (
    STEP_OVERHEAD_S,
    VLLM_LONG_PREFILL_TOKEN_THRESHOLD,
    VLLM_MAX_NUM_SEQS,
    SchedulingPolicy,
    StepSettings,
)
from routing.cost import HBM_CAPACITY_TOKENS, PoolCosts
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5.0  # open streams get this long to finish before they are cut


class QuietServer(uvicorn.Server):
    """A uvicorn.Server that leaves signals to its owner: several share one process."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def step_flags(s: StepSettings) -> list[str]:
    """This command's flags that run vLLM V1's step loop with `s`, every one given explicitly
    (the benchmarks start fleets with them)."""
    return [
        "--engine-model", "steps",
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--long-prefill-token-threshold", str(s.long_prefill_token_threshold),
        "--scheduling-policy", s.scheduling_policy,
        "--max-num-seqs", str(s.max_num_seqs),
        "--step-overhead-ms", f"{s.step_overhead_s * 1000:g}",
    ]  # fmt: skip


def bind_socket(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP; with proto 0, Nagle + delayed ACK add ~40 ms per reused connection.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from err
    return sock


async def serve_app(server: uvicorn.Server, sock: socket.socket) -> None:
    """server.serve() on a bound socket, with uvicorn's sys.exit() on failure made an exception."""
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        raise RuntimeError(f"uvicorn server on {sock.getsockname()} exited ({exc.code})") from None


async def serve_fleet(
    replicas: list[SimReplicaSpec],
    remote: RemoteTierSpec | None = None,
    *,
    started: asyncio.Event | None = None,
) -> None:
    """Serve until SIGINT / SIGTERM or cancellation; `started` is set once every server listens."""
    apps: list[tuple[str, int, FastAPI]] = []
    if remote is not None:
        apps.append((remote.host, remote.port, create_remote_app(remote)))
    apps += [(r.host, r.port, create_sim_app(r)) for r in replicas]

    sockets: list[socket.socket] = []
    try:
        for host, port, _ in apps:
            sockets.append(bind_socket(host, port))
    except OSError:
        for sock in sockets:
            sock.close()
        raise

    servers = [
        QuietServer(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
            )
        )
        for host, port, app in apps
    ]
    tasks = [
        asyncio.create_task(serve_app(s, sock)) for s, sock in zip(servers, sockets, strict=True)
    ]

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(sig, stop)  # only possible in the main thread
            handled.append(sig)
    try:
        if started is not None:
            while not _all_started(servers, tasks):  # noqa: ASYNC110 (uvicorn has only a flag)
                await asyncio.sleep(0.01)
            started.set()
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # one failed: stop all
    finally:
        stop()
        await asyncio.wait(tasks)  # asyncio.wait never cancels them: shutdown stays graceful
        for sig in handled:
            loop.remove_signal_handler(sig)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


def _all_started(servers: list[QuietServer], tasks: list[asyncio.Task[None]]) -> bool:
    """Every server listens, or one has already stopped (so waiting longer is pointless)."""
    return all(s.started for s in servers) or any(t.done() for t in tasks)


def build_parser(
    parser: argparse.ArgumentParser | None = None, *, add_help: bool = True
) -> argparse.ArgumentParser:
    """The `sim` command's arguments, added to `parser` or to a new one.

    To mount it as a subcommand: `sub.add_parser("sim", parents=[build_parser(add_help=False)])`.
    """
    parser = parser or argparse.ArgumentParser(prog="python -m loadtest.sim", add_help=add_help)
    parser.description = (
        "Run simulated GPU replicas that speak the OpenAI API and behave like vLLM with prefix "
        "caching: an HBM KV cache, an optional CPU offload tier and an optional shared remote "
        "tier, with real sleeps for swap-in, remote fetch, prefill and decode. Replicas listen on "
        "consecutive ports from --port and are named sim-0, sim-1, ... Speeds default to the "
        "gateway's cost model (Llama-3.1-8B on one H200). Stop with Ctrl-C."
    )
    parser.epilog = (
        "example: python -m loadtest.sim --replicas 4 --port 9001 --remote-port 9100 "
        "--cpu-capacity-tokens 2000000 --time-factor 0.1"
    )
    add = parser.add_argument
    add("--replicas", type=int, default=2, help="number of replicas (default: %(default)s)")
    add("--port", type=int, default=9001, help="port of sim-0; sim-i gets port+i (default: 9001)")
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add(
        "--remote-port",
        type=int,
        default=None,
        help="also run the shared remote KV tier on this port, and connect every replica to it",
    )
    add(
        "--remote-capacity-tokens",
        type=int,
        default=REMOTE_CAPACITY_TOKENS,
        help="tokens of KV the remote tier holds (default: %(default)s, 1 TiB of 8B KV)",
    )
    add(
        "--hbm-capacity-tokens",
        type=int,
        default=HBM_CAPACITY_TOKENS,
        help="tokens of KV each replica's HBM holds (default: %(default)s, 8B on an H200)",
    )
    add(
        "--cpu-capacity-tokens",
        type=int,
        default=0,
        help="tokens of KV in each replica's CPU offload tier; 0 = no CPU tier (default: 0)",
    )
    add(
        "--itl-ms",
        type=float,
        default=ITL_S * 1000,
        help="a step of decodes alone, the time per output token when nothing prefills, in ms"
        " (default: %(default)s)",
    )
    add(
        "--prefill-tokens-per-s",
        type=float,
        default=PoolCosts().prefill_tokens_per_s,
        help="prefill speed of uncached prompt tokens (default: %(default)s)",
    )
    add(
        "--time-factor",
        type=float,
        default=1.0,
        help="multiply every simulated delay by this; 0.1 runs 10x faster (default: 1.0)",
    )
    add("--model", default=SIM_MODEL, help="model name served (default: %(default)s)")
    add(
        "--block-size-tokens",
        type=int,
        default=DEFAULT_BLOCK_SIZE_TOKENS,
        help="KV block size; must match the gateway's (default: %(default)s)",
    )
    add(
        "--config",
        help="simulate every 127.0.0.1/localhost replica (and remote tier) of this gateway "
        "config, with its capacities and cost constants; the other options are then ignored, "
        "except the engine's (--engine-model and vLLM's scheduler flags)",
    )
    add(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish vLLM-format KV events (ZMQ PUB) for precise mode; sim-i on this port + i",
    )
    add(
        "--kv-replay-port",
        type=int,
        default=None,
        help="answer KV event replay requests (ZMQ ROUTER); sim-i on this port + i",
    )
    add(
        "--tokenizer",
        help="a local tokenizer.json: prompts are tokenized like the engine (precise mode)",
    )
    add("--chat-template", help="the model's chat template (a jinja2 file), with --tokenizer")
    add_engine_arguments(parser)
    add(
        "--max-model-len-tokens",
        type=int,
        default=MAX_MODEL_LEN_TOKENS,
        help="context length; longer requests get HTTP 400 (default: %(default)s)",
    )
    add(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every path but /health, as vLLM's "
        "--api-key (default: none required)",
    )
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """How each replica schedules prefill: vLLM's flags, under vLLM's names and defaults. With
    --config they apply to every replica when given, over the config's pools[].sim."""
    add = parser.add_argument
    add(
        "--engine-model",
        choices=get_args(EngineModel),
        help="steps: vLLM V1's token-budget step loop; serial: one whole prefill at a time, "
        "kept for comparison (default: steps)",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        help="token budget of a step; default: vLLM's 8192 for an OpenAI server on an H100/H200, "
        "scaled to --prefill-tokens-per-s so a full step lasts as long (~273 ms)",
    )
    add(
        "--long-prefill-token-threshold",
        type=int,
        help="cap on one prefill's tokens in a step; 0 = none "
        f"(default: {VLLM_LONG_PREFILL_TOKEN_THRESHOLD}, vLLM's)",
    )
    add(
        "--scheduling-policy",
        choices=get_args(SchedulingPolicy),
        help="fcfs: arrival order; priority: the body's priority, lower first, then arrival "
        "(default: fcfs, vLLM's)",
    )
    add(
        "--max-num-seqs",
        type=int,
        help=f"requests running at once (default: {VLLM_MAX_NUM_SEQS}, vLLM's on an H100/H200)",
    )
    add(
        "--step-overhead-ms",
        type=float,
        help=f"fixed cost of a step, a forward pass (default: {STEP_OVERHEAD_S * 1000:g}, the "
        "weights of an 8B model read once from H200 HBM)",
    )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """SimReplicaSpec's fields for the arguments of add_engine_arguments() that were given."""
    given = {
        "engine_model": args.engine_model,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "scheduling_policy": args.scheduling_policy,
        "max_num_seqs": args.max_num_seqs,
        "step_overhead_s": None if args.step_overhead_ms is None else args.step_overhead_ms / 1000,
    }
    return {k: v for k, v in given.items() if v is not None}


def fleet_specs(args: argparse.Namespace) -> tuple[list[SimReplicaSpec], RemoteTierSpec | None]:
    remote = None
    if args.remote_port is not None:
        remote = RemoteTierSpec(
            name="remote-0",
            host=args.host,
            port=args.remote_port,
            capacity_tokens=args.remote_capacity_tokens,
            block_size_tokens=args.block_size_tokens,
        )
    costs = dataclasses.replace(PoolCosts(), prefill_tokens_per_s=args.prefill_tokens_per_s)
    replicas = [
        SimReplicaSpec(
            name=f"sim-{i}",
            host=args.host,
            port=args.port + i,
            model=args.model,
            block_size_tokens=args.block_size_tokens,
            hbm_capacity_tokens=args.hbm_capacity_tokens,
            cpu_capacity_tokens=args.cpu_capacity_tokens,
            remote_url=remote.url if remote else None,
            costs=costs,
            itl_s=args.itl_ms / 1000,
            time_factor=args.time_factor,
            max_model_len_tokens=args.max_model_len_tokens,
            kv_events_port=None if args.kv_events_port is None else args.kv_events_port + i,
            kv_replay_port=None if args.kv_replay_port is None else args.kv_replay_port + i,
            tokenizer_path=args.tokenizer,
            chat_template=args.chat_template,
            api_key=args.api_key,
            **engine_overrides(args),
        )
        for i in range(args.replicas)
    ]
    return replicas, remote


def run(args: argparse.Namespace) -> int:
    """Serve the fleet described by parsed arguments until Ctrl-C; returns an exit status."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per remote-tier call
    if args.replicas < 1:
        print("error: --replicas must be >= 1", file=sys.stderr)
        return 2
    try:
        if args.config:
            from gateway.config import ConfigError, load_config
            from loadtest.sim.from_config import specs_from_config

            try:
                replicas, remote = specs_from_config(load_config(args.config))
            except ConfigError as err:
                raise ValueError(str(err)) from None
            engine = engine_overrides(args)
            replicas = [dataclasses.replace(r, **engine) for r in replicas]
        else:
            replicas, remote = fleet_specs(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for r in replicas:
        print(f"{r.name}: {r.url}/v1  (model {r.model})")
    if remote is not None:
        print(f"{remote.name}: {remote.url}  (remote KV tier)")
    try:
        asyncio.run(serve_fleet(replicas, remote))
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
