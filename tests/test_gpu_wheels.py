"""What `elastron train` needs on the GPU machines, which have no network and no pydantic.

scripts/gpu-wheels.txt lists the wheels that travel with a GPU run (`make gpu-wheels`); these tests
check that the train path imports nothing the image lacks beyond them, that the list covers what
its packages require, and that the wheels it names exist for the image's Python and fit the limit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from tests.tiny_jobs import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "scripts" / "gpu-wheels.txt"
RAY_WHEEL_LIST = ROOT / "scripts" / "gpu-ray-wheels.txt"  # `make gpu-ray`: Ray & co. for the survive bench
WHEEL_DIR = ROOT / "build" / "gpu-wheels"
MAX_WHEEL_BYTES = 60 * 2**20  # what may travel with a run is 64 MiB in all

# Not on the GPU image and not carried: `elastron train` must not import them.
BLOCKED = (
    "ray", "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic",
    "pydantic_settings", "boto3", "botocore", "moto",
)  # fmt: skip

# What the GPU image has. Source: /work/shared/REFERENCE.md, "The GPU machines have Python 3.12
# (`python3`, torch 2.11 + CUDA 13), transformers 5.17, safetensors, ...", plus sentencepiece,
# pytest-timeout, typing-extensions and httpx as found on the machine.
GPU_IMAGE_HAS = frozenset(
    canonicalize_name(n)
    for n in (
        "torch", "transformers", "safetensors", "numpy", "pyyaml", "xxhash", "jinja2",
        "nvidia-ml-py", "prometheus-client", "rich", "typer", "tokenizers", "sentencepiece",
        "psutil", "pytest", "pytest-timeout", "typing-extensions", "httpx", "peft", "accelerate",
    )
)  # fmt: skip

# The image's interpreter, for evaluating Requires-Dist markers.
GPU_PYTHON = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
GPU_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
GPU_TAGS = frozenset(
    [
        *cpython_tags((3, 12), abis=["cp312"], platforms=GPU_PLATFORMS),
        *compatible_tags((3, 12), interpreter="cp312", platforms=GPU_PLATFORMS),
    ]
)
OPTIONAL = {"torchao"}  # carried for an FP8 comparison only; not in the project's venv


def pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """{canonical name: version} from a wheel list; fails on a line that is not name==version."""
    out = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"{path.name} line {n} is not pinned as name==version: {raw!r}"
        name = canonicalize_name(m[1])
        assert name not in out, f"{path.name} names {m[1]} twice"
        out[name] = m[2]
    return out


def test_train_imports_nothing_the_gpu_image_lacks(tmp_path):
    stubs = tmp_path / "stubs"
    log = tmp_path / "imported.log"
    for name in BLOCKED:
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(
            "import os\n"
            "with open(os.environ['ELASTRON_BLOCKED_LOG'], 'a') as f:\n"
            "    f.write(__name__ + '\\n')\n"
            "raise ImportError('blocked: not on the GPU image')\n"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(stubs), str(ROOT)]),
        "ELASTRON_BLOCKED_LOG": str(log),
    }

    # Positive control: the stubs do shadow the installed packages, so the walk below can fail.
    control = subprocess.run(
        [sys.executable, "-c", "import boto3"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert control.returncode != 0 and "blocked: not on the GPU image" in control.stderr, control.stderr
    assert log.read_text() == "boto3\n"
    log.unlink()

    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "name": "gpu-image-imports",
                "model": TINY_LLAMA,
                "training": {
                    "global_batch_size": 2,
                    "micro_batch_size": 1,
                    "train_iters": 2,
                    "log_interval": 1,
                },
                "resources": {"ranks": 1, "device": "cpu"},
            }
        )
    )
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "elastron.cli", "train", str(job), "--metrics-out", str(metrics)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    imported = log.read_text().split() if log.exists() else []
    assert imported == [], f"`elastron train` imported {imported}, which the GPU image lacks:\n{proc.stderr}"
    assert proc.returncode == 0, proc.stderr
    assert len(metrics.read_text().splitlines()) == 2


def test_wheel_list_is_pinned_and_covers_what_it_requires():
    pinned = pins()
    for name, version in pinned.items():
        try:
            installed = distribution(name).version
        except PackageNotFoundError:
            assert name in OPTIONAL, f"{name} is pinned for the GPU machines but not installed in this venv"
            continue
        assert installed == version, (
            f"gpu-wheels.txt pins {name}=={version} but the venv has {installed}: move both together"
        )
    for carried in ("pydantic", "pydantic-core", "typing-inspection"):
        assert carried in pinned, f"gpu-wheels.txt must carry {carried}"
        assert_requirements_met(carried, pinned, GPU_IMAGE_HAS, "gpu-wheels.txt")


def assert_requirements_met(carried: str, packed: dict[str, str], image: frozenset[str], where: str) -> None:
    """Every requirement of the installed `carried` on the GPU image's Python (extras and other
    platforms aside; torch is the image's own) is either in `packed` at a version it accepts or
    in `image`."""
    for spec in distribution(carried).requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(GPU_PYTHON):
            continue  # an extra, or another platform's or Python's dependency
        dep = canonicalize_name(req.name)
        if dep == "torch":
            continue
        if dep in packed:
            assert req.specifier.contains(packed[dep], prereleases=True), (
                f"{carried} requires {spec!r}; {where} pins {dep}=={packed[dep]}"
            )
        else:
            assert dep in image, f"{carried} requires {spec!r}, which is neither in {where} nor on the GPU image"


# pip's messages when the index cannot be reached (as opposed to a wheel that does not exist).
NETWORK_ERRORS = re.compile(
    r"connection broken by|NewConnectionError|ConnectTimeoutError|ReadTimeoutError|ProxyError|"
    r"Max retries exceeded|Temporary failure in name resolution|Name or service not known|"
    r"Network is unreachable"
)


@pytest.mark.timeout(150)
def test_make_gpu_wheels_downloads_one_fitting_wheel_per_pin():
    env = {**os.environ, "PIP_RETRIES": "1", "PIP_TIMEOUT": "5"}  # 1 retry: pip then says why it failed
    proc = subprocess.run(
        ["make", "gpu-wheels", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and NETWORK_ERRORS.search(output):
        pytest.skip(
            f"network: pip download cannot reach the package index ({NETWORK_ERRORS.search(output)[0]})"
        )
    assert proc.returncode == 0, output

    pinned = pins()
    wheels = sorted(WHEEL_DIR.iterdir())
    found: dict[str, str] = {}
    for wheel in wheels:
        name, version, _, tags = parse_wheel_filename(wheel.name)
        assert name not in found, f"two wheels for {name}: {[w.name for w in wheels]}"
        found[name] = str(version)
        assert tags & GPU_TAGS, f"{wheel.name} does not install on CPython 3.12 manylinux x86_64"
    assert found == pinned
    total = sum(w.stat().st_size for w in wheels)
    assert total <= MAX_WHEEL_BYTES, f"build/gpu-wheels is {total / 2**20:.1f} MiB, over 60 MiB"


# What Ray's and torchft's own requirements find on the GPU image (KINDS.md's package list of the
# device tool, read 2026-11-17), beyond GPU_IMAGE_HAS.
GPU_IMAGE_HAS_FOR_RAY = GPU_IMAGE_HAS | frozenset(
    canonicalize_name(n)
    for n in (
        "click", "filelock", "msgpack", "packaging", "protobuf", "requests", "aiohttp",
        "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict", "propcache", "yarl",
        "idna", "grpcio", "six", "urllib3", "certifi", "charset-normalizer", "anyio",
        "importlib-metadata", "zipp", "wrapt", "google-auth", "proto-plus",
    )
)  # fmt: skip


def test_ray_wheel_list_matches_the_venv_and_covers_what_ray_and_torchft_require():
    """scripts/gpu-ray-wheels.txt (with gpu-wheels.txt) is what `make gpu-ray` packs: the same
    versions as this venv's, and every requirement of what it carries (extras aside: the
    list's comment says how the extras a local Ray loads were found) either packed or on the
    image."""
    ray_pins, base = pins(RAY_WHEEL_LIST), pins()
    assert not set(ray_pins) & set(base), "gpu-ray-wheels.txt repeats a gpu-wheels.txt pin"
    packed = {**base, **ray_pins}
    for name, version in ray_pins.items():
        installed = distribution(name).version
        assert installed == version, (
            f"gpu-ray-wheels.txt pins {name}=={version} but the venv has {installed}: move both together"
        )
    for carried in ray_pins:
        assert_requirements_met(carried, packed, GPU_IMAGE_HAS_FOR_RAY, "the GPU wheel lists")
