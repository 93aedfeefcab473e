"""No import cycle inside rlx_mpi: every ``import``/``from ... import`` of a package module,
at module level or inside a function (a lazy import is still an edge: it only moves the cycle
to run time), walked with `ast`. A cycle is what makes a newcomer unable to say which module
is below which; the fix is to move the shared piece down, not to hide the import."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "rlx_mpi"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str], missing: list | None = None) -> set[str]:
    """The rlx_mpi modules ``name`` imports anywhere in its file; ``missing`` collects
    ``from X import ...`` whose X is no module of the package (a relative import left behind
    by a move fails only when that function runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `from .x import f`: f is a name, x the module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rlx_mpi"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("rlx_mpi"):
                prefix = node.module
            else:
                continue
            if prefix not in known and missing is not None:
                missing.append(f"{name}:{node.lineno}: from {'.' * node.level}{node.module or ''} ({prefix})")
            for alias in node.names:  # `from . import transport` names a module
                full = f"{prefix}.{alias.name}"
                add(full if full in known else prefix)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_package_import_names_a_module():
    mods, missing = modules(), []
    for n, p in mods.items():
        imports_of(n, p, set(mods), missing)
    assert missing == []


def test_the_walk_sees_relative_and_lazy_imports():
    g = graph()
    assert "rlx_mpi.families" in g["rlx_mpi.cluster"]  # module level, relative
    assert "rlx_mpi.drivers.run" in g["rlx_mpi.cli"]  # inside a function
    assert "rlx_mpi.transport" in g["rlx_mpi.drivers.run"]  # `from .. import transport`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
