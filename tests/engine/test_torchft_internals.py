"""The torchft privates engine/distributed builds on, pinned without a Lighthouse or a process
group. torchft 0.2.0 has no public API for them (the per-step minimum quorum size, the healing
flag and applying a received state, the manager's store and process group, the reconfigurable
gloo group's timeout); a torchft upgrade that renames or stops reading one would not fail a job
loudly (setting a renamed attribute just adds a new one): it fails here, naming torchft's
version and the file of ours that uses it.

Each entry: (torchft's class, the private, how we use it, our module). "read" means torchft's own
code must read it (we write it and count on torchft acting on it); "attr" that torchft sets it
(we read it); "method" that it is a method of the class."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

from tests.tools import require_module

torchft = require_module("torchft", "torchft (a main dependency) is not installed")
TORCHFT = f"torchft {importlib.metadata.version('torchft')}"

QUORUM = "engine/fault_tolerance/replica_quorum.py"
GLOO = "engine/fault_tolerance/quorum_gloo.py"
PRIVATES = [
    ("torchft.manager.Manager", "_min_replica_size", "read", QUORUM),  # written: the per-step minimum
    ("torchft.manager.Manager", "_healing", "read", QUORUM),  # read, and cleared after our own apply
    ("torchft.manager.Manager", "_apply_pending_state_dict", "method", QUORUM),
    ("torchft.manager.Manager", "_store", "attr", QUORUM),  # the replica id torchft registered
    ("torchft.manager.Manager", "_pg", "attr", QUORUM),  # the managed group's size
    ("torchft.process_group.ProcessGroupGloo", "_timeout", "read", GLOO),  # swapped around configure
    ("torchft.process_group.ProcessGroupGloo", "_pg", "attr", GLOO),  # the group configure built
]


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _source(cls: type) -> str:
    """The class's source with its bases' (torchft's ProcessGroupGloo gets _timeout and _pg from
    its base classes)."""
    return "\n".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("torchft"))


def missing(privates) -> list[str]:
    """Every pinned private torchft no longer has as we use it, one line each."""
    problems = []
    for path, name, use, ours in privates:
        cls = _class(path)
        source = _source(cls)
        if use == "method":
            ok = callable(getattr(cls, name, None))
        elif use == "attr":
            ok = f"self.{name} =" in source or f"self.{name}: " in source
        else:  # torchft sets it and reads it back
            ok = f"self.{name} =" in source and source.count(f"self.{name}") > 1
        if not ok:
            problems.append(f"{TORCHFT}: {path}.{name} ({use}) is gone or unused; {ours} depends on it")
    return problems


def test_every_torchft_private_we_use_is_still_there():
    assert not missing(PRIVATES), "\n".join(missing(PRIVATES))


def test_a_renamed_private_is_named_with_the_file_that_uses_it():
    renamed = [("torchft.manager.Manager", "_min_quorum_size", "read", QUORUM)]
    assert missing(renamed) == [
        f"{TORCHFT}: torchft.manager.Manager._min_quorum_size (read) is gone or unused; {QUORUM} depends on it"
    ]
    assert missing([("torchft.manager.Manager", "_healing_now", "method", QUORUM)])


@pytest.mark.parametrize("ours", [QUORUM, GLOO])
def test_the_list_covers_every_torchft_private_our_modules_touch(ours):
    """A private used in our code but not pinned above fails here: `manager._x` in the quorum,
    `self._x` of torchft's group in the gloo subclass (its own attribute excepted)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / ours).read_text()
    pattern = r"self\.manager\.(_[a-z_]+)" if ours == QUORUM else r"self\.(_[a-z_]+)"
    used = set(re.findall(pattern, text)) - {"_rendezvous_timeout"}
    pinned = {name for _, name, _, module in PRIVATES if module == ours}
    assert used <= pinned, f"{ours} uses torchft privates not pinned here: {sorted(used - pinned)}"
