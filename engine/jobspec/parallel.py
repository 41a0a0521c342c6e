"""`parallel`: the layout. Sizes derived from it (model-parallel, data-parallel, effective
sequence parallelism) live in engine/jobspec/layout.py, nowhere else.
"""

from __future__ import annotations

from pydantic import Field

from engine.jobspec.common import PositiveInt, _Section


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
        description="ZeRO-1: each data-parallel rank keeps optimizer state for its slice of the params.",
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
