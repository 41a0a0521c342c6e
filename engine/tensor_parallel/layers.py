"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Every parameter carries where it sits in the global (unsharded) tensor, its placement
(engine/parallel_placement.py): `tp_dim` (None when replicated over TP), `tp_stride` (how many
independently split chunks the global tensor is made of, e.g. 2 for SwiGLU's fused gate|up
weight) and the global `shape`. That one description serves three readers: layout-independent
initialisation (a seed gives the same model on any TP size), gathering for tests, and the sharded
checkpoint's global offsets. Replicated parameters whose gradient is a partial sum over TP ranks
(under sequence parallelism: norm weights, biases added after a reduce-scatter; always: the
per-head q/k norms, which see only this rank's heads) are marked `tp_partial_grad` so grad
finalisation all-reduces them over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.parallel_placement import set_placement
from engine.tensor_parallel import fp8 as fp8_ops
from engine.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def mark_sequence_parallel(module: nn.Module, enabled: bool) -> None:
    """Mark a replicated module's params as seeing only part of the work (a sequence chunk, or
    this rank's heads): their grads need a TP sum."""
    for p in module.parameters(recurse=False):
        set_placement(p, tp_partial_grad=enabled)


def shard_of(full: torch.Tensor, dim: int | None, stride: int, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of a global tensor: each of `stride` chunks along `dim` is split in `world`."""
    if dim is None or world == 1:
        return full
    chunks = full.chunk(stride, dim=dim)
    return torch.cat([c.chunk(world, dim=dim)[rank] for c in chunks], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """Inverse of shard_of over all ranks' pieces (rank order)."""
    if dim is None or len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[k] for p in per_rank], dim=dim) for k in range(stride)], dim=dim)


def _tp() -> tuple[int, int]:
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by rows (output features) over TP ranks: Y stays split on its last dim
    unless `gather_output`. Under sequence parallelism the input arrives as a sequence chunk and
    is all-gathered here (its grad reduce-scattered back)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_stride: int = 1,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_std: float = 0.02,
        skip_weight_param_allocation: bool = False,
        fp8: bool = False,
    ):
        super().__init__()
        world, _ = _tp()
        self.fp8 = fp8  # the matmul in float8 (engine.tensor_parallel.fp8)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and world > 1
        out_local = _divide(output_size, world, "output features")
        if skip_weight_param_allocation:  # the caller passes the weight (tied output layer)
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(out_local, input_size, dtype=params_dtype, device=device))
            set_placement(
                self.weight, shape=(output_size, input_size), tp_dim=0, tp_stride=partition_stride, init_std=init_std
            )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=params_dtype, device=device))
            set_placement(self.bias, shape=(output_size,), tp_dim=0, tp_stride=partition_stride, init_std=0.0)
        else:
            self.register_parameter("bias", None)
        self.lora = None  # LoRA adapters (engine.transformer.lora), attached after the build

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` overrides self.weight (tied output layer uses the embedding's shard)."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tensor_model_parallel_region(x)
        y = fp8_ops.linear(x, self.weight if weight is None else weight, self.bias, fp8=self.fp8)
        if self.lora is not None:
            y = y + self.lora.column_update(x)
        return gather_from_tensor_model_parallel_region(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by columns (input features): the input is already split on its last
    dim (the output of a column-parallel layer); partial outputs are all-reduced, or
    reduce-scattered along the sequence under sequence parallelism. The bias is added after the
    reduction so it is counted once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_std: float = 0.02,
        fp8: bool = False,
    ):
        super().__init__()
        world, _ = _tp()
        self.fp8 = fp8  # the matmul in float8 (engine.tensor_parallel.fp8)
        self.sequence_parallel = sequence_parallel and world > 1
        in_local = _divide(input_size, world, "input features")
        self.weight = nn.Parameter(torch.empty(output_size, in_local, dtype=params_dtype, device=device))
        set_placement(self.weight, shape=(output_size, input_size), tp_dim=1, init_std=init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device))
            set_placement(self.bias, init_std=0.0, tp_partial_grad=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.lora = None  # LoRA adapters (engine.transformer.lora), attached after the build

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_ops.linear(x, self.weight, fp8=self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = reduce_from_tensor_model_parallel_region(y)
        if self.lora is not None:  # its A x is reduced like y; B is applied after, like the bias
            y = y + self.lora.row_up(self.lora.row_down(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over TP. Each rank looks up the ids it owns and
    zeroes the rest; the partial results are summed over TP (all-reduce), or reduce-scattered
    straight to sequence chunks under sequence parallelism (ids are [s, b])."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        world, rank = _tp()
        self.sequence_parallel = sequence_parallel and world > 1
        per_rank = _divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, dtype=params_dtype, device=device))
        set_placement(self.weight, shape=(num_embeddings, embedding_dim), tp_dim=0, init_std=init_std)
        self.tp_world = world

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_world == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out)
        return reduce_from_tensor_model_parallel_region(out)
