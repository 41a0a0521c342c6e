"""LoRA adapters on the decoder layers' parallel linears (`model.lora`, PEFT's arithmetic).

A targeted projection computes W x + s B A dropout(x) with s = alpha / rank; W is frozen and
only A (rank x in) and B (out x rank) train. The adapters are a `LoRA` module registered on the
linear as `lora` (ColumnParallelLinear and RowParallelLinear call it where the update belongs),
so parameter names, and with them checkpoints and the Hugging Face import, stay as they were.

One adapter per Hugging Face projection: our fused projections hold several (linear_qkv: q, k,
v; linear_fc1: gate, up), each with its own A and B, and their updates are put into the fused
output rows where the projection's own rows sit. That is what lets a PEFT adapter come in and go
out unchanged (engine/hf/peft.py), and what makes `target_modules: [q_proj, v_proj]` train
exactly PEFT's parameters.

Tensor parallelism splits an adapter the way its layer is split:
- column-parallel layer (output rows split): A whole, B split by output rows. Each TP rank's
  B sees only its rows of the gradient, so A's gradient is a partial sum over TP: it is placed
  `tp_partial_grad` and summed over TP by gradient finalisation, as the per-head q/k norms are.
- row-parallel layer (input columns split): A split by input columns, B whole. The rank's
  partial A x is reduced over TP (all-reduce, or reduce-scatter along the sequence under
  sequence parallelism, the same region as the layer's output) before B; B is then applied after
  the reduction like the layer's bias, so under sequence parallelism its gradient is a partial
  sum over TP and is reduced as the norms' are (`tp_partial_grad` then).
Data parallelism, pipeline stages and context parallelism need nothing of their own: the
adapters are ordinary trainable parameters, and the frozen base has `requires_grad` off, so the
data-parallel buckets, the optimizer and the gradient norm hold adapters only.

Initialisation is layout independent like the base's (engine/transformer/initialization.py):
each A is drawn whole from a generator seeded by (seed, its global name), then sharded; B is
zeros, so step 0 is the base model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel_state as ps
from engine.jobspec.lora import LoRASpec
from engine.parallel_placement import placement_of, set_placement
from engine.tensor_parallel import get_rng_tracker, shard_of
from engine.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from engine.transformer.activations import is_gated
from engine.transformer.config import TransformerConfig
from engine.transformer.initialization import _generator


class LoRA(nn.Module):
    """The adapters of one parallel linear: `A[proj]`, `B[proj]` for each targeted Hugging Face
    projection among `segments` ((name, global output rows) in the order the fused layer holds
    them); `groups` and `rows_per_group` say how a fused layer interleaves them (see __init__)."""

    def __init__(
        self,
        *,
        column: bool,
        input_size: int,
        segments: Sequence[tuple[str, int]],
        targeted: Sequence[str],
        spec: LoRASpec,
        sequence_parallel: bool,
        groups: int = 1,
        rows_per_group: Sequence[int] | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.column, self.scaling, self.p = column, spec.scaling, spec.dropout
        self.sequence_parallel = sequence_parallel and tp > 1
        self.segments = [name for name, _ in segments]
        # A fused layer's local rows: `groups` blocks, each with rows_per_group[i] rows of
        # segment i in turn (QKV: per query group q, k, v; SwiGLU: one block, gate then up).
        self.groups, self.rows_per_group = groups, (tuple(rows_per_group) if rows_per_group else None)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        r = spec.rank
        for name, out in segments:
            if name not in targeted:
                continue
            if column:
                a = nn.Parameter(torch.empty(r, input_size, dtype=params_dtype, device=device))
                set_placement(a, shape=(r, input_size), tp_partial_grad=tp > 1)
                b = nn.Parameter(torch.empty(out // tp, r, dtype=params_dtype, device=device))
                set_placement(b, shape=(out, r), tp_dim=0, init_std=0.0)
            else:
                a = nn.Parameter(torch.empty(r, input_size // tp, dtype=params_dtype, device=device))
                set_placement(a, shape=(r, input_size), tp_dim=1)
                b = nn.Parameter(torch.empty(out, r, dtype=params_dtype, device=device))
                set_placement(b, shape=(out, r), tp_partial_grad=self.sequence_parallel, init_std=0.0)
            self.A[name], self.B[name] = a, b

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        # A row-parallel input is split over TP: each rank's piece gets its own mask (the TP
        # stream); a column-parallel input is whole and alike on every TP rank (default stream).
        with contextlib.nullcontext() if self.column else get_rng_tracker().fork():
            return F.dropout(x, self.p, True)

    def column_update(self, x: torch.Tensor) -> torch.Tensor:
        """The update of a column-parallel layer's local output rows; `x` is its (gathered) input.

        Two matmuls whatever the number of projections: the targeted A's stacked, then one B
        laid out like the fused layer's rows (`_fused_b`: weight-sized work, no activation-sized
        concatenation). Each projection draws its own dropout mask, as PEFT's adapters do."""
        names = [n for n in self.segments if n in self.A]
        if self.p > 0.0 and self.training:
            u = torch.cat([F.linear(self._dropout(x), self.A[n]) for n in names], dim=-1)
        else:
            a = self.A[names[0]] if len(names) == 1 else torch.cat([self.A[n] for n in names])
            u = F.linear(x, a)
        return F.linear(u * self.scaling, self._fused_b(names))

    def _fused_b(self, names: list[str]) -> torch.Tensor:
        """[local output rows, len(names) x rank]: projection i's B in columns i*r:(i+1)*r of
        its own rows (per query group for QKV), zeros elsewhere."""
        if self.rows_per_group is None:  # one projection owns every row
            return self.B[names[0]]
        r, n, groups = next(iter(self.B.values())).shape[1], len(names), self.groups
        blocks = []
        for name, rows in zip(self.segments, self.rows_per_group, strict=True):
            if name in self.B:
                i = names.index(name)
                blocks.append(F.pad(self.B[name].view(groups, rows, r), (i * r, (n - 1 - i) * r)))
            else:
                blocks.append(self.B[names[0]].new_zeros(groups, rows, n * r))
        return torch.cat(blocks, dim=1).reshape(-1, n * r)

    def row_down(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's A x, reduced over TP like the layer's output (x: the local input
        columns); `row_up` finishes the update after the reduction."""
        (name,) = self.A.keys()
        u = F.linear(self._dropout(x), self.A[name])
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(u)
        return reduce_from_tensor_model_parallel_region(u)

    def row_up(self, u: torch.Tensor) -> torch.Tensor:
        (name,) = self.B.keys()
        return F.linear(u * self.scaling, self.B[name])


def attach_lora(
    chunks: Sequence[nn.Module], spec: LoRASpec, config: TransformerConfig, seed: int
) -> tuple[str, ...]:
    """Put adapters on the targeted projections of every decoder layer of `chunks`, draw them
    (module docstring) and freeze everything else; returns the Hugging Face projections
    targeted. Run after the base weights are in place (initialised or imported) and before data
    parallelism wraps the chunks. Adapters from a PEFT folder (model.lora.init_from) are loaded
    over the drawn ones by the caller (engine/hf/peft.py's `load_adapters`)."""
    c = config
    tp = ps.get_tensor_model_parallel_world_size()
    gated = is_gated(c.activation)
    targets = spec.projections(gated)
    hd = c.head_dim
    attention = [("q_proj", c.num_attention_heads * hd), ("k_proj", c.num_query_groups * hd), ("v_proj", c.num_query_groups * hd)]
    fc1 = [("gate_proj", c.ffn_hidden_size), ("up_proj", c.ffn_hidden_size)] if gated else [("up_proj", c.ffn_hidden_size)]
    common = {"spec": spec, "sequence_parallel": c.sequence_parallel, "params_dtype": c.params_dtype, "targeted": targets}
    for chunk in chunks:
        device = next(chunk.parameters()).device
        for layer in chunk.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            gl, qpg = c.num_query_groups // tp, c.num_attention_heads // c.num_query_groups
            plans = [
                (att.linear_qkv, True, c.hidden_size, attention, gl, (qpg * hd, hd, hd)),
                (att.linear_proj, False, c.num_attention_heads * hd, [("o_proj", c.hidden_size)], 1, None),
                (mlp.linear_fc1, True, c.hidden_size, fc1, 1, [n // tp for _, n in fc1] if gated else None),
                (mlp.linear_fc2, False, c.ffn_hidden_size, [("down_proj", c.hidden_size)], 1, None),
            ]
            for linear, column, size, segments, groups, rows in plans:
                if any(name in targets for name, _ in segments):
                    linear.lora = LoRA(
                        column=column, input_size=size, segments=segments, groups=groups, rows_per_group=rows,
                        device=device, **common,
                    )
        for p in chunk.parameters():
            p.requires_grad_(False)
        for _, p in adapter_params(chunk):
            p.requires_grad_(True)
        initialize_adapters(chunk, spec, seed)
    return targets


def adapter_params(chunk: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global name, parameter) of every adapter in `chunk`, in registration order."""
    name_of = getattr(chunk, "global_param_name", lambda n: n)
    return [(name_of(n), p) for n, p in chunk.named_parameters() if is_adapter(n)]


def is_adapter(name: str) -> bool:
    """Whether a parameter name (local or global) is a LoRA adapter's."""
    return ".lora." in name


@torch.no_grad()
def initialize_adapters(chunk: nn.Module, spec: LoRASpec, seed: int) -> None:
    """A: kaiming (PEFT's kaiming_uniform_(a=sqrt(5)): uniform(+-1/sqrt(in))) or gaussian
    (normal(0, 1/rank)), drawn whole per global name, then this rank's shard; B: zeros."""
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in adapter_params(chunk):
        pl = placement_of(p)
        if ".lora.B." in name:
            p.zero_()
            continue
        full = torch.empty(pl.shape)
        if spec.init == "kaiming":
            bound = 1.0 / math.sqrt(pl.shape[1])
            full.uniform_(-bound, bound, generator=_generator(seed, name))
        else:
            full.normal_(0.0, 1.0 / spec.rank, generator=_generator(seed, name))
        p.copy_(shard_of(full, pl.tp_dim, pl.tp_stride, rank, world).to(p.dtype))
