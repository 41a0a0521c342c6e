"""Suite-wide hooks: under ELASTRON_REQUIRE_TOOLS=1 a skip for a missing tool is a failure
(tests/tools.py states the rule); the one Ray cluster of the session and its leak guard
(tests/ray_cluster.py), for every test that asks for `ray_cluster`; and a list, at the end of
the run, of the tests that took over SLOW_TEST_S without saying why in their docstring
("Over 30 s: ...").

`make test TEST_WORKERS=2` runs the suite on pytest-xdist workers (`-n 2 --dist loadgroup`; not
the default yet: on 2 cores the Ray tests overran their waits, issue 52): every test that
uses `ray_cluster` (all in RAY_TEST_DIRS), and every test that starts a Ray cluster of its own,
is one group (RAY_GROUP), run in order on one worker, so the session has one shared Ray cluster
however many workers there are and never two busy Ray clusters at once; the other workers take
the engine, service and deploy tests beside it, at a lower priority (OTHER_TESTS_NICE), in the
CPU the Ray tests leave while they wait on process starts and polls."""

from __future__ import annotations

import os

import pytest

from tests.tools import REQUIRE_TOOLS, is_missing_tool, tools_required

pytest_plugins = ["tests.ray_cluster"]

SLOW_TEST_S = 30.0
SLOW_REASON = "Over 30 s:"
# The xdist group of the Ray tests (one worker runs them all, in order, at normal priority):
# those on the shared cluster (RAY_TEST_DIRS, node ids relative to the rootdir) and those that
# start a Ray cluster of their own. Two Ray clusters busy at once on 2 cores starve each other:
# measured, Ray tests then ran 1.3-2.6x longer and two overran their 300 s limit.
RAY_GROUP = "ray_cluster"
RAY_TEST_DIRS = ("tests/workers/",)
RAY_GROUP_PREFIXES = (
    *RAY_TEST_DIRS,
    "tests/e2e/",  # the REST-to-Ray journey: `elastron up` starts a cluster
    "tests/service/test_local_stack.py",  # the same, per test
    "tests/test_bench_smoke.py::test_bench_runs_in_smoke_mode[recovery-",  # its parts: a cluster each
)
# The other workers' tests run this much nicer (their rank processes and servers with them), so
# the Ray tests, whose heartbeats, rendezvous and step timeouts are wall-clock, keep their pace
# and the rest fills the CPU they leave.
OTHER_TESTS_NICE = 5
# Where a report says it was slow without a reason: a user property, because xdist carries
# those from its workers to the process that prints the summary (not ad-hoc report attributes).
SLOW_WITHOUT_REASON = "slow_without_reason"


def pytest_itemcollected(item):
    """A test on the shared Ray cluster must live where the scheduler below groups them."""
    if "ray_cluster" in getattr(item, "fixturenames", ()) and not item.nodeid.startswith(RAY_TEST_DIRS):
        raise pytest.UsageError(
            f"{item.nodeid} uses ray_cluster outside {', '.join(RAY_TEST_DIRS)}: move it there (or add its "
            "folder to tests/conftest.py's RAY_TEST_DIRS), so it runs on the worker that owns the cluster"
        )


def in_ray_group(nodeid: str) -> bool:
    return nodeid.startswith(RAY_GROUP_PREFIXES)


def pytest_runtest_setup(item):
    """On an xdist worker, the first test outside the Ray group lowers the worker's priority
    (for good: a process cannot raise it back unprivileged). The Ray group is its worker's first
    unit, so that worker runs it all at normal priority and is reniced, if at all, after it."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not in_ray_group(item.nodeid):
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if current < OTHER_TESTS_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, OTHER_TESTS_NICE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` with the Ray tests as one group, chosen by folder here rather than by
    an `xdist_group` mark: pytest-xdist 3.8 marks a group by rewriting `item._nodeid`, which
    pytest 9.2's nodes no longer read, so the mark groups nothing. The controller, which
    schedules, sees node ids only (it collects nothing), hence the folder rule, which the hook
    above holds every test that uses `ray_cluster` to."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayGroupScheduling(LoadScopeScheduling):
        """Each test its own unit, the Ray tests one unit (the largest, so scheduled first)."""

        def _split_scope(self, nodeid: str) -> str:
            return RAY_GROUP if in_ray_group(nodeid) else nodeid

    return RayGroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.duration > SLOW_TEST_S:
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        if SLOW_REASON not in doc:
            report.user_properties.append((SLOW_WITHOUT_REASON, True))
    if report.skipped and tools_required() and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if is_missing_tool(reason):
            report.outcome = "failed"
            report.longrepr = f"{reason} ({REQUIRE_TOOLS}=1: a missing tool fails the run)"


def pytest_terminal_summary(terminalreporter):
    """Name the slow tests that do not say why they must be slow (the durations list shows how slow)."""
    reports = [
        r
        for rs in terminalreporter.stats.values()
        for r in rs
        if (SLOW_WITHOUT_REASON, True) in getattr(r, "user_properties", ())
    ]
    if reports:
        terminalreporter.section(f"tests over {SLOW_TEST_S:.0f} s without '{SLOW_REASON}' in their docstring")
        for r in sorted(reports, key=lambda r: -r.duration):
            terminalreporter.line(f"{r.duration:7.1f} s  {r.nodeid}")
