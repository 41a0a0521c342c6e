"""Suite-wide hooks: under ELASTRON_REQUIRE_TOOLS=1 a skip for a missing tool is a failure
(tests/tools.py states the rule); the one Ray cluster of the session and its leak guard
(tests/ray_cluster.py), for every test that asks for `ray_cluster`; and a list, at the end of
the run, of the tests that took over SLOW_TEST_S without saying why in their docstring
("Over 30 s: ...")."""

from __future__ import annotations

import pytest

from tests.tools import REQUIRE_TOOLS, is_missing_tool, tools_required

pytest_plugins = ["tests.ray_cluster"]

SLOW_TEST_S = 30.0
SLOW_REASON = "Over 30 s:"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.duration > SLOW_TEST_S:
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        report.slow_without_reason = SLOW_REASON not in doc
    if report.skipped and tools_required() and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if is_missing_tool(reason):
            report.outcome = "failed"
            report.longrepr = f"{reason} ({REQUIRE_TOOLS}=1: a missing tool fails the run)"


def pytest_terminal_summary(terminalreporter):
    """Name the slow tests that do not say why they must be slow (the durations list shows how slow)."""
    reports = [r for rs in terminalreporter.stats.values() for r in rs if getattr(r, "slow_without_reason", False)]
    if reports:
        terminalreporter.section(f"tests over {SLOW_TEST_S:.0f} s without '{SLOW_REASON}' in their docstring")
        for r in sorted(reports, key=lambda r: -r.duration):
            terminalreporter.line(f"{r.duration:7.1f} s  {r.nodeid}")
