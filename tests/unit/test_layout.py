"""The layout stays readable: no import circle in gateway/ (module-level, TYPE_CHECKING and
function-level imports alike: a circle held together by type-only imports is still one), no
module over 500 lines and no function over 80 lines in gateway/ and routing/.

deploy/CONFIG.md, the generated config reference, is outside both trees. ALLOWED_* name what may
stay over a limit, each with the reason; an entry that no longer needs its exception fails too,
so the list only shrinks."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("gateway", "routing")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# path -> why it may stay over MAX_MODULE_LINES
ALLOWED_MODULES: dict[str, str] = {}
# "path:function" -> why it may stay over MAX_FUNCTION_LINES
ALLOWED_FUNCTIONS: dict[str, str] = {}


def _modules(tree: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `tree`."""
    found = {}
    for path in sorted((ROOT / tree).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph(tree: str) -> dict[str, set[str]]:
    """Each module of `tree` -> the modules of `tree` it imports, wherever the import statement
    stands (module level, under TYPE_CHECKING, inside a function)."""
    modules = _modules(tree)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from gateway.fleet import replica_auth` imports a module, or a name of one
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm,
    iterative so that a deep package cannot exhaust the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_gateway_has_no_import_circle() -> None:
    graph = import_graph("gateway")
    assert len(graph) > 50  # the walk found the rooms' modules
    assert circles(graph) == []


def _sources() -> list[Path]:
    return [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _long_modules() -> dict[str, int]:
    sized = {_name(p): p.read_text().count("\n") for p in _sources()}
    return {name: lines for name, lines in sized.items() if lines > MAX_MODULE_LINES}


def _long_functions() -> dict[str, int]:
    found = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{_name(path)}:{node.name}"] = lines
    return found


def test_no_module_over_the_limit() -> None:
    long = _long_modules()
    assert {k: v for k, v in long.items() if k not in ALLOWED_MODULES} == {}
    assert set(ALLOWED_MODULES) <= set(long), "an allowed module is short now: drop its entry"


def test_no_function_over_the_limit() -> None:
    long = _long_functions()
    assert {k: v for k, v in long.items() if k not in ALLOWED_FUNCTIONS} == {}
    assert set(ALLOWED_FUNCTIONS) <= set(long), "an allowed function is short now: drop its entry"


@pytest.mark.parametrize("tree", TREES)
def test_the_walk_sees_the_tree(tree: str) -> None:
    assert _modules(tree), f"{tree}/ has no modules: the layout checks would pass vacuously"


def test_one_percentile_definition() -> None:
    """routing/whatif/summary.py's percentile is the only one the project writes; every report
    (benchmarks, Locust's per-shape rows, the what-if replay) calls it."""
    defined = []
    for tree in (*TREES, "loadtest"):
        for path in sorted((ROOT / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and "percentile" in node.name:
                    defined.append(f"{_name(path)}:{node.name}")
    assert sorted(defined) == [  # the first two call the last
        "loadtest/bench/critical_results.py:_percentiles",  # p50, p90, p99 at once
        "loadtest/locust/outcomes.py:ttft_percentile",  # a histogram
        "routing/whatif/summary.py:percentile",
    ]
