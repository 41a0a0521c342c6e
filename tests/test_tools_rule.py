"""tests/tools.py's rule, run on a throwaway test file in a pytest of its own: a missing tool
skips, and fails under ELASTRON_REQUIRE_TOOLS=1 (through the helpers, a missing module included,
and through a skipif marker whose reason names a missing tool); a hardware skip stays a skip either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import pytest
from tests.tools import missing_tool, require_module

def test_module():
    require_module("elastron_no_such_module", "pip install it")

def test_helper():
    missing_tool("no-such-tool", "install it with make test")

@pytest.fixture
def needs_tool():
    missing_tool("no-such-server", "initdb not found")

def test_fixture(needs_tool):
    pass

@pytest.mark.skipif(True, reason="missing tool chromium: apt-get install chromium")
def test_marker():
    pass

@pytest.mark.skipif(True, reason="needs CUDA")
def test_hardware():
    pass

def test_runs():
    pass
'''


def outcomes(tmp_path: Path, require: str | None) -> dict[str, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "ELASTRON_REQUIRE_TOOLS"}
    env["PYTHONPATH"] = str(ROOT)
    if require is not None:
        env["ELASTRON_REQUIRE_TOOLS"] = require
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), f"--junitxml={report}", str(tmp_path / "test_probe.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )
    assert report.exists(), proc.stdout + proc.stderr
    found: dict[str, str] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        # a test's own failure is a "failure"; one in its setup (a fixture, a skipif marker) an "error"
        found[case.get("name")] = kinds[0] if kinds else "passed"
    return found


def test_missing_tools_skip_on_a_developer_machine(tmp_path):
    assert outcomes(tmp_path, None) == {
        "test_module": "skipped", "test_helper": "skipped", "test_fixture": "skipped", "test_marker": "skipped",
        "test_hardware": "skipped", "test_runs": "passed",
    }


def test_missing_tools_fail_when_required(tmp_path):
    found = outcomes(tmp_path, "1")
    assert found == {
        "test_module": "failure", "test_helper": "failure", "test_fixture": "error", "test_marker": "error",
        "test_hardware": "skipped", "test_runs": "passed",
    }
