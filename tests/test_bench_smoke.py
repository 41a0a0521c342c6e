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


# Benches smoked in parts, each part a test of its own under SMOKE_TIMEOUT_S: bench -> part ->
# its arguments. The recovery bench whole took 270 s on an idle 2-core machine and passed 300 s
# on a loaded one (stop 67's CI); in three parts (a Ray start each, ~10 s) none takes half of
# that, and every mode still runs.
SMOKE_PARTS = {
    "recovery": {
        # storage faults (no Ray, ~40 s) and the SIGKILL recovery (one cold start, one restart)
        "faults_and_recovery": ("--only", "storage_faults", "--only", "recovery"),
        # the survive job's kill and the replacement's rejoin
        "survive": ("--only", "survive"),
        # the snapshot overhead's jobs; Ray over local (its Ray side is their plain run)
        "overheads": ("--only", "snapshot_overhead", "--only", "overhead"),
    },
}


def smoke_runs() -> list:
    runs = []
    for path in benches():
        if path.stem in SMOKED_ELSEWHERE:
            continue
        parts = SMOKE_PARTS.get(path.stem, {"": ()})
        runs += [pytest.param(path, args, id=f"{path.stem}-{part}" if part else path.stem) for part, args in parts.items()]
    return runs


def test_bench_parts_cover_every_mode():
    """A part list that forgot a mode would stop smoking it without a failure."""
    from bench.recovery import MODES

    named = {a for args in SMOKE_PARTS["recovery"].values() for a in args if a != "--only"}
    assert named == set(MODES), f"bench/recovery.py modes no part runs: {set(MODES) - named}"


@pytest.mark.parametrize(("path", "args"), smoke_runs())
def test_bench_runs_in_smoke_mode(path, args):
    """Over 30 s: each part of the recovery bench (the others take seconds): a Ray cluster of its
    own, its Ray jobs' cold starts and restarts (each fit() ~20-35 s to its first step on 2 cores)."""
    run = run_bench(path, smoke=True, timeout_s=SMOKE_TIMEOUT_S, args=args)
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
