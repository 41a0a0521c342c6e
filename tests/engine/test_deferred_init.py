"""A model built on the meta device and materialised by data parallelism
(engine/distributed/deferred_init.py) equals the eagerly built and initialised one bit for bit,
at every level that materialises it, keeping each parameter's identity and placement; a frozen
parameter (not held by data parallelism) is materialised too."""

from __future__ import annotations

import pytest
import torch

from engine import parallel_state as ps
from engine.data.tokenizer import build_tokenizer
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.model_setup import build_model_chunks, deferred_init_of, wrap_data_parallel
from engine.parallel_placement import placement_of
from engine.transformer.config import TransformerConfig
from tests.engine.parallel_harness import job


def _compare(spec_dict: dict, level: str) -> dict:
    spec = JobSpec.model_validate(spec_dict)
    ps.initialize_model_parallel()
    config = TransformerConfig.from_job(spec, build_tokenizer(spec.data.tokenizer).vocab_size)
    device = torch.device("cpu")
    eager = build_model_chunks(spec, config, device)[0][0]
    chunks = build_model_chunks(spec, config, device, deferred=True)[0]
    lazy = chunks[0]
    named = dict(lazy.named_parameters())
    assert all(p.is_meta for p in named.values())
    placements = {n: placement_of(p) for n, p in named.items()}
    frozen = "decoder.final_layernorm.weight"
    named[frozen].requires_grad_(False)
    spec.parallel.data_parallel_sharding = level
    wrap_data_parallel(spec, config, chunks, [deferred_init_of(spec, lazy, device)])
    after = dict(lazy.named_parameters())
    out = {"same_objects": all(after[n] is p for n, p in named.items())}
    out["same_placements"] = all(placement_of(p) == placements[n] for n, p in after.items())
    out["all_real"] = not any(p.is_meta for p in after.values())
    eager_params = dict(eager.named_parameters())
    out["bitwise"] = all(torch.equal(eager_params[n], p.detach()) for n, p in after.items())
    out["frozen_equal"] = torch.equal(eager_params[frozen], after[frozen].detach())
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_deferred_model_equals_the_eager_one(arch):
    spec = job(1, model={"arch": arch})
    for level in ("none", "optim", "optim_grads"):
        got = spawn(_compare, 1, (spec, level))[0]
        assert got == dict.fromkeys(
            ("same_objects", "same_placements", "all_real", "bitwise", "frozen_equal"), True
        ), (arch, level, got)
