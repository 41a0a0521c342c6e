"""The one rule for a test that needs a program the machine lacks (Postgres, chromium and its
driver, promtool/prometheus, helm, dclint, a Python package the dev extra installs).

Such a test calls `missing_tool(name, reason)`: it skips, its reason starting with
"missing tool <name>:", so a developer's machine without the tool still runs the rest. Under
ELASTRON_REQUIRE_TOOLS=1 (.ci/run sets it; `make test` installs every tool where it can) the same
call fails the test instead, so a CI that lost a tool goes red instead of green-with-skips. The
hook in tests/conftest.py applies the rule to skips that did not come through here but carry the
same prefix (a `skipif` marker's reason). Skips for hardware (CUDA, an NVIDIA GPU) or for running
as root are not missing tools and stay skips.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_TOOLS = "ELASTRON_REQUIRE_TOOLS"
PREFIX = "missing tool "


def tools_required() -> bool:
    return os.environ.get(REQUIRE_TOOLS) == "1"


def missing_tool(name: str, reason: str, *, allow_module_level: bool = False) -> NoReturn:
    """Skip the test (fail it under ELASTRON_REQUIRE_TOOLS=1): `name` is not available, `reason`
    says why and how to get it. `allow_module_level`: called at a module's import (the whole
    module skips; under the variable its collection fails)."""
    message = f"{PREFIX}{name}: {reason}"
    if tools_required():
        pytest.fail(f"{message} ({REQUIRE_TOOLS}=1: a missing tool fails the run)", pytrace=False)
    pytest.skip(message, allow_module_level=allow_module_level)


def is_missing_tool(reason: str) -> bool:
    """Whether a skip's reason is a missing tool's (pytest's skip reasons start with "Skipped: ")."""
    return reason.removeprefix("Skipped: ").startswith(PREFIX)


def require_module(name: str, reason: str) -> ModuleType:
    """`pytest.importorskip` under the rule above: the module, or a missing-tool skip (a failure
    under ELASTRON_REQUIRE_TOOLS=1). Usable at a module's top, in a fixture or in a test."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        missing_tool(name, f"{reason} ({err})", allow_module_level=True)
