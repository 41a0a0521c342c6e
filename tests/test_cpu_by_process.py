"""scripts/cpu_by_process.py: the CPU-seconds of a command's processes land under their kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BURN = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass\n"


def test_a_child_that_burns_a_cpu_second_is_counted_under_its_name(tmp_path):
    burner = tmp_path / "burn_one_second.py"
    burner.write_text(BURN)
    out = tmp_path / "cpu.json"
    run = subprocess.run(
        [sys.executable, "scripts/cpu_by_process.py", "--interval", "0.05", "--json", str(out), "--",
         sys.executable, str(burner)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    kinds = json.loads(out.read_text())["kinds"]
    burned = [cpu for kind, cpu in kinds.items() if "burn_one_second.py" in kind]
    assert burned and 0.8 <= burned[0] <= 1.5, kinds
    assert "burn_one_second.py" in run.stderr and "machine busy" in run.stderr


def test_the_command_exit_code_is_passed_on(tmp_path):
    run = subprocess.run(
        [sys.executable, "scripts/cpu_by_process.py", "--", sys.executable, "-c", "raise SystemExit(3)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 3, run.stderr


def test_no_command_is_a_usage_error():
    run = subprocess.run([sys.executable, "scripts/cpu_by_process.py"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "give the command" in run.stderr
