"""deploy/Dockerfile, read without a Docker engine.

Checks what a build would trip over first: every stage pins torch from constraints.txt before it
installs anything else and keeps the pin for every later pip call; what the image copies exists
and passes the build-context filter; the GPU image installs the `gpu` extra; the images run as a
numeric non-root user; and the entry points the image and the compose file start exist in the
package (`elastron` console script, `service.app:create_app`).
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.deploy.tools import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def runs(self) -> list[str]:
        return [args for op, args in self.instructions if op == "RUN"]


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    """Instructions per stage, with line continuations joined and comments dropped."""
    logical: list[str] = []
    current = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            logical.append(current.strip())
        current = ""
    stages: list[Stage] = []
    for statement in logical:
        op, _, args = statement.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.I)
            assert m, statement
            stages.append(Stage(m.group(2) or str(len(stages)), m.group(1)))
        elif stages:
            stages[-1].instructions.append((op, args.strip()))
    return stages


def stage(name: str) -> Stage:
    (found,) = [s for s in parse_dockerfile() if s.name == name]
    return found


def torch_pin() -> str:
    (pin,) = [
        line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch==")
    ]
    return pin


def test_stages() -> None:
    names = [s.name for s in parse_dockerfile()]
    assert {"cpu", "gpu-build", "gpu"} <= set(names)
    assert stage("gpu").base.startswith("nvidia/cuda:") and "runtime" in stage("gpu").base
    assert "devel" in stage("gpu-build").base
    assert stage("cpu").base.startswith("python:")


# python3 of the Ubuntu releases the GPU image may be based on
UBUNTU_PYTHON = {"22.04": "3.10", "24.04": "3.12", "26.04": "3.14"}


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", DOCKERFILE.read_text(), re.M))


def test_cpu_and_gpu_images_run_the_same_python() -> None:
    """Ray refuses nodes whose Python differs from the head's: the CPU head and API image and
    the GPU worker image must agree."""
    args = build_args()
    assert stage("cpu").base == "python:${PYTHON_VERSION}-slim-bookworm"
    assert stage("gpu").base.endswith("-ubuntu${UBUNTU_VERSION}")
    assert args["PYTHON_VERSION"] == UBUNTU_PYTHON[args["UBUNTU_VERSION"]]
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(args["PYTHON_VERSION"]), requires


@pytest.mark.parametrize("name", ["cpu", "gpu-build"])
def test_torch_is_installed_first_from_the_constraints_pin(name: str) -> None:
    s = stage(name)
    env = " ".join(args for op, args in s.instructions if op == "ENV")
    assert "PIP_CONSTRAINT=/opt/elastron/constraints.txt" in env
    workdir = [args for op, args in s.instructions if op == "WORKDIR"][0]
    assert workdir == "/opt/elastron" and ("COPY", "constraints.txt ./") in s.instructions
    installs = [run for run in s.runs() if re.search(r"pip install (?!--upgrade pip)", run)]
    first = installs[0]
    assert "torch==$(sed -n 's/^torch==//p' constraints.txt)" in first, first
    # the shell expression in the Dockerfile yields the pin
    version = subprocess.run(
        ["sed", "-n", "s/^torch==//p", "constraints.txt"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.strip()
    assert f"torch=={version}" == torch_pin()


def test_cpu_image_takes_torch_from_the_cpu_index() -> None:
    first_torch = [run for run in stage("cpu").runs() if "torch==" in run][0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in first_torch


def test_gpu_image_installs_the_gpu_extra_against_the_pinned_torch() -> None:
    runs = " ".join(stage("gpu-build").runs())
    assert "['optional-dependencies']['gpu']" in runs
    assert "--no-build-isolation -r /tmp/requirements-gpu.txt" in runs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("transformer-engine") for dep in extras["gpu"])
    copies = [args for op, args in stage("gpu").instructions if op == "COPY"]
    assert "--from=gpu-build /opt/venv /opt/venv" in copies


def dockerignore_allows(path: str) -> bool:
    allowed = False
    for pattern in DOCKERIGNORE.read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("name", ["cpu", "gpu-build"])
def test_copied_files_exist_and_pass_the_context_filter(name: str) -> None:
    for op, args in stage(name).instructions:
        if op != "COPY" or args.startswith("--from"):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: missing"
            assert dockerignore_allows(source), f"COPY {source}: left out by {DOCKERIGNORE.name}"
    assert not dockerignore_allows(".venv") and not dockerignore_allows(".tools")


def test_package_data_is_found_where_the_code_expects_it() -> None:
    """The image installs the project in editable mode, so files beside the code that
    pyproject's package-data does not list (the shipped corpus) are still found."""
    for name in ("cpu", "gpu-build"):
        assert any("pip install --no-deps -e ." in run for run in stage(name).runs()), name
    assert (ROOT / "engine" / "data" / "corpus").is_dir()


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_image_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = [args for op, args in stage(name).instructions if op == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), users


def defines(module: Path, name: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
    return False


def module_file(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def test_elastron_console_script_exists() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["elastron"].partition(":")
    assert module_file(module).is_file() and defines(module_file(module), attr), scripts["elastron"]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_image_starts_the_api_app_factory(name: str) -> None:
    (cmd,) = [args for op, args in stage(name).instructions if op == "CMD"]
    assert cmd.startswith('["uvicorn", "--factory", "service.app:create_app"')


def test_api_app_factory_exists() -> None:
    app = module_file("service.app")
    assert app.exists(), "service/app.py (the API's module) is missing"
    assert defines(app, "create_app"), "service/app.py defines no create_app"


@pytest.mark.parametrize("name", ["cpu", "gpu-build"])
def test_the_image_copies_every_package_the_project_installs(name: str) -> None:
    """A package pyproject installs but the image leaves out breaks the console script there."""
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in includes["include"]}
    copied = {
        args.split()[0] for op, args in stage(name).instructions if op == "COPY" and not args.startswith("--from")
    }
    assert packages <= copied, packages - copied
