"""Context parallelism: the sequence split over CP ranks, attention by a ring of K/V blocks.

Why: attention activations grow with the sequence, and past a few thousand tokens they, not the
weights, fill a device. Context parallelism (Megatron-Core's `--context-parallel-size`) gives
each of `cp` ranks a share of every sequence; everything but attention is per token, so only
attention needs the other ranks' tokens, and it gets them as K/V blocks passed around a ring.
Weights are replicated over CP, so gradients are reduced over DP x CP (the `dp_cp` group).

Layout (Megatron-Core's causal load balancing): a sequence of `s` tokens is cut into `2 * cp`
equal chunks and CP rank r keeps chunks r and 2cp-1-r, one early and one late, in that order.
Under a causal mask early tokens attend to little and late ones to a lot, so with a plain split
the last rank would do most of the work; with this pairing every rank does the same. Positions
(RoPE, learned position embeddings) are the global ones of the chunks a rank holds, and the
labels are cut the same way as the tokens, so each rank's token losses are exactly the ones the
single-rank run computes for those tokens.

Ring attention (`ring_attention`), on `cp` ranks with local q, k, v of 2 chunks each: in step i
rank r holds the K/V of rank src = r - i (mod cp), received from its left neighbour while it
computed the previous step. With the layout above only three cases occur:
- i = 0 (its own K/V): causal attention over its 2 local chunks, positions are increasing;
- src < r: both local query chunks see src's first (early) chunk in full, its late chunk not;
- src > r: only the local late query chunk sees src's K/V, both chunks in full.
Each partial result comes with its log-sum-exp; results are merged with the online-softmax rule
(out = sum_i out_i * exp(lse_i - lse), lse = logaddexp over i), in fp32. Backward runs the ring
again: each block's gradient comes from the merged output and log-sum-exp (as flash attention's
backward does), dq stays local, and dk/dv accumulate in a buffer that travels with the K/V
block and is sent home after the last step.

Written here rather than with torch's `context_parallel` (torch.distributed.tensor.experimental),
which has no sharding strategy for the CPU attention kernels and so does not run on CPU ranks.
On CPU each block uses torch's flash-attention CPU kernel and its backward (they return and
take the log-sum-exp, and handle grouped-query heads); elsewhere a plain-math block (fp32
scores) does the same. On GPU with the Transformer Engine spec, TE's own context-parallel
attention is the one to use: `core_attention_for_spec("te")` is that hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from engine import parallel_state as ps

# ---------------------------------------------------------------------------- layout


def cp_size() -> int:
    return ps.get_size_of("cp") if ps.model_parallel_is_initialized() else 1


def cp_rank() -> int:
    return ps.get_rank_in("cp") if ps.model_parallel_is_initialized() else 0


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two of 2*size sequence chunks CP rank `rank` holds: (rank, 2*size-1-rank)."""
    return rank, 2 * size - 1 - rank


def shard_sequence(
    t: torch.Tensor, dim: int, size: int | None = None, rank: int | None = None
) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `dim` (the full sequence), concatenated in order."""
    size = cp_size() if size is None else size
    if size == 1:
        return t
    rank = cp_rank() if rank is None else rank
    if t.shape[dim] % (2 * size):
        raise ValueError(
            f"a sequence of {t.shape[dim]} tokens cannot be cut into 2 x context ({2 * size}) equal chunks"
        )
    chunks = t.chunk(2 * size, dim=dim)
    first, second = chunk_ids(rank, size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def local_positions(global_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of this CP rank's tokens of a `global_len`-token sequence."""
    return shard_sequence(torch.arange(global_len, device=device), 0)


# ---------------------------------------------------------------------------- one block


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BWD is not None


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V of query groups [b, g, s, d] -> one per query head [b, heads, s, d] (GQA)."""
    g = t.shape[1]
    return t if g == heads else t.repeat_interleave(heads // g, dim=1)


def _fold_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradients per query head [b, heads, s, d] -> per query group [b, g, s, d]."""
    b, h, s, d = t.shape
    return t if h == groups else t.view(b, groups, h // groups, s, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, math: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v of one block and its fp32 log-sum-exp [b, heads, sq].
    k, v may have fewer (grouped) heads than q."""
    if _use_cpu_flash(q) and not math:
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal)
        return out, lse.float()
    s = _scores(q, _expand_heads(k, q.shape[1]), causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ _expand_heads(v, q.shape[1]).float()
    return out.to(q.dtype), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the *merged* output and log-sum-exp of q's rows: the
    block's probabilities are exp(scores - lse), and the softmax's row term is sum(dout * out)."""
    if _use_cpu_flash(q) and not math:
        return _CPU_FLASH_BWD(dout, q, k, v, out, lse.to(torch.float32), 0.0, causal)
    groups, heads = k.shape[1], q.shape[1]
    ke, ve = _expand_heads(k, heads).float(), _expand_heads(v, heads).float()
    p = torch.exp(_scores(q, ke, causal) - lse.unsqueeze(-1))
    dout32 = dout.float()
    dv = p.transpose(-1, -2) @ dout32
    dp = dout32 @ ve.transpose(-1, -2)
    ds = p * (dp - (dout32 * out.float()).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = ds @ ke
    dk = ds.transpose(-1, -2) @ q.float()
    return dq.to(q.dtype), _fold_heads(dk, groups).to(k.dtype), _fold_heads(dv, groups).to(v.dtype)


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Online-softmax merge of a block's (out, lse) into the running fp32 (out, lse), in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - new).unsqueeze(-1)
    )
    lse.copy_(new)


# ---------------------------------------------------------------------------- the ring


class _Ring:
    """Send a tensor to the next CP rank while receiving the previous rank's, asynchronously."""

    KV, DKV = 0, 1  # tags: K/V blocks and their gradients can be in flight at the same time

    def __init__(self, group: dist.ProcessGroup):
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.group, self.size, self.rank = group, len(ranks), me
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def start(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        buf = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        buf, works = pending
        for w in works:
            w.wait()
        return buf


def _plan(step: int, ring: _Ring, half: int) -> tuple[slice, slice, bool]:
    """(local query rows, rows of the held K/V block, causal) for ring step `step`."""
    src = (ring.rank - step) % ring.size
    if step == 0:
        return slice(None), slice(None), True
    if src < ring.rank:  # both local chunks come after src's early chunk, before its late one
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # only the local late chunk sees src's chunks


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows (sequence positions, dim 2 of [b, heads, s, d] / last of [b, heads, s]) as a block."""
    return t[:, :, rows].contiguous() if rows != slice(None) else t


class RingAttention(torch.autograd.Function):
    """Causal attention over a load-balanced CP-sharded sequence; q [b, hq, s, d], k/v
    [b, hkv, s, d] with s the local length (two chunks), hq a multiple of hkv."""

    @staticmethod
    def forward(ctx, q, k, v, group, math):
        ring = _Ring(group)
        half = q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            pending = ring.start(kv, _Ring.KV) if step + 1 < ring.size else None
            q_rows, kv_rows, causal = _plan(step, ring, half)
            o, block_lse = block_forward(
                _rows(q, q_rows), _rows(kv[0], kv_rows), _rows(kv[1], kv_rows), causal, math
            )
            if out is None:
                out, lse = o.float(), block_lse
            else:
                merge_into(out[:, :, q_rows], lse[:, :, q_rows], o, block_lse)
            if pending is not None:
                kv = ring.wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.math = group, math
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, math = _Ring(ctx.group), ctx.math
        dout, half = dout.contiguous(), q.shape[2] // 2
        kv = torch.stack([k, v])
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv_pending = None
        for step in range(ring.size):
            kv_pending = ring.start(kv, _Ring.KV) if step + 1 < ring.size else None
            q_rows, kv_rows, causal = _plan(step, ring, half)
            gq, gk, gv = block_backward(
                _rows(dout, q_rows),
                _rows(q, q_rows),
                _rows(kv[0], kv_rows),
                _rows(kv[1], kv_rows),
                _rows(out, q_rows),
                _rows(lse, q_rows),
                causal,
                math,
            )
            dq[:, :, q_rows] += gq
            # The gradient buffer of the held block arrives from the left (empty at step 0).
            dkv = (
                ring.wait(dkv_pending)
                if dkv_pending is not None
                else torch.zeros_like(kv, dtype=torch.float32)
            )
            dkv[0][:, :, kv_rows] += gk
            dkv[1][:, :, kv_rows] += gv
            dkv_pending = ring.start(dkv, _Ring.DKV)  # to the rank that holds this block next
            if kv_pending is not None:
                kv = ring.wait(kv_pending)
        dkv = ring.wait(dkv_pending)  # after cp sends, each block's gradient is back home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    math: bool = False,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (see the module
    docstring); `group` defaults to the CP group. `math` forces the plain-math block kernel."""
    group = ps.get_group("cp") if group is None else group
    if dist.get_world_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"context parallel attention needs an even local sequence (two chunks), got {q.shape[2]}"
        )
    return RingAttention.apply(q, k, v, group, math)


def core_attention_for_spec(
    spec: str = "local",
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The context-parallel core attention of a module spec: (q, k, v) [b, heads, s_local, d] ->
    out, over the CP group.

    "local": `ring_attention` (pure torch, every device). "te" is the hook for the Transformer
    Engine spec: TE's DotProductAttention with cp_group / cp_global_ranks / cp_stream and
    cp_comm_type "p2p" runs the same ring with the same load-balanced chunks on fused GPU
    kernels; it is wired here when that spec lands."""
    if spec == "local":
        return ring_attention
    if spec == "te":
        raise NotImplementedError(
            "context parallelism with the Transformer Engine spec is not wired yet "
            "(engine.transformer.context_parallel.core_attention_for_spec('te')): use the local spec"
        )
    raise ValueError(f"unknown module spec {spec!r}: expected 'local' or 'te'")
