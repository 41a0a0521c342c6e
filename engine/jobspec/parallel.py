"""`parallel`: the layout. Sizes derived from it (model-parallel, data-parallel, effective
sequence parallelism) live in engine/jobspec/layout.py, nowhere else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engine.jobspec.common import PositiveInt, _Section

# Megatron-FSDP's levels: what each data-parallel rank keeps a 1/d shard of (and not the rest).
SHARDING_LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")


class ParallelSpec(_Section):
    """Parallel layout. Data parallel size is derived: ranks / (tensor*pipeline*context)."""

    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    virtual_pipeline: PositiveInt | None = None
    context: PositiveInt = 1
    expert: PositiveInt = 1
    sequence_parallel: bool = Field(
        False, description="Shard activations along the sequence between TP regions (no-op when tensor=1)."
    )
    pipeline_layers: list[PositiveInt] | None = Field(
        None,
        description="Layers per (virtual) pipeline stage, in stage order; default: an even split. "
        "Length pipeline x virtual_pipeline, sum model.num_layers.",
    )
    distributed_optimizer: bool = Field(
        False,
        description="ZeRO-1: each data-parallel rank keeps optimizer state for its slice of the params. "
        "An alias: true is data_parallel_sharding: optim; after parsing it says whether the optimizer is sharded.",
    )
    data_parallel_sharding: Literal["none", "optim", "optim_grads", "optim_grads_params"] = Field(
        "none",
        description="What data-parallel ranks shard: none; optim (ZeRO-1, the distributed optimizer); "
        "optim_grads (ZeRO-2: also gradients, reduce-scattered during backward); optim_grads_params "
        "(ZeRO-3 / FSDP: also parameters, all-gathered per layer just before its forward and backward).",
    )
    data_parallel_shard_size: PositiveInt | None = Field(
        None,
        description="Hybrid sharding (HSDP): shard within groups of this many data-parallel ranks (with "
        "their context-parallel peers) and replicate across groups (gradients all-reduced over the "
        "replicas). Default: the whole DP size.",
    )
    grad_reduce_in_fp32: bool = Field(
        True, description="Accumulate and reduce gradients in fp32 even when params are bf16/fp16."
    )
    overlap_grad_reduce: bool = Field(
        True, description="Launch each gradient bucket's reduction during backward."
    )
    grad_bucket_size: PositiveInt = Field(
        40_000_000, description="Gradient elements per data-parallel communication bucket."
    )

    @model_validator(mode="before")
    @classmethod
    def _sharding_alias(cls, data: Any) -> Any:
        """`distributed_optimizer: true` is `data_parallel_sharding: optim`; both end up set, so a
        parsed spec says the same when parsed again (distributed_optimizer: the optimizer is sharded,
        which every level but none does)."""
        if not isinstance(data, dict):
            return data
        alias, level = data.get("distributed_optimizer", False), data.get("data_parallel_sharding")
        if not isinstance(alias, bool) or (level is not None and level not in SHARDING_LEVELS):
            return data  # the field validators name the wrong type or value
        if level is None:
            level = "optim" if alias else "none"
        elif "distributed_optimizer" in data and alias != (level != "none"):
            raise ValueError(
                f"parallel.distributed_optimizer ({str(alias).lower()}) contradicts parallel.data_parallel_sharding "
                f"({level}): distributed_optimizer: true means data_parallel_sharding: optim (or higher); set only "
                "data_parallel_sharding"
            )
        return {**data, "data_parallel_sharding": level, "distributed_optimizer": level != "none"}
