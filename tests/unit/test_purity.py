"""routing/ is the pure core: no IO, web framework, HTTP client, wire / template library or
metrics client (the adapters live in gateway/: index backends in gateway/index/, engine
integrations in gateway/engines/)."""

import ast
from pathlib import Path

import pytest

FORBIDDEN = {
    "fastapi", "starlette", "httpx", "uvicorn", "aiohttp", "requests", "gateway",
    "msgpack", "zmq", "jinja2", "tokenizers",
    "redis", "asyncio", "prometheus_client",
}  # fmt: skip
ROUTING = Path(__file__).resolve().parents[2] / "routing"
MODULES = sorted(ROUTING.rglob("*.py"))


def test_routing_has_modules_in_subpackages() -> None:
    assert any(p.parent != ROUTING for p in MODULES)  # routing/policies/ is walked too


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROUTING)))
def test_routing_module_imports_no_io(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{path.name} imports {imported & FORBIDDEN}"
