"""In-memory snapshots (engine/checkpointing/memory.py): a rank's checkpoint parts as checksummed
bytes, restored into a fresh Trainer of the same layout.

The proof is bitwise: 4 steps straight vs 2 steps + snapshot + a fresh Trainer restored from the
bytes + 2 steps give identical losses and identical final weights, on layouts that put every
kind of state in play: ZeRO-1 over DP=2 (the optimizer's own shards, per-rank RNG; with bf16
weights, their fp32 masters too), plain DP=2
(Adam's state replicated), TP=2 x DP=2 (DTensor shards and strided pieces kept in slices over
DP), MoE experts over EP=2 with ZeRO-3 on 4 ranks (each rank's shards its own, no gathering),
HSDP 2 x 2 (shards the same on their two replicas), and PP=2 with two virtual chunks per stage
under ZeRO-1 (several model chunks per rank, the tied embedding on both ends). Each rank keeps its slice of what its
replicas share, and the bytes per parameter say so. A corrupted blob, or another rank's, is refused before anything is
loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.checkpointing.memory import SnapshotError, _share
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.parallel_harness import job


def _weights(trainer: Trainer) -> torch.Tensor:
    for ddp in trainer.ddp_chunks:  # ZeRO-3 keeps shards between steps
        ddp.gather_all_params()
    return torch.cat([p.detach().flatten().clone() for c in trainer.model_chunks for p in c.parameters()])


def _roundtrip(spec_dict: dict) -> dict:
    spec = JobSpec.model_validate(spec_dict)
    straight = Trainer(spec)
    expected = [straight.train_step().loss for _ in range(4)]
    expected_weights = _weights(straight)
    ps.destroy_model_parallel()

    first = Trainer(spec)
    losses = [first.train_step().loss for _ in range(2)]
    snap = first.capture_snapshot()
    blob = snap.to_bytes()
    ps.destroy_model_parallel()

    fresh = Trainer(spec)
    errors = {}
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0x10  # one bit of the last tensor
    peer = [None] * dist.get_world_size()
    dist.all_gather_object(peer, blob)
    for name, bad in (
        ("corrupt", bytes(corrupt)),
        ("truncated", blob[:-1]),
        ("other_rank", peer[(dist.get_rank() + 1) % dist.get_world_size()]),
    ):
        try:
            fresh.restore_snapshot(bad)
        except SnapshotError as err:
            errors[name] = str(err)
    assert fresh.iteration == 0  # nothing was loaded by the refused blobs
    resumed_at = fresh.restore_snapshot(blob)
    losses += [fresh.train_step().loss for _ in range(2)]
    same_weights = bool(torch.equal(_weights(fresh), expected_weights))
    ps.destroy_model_parallel()
    return {
        "expected": expected,
        "losses": losses,
        "resumed_at": resumed_at,
        "same_weights": same_weights,
        "errors": errors,
        "nbytes": snap.nbytes,
        "state_bytes": sum(row[5] for row in snap.index),
        "params": sum(p.numel() for c in first.model_chunks for p in c.parameters()),
        "streams": sorted(snap.streams),
    }


MOE_MODEL = {"num_layers": 2, "moe": {"num_experts": 4, "top_k": 2, "aux_loss_coeff": 0.01}}


# Bytes per parameter of the rank's state and of its snapshot (fp32 weights: 4 B, Adam's two
# moments: 8 B; each kept 1/n where n ranks hold it alike, the optimizer's own shard under ZeRO).
@pytest.mark.parametrize(
    "ranks,sections,streams,state_per_param,kept_per_param",
    [
        # Weights on both ranks, half the moments each: 4 + 8/2 held, 4/2 + 8/2 kept.
        (2, {"parallel": {"distributed_optimizer": True}}, [["0,1"], ["0,1"]], 8, 6),
        # bf16 weights on both ranks (2 B), fp32 masters and moments sharded: 2 + 12/2 held,
        # 2/2 + 12/2 kept.
        (
            2,
            {"parallel": {"distributed_optimizer": True}, "training": {"precision": "bf16"}},
            [["0,1"], ["0,1"]],
            8,
            7,
        ),
        # Weights and moments on both: 12 held, 12/2 kept.
        (2, {}, [["0,1"], ["0,1"]], 12, 6),
        (4, {"parallel": {"tensor": 2}}, [["0,2"], ["1,3"], ["0,2"], ["1,3"]], 12, 6),
        # Dense weights over DP=4 and experts over expert DP=2, moments sharded the same way.
        (
            4,
            {
                "parallel": {"expert": 2, "data_parallel_sharding": "optim_grads_params"},
                "model": MOE_MODEL,
                "training": {"global_batch_size": 8, "micro_batch_size": 1},
            },
            [[], [], [], []],  # every rank's shards its own: nothing to slice, nothing gathered
            None,
            None,
        ),
        # Shards over 2 ranks, the same on the 2 HSDP replicas of each: 4/2 + 8/2 held, half kept.
        (
            4,
            {
                "parallel": {"data_parallel_sharding": "optim_grads_params", "data_parallel_shard_size": 2},
                "training": {"global_batch_size": 8},
            },
            [["0,2"], ["1,3"], ["0,2"], ["1,3"]],
            6,
            3,
        ),
        # Two stages of two virtual chunks each (the tied embedding on the first and last), ZeRO-1
        # over DP=2 within each stage: as zero1-dp2.
        (
            4,
            {
                "parallel": {"pipeline": 2, "virtual_pipeline": 2, "distributed_optimizer": True},
                "model": {"num_layers": 4},
                "training": {"global_batch_size": 8},
            },
            [["0,1"], ["0,1"], ["2,3"], ["2,3"]],
            8,
            6,
        ),
    ],
    ids=["zero1-dp2", "zero1-bf16-dp2", "dp2", "tp2-dp2", "moe-ep2-zero3-dp4", "hsdp-2x2", "pp2x2-vpp2-zero1"],
)
def test_snapshot_restored_into_a_fresh_trainer_continues_bitwise(
    ranks, sections, streams, state_per_param, kept_per_param
):
    sections = {**sections, "training": {"train_iters": 8, **sections.get("training", {})}}
    spec = job(ranks, **sections)
    results = spawn(_roundtrip, ranks, (spec,), timeout_s=300)
    assert [r["streams"] for r in results] == streams  # the replica groups each rank keeps a slice of
    for result in results:
        assert result["resumed_at"] == 2
        assert result["losses"] == result["expected"]  # bitwise, not approximately
        assert result["same_weights"]
        held, kept = result["state_bytes"] / result["params"], result["nbytes"] / result["params"]
        if state_per_param is not None:  # within the RNG states and alignment
            assert held == pytest.approx(state_per_param, rel=0.05), held
            assert kept == pytest.approx(kept_per_param, rel=0.05), kept
        if result["streams"]:
            assert 0 < kept < held, (kept, held)
        else:
            assert kept == pytest.approx(held, rel=0.01)
        errors = result["errors"]
        assert set(errors) == {"corrupt", "truncated", "other_rank"}
        assert "checksum mismatch" in errors["corrupt"] and "checksum mismatch" in errors["truncated"]
        assert "not this rank's" in errors["other_rank"] and "rank" in errors["other_rank"]


@pytest.mark.parametrize("total", [0, 1, 63, 64, 65, 1000, 4096, 10**6 + 7])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_the_slices_of_a_shared_stream_cover_it_once(total, size):
    covered = []
    for index in range(size):
        per, lo, hi = _share(total, size, index)
        assert lo <= hi and hi - lo <= per and per * size >= total
        assert lo % 64 == 0 or lo == total  # aligned: a slice starts where a tensor may
        covered += range(lo, hi)
    assert covered == list(range(total))


def test_snapshot_fields_in_the_job_spec():
    ok = JobSpec.model_validate(job(1, checkpoint={"local_interval": 1, "local_replicas": 2}))
    assert (ok.checkpoint.local_interval, ok.checkpoint.local_replicas) == (1, 2)
    assert JobSpec.model_validate(job(1)).checkpoint.local_replicas == 1
    for bad, field in (({"local_interval": 0}, "local_interval"), ({"local_replicas": -1}, "local_replicas")):
        with pytest.raises(ValueError, match=field):
            JobSpec.model_validate(job(1, checkpoint=bad))


def _records_before_a_failed_snapshot(spec_dict: dict) -> list[int]:
    """Rank function: the snapshot due after iteration 4 fails (as a peer's death makes its
    collective fail); returns the iterations rank 0 recorded before that."""
    from engine.train_loop import train_rank

    recorded: list[int] = []

    def fail(trainer: Trainer) -> None:
        if trainer.iteration == 4:
            raise RuntimeError("a peer died during the snapshot")

    with pytest.raises(RuntimeError, match="peer died"):
        train_rank(
            spec_dict, quiet=True, on_record=lambda r: recorded.append(r["iteration"]), on_snapshot_due=fail
        )
    ps.destroy_model_parallel()
    return recorded


def test_a_failed_snapshot_does_not_cost_the_checkpointed_steps_record(tmp_path):
    """Iteration 4 saves its persistent checkpoint, then its snapshot fails: its record was
    already handed on (a resume from that checkpoint never runs step 4 again)."""
    spec = job(
        1, training={"train_iters": 8}, checkpoint={"path": str(tmp_path), "interval": 4, "local_interval": 1}
    )
    assert spawn(_records_before_a_failed_snapshot, 1, (spec,), timeout_s=240)[0] == [1, 2, 3, 4]


def _records_when_the_save_fails_after_its_commit(spec_dict: dict) -> tuple[list[int], list[int], list[int]]:
    """Iteration 4's save commits on rank 0 and then fails in its closing collective, as when it
    meets a dead peer; returns what rank 0 recorded, what it had recorded when the closing
    collective began, and the committed iterations."""
    from engine.checkpointing import checkpointer as checkpointer_module
    from engine.train_loop import train_rank

    recorded: list[int] = []
    at_the_barrier: list[int] = []
    committed_now: list[int] = []
    real_commit = checkpointer_module.commit_checkpoint
    real_agree = checkpointer_module.Checkpointer._agree

    def commit(storage, root, iteration, *args, **kwargs):
        real_commit(storage, root, iteration, *args, **kwargs)
        committed_now.append(iteration)

    def agree(error, group):
        if committed_now == [4]:  # the closing collective of iteration 4's save
            at_the_barrier.extend(recorded)
            raise RuntimeError("the collective after the commit: a peer died")
        return real_agree(error, group)

    checkpointer_module.commit_checkpoint = commit
    checkpointer_module.Checkpointer._agree = staticmethod(agree)
    try:
        with pytest.raises(RuntimeError, match="a peer died"):
            train_rank(spec_dict, quiet=True, on_record=lambda r: recorded.append(r["iteration"]))
    finally:
        checkpointer_module.commit_checkpoint = real_commit
        checkpointer_module.Checkpointer._agree = staticmethod(real_agree)
        ps.destroy_model_parallel()
    root = Path(spec_dict["checkpoint"]["path"])
    committed = sorted(int(p.name.split("_")[1]) for p in root.rglob("iter_*") if (p / "manifest.json").exists())
    return recorded, at_the_barrier, committed


def test_a_save_that_fails_after_its_commit_still_hands_on_the_steps_record(tmp_path):
    """The resume starts after iteration 4 (it is committed), so iteration 4's record must be out,
    and out before the save's closing collective: a frozen peer holds that collective for as long
    as it is frozen, and a watchdog kill of this rank then would lose the record."""
    spec = job(1, training={"train_iters": 8}, checkpoint={"path": str(tmp_path), "interval": 4})
    recorded, at_the_barrier, committed = spawn(_records_when_the_save_fails_after_its_commit, 1, (spec,), timeout_s=240)[0]
    assert committed == [4]
    assert at_the_barrier == [1, 2, 3, 4]
    assert recorded == [1, 2, 3, 4]
