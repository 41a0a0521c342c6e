"""Multi-token prediction (model.mtp_num_layers): the objective and the reported depth loss equal
a computation written out here on one rank, and every layout equals one rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import parallel_state as ps
from engine.jobspec import JobSpec
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.parallel_harness import assert_same_training, job, run_job

MTP = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3}


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _by_hand(spec: dict) -> dict:
    """One rank: the step's objective built from the model's pieces with the shifts written out,
    its gradient of depth 1's eh_proj, against what the Trainer computes and reports."""
    trainer = Trainer(JobSpec.model_validate(spec))
    model, lam, depths = trainer.model, 0.3, 2
    batches = trainer.batches.read(trainer.source, trainer.consumed_samples, 1)
    tokens, labels = batches[0].tokens, batches[0].labels
    s = tokens.shape[1]
    emb, out_w = model.embedding.weight, model.output_layer.weight
    x = model.decoder(model._embed(tokens.t()), model._rotary(s, torch.float32))
    logits = model._logits(x)
    main = F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]), labels.reshape(-1))
    h, mtp = x, []
    for k, layer in enumerate(model.mtp.layers, start=1):
        n = s - k  # positions whose target t_{i+k+1} exists
        e = F.embedding(labels[:, k - 1 : k - 1 + n].t(), emb)  # token i + k = label i + k - 1
        h = layer.transformer_layer(
            torch.cat([_rms(e, layer.enorm), _rms(h[:n], layer.hnorm)], -1) @ layer.eh_proj.weight.t(),
            model._rotary(n, torch.float32),
        )
        lg = (_rms(h, layer.final_layernorm) @ out_w.t())[..., : trainer.config.true_vocab_size]
        mtp.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, k:].t().reshape(-1)))
    objective = main + lam / depths * sum(mtp)
    (want,) = torch.autograd.grad(objective, model.mtp.layers[0].eh_proj.weight)
    step = trainer.train_step()
    got = model.mtp.layers[0].eh_proj.weight.main_grad
    ps.destroy_model_parallel()
    return {
        "main": (step.loss, float(main)),
        "mtp": (step.mtp_loss, float(sum(mtp) / depths)),
        "grad": float((got - want).abs().max() / want.abs().max()),
    }


def test_objective_and_reported_loss_match_a_computation_by_hand():
    spec = job(1, model=MTP, training={"global_batch_size": 2, "micro_batch_size": 2})
    got = spawn(_by_hand, 1, (spec,), timeout_s=120)[0]
    assert got["main"][0] == pytest.approx(got["main"][1], rel=1e-5)
    assert got["mtp"][0] == pytest.approx(got["mtp"][1], rel=1e-5)
    assert got["grad"] < 1e-5


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_job(job(1, model=MTP))


@pytest.mark.parametrize(
    ("ranks", "parallel", "model"),
    [
        (2, {"tensor": 2, "sequence_parallel": True}, {}),
        (2, {"pipeline": 2}, {}),
        (2, {}, {}),
    ],
    ids=["tp2-sp", "pp2", "dp2"],
)
def test_layouts_match_single_rank(reference, ranks, parallel, model):
    got = run_job(job(ranks, model={**MTP, **model}, parallel=parallel))
    assert_same_training(got, reference)
    assert got["mtp_losses"] == pytest.approx(reference["mtp_losses"], rel=1e-5)
    assert all(v is not None and v > 0 for v in got["mtp_losses"])


def test_tied_embeddings_on_pp2_keep_the_mtp_embedding_equal():
    tied = {**MTP, "tie_embeddings": True}
    got = run_job(job(2, model=tied, parallel={"pipeline": 2}))
    assert_same_training(got, run_job(job(1, model=tied)))
