"""The package's layers (docs/design.md, "Layers"): imports go down only, there is no import
cycle, and ``import flashoverlap_core`` loads none of the tools and no plotting.

Imports are read from the source with ``ast``, including those inside functions (a deferred
import is still a dependency), with relative imports resolved against the importing module.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = "flashoverlap_core"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top; a module may import modules of its own layer and of the layers below. A
# module is placed by its name, or by the first package of its name ("tuning", "tools").
LAYERS = (
    ("model", {"ops", "tiles", "plan", "grouping", "reorder"}),
    ("contract", {"backend", "tile_trace", "registry", "collectives", "gather", "devices", "faults"}),
    ("api", {"api", "checks", "planning", "agreement", "all_to_all", "add_rmsnorm", "fp8",
             "transfers"}),
    ("backends", {"reference", "decomposition"}),
    ("torch integration", {"torch_ops", "nn"}),
    ("tuning", {"tuning"}),
    ("package", {""}),  # flashoverlap_core/__init__.py: the public names, wiring api to tuning
    ("tools", {"tools"}),
    ("conformance suite", {"testing"}),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the package that ``name`` imports anywhere in its source, with the
    packages whose ``__init__`` such an import runs first (but not the importer's own
    packages: they are being imported already)."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    found = set()
    own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    for target in targets:
        if target in known:
            found.add(target)
        parts = target.split(".")
        for i in range(1, len(parts)):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            prefix = ".".join(parts[:i])
            if prefix in known and prefix not in own_packages:
                found.add(prefix)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def layer_of(name: str) -> int:
    parts = name.split(".")[1:]
    key = parts[0] if parts else ""
    for rank, (_, members) in enumerate(LAYERS):
        if key in members:
            return rank
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__} and to the "
                         "layers of docs/design.md")


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_relative_deferred_and_package_imports():
    """The reader itself: a deferred relative import, ``from . import module`` and the
    ``__init__`` of an imported package all count."""
    edges = graph()
    assert "flashoverlap_core.registry" in edges["flashoverlap_core.api"]
    assert "flashoverlap_core.tuning" in edges["flashoverlap_core.tools.tune"]
    assert "flashoverlap_core.tuning.cache" in edges["flashoverlap_core.tools.tune"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_imports_go_down_the_layers():
    edges = graph()
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a in sorted(edges) for b in sorted(edges[a]) if layer_of(b) > layer_of(a)]
    assert not upward, "imports that go up a layer:\n  " + "\n  ".join(upward)


def test_import_loads_no_tool_and_no_plotting():
    code = ("import json, sys; import flashoverlap_core; "
            "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    loaded = json.loads(done.stdout)
    assert "flashoverlap_core.api" in loaded  # the probe works
    heavy = [m for m in loaded if m.startswith(("flashoverlap_core.tools", "matplotlib",
                                                "flashoverlap_core.testing"))]
    assert not heavy, f"import flashoverlap_core loaded {heavy}"
