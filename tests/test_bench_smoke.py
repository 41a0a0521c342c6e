"""Every bench in bench/ runs in its --smoke mode (tiny sizes, seconds) and prints its figures,
so a bench broken by an engine change fails here instead of on the next person who needs its
number. The numbers are not asserted: they are not benchmarks at this size. (A bench another
test smokes already, SMOKED_ELSEWHERE, is not run twice.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.run_benches import benches, run_bench

SMOKE_TIMEOUT_S = 300.0
# Benches whose --smoke another test runs already, checking more than that it prints figures
# (~15-20 s of CI each, run once): bench -> (the script that runs it, the test that runs that).
SMOKED_ELSEWHERE = {
    # scripts/gpu_check.sh --cpu's `mfu` step: tests/test_gpu_check.py checks every run's figures
    "gpu_mfu": ("scripts/gpu_check.sh", "tests/test_gpu_check.py"),
}


def test_benches_smoked_elsewhere_are_smoked_there():
    root = Path(__file__).resolve().parents[1]
    for name, (script, test) in SMOKED_ELSEWHERE.items():
        assert (root / "bench" / f"{name}.py").exists(), name
        assert f"bench/{name}.py" in (root / script).read_text(), f"{script} no longer runs bench/{name}.py"
        assert Path(script).name in (root / test).read_text(), f"{test} no longer runs {script}"


# Benches smoked in parts, each part a test of its own: bench -> part -> its arguments. The
# recovery bench whole took 270 s on an idle 2-core machine and passed its 300 s limit on a loaded
# one (stop 67's CI). Measured alone, each part pays for a Ray start and cold worker processes
# (in three parts the whole took 386 s), so two parts, of ~150-190 s, each under
# PART_TIMEOUT_S: a guard against a hang, with room for a machine 2x slower than an idle one.
SMOKE_PARTS = {
    "recovery": {
        # storage faults (no Ray), the SIGKILL recovery (a cold start and a restart), the survive
        # job's kill and rejoin
        "faults_recovery_survive": ("--only", "storage_faults", "--only", "recovery", "--only", "survive"),
        # the snapshot overhead's jobs; Ray over local (its Ray side is their plain run); a
        # launch with the ranks' processes asked for ahead and one without
        "overheads": ("--only", "snapshot_overhead", "--only", "overhead", "--only", "launch"),
        # a live resize's shrink and grow, and the restart-based resize's stop and relaunches
        "resize": ("--only", "resize"),
    },
}
PART_TIMEOUT_S = 450.0


def smoke_runs() -> list:
    runs = []
    for path in benches():
        if path.stem in SMOKED_ELSEWHERE:
            continue
        parts = SMOKE_PARTS.get(path.stem, {"": ()})
        for part, args in parts.items():
            limit = PART_TIMEOUT_S if part else SMOKE_TIMEOUT_S
            runs.append(pytest.param(path, args, limit, id=f"{path.stem}-{part}" if part else path.stem,
                                     marks=pytest.mark.timeout(limit + 30)))  # fmt: skip
    return runs


def test_bench_parts_cover_every_mode():
    """A part list that forgot a mode would stop smoking it without a failure."""
    from bench.recovery import MODES

    named = {a for args in SMOKE_PARTS["recovery"].values() for a in args if a != "--only"}
    assert named == set(MODES), f"bench/recovery.py modes no part runs: {set(MODES) - named}"


@pytest.mark.parametrize(("path", "args", "limit_s"), smoke_runs())
def test_bench_runs_in_smoke_mode(path, args, limit_s):
    """Over 30 s: each part of the recovery bench (the others take seconds): a Ray cluster of its
    own, its Ray jobs' cold starts and restarts (each fit() ~20-35 s to its first step on 2 cores).
    The bench's own time limit ends it (with its output) before pytest-timeout would."""
    run = run_bench(path, smoke=True, timeout_s=limit_s, args=args)
    assert run.ok, run.problem()


def test_a_bench_that_raises_or_prints_nothing_fails(tmp_path):
    """The check above can fail: a bench that raises, and one that prints no figure."""
    raising = tmp_path / "raising.py"
    raising.write_text("import sys\nif '--smoke' in sys.argv:\n    raise RuntimeError('models differ')\n")
    silent = tmp_path / "silent.py"
    silent.write_text("print('no json here')\n")
    fine = tmp_path / "fine.py"
    fine.write_text("import json, sys\nprint(json.dumps({'figure': 1.0, 'smoke': '--smoke' in sys.argv}))\n")
    bad = run_bench(raising, smoke=True, timeout_s=60)
    assert not bad.ok and bad.returncode == 1 and "models differ" in bad.problem()
    assert not run_bench(silent, smoke=True, timeout_s=60).ok
    good = run_bench(fine, smoke=True, timeout_s=60)
    assert good.ok and good.lines == [{"figure": 1.0, "smoke": True}]
