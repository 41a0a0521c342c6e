"""What of the rerun state machine a checkpoint keeps, and its JSON form.

A rerun from a checkpoint crosses a process boundary: the job saves, exits 16 and resumes on other
hardware, where the machine must know which iteration it re-runs and, on each rank, which
validated result failed and what it was. That saved state is a contract between two runs (and
between versions of the engine), so it is written down here once, apart from the decisions made
on it (state_machine.py): the state common to every rank (`CommonState`), each rank's own
(`RankState`), and the checkpoint entry that holds both, `{"common": ..., "ranks": [...]}`
(engine/checkpointing/stateful.py's RerunMachineState stores it in the manifest's meta["rerun"],
an in-memory snapshot in its meta). Everything is plain JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch.distributed as dist


class CommonState(TypedDict):
    """The machine's state every rank shares (agreed by its collectives)."""

    mode: str  # RerunMode: a resume under another mode drops a pending rerun
    state: str  # RerunState: only will_rerun_from_checkpoint survives a resume
    current_iteration: int  # the iteration a pending rerun re-runs
    injector_draws: int  # error injection's draw counter: a resumed job injects where the first would
    counts: dict[str, int]  # reruns and diagnoses so far, for the metrics record
    skipped_batches: list[dict]
    diagnoses: list[dict]


@dataclass
class RankState:
    """What one rank remembers about the iteration under suspicion (checkpointed per rank): the
    validation call that failed here and its result, whether the failure was injected or fatal,
    the (node, device) it reproduced on, and the loss-spike windows."""

    failed_call: tuple[str, int] | None = None
    initial_result: float | None = None
    injected: bool = False
    fatal: bool = True
    suspicious: tuple[str, str] | None = None
    spike_count: dict[str, int] = field(default_factory=dict)
    spike_max: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "failed_call": list(self.failed_call) if self.failed_call else None,
            "initial_result": self.initial_result,
            "injected": self.injected,
            "fatal": self.fatal,
            "suspicious": list(self.suspicious) if self.suspicious else None,
            "spike_count": dict(self.spike_count),
            "spike_max": dict(self.spike_max),
        }

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> RankState:
        return cls(
            failed_call=tuple(saved["failed_call"]) if saved["failed_call"] else None,
            initial_result=saved["initial_result"],
            injected=saved["injected"],
            fatal=saved["fatal"],
            suspicious=tuple(saved["suspicious"]) if saved["suspicious"] else None,
            spike_count=dict(saved["spike_count"]),
            spike_max=dict(saved["spike_max"]),
        )


def checkpoint_entry(common: CommonState, mine: dict[str, Any], gather: bool = True) -> dict[str, Any]:
    """{"common": ..., "ranks": [every rank's own]}. Every rank's own state is small, so it is
    gathered (a collective); `gather=False` fills in only this rank's entry, no collective (an
    in-memory snapshot: one rank's, restored by that rank of the same layout)."""
    ranks: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    if gather:
        dist.all_gather_object(ranks, mine)
    else:
        ranks[dist.get_rank()] = mine
    return {"common": common, "ranks": ranks}


def own_entry(saved: dict[str, Any], same_layout: bool) -> dict[str, Any] | None:
    """This rank's own state in a checkpoint entry: only on the layout that saved it (on another,
    rank i is not the rank that failed there); None otherwise."""
    return saved["ranks"][dist.get_rank()] if same_layout else None
