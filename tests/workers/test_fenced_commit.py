"""Issue 61: a fenced attempt (an orphan the control plane gave up on) commits no checkpoint.
Rank 0's checkpointer asks `before_commit` just before it commits; the workers' guard
(workers/fencing.py) asks the control plane and exits when the attempt is fenced. One process,
gloo, a tiny part: the decision and where it sits, without Ray."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.checkpointing.checkpointer import Checkpointer
from engine.jobspec.checkpoint import CheckpointSpec
from engine.rerun.event_log import EventLog
from workers.fencing import commit_guard


class Part:
    def __init__(self, iteration: int) -> None:
        self.weights, self.iteration = torch.ones(4), iteration

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "iteration": self.iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weights.copy_(state_dict["weights"])


class Sender:
    """The telemetry sender's answer to "is this attempt still the job's current one?"."""

    def __init__(self, current: bool) -> None:
        self.current, self.asked = current, 0

    def still_current(self, timeout_s: float) -> bool:
        self.asked += 1
        return self.current


class Fenced(Exception):
    pass


def _exit(message: str) -> None:
    raise Fenced(message)  # stands in for os._exit: nothing after it runs


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(tmp_path, sender: Sender, iteration: int) -> Checkpointer:
    spec = CheckpointSpec(path=str(tmp_path / "ckpt"), interval=1)
    ck = Checkpointer(
        {"model": Part(iteration)}, spec, job_name="j", events=EventLog(None, "j"), layout="single"
    )
    ck.before_commit = commit_guard(sender, exit=_exit)
    ck.save()
    return ck



def test_the_current_attempt_commits_and_a_fenced_one_does_not(group, tmp_path):
    root = tmp_path / "ckpt" / "j"
    current = Sender(current=True)
    _save(tmp_path, current, 5)
    assert current.asked == 1
    assert (root / "iter_0000005" / "manifest.json").exists() and (root / "latest").read_text().strip() == "5"

    fenced = Sender(current=False)
    with pytest.raises(Fenced, match="iteration 6 is not committed"):
        _save(tmp_path, fenced, 6)
    # Its shards may be written (debris the next save of that iteration clears), never committed:
    # no manifest, and `latest` still names the current attempt's checkpoint.
    assert not (root / "iter_0000006" / "manifest.json").exists()
    assert (root / "latest").read_text().strip() == "5"
