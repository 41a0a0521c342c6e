"""tests/conftest.py's hooks under `make test`'s pytest-xdist workers, run on a throwaway test file
in a pytest of its own: every test that uses `ray_cluster` runs on one worker (one shared Ray
cluster per session, however many workers) at normal priority, the other tests spread over both
at a lower one, and a slow test
without its "Over 30 s:" reason is still named in the summary, which the controller process
prints from reports its workers sent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import OTHER_TESTS_NICE

ROOT = Path(__file__).resolve().parents[1]

# The probe stands in for the Ray tests (no cluster is started): `ray_cluster` and the leak guard
# are overridden; what the hooks see is the fixture's name and the folder. Each test writes the
# worker it ran on; the slow threshold is lowered so two tests count as slow.
COMMON = '''
import os, time
from pathlib import Path
import pytest
import tests.conftest

tests.conftest.SLOW_TEST_S = 0.5

@pytest.fixture
def ray_cluster():
    return None

@pytest.fixture(autouse=True)
def ray_leak_guard():
    yield

def _ran(name):
    out = Path(os.environ["PROBE_OUT"])
    out.mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "none")
    (out / name).write_text(f"{worker} {os.getpriority(os.PRIO_PROCESS, 0)}")
    time.sleep(0.3)
'''
RAY_PROBE = COMMON + '''
@pytest.mark.parametrize("i", range(4))
def test_on_ray(ray_cluster, i):
    _ran(f"ray{i}")
'''
PLAIN_PROBE = COMMON + '''
@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    _ran(f"plain{i}")

def test_slow_without_reason():
    time.sleep(0.8)

def test_slow_with_reason():
    """Over 30 s: it says why."""
    time.sleep(0.8)
'''
MISPLACED_PROBE = COMMON + '''
def test_misplaced(ray_cluster):
    pass
'''


def pytest_in(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROBE_OUT": str(tmp_path / "ran")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), *args],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180,
    )


def test_ray_tests_share_one_worker_and_slow_tests_are_named(tmp_path):
    (tmp_path / "tests" / "workers").mkdir(parents=True)
    (tmp_path / "tests" / "workers" / "test_ray_probe.py").write_text(RAY_PROBE)
    (tmp_path / "test_plain_probe.py").write_text(PLAIN_PROBE)
    proc = pytest_in(tmp_path, "-n", "2", "--dist", "loadgroup", ".")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    ran = {p.name: p.read_text().split() for p in (tmp_path / "ran").iterdir()}
    assert len(ran) == 12, ran
    ray_workers = {w for name, (w, _) in ran.items() if name.startswith("ray")}
    assert len(ray_workers) == 1 and ray_workers <= {"gw0", "gw1"}, ran
    # the others were not held up behind the Ray group: the other worker ran some
    assert {w for name, (w, _) in ran.items() if name.startswith("plain")} - ray_workers, ran
    # the Ray tests at this process' priority, the others at a lower one
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert {int(nice) for name, (_, nice) in ran.items() if name.startswith("ray")} == {mine}, ran
    others = {int(nice) for name, (_, nice) in ran.items() if name.startswith("plain")}
    assert min(others) >= max(mine, OTHER_TESTS_NICE), ran
    summary = out.split("without 'Over 30 s:' in their docstring", 1)
    assert len(summary) == 2, out
    assert "test_slow_without_reason" in summary[1] and "test_slow_with_reason" not in summary[1], out


def test_a_ray_test_outside_the_ray_folder_is_refused(tmp_path):
    (tmp_path / "test_misplaced_probe.py").write_text(MISPLACED_PROBE)
    proc = pytest_in(tmp_path, "--collect-only", ".")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "test_misplaced uses ray_cluster outside tests/workers/" in out, out
