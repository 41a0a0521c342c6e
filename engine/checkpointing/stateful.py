"""What a checkpointed part of training looks like to the checkpointer.

A checkpointer that reads the trainer's optimizer, counters, schedule and RNG itself has to be
taught the trainer's insides for every new kind of state (an FSDP model, a Hugging Face import,
an in-memory copy). Instead it is handed named parts that each say what their state is, with
torch.distributed.checkpoint's `Stateful` protocol, and it only decides where each value goes:

- a tensor value (a torch.Tensor or a DTensor, whose placements carry the sharding) is a shard
  entry, saved through DCP under "<part name>/<key>": the part name is the first component of
  every DCP key, so parts never collide and a checkpoint says which parts its tensors belong to;
- any other value is plain JSON and goes into the manifest's meta under its own key, because the
  meta is one flat object that tools read without torch (`iteration` at the top, as ever); a key
  claimed by two parts is an error.

Loading follows DCP: the tensors of a part's state dict are loaded in place, the other values
are replaced by the manifest's (a key an older checkpoint lacks keeps the value it had), and the
result goes to `load_state_dict`, called only once every part's tensors loaded (restore.py, for
the persistent resume and the in-memory snapshot alike). A part whose load
depends on the checkpoint (which optimizer states it holds, whether it was saved by this very
layout) or that should not build its save-time state just to be loaded into (the ZeRO-1 optimizer
assembles its state over DP) also has `load_target`, which the checkpointer calls instead of
`state_dict` before anything is read.

The tensor parts (model weights, optimizer state, RNG streams) are in state.py; here are the
parts whose state is meta only, mostly adapters for objects that predate the protocol or whose
own `state_dict` has another shape (the rerun state machine's is (common, this rank's)). Every
part reads its owner only through the owner's own accessors (the optimizer's segment state,
the RNG module's `rng_state_dict`, the rerun machine's `checkpoint_state`), so an owner can
change its insides without the checkpoint parts noticing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch.distributed as dist

if TYPE_CHECKING:
    from engine.optimizer.grad_scaler import DynamicGradScaler
    from engine.optimizer.scheduler import OptimizerParamScheduler

log = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful: state out, the same shape of state back in."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a part may need to know about the checkpoint it is about to be restored from."""

    iteration: int
    meta: dict[str, Any]  # the manifest's meta, every part's entries
    same_layout: bool  # saved by this parallel layout: per-rank state (RNG positions) applies


@runtime_checkable
class PlansItsLoad(Stateful, Protocol):
    """A part that says what to load into, given the checkpoint, instead of its state_dict().

    `load_target` returns the keys `load_state_dict` will get: tensors to load in place (with
    this layout's shapes and sharding), and placeholders for meta values. It may keep what it
    decided (e.g. whether the layout is the same) for the `load_state_dict` that follows."""

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]: ...


@runtime_checkable
class SharesReplicas(Stateful, Protocol):
    """A part some of whose tensors other ranks hold bit for bit (data-parallel replicas of the
    weights and, without the distributed optimizer, of Adam's state): the snapshot parts of
    local_shards.py.

    `replica_group(key)` is the process group whose every rank holds `key`'s tensor identically
    (None: only this rank has it). The persistent checkpoint does not need it (DCP writes one
    replica of a plain tensor); an in-memory snapshot, taken every step, keeps 1/n of such a
    tensor on each of the n ranks and gathers the rest back when it is restored, so each rank
    copies its share instead of all of it."""

    def replica_group(self, key: str) -> dist.ProcessGroup | None: ...


class DataPosition:
    """Where training is in its data: the `iteration` and `consumed_samples` counters of `owner`
    (the trainer keeps them as plain attributes that the loop advances)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.owner.iteration, "consumed_samples": self.owner.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.owner.iteration = state_dict["iteration"]
        self.owner.consumed_samples = state_dict["consumed_samples"]


class SchedulerState:
    """The LR / weight-decay schedule, as meta["scheduler"]. A resumed job keeps its own settings
    (it may train longer or change its schedule) and only takes the step from the checkpoint; the
    differences are logged."""

    def __init__(self, scheduler: OptimizerParamScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        changed = self.scheduler.load_state_dict(state_dict["scheduler"], strict=False)
        if changed and dist.get_rank() == 0:
            log.warning(
                "resumed with this job's lr / weight-decay schedule, not the checkpoint's: %s",
                "; ".join(changed),
            )


class GradScalerState:
    """The fp16 loss scaler, as meta["grad_scaler"]: None when the job has none. A checkpoint and
    a job of which only one has a scaler (a change of precision) leave the job's as it is."""

    def __init__(self, grad_scaler: DynamicGradScaler | None) -> None:
        self.grad_scaler = grad_scaler

    def state_dict(self) -> dict[str, Any]:
        return {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.grad_scaler is not None and state_dict["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


class CheckpointedRerun(Protocol):
    """What RerunMachineState uses of the rerun state machine (engine/rerun/state_machine.py): its
    own checkpoint accessors, and nothing of its insides (checkpoint_state.py there is the shape of
    what it saves)."""

    def checkpoint_state(self, gather: bool = True) -> dict[str, Any]: ...

    def load_checkpoint_state(self, saved: dict[str, Any] | None, same_layout: bool) -> None: ...

    def resume_at(self, iteration: int) -> None: ...


class RerunMachineState:
    """The rerun state machine, as meta["rerun"] = {"common": ..., "ranks": [every rank's own]}
    (the machine's `checkpoint_state`: gathered from every rank, so `state_dict` is a
    collective). A rank's own state comes back only on the layout that saved it; checkpoints
    written before the rerun state machine have no "rerun": nothing is restored then. Either way
    the machine then counts iterations from the one restored (`resume_at`)."""

    def __init__(self, rerun: CheckpointedRerun, gather: bool = True) -> None:
        """`gather=False`: only this rank's own entry is filled in, no collective (an in-memory
        snapshot: one rank's, restored by that rank of the same layout)."""
        self.rerun = rerun
        self.gather = gather
        self._saved: SavedCheckpoint | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"rerun": self.rerun.checkpoint_state(gather=self.gather)}

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        self._saved = saved
        return {"rerun": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, self._saved = self._saved, None
        self.rerun.load_checkpoint_state(state_dict.get("rerun"), same_layout=saved is None or saved.same_layout)
        if saved is not None:
            self.rerun.resume_at(saved.iteration)


class JobRecord:
    """The job specification the checkpoint was saved by, as meta["job"], for whoever reads the
    manifest. Never restored: a resumed job runs by its own specification."""

    def __init__(self, job: Callable[[], dict[str, Any]]) -> None:
        self.job = job

    def state_dict(self) -> dict[str, Any]:
        return {"job": self.job()}

    def load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        return {"job": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
