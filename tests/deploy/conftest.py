"""Fixtures for the deploy tests: the command-line tools (see tests/deploy/tools.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.tools import require_tool


@pytest.fixture(scope="session")
def promtool() -> Path:
    return require_tool("promtool")


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    """The Prometheus server, installed beside promtool."""
    return require_tool("promtool").with_name("prometheus")


@pytest.fixture(scope="session")
def helm() -> Path:
    return require_tool("helm")


@pytest.fixture(scope="session")
def dclint() -> Path:
    return require_tool("dclint")
