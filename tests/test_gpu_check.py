"""scripts/gpu_check.sh --cpu: every step of the GPU check (versions, `pytest -m cuda`, the bf16
vs fp32 correctness run, bench/gpu_mfu.py with compile and fp8) at tiny sizes on this CPU, so
the script that a rare GPU loan depends on cannot rot in between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_step_on_cpu(tmp_path):
    """Over 30 s: every step of scripts/gpu_check.sh in its own processes (a nested pytest, the
    bf16/fp32 correctness run, the MFU bench with torch.compile and fp8)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["mode"] == "cpu"
    assert [s["step"] for s in summary["steps"]] == ["versions", "pytest-cuda", "correctness", "mfu"]
    assert summary["versions"]["torch"].startswith(("2.",)) and summary["versions"]["transformer_engine"]
    assert summary["correctness"]["ok"] and summary["correctness"]["max_loss_diff"] > 0  # bf16 really ran
    runs = {r["run"]: r for r in summary["mfu"]}
    assert set(runs) == {"engine", "reference", "compile", "fp8"}, runs
    assert not any(r["error"] for r in runs.values()), runs
    assert runs["reference"]["engine_over_reference"] > 0 and runs["fp8"]["speedup_over_bf16"] > 0
    assert 0 < runs["engine"]["mfu"] < 1
