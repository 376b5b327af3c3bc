"""The packages' import graph: kernels never import the daemon, no installed package imports
the benchmarks, and no module-level import cycle exists (modules import downward only)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"pagoda_daemon": ROOT / "daemon", "pagoda_operator": ROOT / "operator",
            "pagoda_kernels": ROOT / "kernels", "benchmarks": ROOT}


def module_name(path: Path, source_root: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(module_level_only: bool) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports (at module level only, if asked: imports
    inside functions are how a module defers a heavy or upward dependency on purpose)."""
    modules: dict[str, Path] = {}
    for package, source_root in PACKAGES.items():
        for path in (source_root / package).rglob("*.py"):
            modules[module_name(path, source_root)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if module_level_only else list(ast.walk(tree))
        found: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.If) and module_level_only:  # `if TYPE_CHECKING:` imports nothing at run time
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_kernels_never_import_the_daemon_or_the_operator():
    for module, deps in imports(module_level_only=False).items():
        if module.startswith("pagoda_kernels"):
            assert not {d for d in deps if not d.startswith("pagoda_kernels")}, (module, deps)


def test_no_installed_package_imports_the_benchmarks():
    for module, deps in imports(module_level_only=False).items():
        if not module.startswith("benchmarks"):
            assert not {d for d in deps if d.startswith("benchmarks")}, (module, deps)


def test_no_module_level_import_cycles():
    graph = imports(module_level_only=True)
    # a package's __init__ importing its own submodules is how packages export names: not a cycle
    edges = {m: {d for d in deps if m != d.rsplit(".", 1)[0]} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, cycles
