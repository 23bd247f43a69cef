"""routing/ is the pure core: no web framework, HTTP client or wire / template library (the
adapters live in gateway/)."""

import ast
from pathlib import Path

import pytest

FORBIDDEN = {
    "fastapi", "starlette", "httpx", "uvicorn", "aiohttp", "requests", "gateway",
    "msgpack", "zmq", "jinja2", "tokenizers",
}  # fmt: skip
ROUTING = Path(__file__).resolve().parents[2] / "routing"


@pytest.mark.parametrize("path", sorted(ROUTING.glob("*.py")), ids=lambda p: p.name)
def test_routing_module_imports_nothing_web(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{path.name} imports {imported & FORBIDDEN}"
