"""The dependency rule (docs/architecture.md, "Layers"): engine is a library (imports neither workers nor service);
workers never import service; service (and the CLI) start without importing torch or Ray Train. No module of
engine, workers or service imports itself back through others (no import circles), and inside the engine every
import goes down its floors (`ENGINE_FLOORS`)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The engine's floors, bottom to top (mirrored in docs/architecture.md, "Layers"). A unit is a package
# of engine/ or one of its top-level modules. A module may import any module of its own unit, and of
# the units on the floors below its own: never one above (up), nor another unit of its own floor
# (around). Each unit is placed once; a new one fails test_every_engine_unit_has_a_floor until it is.
ENGINE_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("jobspec", "device", "parallel_state", "parallel_placement", "loggers", "compile",
                    "step_metrics", "watchdog")),
    ("process groups", ("distributed", "fault_tolerance", "microbatches")),
    ("parallel layers, optimizer", ("tensor_parallel", "optimizer", "timers", "energy_monitor")),
    ("transformer", ("transformer",)),
    ("models", ("models", "pipeline_parallel", "step_batches", "flops")),
    ("rank hooks", ("rank_hooks",)),
    ("rerun machine", ("rerun",)),
    ("checkpoints", ("checkpointing",)),
    ("data", ("data",)),
    ("Hugging Face", ("hf",)),
    ("model setup, objective", ("model_setup", "objective")),
    ("evaluation, step meter", ("evaluation", "step_meter")),
    ("training", ("training",)),
    ("rank loop, launcher", ("train_loop", "launcher")),
    ("lm-eval harness", ("harness",)),
    ("commands", ("cli",)),
)  # fmt: skip

# The packages whose import graph must have no cycle.
GRAPH_PACKAGES = ("engine", "workers", "service")


def _imported_modules(package: str) -> dict[str, set[str]]:
    """Every module any import statement in `package` names (lazy imports inside functions
    included), with the files that import it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _imported_packages(package: str) -> dict[str, set[str]]:
    """The top-level packages `package` imports, with the files that import them."""
    found: dict[str, set[str]] = {}
    for module, files in _imported_modules(package).items():
        found.setdefault(module.split(".")[0], set()).update(files)
    return found


def test_engine_imports_neither_workers_nor_service():
    imported = _imported_packages("engine")
    assert "service" not in imported, imported.get("service")
    assert "workers" not in imported, imported.get("workers")


def test_workers_do_not_import_service():
    assert "service" not in _imported_packages("workers")


def test_service_imports_only_the_job_spec_of_the_engine_and_nothing_of_the_workers():
    """The control plane launches the layers below it; it does not reach into them. The job spec
    package (pydantic, torch-free) is the contract it shares with them."""
    imported = _imported_modules("service")
    engine = {m: f for m, f in imported.items() if m.split(".")[0] == "engine"}
    beyond_spec = {
        m: f for m, f in engine.items() if not (m == "engine.jobspec" or m.startswith("engine.jobspec."))
    }
    assert not beyond_spec, beyond_spec
    assert not {m: f for m, f in imported.items() if m.split(".")[0] in ("workers", "elastron")}


def test_the_job_spec_imports_nothing_else_of_the_engine():
    """What the service imports of the engine must not pull in the rest of it (torch)."""
    imported = _imported_modules("engine/jobspec")
    other = {m: f for m, f in imported.items() if m.startswith("engine.") and not m.startswith("engine.jobspec")}
    assert not other, other


def test_only_the_dispatcher_composes_the_layers():
    assert "elastron" not in _imported_packages("engine")
    assert not {"service", "elastron"} & set(_imported_packages("workers"))


def test_service_and_cli_start_without_torch_or_ray_train():
    code = (
        "import sys, service, service.cli, engine.jobspec, engine.cli, workers.cli, elastron.cli; "
        "bad = [m for m in ('torch', 'ray.train') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_device_handling_lives_in_one_place():
    """Only engine/device.py talks to torch.cuda."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "engine").rglob("*.py")
        if "torch.cuda" in p.read_text() and p.name != "device.py"
    ]
    assert not offenders, offenders


def test_only_workers_touch_ray_train_internals():
    """Ray Train's `_internal` packages change without notice between releases: workers/trainer.py
    is the one place that leans on them (and tests/workers/test_ray_internals.py, which pins
    them), so an upgrade breaks one module, caught by one test."""
    allowed = {ROOT / "tests" / "workers" / "test_ray_internals.py"}

    def internal(name: str) -> bool:
        parts = name.split(".")
        return parts[:2] == ["ray", "train"] and "_internal" in parts[2:]

    offenders = []
    for package in ("engine", "service", "bench", "tests", "scripts", "deploy", "examples"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from ray.train.v2 import _internal` names the package in the alias
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif (
                    isinstance(node, ast.Call)  # importlib.import_module("...") / __import__("...")
                    and getattr(node.func, "attr", getattr(node.func, "id", None))
                    in ("import_module", "__import__")
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    names = [node.args[0].value]
                else:
                    continue
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if internal(n)]
    assert not offenders, offenders


def test_the_dispatcher_lists_every_layers_commands_as_before_the_split():
    """Each layer owns its commands, but `elastron --help` lists the same commands in the same
    order as when service/cli.py held them all (the order the layers' apps are added in)."""
    import typer

    from elastron.cli import app

    # typer keeps the commands in the order they were added (and lists them so in --help)
    assert list(typer.main.get_command(app).commands) == [
        "train", "export", "eval", "schema", "preprocess", "checkpoint",  # engine/cli.py (checkpoint: the admin's convert)
        "worker-run",  # workers/cli.py
        # service/cli.py; its command groups (token, jobs: a listing with `jobs export`, tenants, sweep) come last
        "up", "down", "submit", "status", "logs", "cancel", "demo", "queue", "token", "jobs", "tenants", "sweep",
    ]  # fmt: skip


# --- the module import graph: no circles, and the engine's floors --------------------------------------


@dataclass(frozen=True)
class Edge:
    """One import statement of `importer` (in `path`, at `line`) that names module `imported`."""

    importer: str
    imported: str
    path: str
    line: int
    statement: str

    def where(self) -> str:
        return f"{self.path}:{self.line} `{self.statement}`"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages."""
    return {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the graph that importing `name` runs: `name` itself, or the nearest package
    above it (`a.b.C`, a name inside module a.b, is a.b); None outside the graph."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict) -> list[str]:
    """The dotted names an import statement of `module` imports. `from pkg import sub` names the
    submodule pkg.sub, `from pkg import name` the package pkg; relative imports are resolved
    against the module's package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return subs if len(subs) == len(node.names) else [*subs, base]


def import_graph(root: Path, packages: tuple[str, ...] = GRAPH_PACKAGES) -> list[Edge]:
    """Every import edge between the modules of `packages` under `root`: each import statement
    anywhere in a file (top level, `if TYPE_CHECKING:`, inside functions)."""
    modules = _modules(root, packages)
    edges: list[Edge] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = _imported_names(node, module, path.name == "__init__.py", modules)
                found = {t for t in (_known(n, modules) for n in names) if t and t != module}
                edges += [Edge(module, t, rel, node.lineno, ast.unparse(node)) for t in sorted(found)]
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (the import circles), each
    sorted; iterative, so the depth of the graph does not matter."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(graph) | {w for ws in graph.values() for w in ws})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def import_cycles(edges: list[Edge]) -> list[str]:
    """One report per import circle: its modules, then each import statement between them."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    reports = []
    for component in strongly_connected(graph):
        members = set(component)
        inside = [e for e in edges if e.importer in members and e.imported in members]
        lines = [f"{e.importer} -> {e.imported}  ({e.where()})" for e in inside]
        reports.append(f"circle of {len(component)}: {', '.join(component)}\n    " + "\n    ".join(lines))
    return reports


def engine_unit(module: str) -> str | None:
    """The floor unit of an engine module: its package under engine/, or the top-level module
    itself (engine.distributed.sharding -> distributed); None for the engine package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def floor_violations(edges: list[Edge], floors: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    """Every import between two engine units that does not go down the floors: up (to a higher
    floor) or around (to another unit of the same floor), naming the file, the import and both
    floors. An import of a unit the table does not place is reported too."""
    floor_of = {unit: (i, name) for i, (name, units) in enumerate(floors) for unit in units}

    def describe(unit: str) -> str:
        i, name = floor_of[unit]
        return f"{unit} (floor {i}, {name})"

    out = []
    for e in edges:
        a, b = engine_unit(e.importer), engine_unit(e.imported)
        if a is None or b is None or a == b:
            continue
        if a not in floor_of or b not in floor_of:
            missing = sorted({u for u in (a, b) if u not in floor_of})
            out.append(f"{e.where()}: {', '.join(missing)} has no floor")
            continue
        if floor_of[b][0] > floor_of[a][0]:
            way = "up"
        elif floor_of[b][0] == floor_of[a][0]:
            way = "around"
        else:
            continue
        out.append(f"{e.where()}: goes {way}: {describe(a)} imports {e.imported} of {describe(b)}")
    return out


def unplaced_units(root: Path, floors: tuple[tuple[str, ...], ...]) -> tuple[list[str], list[str]]:
    """(engine units without a floor, table entries naming no unit, or placed twice)."""
    units = {u for m in _modules(root, ("engine",)) if (u := engine_unit(m))}
    placed = [u for _, us in floors for u in us]
    stale = sorted({u for u in placed if u not in units or placed.count(u) > 1})
    return sorted(units - set(placed)), stale


def test_no_import_circles():
    """engine, workers and service: no module imports itself back, through any chain of imports
    (type-only and function-local ones included). What a lower module needs of a higher one is a
    Protocol the lower module owns, or a piece moved down to a module of its own."""
    cycles = import_cycles(import_graph(ROOT))
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_every_engine_unit_has_a_floor():
    unplaced, stale = unplaced_units(ROOT, ENGINE_FLOORS)
    assert not unplaced, f"engine units with no floor in ENGINE_FLOORS (place them): {unplaced}"
    assert not stale, f"ENGINE_FLOORS entries naming no engine package or module, or placed twice: {stale}"


def test_engine_imports_go_down_the_floors():
    """Every import between two engine units goes to a lower floor (ENGINE_FLOORS)."""
    bad = floor_violations(import_graph(ROOT, ("engine",)), ENGINE_FLOORS)
    assert not bad, "imports up or around the engine's floors:\n" + "\n".join(bad)


def test_the_floor_table_in_the_docs_is_this_one():
    """docs/architecture.md's "Layers" lists the same floors, with the same names, in the same order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    layers = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in layers.splitlines() if line.startswith("| ")]
    documented = [
        (int(cells[0]), cells[1].strip(), tuple(u.strip(" `") for u in cells[2].split(",")))
        for cells in rows
        if cells[0].strip().isdigit()
    ]
    assert documented == [(i, name, units) for i, (name, units) in enumerate(ENGINE_FLOORS)]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_checkers_catch_a_back_import(tmp_path):
    """A fake engine whose low package imports its high module back, once under TYPE_CHECKING and
    once inside a function, through `from pkg import submodule` and relative imports: the graph
    has the edges, the circle is reported, and the floors report the import going up."""
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/low/__init__.py": "",
            "engine/low/a.py": """
                from typing import TYPE_CHECKING

                from . import b

                if TYPE_CHECKING:
                    from engine.high import Thing
            """,
            "engine/low/b.py": """
                def late():
                    from ..side import helper
                    return helper
            """,
            "engine/side.py": "import os\n",
            "engine/high.py": "from engine.low import a\n\nThing = a\n",
        },
    )
    edges = import_graph(root, ("engine",))
    assert {(e.importer, e.imported) for e in edges} == {
        ("engine.low.a", "engine.low.b"),  # from . import b: the submodule
        ("engine.low.a", "engine.high"),  # type-only
        ("engine.low.b", "engine.side"),  # function-local, relative
        ("engine.high", "engine.low.a"),  # from pkg import submodule
    }
    (cycle,) = import_cycles(edges)
    assert "engine.high, engine.low.a" in cycle
    assert "engine.low.a -> engine.high  (engine/low/a.py:7 `from engine.high import Thing`)" in cycle
    assert "engine.high -> engine.low.a  (engine/high.py:1 `from engine.low import a`)" in cycle

    floors = (("bottom", ("low", "side")), ("top", ("high",)))
    assert floor_violations(edges, floors) == [
        "engine/low/a.py:7 `from engine.high import Thing`: goes up: low (floor 0, bottom) imports "
        "engine.high of high (floor 1, top)",
        "engine/low/b.py:3 `from ..side import helper`: goes around: low (floor 0, bottom) imports "
        "engine.side of side (floor 0, bottom)",
    ]
    assert floor_violations(edges, (("bottom", ("side",)), ("middle", ("low",)), ("top", ("high",)))) == [
        "engine/low/a.py:7 `from engine.high import Thing`: goes up: low (floor 1, middle) imports "
        "engine.high of high (floor 2, top)"
    ]

    assert unplaced_units(root, floors) == ([], [])
    assert unplaced_units(root, (("bottom", ("low", "gone")),)) == (["high", "side"], ["gone"])
    assert floor_violations(edges, (("bottom", ("low",)), ("top", ("high",))))[1:] == [
        "engine/low/b.py:3 `from ..side import helper`: side has no floor"
    ]


def test_the_cycle_finder_on_a_synthetic_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}}) == []
    deep = {str(i): {str(i + 1)} for i in range(5000)} | {"5000": {"0"}}
    assert [len(c) for c in strongly_connected(deep)] == [5001]
