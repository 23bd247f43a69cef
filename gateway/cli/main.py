"""`cachelane`: serve the gateway, run simulated replicas, run the demo, explain a decision."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from gateway import __version__
from gateway.cli import keygen, report
from gateway.config import (
    ConfigError,
    GatewayConfig,
    load_config,
    no_tenant_warning,
    quick_config,
)
from gateway.extras import SIM_MODULES, missing_message, missing_modules
from routing.decide import Policy

CONFIG_ENV = "CACHELANE_CONFIG"  # the config file's path when --config is not given

EPILOG = """\
examples:
  cachelane demo                                   # the whole story in under 2 minutes
  cachelane sim --replicas 4 --port 9001           # 4 simulated GPU replicas on 9001..9004
  cachelane serve --replicas http://127.0.0.1:9001,http://127.0.0.1:9002
  cachelane serve --config deploy/examples/sim-fleet.yaml
  cachelane route-explain --prompt "You are a helpful assistant..." --model sim-llama-8b
  cachelane report http://127.0.0.1:8000 --admin-key $KEY   # where offloading's cost landed
  cachelane keygen voice --class critical          # a new key and its tenants: entry
  cachelane locust --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8000
"""


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.fleet.siblings import WORKERS_DIR_ENV
    from gateway.http.app import create_app
    from gateway.http.exposure import HTTP_PROTOCOL
    from gateway.telemetry.heap import freeze_startup_heap
    from gateway.telemetry.logs import configure_logging

    try:
        config = _serve_config(args)
    except ConfigError as err:
        print(f"cachelane: {err}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format)
    common: dict[str, Any] = {
        "host": config.listen.host,
        "port": config.listen.port,
        "log_level": args.log_level,
        "log_config": None,  # uvicorn's lines go through the root handler, in --log-format
        "access_log": False,  # cachelane.access writes one line per request instead
        "http": HTTP_PROTOCOL,  # uvicorn's, with a deadline on a request's headers
        # X-Forwarded-For only from the proxies the config names ("": none, not even loopback;
        # uvicorn's FORWARDED_ALLOW_IPS environment variable is not read)
        "forwarded_allow_ips": config.listen.trusted_proxies,
    }
    if args.workers == 1:
        app = create_app(config, config_path=_config_path(args))
        freeze_startup_heap()
        uvicorn.run(app, **common)  # SIGHUP reloads
        return 0
    # N processes on one socket (uvicorn's supervisor binds it, each worker accepts on it); each
    # builds its app from these same arguments and finds its siblings in the directory; SIGHUP
    # reloads each worker in place (gateway/cli/workers.py)
    from gateway.cli.workers import run_workers

    with tempfile.TemporaryDirectory(prefix="cachelane-workers-") as directory:
        os.environ[WORKERS_DIR_ENV] = directory
        os.environ[SERVE_ARGV_ENV] = json.dumps(args.argv)
        run_workers(
            uvicorn.Config(
                "gateway.cli.main:worker_app", factory=True, workers=args.workers, **common
            )
        )
    return 0


SERVE_ARGV_ENV = "CACHELANE_SERVE_ARGV"  # a worker's `serve` arguments (--workers N)


def worker_app() -> Any:
    """The app of one worker of `cachelane serve --workers N` (uvicorn calls this in each)."""
    from gateway.http.app import create_app
    from gateway.telemetry.heap import freeze_startup_heap
    from gateway.telemetry.logs import configure_logging

    args = build_parser().parse_args(json.loads(os.environ[SERVE_ARGV_ENV]))
    configure_logging(args.log_level, args.log_format)
    app = create_app(_serve_config(args), config_path=_config_path(args))
    freeze_startup_heap()
    return app


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _config_path(args: argparse.Namespace) -> str | None:
    return args.config or (None if args.replicas else os.environ.get(CONFIG_ENV))


def _serve_config(args: argparse.Namespace) -> GatewayConfig:
    if args.config and args.replicas:
        raise ConfigError("give either --config or --replicas, not both")
    path = _config_path(args)
    if path:
        config = load_config(path)
        listen = config.listen.model_copy(
            update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        )
        routing = config.routing
        if args.policy:
            routing = routing.model_copy(update={"policy": Policy(args.policy)})
        return config.model_copy(update={"listen": listen, "routing": routing})
    if not args.replicas:
        raise ConfigError(f"give --config FILE (or set {CONFIG_ENV}) or --replicas URL[,URL...]")
    urls = [u.strip() for u in args.replicas.split(",") if u.strip()]
    return quick_config(
        urls,
        policy=Policy(args.policy or Policy.CACHE_AWARE.value),
        host=args.host or "127.0.0.1",
        port=args.port if args.port is not None else 8000,
    )


def _sim(argv: list[str]) -> int:
    """`cachelane sim ...`: the simulator is imported only when this command runs."""
    if _missing_extra("cachelane sim", "sim"):
        return 2
    from loadtest.sim.fleet import build_parser as sim_parser
    from loadtest.sim.fleet import run

    parser = argparse.ArgumentParser(prog="cachelane sim")
    return int(run(sim_parser(parser).parse_args(argv)) or 0)


def _demo(argv: list[str]) -> int:
    """`cachelane demo ...`: the demo (and matplotlib) are imported only when this command runs."""
    if _missing_extra("cachelane demo", "sim"):
        return 2
    from loadtest.demo.run import add_demo_arguments, run_demo

    parser = argparse.ArgumentParser(prog="cachelane demo")
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))


def _locust(argv: list[str]) -> int:
    """`cachelane locust ...`: Locust on the package's scenarios (loadtest/locust/run.py)."""
    missing = missing_modules(("locust",))
    if missing:
        print(
            f"cachelane: {missing_message('cachelane locust', 'bench', missing)}", file=sys.stderr
        )
        return 2
    from loadtest.locust.run import main as run_locust

    return run_locust(argv)


def _missing_extra(feature: str, extra: str) -> bool:
    """Say which extra to install (before any work starts) if the command needs one."""
    missing = missing_modules(SIM_MODULES)
    if missing:
        print(f"cachelane: {missing_message(feature, extra, missing)}", file=sys.stderr)
    return bool(missing)


def _plan(argv: list[str]) -> int:
    """`cachelane plan CAPTURE ...` (gateway/cli/plan.py; --png needs the [sim] extra)."""
    from gateway.cli.plan import run

    return run(argv)


# Commands parsed by their own module's parser, imported only when the command runs, so that
# `cachelane serve` (and `import gateway.cli.main`) loads none of loadtest; `cachelane --help` lists
# them.
LAZY_COMMANDS = {
    "sim": (_sim, "run simulated GPU replicas"),
    "demo": (_demo, "run the demo: round_robin vs cache_aware on a simulated fleet"),
    "locust": (_locust, "run the Locust scenarios: Locust's options (--help lists them), --shapes"),
    "plan": (_plan, "what-if: replay a traffic capture (capture.path) on other set-ups"),
}


def _first_model(gateway: str, api_key: str | None, admin_key: str | None) -> str:
    """The first model the gateway serves, for a route-explain without --model: GET /v1/models
    with the tenant's key, or the models /ready lists for its replicas with the admin key."""
    if api_key or not admin_key:
        resp = httpx.get(f"{gateway}/v1/models", headers=_bearer(api_key), timeout=10)
        if resp.status_code != 200:
            hint = (
                ""
                if resp.status_code != 401
                else "; give --admin-key (the gateway's admin key: /debug/route needs it too), "
                "or --model, or --api-key (a tenant's)"
            )
            raise ValueError(f"cannot list the gateway's models: {_readable_error(resp)}{hint}")
        models = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
    else:
        resp = httpx.get(f"{gateway}/ready", headers=_bearer(admin_key), timeout=10)
        replicas = resp.json().get("replicas", {}) if resp.status_code in (200, 503) else {}
        models = sorted({m for r in replicas.values() for m in r.get("models", [])})
    if not models:
        raise ValueError("the gateway serves no model yet (no replica has answered); pass --model")
    return str(models[0])


def _bearer(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def _readable_error(resp: httpx.Response) -> str:
    """'404 model_not_found: the model ... does not exist' from an OpenAI error envelope."""
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return f"{resp.status_code} {code}: {error.get('message')}"
    return f"{resp.status_code}: {resp.text[:300]}"


def _debug_key_hint(status: int, admin_key: str | None) -> str:
    """What to change when /debug/route refused the explanation for its key."""
    if status == 401 and not admin_key:
        return (
            "; the gateway checks keys (auth.mode keys): give --admin-key (its config's "
            "admin.api_key)"
        )
    if status == 404:
        return (
            "; the gateway has no admin key: set admin.api_key in its config, or run it with "
            "auth.mode open, where route-explain needs no key"
        )
    return ""


def _ask_debug_route(args: argparse.Namespace) -> httpx.Response:
    """POST the explained body to /debug/route (the admin key's, as --tenant if given)."""
    debug_headers = _bearer(args.admin_key)
    if args.tenant:
        debug_headers["x-cachelane-tenant"] = args.tenant
    if args.file:
        body = json.loads(Path(args.file).read_text())
    else:
        model = args.model or _first_model(args.gateway, args.api_key, args.admin_key)
        body = {"model": model, "messages": [{"role": "user", "content": args.prompt}]}
    return httpx.post(f"{args.gateway}/debug/route", json=body, headers=debug_headers, timeout=10)


def _route_explain(args: argparse.Namespace) -> int:
    from gateway.cli.text_table import Out, TextTable

    try:
        resp = _ask_debug_route(args)
    except httpx.HTTPError as err:
        print(f"cachelane: cannot reach the gateway at {args.gateway}: {err}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:
        print(f"cachelane: {err}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(
            f"cachelane: the gateway answered {_readable_error(resp)}"
            + _debug_key_hint(resp.status_code, args.admin_key),
            file=sys.stderr,
        )
        return 1
    data = resp.json()
    console = Out()
    console.print(
        f"{data['policy']} -> {data['replica']} "
        f"because {data['reason']}; ~{data['prompt_tokens']} prompt tokens, "
        f"est. TTFT {data['est_ttft_ms']} ms, {data['expected_cached_tokens']} cached tokens "
        f"expected (decided in {data['decision_ms']} ms)"
    )
    # "others": the wait a candidate would add to requests it goes before (shown when any would)
    others = any(c.get("others_wait_ms", 0.0) > 0 for c in data["candidates"])
    table = TextTable("cached tokens per tier, estimated TTFT terms in ms")
    table.add_column("replica")
    names = ("hbm", "cpu", "remote", "fixed", "queue", "swap", "fetch", "prefill", "TTFT", "steps")
    for name in (*names, "others") if others else names:
        table.add_column(name, right=True)
    for c in sorted(data["candidates"], key=lambda c: c["estimate_ms"]["ttft"]):
        o, e = c["overlap"], c["estimate_ms"]
        cells = [
            c["replica"],
            str(o["hbm_tokens"]),
            str(o["cpu_tokens"]),
            str(o["remote_tokens"]),
            f"{e['fixed_s']:.2f}",
            f"{e['queue_s']:.2f}",
            f"{e['swap_s']:.2f}",
            f"{e['remote_s']:.2f}",
            f"{e['prefill_s']:.2f}",
            f"{e['ttft']:.2f}",
            f"{c.get('steps', 0.0):.1f}",
        ]
        if others:
            cells.append(f"{c['others_wait_ms']:.2f}")
        table.add_row(*cells)
    console.print(str(table))
    costs = data.get("costs")
    if costs:
        fits = TextTable(f"cost terms in use (routing.calibration: {costs['mode']})")
        fits.add_column("replica")
        columns = ("source", "samples", "fixed ms", "prefill tok/s", "swap tok/s", "fetch tok/s")
        for name in (*columns, "step ms"):
            fits.add_column(name, right=True)
        for name, f in sorted(costs["replicas"].items()):
            fits.add_row(
                name,
                f["source"],
                str(f["samples"]),
                f"{f['fixed_ms']:.1f}",
                f"{f['prefill_tokens_per_s']:,.0f}",
                f"{f['swap_tokens_per_s']:,.0f}",
                f"{f['fetch_tokens_per_s']:,.0f}",
                f"{f.get('step_ms', 0.0):.1f}",
            )
        console.print(str(fits))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    if args.file and args.config and args.file != args.config:
        print("cachelane: give the config once: FILE or --config FILE", file=sys.stderr)
        return 2
    path = args.config or args.file or os.environ.get(CONFIG_ENV)
    if not path:
        print(
            f"cachelane: give a config FILE (or --config FILE, or set {CONFIG_ENV})",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(path)
    except ConfigError as err:
        print(f"cachelane: {err}", file=sys.stderr)
        return 2
    replicas = sum(len(p.replicas) for p in config.pools)
    discovered = sum(p.discovery is not None for p in config.pools)
    print(
        f"{path}: valid; {len(config.pools)} pool(s), {replicas} replica(s)"
        + (f" and {discovered} pool(s) discovered in DNS" if discovered else "")
        + f", {len(config.tenants)} tenant(s), auth {config.auth.mode}, routing "
        f"{config.routing.mode} {config.routing.policy.value}, index {config.index.backend}"
    )
    if config.auth.mode == "keys" and not config.tenants:
        print(f"cachelane: warning: {no_tenant_warning(config)}", file=sys.stderr)
    if not args.probe:
        return 0
    from gateway.cli.probe import probe_replicas

    disagree = False
    for pool in config.pools:
        if pool.discovery is not None:
            print(f"  pool {pool.name}: its replicas are found in DNS when it serves; not asked")
    for probed in probe_replicas(config):
        print(f"  {probed.replica}: {probed.line}")
        if probed.warning is not None:
            print(f"cachelane: warning: {probed.warning}", file=sys.stderr)
        disagree = disagree or probed.refuses_priority
    return 1 if disagree else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachelane",
        description="OpenAI-compatible gateway that routes LLM requests by where their KV cache "
        "lives.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cachelane {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway in front of OpenAI-compatible replicas")
    serve.add_argument(
        "--config", help=f"YAML config file (see deploy/examples/; default: ${CONFIG_ENV})"
    )
    serve.add_argument("--replicas", help="quick start without a file: comma-separated URLs")
    serve.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        help="routing policy (default: cache_aware, or the config's)",
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1, or the config's)")
    serve.add_argument("--port", type=int, help="listen port (default 8000, or the config's)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text, or json: one object a line (the access line's fields at the top level)",
    )
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="worker processes on the one port, sharing the routing view (default 1)",
    )
    serve.set_defaults(func=_serve)

    for name, (run, help_text) in LAZY_COMMANDS.items():
        # every argument goes to the command's own parser: none is an option of this stub
        lazy = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
        lazy.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        lazy.set_defaults(func=lambda args, run=run: run(args.argv))

    check = sub.add_parser(
        "check-config",
        help="validate a config file (variables and secret files resolved) and exit: "
        "0 when valid, 2 with every error (1: --probe found an engine that disagrees)",
    )
    check.add_argument("file", nargs="?", help=f"the config (default: ${CONFIG_ENV})")
    check.add_argument("--config", help="the config, as `serve --config FILE` takes it")
    check.add_argument(
        "--probe",
        action="store_true",
        help="also ask every replica listed: its models, and whether its engine takes "
        "`priority` where the pool sends it (a one-token generation); exit 1 when an engine "
        "refuses what its pool sends",
    )
    check.set_defaults(func=_check_config)

    explain = sub.add_parser(
        "route-explain", help="show the routing decision a running gateway would make"
    )
    explain.add_argument("--gateway", default="http://127.0.0.1:8000", help="gateway base URL")
    explain.add_argument("--file", help="a JSON request body (chat or completions)")
    explain.add_argument("--prompt", default="Hello", help="a user message, when no --file")
    explain.add_argument(
        "--model", help="model, when no --file (default: the first the gateway lists)"
    )
    explain.add_argument(
        "--api-key", help="a tenant's key, to list the models without --model (else --admin-key's)"
    )
    explain.add_argument(
        "--admin-key", help="the admin key: /debug/route needs it unless auth.mode is open"
    )
    explain.add_argument("--tenant", help="explain the route as this tenant (with --admin-key)")
    explain.set_defaults(func=_route_explain)
    report.add_parser(sub)
    keygen.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LAZY_COMMANDS:  # its own parser takes every argument after the name
        run, _ = LAZY_COMMANDS[argv[0]]
        return run(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --workers N`: each worker parses the same arguments
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
