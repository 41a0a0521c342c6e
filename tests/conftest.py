"""Suite-wide hooks: under ELASTRON_REQUIRE_TOOLS=1 a skip for a missing tool is a failure
(tests/tools.py states the rule); the one Ray cluster of the session and its leak guard
(tests/ray_cluster.py), for every test that asks for `ray_cluster`."""

from __future__ import annotations

import pytest

from tests.tools import REQUIRE_TOOLS, is_missing_tool, tools_required

pytest_plugins = ["tests.ray_cluster"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and tools_required() and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if is_missing_tool(reason):
            report.outcome = "failed"
            report.longrepr = f"{reason} ({REQUIRE_TOOLS}=1: a missing tool fails the run)"
