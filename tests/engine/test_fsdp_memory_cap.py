"""Full sharding lets a model train whose unsharded state does not fit a rank: with a memory cap
enforced by the kernel on each rank process (not counted on tensors), optim_grads_params trains,
saves and resumes, and the same job unsharded runs out of memory.

The cap is RLIMIT_DATA (resource.setrlimit in the rank process, so only that process is
limited): the kernel refuses any private writable mapping past it (heap, anonymous mmap: where
tensors live), and torch raises a MemoryError / RuntimeError out of the allocation. It is set
to the rank's data size once torch is up plus CAP_BYTES_PER_PARAM bytes per parameter of the
model: less than the 16 bytes per parameter its unsharded fp32 state needs (weights, gradients,
Adam's two moments), more than the 8 per parameter that 2 ranks of full sharding hold plus the
gathered units, staged gradients, Adam's temporaries and activations of a step (and a save).
"""

from __future__ import annotations

import ctypes
import resource
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.launcher import RankFailure, spawn
from tests.engine.parallel_harness import job, train_until

CAP_BYTES_PER_PARAM = 14
MODEL = {"num_layers": 16, "hidden_size": 384, "num_attention_heads": 6, "num_query_groups": 6, "seq_length": 32}
TRAINING = {"global_batch_size": 2, "micro_batch_size": 1, "train_iters": 3}


def _spec(level: str, path: Path, **checkpoint) -> dict:
    return job(
        2,
        name="capped",
        model=MODEL,
        training=TRAINING,
        parallel={"data_parallel_sharding": level},
        checkpoint={"path": str(path), "interval": 2, **checkpoint},
    )


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(field)


def _lean_address_space() -> None:
    """Keep what the kernel counts in RLIMIT_DATA but no tensor uses small: one malloc arena
    (glibc gives each thread that allocates a 64 MiB arena of its own) and 1 MiB thread stacks
    (8 MiB by default, for each of the dozens of gloo and pool threads) for threads started from
    now on. Without this the cap measures thread count, not model state."""
    libc = ctypes.CDLL(None)
    libc.mallopt(-8, 1)  # M_ARENA_MAX
    libc.mallopt(-3, 1 << 18)  # M_MMAP_THRESHOLD, fixed
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t (64 bytes on x86-64 and aarch64)
    libc.pthread_attr_init(attr)
    libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(1 << 20))
    libc.pthread_setattr_default_np(attr)
    threading.stack_size(1 << 20)


def _num_params(spec_dict: dict) -> int:
    """The whole model's parameter count, from a build on the meta device (no memory)."""
    from engine.jobspec import JobSpec
    from engine.models import GPTModel
    from engine.transformer.config import TransformerConfig

    spec = JobSpec.model_validate(spec_dict)
    config = TransformerConfig.from_job(spec, 257)
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(config).parameters())


def capped_train_until(spec_dict: dict, stop_at: int) -> dict:
    """Rank function: cap this process's data size, then train_until (tests/engine/parallel_harness.py)."""
    _lean_address_space()
    params = _num_params(spec_dict)
    cap = _kib("VmData") * 1024 + CAP_BYTES_PER_PARAM * params
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        out = train_until(spec_dict, stop_at)
    except BaseException:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))  # room to report the failure
        raise
    return {**out, "params": params, "rank": dist.get_rank()}


def test_full_sharding_trains_saves_and_resumes_under_a_cap_unsharded_state_exceeds(tmp_path):
    first = spawn(capped_train_until, 2, (_spec("optim_grads_params", tmp_path / "a"), 3), timeout_s=240)[0]
    assert 16 * first["params"] > CAP_BYTES_PER_PARAM * first["params"] > 20 * 2**20  # a real cap
    assert len(first["losses"]) == 3 and all(torch.isfinite(torch.tensor(first["losses"])))
    # Resume the save of iteration 2 under the same cap: the third step is the same step.
    resume = str(tmp_path / "a" / "capped" / "iter_0000002")
    second = spawn(
        capped_train_until, 2, (_spec("optim_grads_params", tmp_path / "b", resume_from=resume), 3), timeout_s=240
    )[0]
    assert second["start"] == 2
    assert second["losses"] == first["losses"][2:]  # bit for bit


def test_the_cap_is_real_the_same_job_unsharded_runs_out_of_memory(tmp_path):
    with pytest.raises(RankFailure, match="can't allocate memory|MemoryError"):
        spawn(capped_train_until, 2, (_spec("none", tmp_path), 3), timeout_s=240)
