"""Context parallelism: the sequence split over CP ranks trains the same model as one rank.

- The layout (2 x context chunks, rank r keeps chunks r and 2cp-1-r) and its positions, by hand.
- Ring attention alone on 2 ranks against F.scaled_dot_product_attention on the whole sequence
  (causal, grouped-query heads): output and q/k/v gradients within 1e-5 of the largest value,
  with the CPU flash kernel and with the plain-math kernel.
- Whole training runs against the single-rank run of the same job (the harness's tolerances:
  losses and grad norms 1e-5 relative, last gradients and final parameters 1e-4 of each
  tensor's largest value): CP=2, CP=2 x TP=2 with sequence parallelism (and full recompute),
  CP=2 x DP=2 with the distributed optimizer (sharded over DP x CP), and GPT-2 (learned
  positions, tied embeddings split over stages) on CP=2 x PP=2.
- A CP=2 checkpoint resumes on one rank and continues the uninterrupted run's losses.
- Sequence lengths that do not cut into 2 x context chunks are refused at submit time.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.jobspec import JobSpecError, parse_job
from engine.launcher import spawn
from engine.transformer import context_parallel as cp
from tests.engine.parallel_harness import assert_continues, assert_same_training, job, run_job, train_until

GPT2 = {"arch": "gpt2", "num_query_groups": None}


# ---------------------------------------------------------------------------- layout


def test_each_rank_keeps_an_early_and_a_late_chunk():
    seq = torch.arange(12)
    assert cp.shard_sequence(seq, 0, size=2, rank=0).tolist() == [0, 1, 2, 9, 10, 11]
    assert cp.shard_sequence(seq, 0, size=2, rank=1).tolist() == [3, 4, 5, 6, 7, 8]
    assert cp.shard_sequence(seq, 0, size=3, rank=1).tolist() == [2, 3, 8, 9]
    batch = torch.arange(16).view(2, 8)  # [b, s]: cut along the sequence only
    assert cp.shard_sequence(batch, 1, size=2, rank=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


# ---------------------------------------------------------------------------- ring attention


def _ring_vs_sdpa(math: bool) -> dict[str, float]:
    """Rank function: the ring's output and gradients on this rank's chunks vs SDPA on the whole
    sequence (every rank computes the reference from the same seed)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    b, heads, groups, s, d = 2, 4, 2, 24, 16
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, heads, s, d)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(dout)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return cp.shard_sequence(t.detach(), 2, size, rank)

    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    out = cp.ring_attention(ql, kl, vl, dist.group.WORLD, math=math)
    out.backward(mine(dout))
    pairs = {"out": (out, ref), "dq": (ql.grad, q.grad), "dk": (kl.grad, k.grad), "dv": (vl.grad, v.grad)}
    return {n: float((a.detach() - mine(r)).abs().max() / r.abs().max()) for n, (a, r) in pairs.items()}


def _ring_vs_sdpa_both_kernels() -> dict[str, dict[str, float]]:
    return {kernel: _ring_vs_sdpa(math) for kernel, math in (("cpu-flash", False), ("math", True))}


def test_ring_attention_matches_sdpa_on_two_ranks():
    for rank, kernels in enumerate(spawn(_ring_vs_sdpa_both_kernels, 2, timeout_s=120)):
        for kernel, diffs in kernels.items():
            for name, diff in diffs.items():
                assert diff < 1e-5, f"rank {rank}, {kernel} kernel: {name} differs by {diff:.2e} (relative)"


# ---------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def llama_reference():
    return run_job(job(1))


LLAMA_LAYOUTS = {
    "cp2": (2, {"context": 2}, {}),
    "cp2-tp2-sp-full-recompute": (
        4,
        {"context": 2, "tensor": 2, "sequence_parallel": True},
        {"recompute": "full"},
    ),
    "cp2-dp2-distributed-optimizer": (4, {"context": 2, "distributed_optimizer": True}, {}),
}


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_context_parallel_matches_single_rank(llama_reference, layout):
    """Llama (RoPE at global positions, GQA 4 heads / 2 groups), sequence 32 = 4 chunks of 8.
    Full recompute replays the ring in backward; it changes no number."""
    ranks, parallel, training = LLAMA_LAYOUTS[layout]
    got = run_job(job(ranks, parallel=parallel, training=training))
    assert_same_training(got, llama_reference)


def test_gpt2_context_parallel_with_pipeline_matches_single_rank():
    """GPT-2: learned position embeddings read at each rank's global positions (their gradient
    sums over CP), tied embeddings split over two pipeline stages."""
    ref = run_job(job(1, model=GPT2))
    got = run_job(job(4, model=GPT2, parallel={"context": 2, "pipeline": 2}))
    assert_same_training(got, ref)
    assert got["tied_copy_diff"] is not None and got["tied_copy_diff"] < 1e-6, got["tied_copy_diff"]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain", "zero1-over-dp-x-cp"])
def test_cp2_checkpoint_resumes_on_one_rank(llama_reference, tmp_path, distributed_optimizer):
    """Iterations 1-2 on CP=2, a checkpoint, 3-5 on one rank: the losses of the uninterrupted
    single-rank run (the reference job; name and checkpoint path change nothing it trains). With
    the distributed optimizer the Adam state is sharded over DP x CP and reassembled on save."""
    parallel = {"context": 2, "distributed_optimizer": distributed_optimizer}
    src = job(2, name="cp-src", parallel=parallel, checkpoint={"path": str(tmp_path / "a")})
    first = spawn(train_until, 2, (src, 2), timeout_s=240)[0]
    dst = job(
        1,
        name="cp-dst",
        checkpoint={"path": str(tmp_path / "b"), "resume_from": str(tmp_path / "a" / "cp-src")},
    )
    second = spawn(train_until, 1, (dst, 5), timeout_s=240)[0]
    assert (first["start"], second["start"]) == (0, 2)
    assert_continues(first["losses"] + second["losses"], llama_reference["losses"])


# ---------------------------------------------------------------------------- job spec


def test_seq_length_not_cut_into_two_chunks_per_rank_is_refused():
    with pytest.raises(JobSpecError) as info:
        parse_job(job(2, model={"seq_length": 30}, parallel={"context": 2}))
    msg = str(info.value)
    assert "model.seq_length (30) must be a multiple of 4 with parallel.context (2)" in msg, msg
    assert "use model.seq_length 28 or 32" in msg, msg


def test_seq_length_rule_counts_sequence_parallel_over_tp():
    # 36 = 4 chunks of 9, but each CP rank's 18 tokens do not split over TP 4: a multiple of 2 x 4 = 8.
    model = {"seq_length": 36, "num_query_groups": 4}
    with pytest.raises(
        JobSpecError, match=r"model\.seq_length \(36\) must be a multiple of 8 .*parallel\.tensor \(4\)"
    ):
        parse_job(job(8, model=model, parallel={"context": 2, "tensor": 4, "sequence_parallel": True}))
    # Without sequence parallelism TP does not split the sequence.
    parse_job(job(8, model=model, parallel={"context": 2, "tensor": 4}))


def test_context_parallel_is_supported_and_attention_dropout_is_refused():
    parse_job(job(2, parallel={"context": 2}))  # the one home of "not supported yet": the job spec
    with pytest.raises(JobSpecError, match=r"model\.attention_dropout.*parallel\.context > 1"):
        parse_job(job(2, model={"attention_dropout": 0.1}, parallel={"context": 2}))
