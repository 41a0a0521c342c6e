"""Activation recomputation changes memory, not numbers: with dropout on, recompute none /
selective / full give the same per-token loss and the same gradients for the same seed, on one
rank and under TP=2 with sequence parallelism (where the hidden dropout runs on the tracker's
per-rank stream). The comparison can fail: other dropout masks (another seed, or a recompute
that does not restore the tracker streams) change the gradients; and recomputation really runs:
the checkpointed functions are called twice per step.

Each rank builds the model the way engine.training.Trainer does and runs two forward/backward
passes over one microbatch (no optimizer step). The second pass, and the RNG states left after
it, show that recomputation puts the streams back where the forward left them.
"""

from __future__ import annotations

import pytest
import torch

from engine import device
from engine import parallel_state as ps
from engine.data.builder import build_datasets
from engine.data.sources import micro_batch
from engine.data.tokenizer import build_tokenizer
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.models import GPTModel
from engine.tensor_parallel import get_rng_tracker, model_parallel_manual_seed
from engine.tensor_parallel import random as tp_random
from engine.transformer.attention import SelfAttention
from engine.transformer.config import TransformerConfig
from engine.transformer.initialization import initialize_weights
from engine.transformer.transformer_layer import TransformerLayer
from tests.engine.parallel_harness import job, max_rel_diff

RTOL = 1e-6
MODES = ("none", "selective", "full")
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
ARCHS = {
    "llama": {**DROPOUT},
    "gpt2": {**DROPOUT, "arch": "gpt2", "num_query_groups": None},
}


class _TrackerNotRestored(tp_random._ForwardRNG):
    """A broken recompute context (control): restores the default stream but not the tracker."""

    def __enter__(self) -> None:
        self._saved.append((device.get_rng_state(), None))
        device.set_rng_state(self._default)

    def __exit__(self, *exc: object) -> None:
        device.set_rng_state(self._saved.pop()[0])


def _counting(cls: type, name: str, counts: dict[str, int]):
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(cls, name, wrapper)
    return original


def _forward_backward(spec_dict: dict, dropout_seed: int | None = None, break_tracker: bool = False) -> dict:
    """Per-token losses and local grads of two passes, the layer / attention-core call counts of
    the first (after its forward, after its backward), and the RNG states at the end."""
    spec = JobSpec.model_validate(spec_dict)
    p, t = spec.parallel, spec.training
    ps.initialize_model_parallel(tensor=p.tensor, pipeline=p.pipeline, context=p.context, expert=p.expert)
    model_parallel_manual_seed(t.seed)
    tokenizer = build_tokenizer(spec.data.tokenizer)
    config = TransformerConfig.from_job(spec, tokenizer.vocab_size)
    model = GPTModel(config).to(device.current_device())
    initialize_weights(model, t.seed)
    if dropout_seed is not None:  # same weights, other dropout masks
        model_parallel_manual_seed(dropout_seed)
    source = build_datasets(
        spec, tokenizer, config.seq_length, t.seed, synthetic_vocab_size=config.true_vocab_size
    ).train
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    model.train()

    counts = {"forward": 0, "core_attention": 0}
    originals = {
        (TransformerLayer, "forward"): _counting(TransformerLayer, "forward", counts),
        (SelfAttention, "core_attention"): _counting(SelfAttention, "core_attention", counts),
    }
    if break_tracker:
        originals[(tp_random, "_ForwardRNG")] = tp_random._ForwardRNG
        tp_random._ForwardRNG = _TrackerNotRestored
    losses, grads, calls = [], [], {}
    try:
        for it in range(2):
            model.zero_grad(set_to_none=True)
            tokens, labels = micro_batch(
                source, it * t.micro_batch_size * dp, 0, t.micro_batch_size, dp, dp_rank
            )
            per_token = model(tokens, labels)
            calls.setdefault("in_forward", dict(counts))
            per_token.float().mean().backward()
            calls.setdefault("in_step", dict(counts))
            losses.append(per_token.detach().clone())
            grads.append({n: q.grad.detach().clone() for n, q in model.named_parameters()})
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    result = {
        "losses": losses,
        "grads": grads,
        "calls": calls,
        "num_layers": config.num_layers,
        "rng": {"default": device.get_rng_state(), **get_rng_tracker().get_states()},
    }
    ps.destroy_model_parallel()
    return result


def _runs(spec_dicts: list[dict], kwargs: list[dict]) -> list[dict]:
    """Several runs in one process (one spawn), each from a freshly built grid and model."""
    return [_forward_backward(s, **kw) for s, kw in zip(spec_dicts, kwargs, strict=True)]


def _spawn_runs(ranks: int, runs: list[tuple[dict, dict]]) -> list[list[dict]]:
    """runs: (spec, kwargs) pairs -> per rank, the results in run order."""
    specs, kwargs = [s for s, _ in runs], [k for _, k in runs]
    return spawn(_runs, ranks, (specs, kwargs), timeout_s=240)


def _spec(ranks: int, model: dict, recompute: str, seed: int = 7, **sections) -> dict:
    return job(
        ranks,
        model=model,
        data={"source": "synthetic"},
        training={"recompute": recompute, "seed": seed},
        **sections,
    )


def _assert_same(got: dict, ref: dict, what: str) -> None:
    for it in range(len(ref["losses"])):
        a, b = got["losses"][it], ref["losses"][it]
        diff = float((a - b).abs().max() / b.abs().max())
        assert diff <= RTOL, f"{what}: pass {it + 1} per-token loss differs by {diff:.2e} (relative)"
        diff, where = max_rel_diff(got["grads"][it], ref["grads"][it])
        assert diff <= RTOL, f"{what}: pass {it + 1} gradient of {where} differs by {diff:.2e} (relative)"
    for name, state in ref["rng"].items():
        assert torch.equal(got["rng"][name], state), f"{what}: RNG state {name!r} differs after backward"


@pytest.fixture(scope="module", params=list(ARCHS))
def single_rank(request) -> dict:
    """One rank: every recompute mode, and the controls, for one architecture."""
    model = ARCHS[request.param]
    runs = {mode: (_spec(1, model, mode), {}) for mode in MODES}
    runs["other-seed"] = (_spec(1, model, "none", seed=8), {})
    runs["other-dropout-seed"] = (_spec(1, model, "none"), {"dropout_seed": 8})
    runs["full-tracker-not-restored"] = (_spec(1, model, "full"), {"break_tracker": True})
    (results,) = _spawn_runs(1, list(runs.values()))
    return dict(zip(runs, results, strict=True))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_matches_no_recompute(single_rank, mode):
    _assert_same(single_rank[mode], single_rank["none"], f"recompute={mode}")


def test_bitwise_on_one_rank(single_rank):
    """Stronger than the tolerance: on CPU the recomputed step is the same arithmetic."""
    ref = single_rank["none"]
    for mode in ("selective", "full"):
        got = single_rank[mode]
        for it in range(len(ref["losses"])):
            assert torch.equal(got["losses"][it], ref["losses"][it]), (mode, it)
            assert all(torch.equal(got["grads"][it][n], g) for n, g in ref["grads"][it].items()), (mode, it)


def test_other_seed_is_detected(single_rank):
    """Control: the comparison fails for another seed (other weights and masks)."""
    with pytest.raises(AssertionError, match="differs"):
        _assert_same(single_rank["other-seed"], single_rank["none"], "seed 8")


def test_other_dropout_masks_are_detected(single_rank):
    """Control: same weights, only the dropout streams reseeded, and the gradients differ."""
    with pytest.raises(AssertionError, match="differs"):
        _assert_same(single_rank["other-dropout-seed"], single_rank["none"], "dropout seed 8")


def test_recompute_without_tracker_restore_is_detected(single_rank):
    """Control: a recompute that restores the default stream but not the tracker redraws the
    attention dropout mask (a tracker stream) in backward, and the gradients are wrong."""
    with pytest.raises(AssertionError, match="pass 1 gradient of"):
        _assert_same(single_rank["full-tracker-not-restored"], single_rank["none"], "no tracker restore")


@pytest.mark.parametrize(
    ("mode", "layer_calls", "core_calls"),
    [("none", 1, 1), ("selective", 1, 2), ("full", 2, 2)],
)
def test_checkpointed_functions_run_again_in_backward(single_rank, mode, layer_calls, core_calls):
    """Per layer and step: full recompute runs each layer's forward twice, selective the
    attention core twice; neither runs anything twice during the forward itself."""
    got = single_rank[mode]
    n = got["num_layers"]
    assert got["calls"]["in_forward"] == {"forward": n, "core_attention": n}
    assert got["calls"]["in_step"] == {"forward": layer_calls * n, "core_attention": core_calls * n}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_recompute_matches_under_tp2_sequence_parallel(arch):
    """TP=2 + SP: attention and hidden dropout both draw from the per-rank tracker stream."""
    parallel = {"tensor": 2, "sequence_parallel": True}
    runs = [(_spec(2, ARCHS[arch], mode, parallel=parallel), {}) for mode in MODES]
    runs.append((_spec(2, ARCHS[arch], "full", parallel=parallel), {"break_tracker": True}))
    per_rank = _spawn_runs(2, runs)
    for rank, (none, selective, full, broken) in enumerate(per_rank):
        _assert_same(selective, none, f"rank {rank} recompute=selective")
        _assert_same(full, none, f"rank {rank} recompute=full")
        with pytest.raises(AssertionError, match="pass 1 gradient of"):
            _assert_same(broken, none, f"rank {rank} no tracker restore")
        assert full["calls"]["in_step"]["forward"] == 2 * full["num_layers"]
