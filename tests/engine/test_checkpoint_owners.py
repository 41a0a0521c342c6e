"""Each owner exposes its own state, and the checkpoint parts go through nothing else.

- the optimizer: per segment its master and Adam's moments by name, Adam's step, and a way to
  put a segment's state back (engine/optimizer/optimizer.py, adam_state.py);
- the RNG streams a checkpoint keeps (engine/tensor_parallel/random.py);
- the rerun state machine as a checkpoint keeps it, gathered or this rank's own, and the
  iteration it counts from after a restore (engine/rerun/);
- one restore routine (engine/checkpointing/restore.py) for the persistent resume and the
  in-memory snapshot restore: every part plans its load before any tensor is read, and gets its
  state only after all of them are in.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine import device
from engine.checkpointing.restore import restore_parts
from engine.checkpointing.stateful import RerunMachineState, SavedCheckpoint
from engine.distributed.data_parallel import DataParallel
from engine.jobspec import OptimizerSpec
from engine.launcher import spawn
from engine.optimizer.optimizer import TrainingOptimizer
from engine.rerun.state_machine import RerunState, RerunStateMachine, is_nan_or_inf
from engine.tensor_parallel.random import get_rng_tracker, load_rng_state_dict, rng_state_dict

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the one restore routine
class Recorder:
    """A part that logs every call into a shared list."""

    def __init__(self, name: str, log: list, plans: bool) -> None:
        self.name, self.log, self.plans = name, log, plans
        self.tensor = torch.zeros(2)
        self.loaded: dict[str, Any] | None = None
        if plans:
            self.load_target = self._load_target

    def state_dict(self) -> dict[str, Any]:
        self.log.append(("state_dict", self.name))
        return {f"{self.name}_t": self.tensor, f"{self.name}_note": "mine", f"{self.name}_new": "default"}

    def _load_target(self, saved: SavedCheckpoint) -> dict[str, Any]:
        self.log.append(("load_target", self.name, saved.iteration))
        return {f"{self.name}_t": self.tensor, f"{self.name}_note": None, f"{self.name}_new": "default"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.log.append(("load_state_dict", self.name))
        self.loaded = state_dict


def test_restore_parts_plans_every_part_first_and_loads_only_after_every_tensor():
    log: list = []
    parts = {"a": Recorder("a", log, plans=True), "b": Recorder("b", log, plans=False)}

    def load_tensors(targets):
        log.append(("load_tensors", sorted(targets)))
        for t in targets.values():
            for v in t.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(3.0)

    meta = {"a": {"a_note": "saved a"}, "b": {"b_note": "saved b"}}  # "<part>_new": older checkpoint
    restore_parts(parts, SavedCheckpoint(5, {}, same_layout=True), load_tensors, meta)
    assert log == [
        ("load_target", "a", 5),
        ("state_dict", "b"),
        ("load_tensors", ["a", "b"]),
        ("load_state_dict", "a"),
        ("load_state_dict", "b"),
    ]
    for name, part in parts.items():
        assert part.loaded[f"{name}_note"] == f"saved {name}"
        assert part.loaded[f"{name}_new"] == "default", "a key the checkpoint lacks keeps the target's value"
        assert part.loaded[f"{name}_t"] is part.tensor and part.tensor.tolist() == [3.0, 3.0]


def test_a_refused_load_changes_no_part():
    log: list = []
    parts = {"a": Recorder("a", log, plans=True)}

    def refuse(targets):
        raise ValueError("not this checkpoint")

    with pytest.raises(ValueError, match="not this checkpoint"):
        restore_parts(parts, SavedCheckpoint(1, {}, same_layout=True), refuse, {"a": {}})
    assert parts["a"].loaded is None and ("load_state_dict", "a") not in log


# ---------------------------------------------------------------- the optimizer's accessors
def _model(dtype: torch.dtype) -> DataParallel:
    torch.manual_seed(0)
    return DataParallel(nn.Sequential(nn.Linear(8, 8, dtype=dtype), nn.LayerNorm(8, dtype=dtype)), None)


def _optimizer(ddp: DataParallel) -> TrainingOptimizer:
    return TrainingOptimizer([ddp], OptimizerSpec(lr=1e-2), norm_group=None)


def _step(ddp: DataParallel, opt: TrainingOptimizer, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(2, 8).to(next(ddp.module.parameters()).dtype)
    ddp.start_step(1)
    ddp(x).float().pow(2).sum().backward()
    ddp.finish_grad_sync()
    opt.step()


def _weights(ddp: DataParallel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ddp.module.parameters()]


def test_optimizer_state_accessors_before_the_first_step():
    ddp = _model(torch.bfloat16)
    opt = _optimizer(ddp)
    assert opt.adam_step() == 0 and opt.has_master_copies()
    for i, (p, lo, hi) in enumerate(opt.segments):
        assert opt.state_names(i) == ("master", "exp_avg", "exp_avg_sq")
        master = opt.segment_state(i, "master")
        assert master.dtype == torch.float32 and master.numel() == hi - lo
        assert torch.equal(master, p.detach().float().reshape(-1)[lo:hi])
        assert not opt.segment_state(i, "exp_avg").any(), "a fresh Adam's moments are zeros"


def test_optimizer_state_put_back_continues_bitwise():
    """Optimizer B, given A's state through the accessors, steps exactly as A does; a fresh B
    (Adam's first step, no moments) would not."""
    a_ddp, b_ddp = _model(torch.bfloat16), _model(torch.bfloat16)
    a, b = _optimizer(a_ddp), _optimizer(b_ddp)
    for seed in (1, 2):
        _step(a_ddp, a, seed)
    assert a.adam_step() == 2
    with torch.no_grad():
        for pa, pb in zip(a_ddp.module.parameters(), b_ddp.module.parameters(), strict=True):
            pb.copy_(pa)
    for i in range(len(b.segments)):
        b.load_segment_state(i, a.adam_step(), {n: a.segment_state(i, n).clone() for n in a.state_names(i)})
        assert torch.equal(b.segment_state(i, "exp_avg"), a.segment_state(i, "exp_avg"))
    assert b.adam_step() == 2
    _step(a_ddp, a, 3)
    _step(b_ddp, b, 3)
    for wa, wb in zip(_weights(a_ddp), _weights(b_ddp), strict=True):
        assert torch.equal(wa, wb)
    for i in range(len(a.segments)):
        assert torch.equal(a.segment_state(i, "master"), b.segment_state(i, "master"))


def test_an_fp32_master_is_the_parameter_and_never_written_by_a_load():
    ddp = _model(torch.float32)
    opt = _optimizer(ddp)
    assert not opt.has_master_copies()
    before = _weights(ddp)
    for i, (p, lo, _) in enumerate(opt.segments):
        assert opt.state_names(i) == ("exp_avg", "exp_avg_sq")
        assert opt.segment_state(i, "master").data_ptr() == p.data_ptr() + lo * p.element_size()
        moments = {n: torch.full_like(opt.segment_state(i, "master"), 0.5) for n in opt.state_names(i)}
        opt.load_segment_state(i, 4, {**moments, "master": torch.zeros_like(moments["exp_avg"])})
        assert torch.equal(opt.segment_state(i, "exp_avg_sq"), moments["exp_avg_sq"])
    assert opt.adam_step() == 4
    for w, b in zip(_weights(ddp), before, strict=True):
        assert torch.equal(w, b), "the model part restores an fp32 master, not the optimizer's load"


# ---------------------------------------------------------------- the RNG streams
def _draws() -> list[float]:
    where = device.current_device()
    out = torch.rand(3, device=where).tolist()
    with get_rng_tracker().fork("a"):
        out += torch.rand(3, device=where).tolist()
    return out + torch.rand(3, device=where).tolist()


def test_rng_state_dict_puts_back_the_default_and_the_tracker_streams():
    tracker = get_rng_tracker()
    kept = tracker.get_states()
    try:
        tracker.reset()
        tracker.add("a", 1234)
        state = rng_state_dict()
        assert set(state) == {"default", "tracker.a"}
        first = _draws()
        assert _draws() != first
        load_rng_state_dict(state)
        assert _draws() == first
    finally:
        tracker.set_states(kept)


# ---------------------------------------------------------------- the rerun state machine
def _step_rerun(rsm: RerunStateMachine, results: list[float]) -> None:
    passes = 0
    while rsm.should_run_forward_backward(None):
        rsm.validate_result(results[passes], is_nan_or_inf, "loss", fatal=True)
        passes += 1
    rsm.should_checkpoint_and_exit()


def _rerun_rank() -> dict:
    """Rank 1's loss is NaN at iteration 2 on both runs: every rank agrees to re-run it from a
    checkpoint, and only rank 1's own state names the failed call."""
    rank = dist.get_rank()
    rsm = RerunStateMachine()
    _step_rerun(rsm, [1.0])
    _step_rerun(rsm, [math.nan, math.nan] if rank == 1 else [1.0, 1.0])
    gathered = json.loads(json.dumps(rsm.checkpoint_state()))  # as the manifest keeps it
    own = json.loads(json.dumps(rsm.checkpoint_state(gather=False)))

    same = RerunStateMachine()
    same.load_checkpoint_state(gathered, same_layout=True)
    same.resume_at(7)
    other = RerunStateMachine()
    other.load_checkpoint_state(gathered, same_layout=False)
    other.resume_at(7)
    older = RerunStateMachine()
    older.load_checkpoint_state(None, same_layout=True)  # a checkpoint from before the machine

    part = RerunMachineState(RerunStateMachine())
    part.load_target(SavedCheckpoint(9, {}, same_layout=False))
    part.load_state_dict({"rerun": gathered})
    return {
        "rank": rank,
        "state": rsm.state.value,
        "gathered_failed": [r["failed_call"] is not None for r in gathered["ranks"]],
        "own_filled": [r is not None for r in own["ranks"]],
        "same": (same.state.value, same.current_iteration, same.rank_state.failed_call is not None),
        "other": (other.state.value, other.current_iteration),
        "older": (older.state.value, older.current_iteration),
        "part": (part.rerun.state.value, part.rerun.current_iteration),
    }


@pytest.fixture(scope="module")
def rerun_ranks() -> list[dict]:
    return spawn(_rerun_rank, 2, (), timeout_s=120)


def test_the_rerun_machine_gathers_every_ranks_own_state_or_keeps_its_own(rerun_ranks):
    for r in rerun_ranks:
        assert r["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT.value
        assert r["gathered_failed"] == [False, True], "every rank's own state, in rank order"
        assert r["own_filled"] == [i == r["rank"] for i in range(2)], "gather=False: this rank's only"


def test_a_restored_rerun_machine_keeps_a_pending_rerun_only_on_its_layout(rerun_ranks):
    for r in rerun_ranks:
        # Same layout: the pending rerun of iteration 2 stays, and with it that iteration.
        assert r["same"] == ("will_rerun_from_checkpoint", 2, r["rank"] == 1)
        # Another layout drops it and counts on from the restored iteration.
        assert r["other"] == ("not_running_yet", 7)
        assert r["older"] == ("not_running_yet", 0)
        # The checkpoint part does that fix-up itself, from the checkpoint's iteration.
        assert r["part"] == ("not_running_yet", 9)


# ---------------------------------------------------------------- the rule
OWNED = ("engine.optimizer", "engine.rerun", "engine.tensor_parallel")
# Fields of the optimizer, the rerun machine and the RNG tracker that only their owners read.
PRIVATE = {"main_params", "needs_copy_back", "inner", "rank_state", "get_states", "set_states", "is_expert"}


def test_checkpoint_parts_use_only_their_owners_accessors():
    runtime_imports, reads = set(), []
    for path in sorted((ROOT / "engine" / "checkpointing").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(OWNED):
                runtime_imports.add((path.name, node.module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                reads.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Name) and node.id == "get_rng_tracker":
                reads.append(f"{path.name}:{node.lineno} get_rng_tracker")
    assert not reads, reads
    # The RNG part needs the RNG module's accessors at runtime; everything else is typing only.
    assert runtime_imports == {("state.py", "engine.tensor_parallel.random")}, runtime_imports
