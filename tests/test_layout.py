"""The code's layout: the import graph of shared/, cog/, modal_app/ and bundle_client/, read with ast.

Every import counts (module level, inside functions, under TYPE_CHECKING): a lazy import is
still an arrow between two modules. The rules:
- no import cycle between modules;
- the layers of shared/ import one way, downwards: the top-level foundation (settings,
  settings_serving, env_values, errors, schemas, streaming, redis_client) < obs < models and cache (fetching and
  building model files, the compile-cache pack) < engine (its contract and the vLLM adapter) <
  shaping (OpenAI output shaping on the contract) < generation (one generation's output, replay
  buffer and registry) < replicas (identity across replicas: store, log, liveness, takeover) <
  the assembly (service, sampling, starter, lifecycle, server_state, and any other top-level
  module) < responses (the Responses API, built on the service) < http < the entry point (serve);
- nothing in shared/ imports cog/'s modules or modal_app;
- bundle_client imports nothing from shared (it is shipped to users without the server).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOUNDATION = {
    "shared.settings",
    "shared.env_values",
    "shared.settings_serving",
    "shared.errors",
    "shared.schemas",
    "shared.streaming",
    "shared.redis_client",
}
ENTRY = {"shared.serve"}
# Lower number: lower layer. A module may import its own layer and those below.
# shared.procs (several API processes) runs the http layer's server in each of them.
LAYER_OF_PACKAGE = {
    "shared.obs": 1,
    "shared.models": 2,
    "shared.cache": 2,  # used by the engine's start, uses only the foundation
    "shared.engine": 3,
    "shared.shaping": 4,
    "shared.generation": 5,
    "shared.replicas": 6,
    "shared.responses": 8,
    "shared.http": 9,
    "shared.procs": 9,
}
ASSEMBLY, TOP = 7, 10
NAMES = {
    0: "foundation",
    1: "obs",
    2: "models",
    3: "engine",
    4: "shaping",
    5: "generation",
    6: "replicas",
    7: "assembly",
    8: "responses",
    9: "http",
    10: "entry",
}


def module_files() -> dict[str, Path]:
    """Dotted name -> file. cog/ is no package (`import cog` is the Cog SDK): its modules are
    top-level names, as cog/predict.py and pytest's pythonpath import them."""
    found = {}
    for top in ("shared", "modal_app", "bundle_client"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "cog").glob("*.py"):
        found[path.stem] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The known modules that `path` imports (`from a import b` counts a.b when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & known
            out |= subs or ({node.module} & known)
    return out


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int | None:
    """shared/'s layer of a module; None outside shared/ and for package __init__ files."""
    if module in FOUNDATION:
        return 0
    if module in ENTRY:
        return TOP
    for package, number in LAYER_OF_PACKAGE.items():
        if module.startswith(package + "."):
            return number
    if module.startswith("shared.") and module.count(".") == 1:
        return ASSEMBLY
    return None


def test_graph_is_read() -> None:
    """The graph sees the imports it should: a broken reader would make every rule below pass."""
    edges = graph()
    assert len(edges) > 40
    assert "shared.engine.contract" in edges["shared.service"]
    assert "shared.engine.vllm_startup" in edges["shared.assembly"]
    assert "shared.engine.contract" in edges["shared.shaping.choices"]
    assert "shared.models.tiny_model" in edges["shared.engine.vllm_startup"]
    assert "shared.http.api" in edges["shared.serve"]
    assert "cog_bridge" in edges["predict"]
    assert "bundle_client.sse" in edges["bundle_client.client"]


def test_every_package_of_shared_has_a_layer() -> None:
    """A sub-package left out of LAYER_OF_PACKAGE would count as no layer, and its imports as
    unchecked (shared.responses was, until issue 42)."""
    packages = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "shared").glob("*/__init__.py")
    }
    assert packages == set(LAYER_OF_PACKAGE)
    assert layer("shared.responses.manager") == 8


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_shared_layers_import_downwards() -> None:
    upward = []
    for module, targets in graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if here is not None and there is not None and there > here:
                upward.append(f"{module} ({NAMES[here]}) imports {target} ({NAMES[there]})")
    assert upward == []


def test_core_imports_no_wrapper() -> None:
    """Nothing in shared/ imports cog/'s modules or modal_app; the sub-packages' __init__ files
    import nothing (no re-exports that could hide a cycle or pull in a whole layer)."""
    files = module_files()
    wrappers = {name for name in files if not name.startswith(("shared", "bundle_client"))}
    for module, targets in graph().items():
        if module.startswith("shared"):
            assert not targets & wrappers, (module, targets & wrappers)
    for package in (*LAYER_OF_PACKAGE, "bundle_client"):
        tree = ast.parse(files[package].read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], package


def test_client_imports_nothing_from_shared() -> None:
    for module, targets in graph().items():
        if module.startswith("bundle_client"):
            assert not {t for t in targets if t.startswith("shared")}, module
