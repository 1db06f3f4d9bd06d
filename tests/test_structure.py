"""kvlink's own imports run one way: no circle between modules, and packages only import lower layers.

Every module under src/kvlink is parsed with `ast`; every `import` counts, at module
level, inside functions and under `if TYPE_CHECKING:` alike. The layer order is
ARCHITECTURE.md's, with `bench` where it really sits (docs/structure.md).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Top to bottom: a package may import its own modules and those of any package below it.
LAYERS = ("cli", "bench", "serve", "engine", "integrations", "connector", "transfer", "plan", "layout")
# `kvlink` itself (its __init__) and `procs` import nothing of kvlink beyond their own modules, so
# any layer may import them.
FOUNDATIONS = ("kvlink", "procs")
# The one edge up the layers, with its reason (docs/structure.md).
ALLOWED_UPWARD = {
    # vLLM's copy of SmolLM2 is built from the GGUF file the reference engine reads; the
    # function that finds that file lives with the engine's loader.
    ("kvlink.integrations.vllm.models", "kvlink.engine.model.gguf_loader"),
}


def module_files() -> dict[str, Path]:
    """Dotted module name → file, for every module and package of kvlink."""
    files = {}
    for path in sorted((SRC / "kvlink").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(module: str, path: Path, files: dict[str, Path]) -> set[str]:
    """Every module `module` imports anywhere in its file: `from a import b` imports a.b when
    kvlink has such a module, else a (outside kvlink always a, e.g. `vllm.config`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                      for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """kvlink module → the other kvlink modules it imports."""
    files = module_files()
    return {module: {name for name in imported_modules(module, path, files) if name in files} - {module}
            for module, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def layer_of(module: str) -> str:
    if module == "kvlink.__main__":  # `python -m kvlink`: the command line's entry point
        return "cli"
    return module.split(".")[1] if module.count(".") else module


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge against the layer order, explained."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(module) in FOUNDATIONS and layer_of(target) != layer_of(module):
                wrong.append(f"{module} -> {target} ({layer_of(module)} imports nothing of kvlink)")
            elif layer_of(target) in FOUNDATIONS or (module, target) in ALLOWED_UPWARD:
                continue
            elif LAYERS.index(layer_of(target)) < LAYERS.index(layer_of(module)):
                wrong.append(f"{module} -> {target} (up from {layer_of(module)} to {layer_of(target)})")
    return wrong


def test_imports_point_down_the_layers() -> None:
    graph = import_graph()
    assert {layer_of(m) for m in graph} == {*LAYERS, *FOUNDATIONS}, "a package outside the layers"
    wrong = layer_violations(graph)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)
    used = {(m, t) for m, targets in graph.items() for t in targets}
    assert used >= ALLOWED_UPWARD, f"an allowed upward edge no longer exists: {ALLOWED_UPWARD - used}"


def test_vllm_is_imported_only_under_integrations() -> None:
    files = module_files()
    outside = sorted(module for module, path in files.items()
                     if not module.startswith("kvlink.integrations.")
                     and any(n.split(".")[0] == "vllm" for n in imported_modules(module, path, files)))
    assert outside == [], f"modules importing vLLM outside kvlink.integrations: {outside}"


def test_the_checks_see_what_they_check() -> None:
    """The parser sees an import under TYPE_CHECKING and inside a function, and planted edges
    show as a circle and as upward imports: the tests above cannot pass by seeing nothing."""
    graph = import_graph()
    assert "kvlink.integrations.vllm.connector" in graph["kvlink.integrations.vllm"]  # function-level
    assert "kvlink.connector.staging" in graph["kvlink.connector.loads"]  # under TYPE_CHECKING
    files = module_files()
    connector = "kvlink.integrations.vllm.connector"
    assert "vllm.config" in imported_modules(connector, files[connector], files)  # TYPE_CHECKING, outside kvlink
    assert "kvlink.layout.spec" in graph["kvlink.connector.worker"]
    planted = {**graph, "kvlink.layout.spec": {"kvlink.connector.worker"}}
    cycle = find_cycle(planted)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert all(b in planted[a] for a, b in itertools.pairwise(cycle))
    assert layer_violations(planted) == [
        "kvlink.layout.spec -> kvlink.connector.worker (up from layout to connector)"]
    assert layer_violations({**graph, "kvlink.procs.launcher": {"kvlink.layout.spec"}}) == [
        "kvlink.procs.launcher -> kvlink.layout.spec (procs imports nothing of kvlink)"]
