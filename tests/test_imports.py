"""The layers of rlx_mpi and no import cycle: every package module belongs to one layer of
`LAYERS` and imports only from its own layer or lower ones (ARCHITECTURE.md draws the same
table); and no cycle: every ``import``/``from ... import`` of a package module,
at module level or inside a function (a lazy import is still an edge: it only moves the cycle
to run time), walked with `ast`. A cycle is what makes a newcomer unable to say which module
is below which; the fix is to move the shared piece down, not to hide the import."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "rlx_mpi"

# lowest first; a module may import its own layer and the layers before it, never one after
LAYERS = [
    ("kernels", ["kernels"]),  # numba kernels: a leaf
    ("base", ["errors", "rules", "tags", "config", "outputs"]),  # plain data, the rules, the job file
    ("lifecycle", ["lifecycle"]),  # one rank's life: supervisor, MPI start/end, faults, signals
    ("comm", ["comm"]),  # bytes between ranks: transport, collectives, schedule, executor, tags
    ("model", ["model"]),  # the family contract, checkpoint, KV cache, cost
    ("engine", ["engine"]),  # rows through steps (pure): records, scheduler, admission, sampling
    ("io", ["io"]),  # files in and out: prompts, tokenizer, journal, identity, stats, trace
    ("families", ["families"]),  # the decoder and the family modules, the checkpoint readers
    ("cluster", ["cluster"]),  # start-up every MPI command shares, caps, placement
    ("drivers", ["drivers"]),  # one module per command
    ("entry", ["", "cli", "__main__"]),  # the package's lazy names, the command line
]


def layer_of(name: str) -> int:
    rest = name.split(".", 1)[1] if "." in name else ""
    head = rest.split(".", 1)[0]
    for i, (_, heads) in enumerate(LAYERS):
        if head in heads:
            return i
    raise AssertionError(f"{name} is in no layer of tests/test_imports.py's LAYERS: add it to one")


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of a higher layer, as 'module (layer) -> module (layer)'."""
    out = []
    for n, deps in sorted(g.items()):
        for d in sorted(deps):
            if layer_of(d) > layer_of(n):
                out.append(f"{n} ({LAYERS[layer_of(n)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})")
    return out


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: Path = PKG) -> dict[str, Path]:
    return {module_name(p, pkg): p for p in pkg.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str], missing: list | None = None, tree: ast.AST | None = None) -> set[str]:
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

    for node in ast.walk(tree or ast.parse(path.read_text(), str(path))):
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


def graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg)
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def test_no_layer_imports_a_higher_one():
    assert upward(graph()) == []


def test_a_planted_upward_import_is_caught(tmp_path):
    """A copy of the package with one module of `comm` importing a driver: the check names it."""
    import shutil

    copy = tmp_path / "rlx_mpi"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "comm" / "planted.py").write_text("def f():\n    from ..drivers import generate\n")
    assert upward(graph(copy)) == ["rlx_mpi.comm.planted (comm) -> rlx_mpi.drivers.generate (drivers)"]


def test_every_module_has_a_layer():
    for n in modules():
        layer_of(n)


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
    assert "rlx_mpi.families" in g["rlx_mpi.cluster.start"]  # module level, relative
    assert "rlx_mpi.drivers.run" in g["rlx_mpi.cli"]  # inside a function
    assert "rlx_mpi.comm.transport" in g["rlx_mpi.drivers.run"]  # `from .. import transport`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# the simulator (``plan --simulate``) runs where no MPI is: importing it loads no MPI, no numba
# and no numba kernel, however far down its module-level imports go (a function's lazy import of
# a kernel it never calls is allowed; tests/test_simulate.py runs a whole simulation and checks
# what was loaded)
PURE = ["rlx_mpi.engine.simulate", "rlx_mpi.model.calibration", "rlx_mpi.engine.ring", "rlx_mpi.engine.rounds"]
NOT_IN_PURE = ("mpi4py", "numba")


def _module_level(tree: ast.AST):
    """The nodes run on import: everything but the bodies of functions."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node)
                 if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def loaded_on_import(pkg: Path = PKG) -> dict[str, set[str]]:
    """Per module: the package modules and the foreign top-level names its import runs."""
    mods = modules(pkg)
    out = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        body = ast.Module(body=[n for n in _module_level(tree) if isinstance(n, (ast.Import, ast.ImportFrom))],
                          type_ignores=[])
        deps = imports_of(name, path, set(mods), tree=body)
        foreign = set()
        for n in body.body:
            if isinstance(n, ast.Import):
                foreign |= {a.name.split(".")[0] for a in n.names}
            elif not n.level and n.module:
                foreign.add(n.module.split(".")[0])
        out[name] = deps | {f"<{f}>" for f in foreign & set(NOT_IN_PURE)}
    return out


def impure(pkg: Path = PKG) -> list[str]:
    g = loaded_on_import(pkg)
    seen, todo = set(), [m for m in PURE if m in g]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [d for d in g[n] if not d.startswith("<")]
    bad = []
    for n in sorted(seen):
        if n.startswith(("rlx_mpi.kernels", "rlx_mpi.comm", "rlx_mpi.lifecycle")):
            bad.append(f"{n} (a kernel / MPI layer)")
        bad += [f"{n} imports {d[1:-1]}" for d in sorted(g[n]) if d.startswith("<")]
    return bad


def test_the_simulator_imports_no_mpi_and_no_numba_kernels():
    assert impure() == []


def test_a_planted_kernel_import_in_the_simulator_is_caught(tmp_path):
    import shutil

    copy = tmp_path / "rlx_mpi"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "engine" / "planted.py").write_text("import mpi4py\nfrom ..kernels import attend\n")
    sim = copy / "engine" / "simulate.py"
    sim.write_text(sim.read_text() + "\nfrom . import planted\n")
    bad = impure(copy)
    assert "rlx_mpi.engine.planted imports mpi4py" in bad and "rlx_mpi.kernels (a kernel / MPI layer)" in bad
