"""The dependency rule (docs/architecture.md, "Layers"): engine is a library (imports neither workers nor service);
workers never import service; service (and the CLI) start without importing torch or Ray Train."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
        "train", "export", "schema", "preprocess", "checkpoint",  # engine/cli.py (checkpoint: the admin's convert)
        "worker-run",  # workers/cli.py
        # service/cli.py; its command groups (token, jobs: a listing with `jobs export`, tenants) come last
        "up", "down", "submit", "status", "logs", "cancel", "demo", "queue", "token", "jobs", "tenants",
    ]  # fmt: skip
