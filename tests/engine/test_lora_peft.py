"""LoRA on one rank computes what Hugging Face PEFT computes: the same tiny Llama (written by the
test, no download), the same adapters at the start (ours, copied into PEFT's by name), the same
data and AdamW: the losses of 10 steps and every adapter's gradient at every step within 1e-5
(fp32, relative to the tensor's largest value). The base weights get no gradient, no optimizer
state and no place in the data-parallel buckets."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import parallel_state as ps
from engine.data.sources import SyntheticSource
from engine.hf.peft import our_name, peft_name
from engine.jobspec import parse_job
from engine.launcher import spawn
from engine.training import Trainer
from engine.transformer.lora import adapter_params
from tests.engine import hf_harness as h
from tests.tools import require_module

peft = require_module("peft", "peft (a test dependency: pip install -e '.[dev]') is not installed")

RTOL = 1e-5
VOCAB = 300
STEPS = 10
LLAMA = dict(h.TINY_LLAMA, vocab_size=VOCAB)
OPTIMIZER = {"lr": 1e-2, "lr_decay_style": "constant", "weight_decay": 0.01, "adam_beta2": 0.95, "adam_eps": 1e-6}
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    h.save_tiny(folder, LlamaConfig, LlamaForCausalLM, **LLAMA)
    return folder


@pytest.fixture(scope="module")
def full_run(llama):
    """Adapters on attention and MLP, 10 steps on one rank."""
    return spawn(_ours, 1, (lora_job(llama),), timeout_s=240)[0]


def lora_job(folder, targets=TARGETS, **lora) -> dict:
    return h.job(
        folder,
        1,
        model={"lora": {"rank": 4, "alpha": 8, "target_modules": targets, **lora}},
        training={"train_iters": STEPS},
        optimizer=OPTIMIZER,
    )


def _ours(spec: dict) -> dict:
    """On the rank: the initial adapters, then each step's loss and adapter gradients."""
    trainer = Trainer(parse_job(spec))
    (chunk,), (ddp,) = trainer.model_chunks, trainer.ddp_chunks
    adapters = adapter_params(chunk)
    initial = {n: p.detach().clone() for n, p in adapters}
    frozen = [n for n, p in chunk.named_parameters() if not p.requires_grad]
    in_buckets = sum(len(b.params) for b in ddp.buckets)
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(trainer.train_step().loss)
        grads.append({n: p.main_grad.detach().clone() for n, p in adapters})
    ps.destroy_model_parallel()
    return {
        "initial": initial,
        "losses": losses,
        "grads": grads,
        "frozen": frozen,
        "in_buckets": in_buckets,
        "optimizer_segments": len(trainer.optimizer.segments),
        "base_grads": [n for n, p in chunk.named_parameters() if not p.requires_grad and p.grad is not None],
    }


def _peft_run(folder, initial: dict, targets: list[str]) -> dict:
    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").float()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    trainable = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(peft_name(n) for n in initial), "the same adapters on both sides"
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(initial[our_name(name)])
    params = list(trainable.values())
    opt = torch.optim.AdamW(
        params, lr=OPTIMIZER["lr"], betas=(0.9, 0.95), eps=OPTIMIZER["adam_eps"], weight_decay=0.01, foreach=True
    )
    source = SyntheticSource(VOCAB, h.SEQ, h.SEED)
    losses, grads = [], []
    for step in range(STEPS):
        rows = torch.stack([source[4 * step + i] for i in range(4)])
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({our_name(n): p.grad.detach().clone() for n, p in trainable.items()})
        opt.step()
    return {"losses": losses, "grads": grads}


def _assert_same(got: dict, ref: dict) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert a == pytest.approx(b, rel=RTOL), f"step {step + 1}: loss {a} vs PEFT {b}"
    for step, (mine, theirs) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert mine.keys() == theirs.keys()
        for name in mine:
            scale = float(theirs[name].abs().max()) + 1e-12
            diff = float((mine[name].view_as(theirs[name]) - theirs[name]).abs().max()) / scale
            assert diff < RTOL, f"step {step + 1}: gradient of {name} differs from PEFT's by {diff:.2e} (relative)"


def test_ten_steps_equal_peft_on_attention_and_mlp(llama, full_run):
    got = full_run
    # Frozen base: every non-adapter weight, none with a gradient, none in a bucket or the optimizer.
    assert len(got["frozen"]) > 0 and not any(".lora." in n for n in got["frozen"])
    assert got["base_grads"] == []
    assert got["in_buckets"] == got["optimizer_segments"] == len(got["initial"]) == 2 * 2 * len(TARGETS)
    # B starts at zero (PEFT's init), so step 1's loss is the base model's.
    assert all(float(t.abs().max()) == 0.0 for n, t in got["initial"].items() if ".lora.B." in n)
    assert all(float(t.abs().max()) > 0.0 for n, t in got["initial"].items() if ".lora.A." in n)
    ref = _peft_run(llama, got["initial"], TARGETS)
    _assert_same(got, ref)
    assert got["losses"][-1] < got["losses"][0] - 0.01, "the adapters learn"


def test_query_and_value_only_touch_their_rows(llama):
    """PEFT's default targets: an adapter on q_proj and v_proj of our fused QKV, none on k."""
    got = spawn(_ours, 1, (lora_job(llama, ["q_proj", "v_proj"], init="gaussian"),), timeout_s=240)[0]
    assert {n.rsplit(".", 1)[-1] for n in got["initial"]} == {"q_proj", "v_proj"}
    a = got["initial"]["decoder.layers.0.self_attention.linear_qkv.lora.A.q_proj"]
    assert float(a.std()) == pytest.approx(1 / 4, rel=0.2), "gaussian: normal(0, 1/rank)"
    _assert_same(got, _peft_run(llama, got["initial"], ["q_proj", "v_proj"]))


def test_kaiming_init_has_peft_bound(full_run):
    """kaiming: PEFT's kaiming_uniform_(a=sqrt(5)) on A [r, in] is uniform(+-1/sqrt(in)); ours too
    (drawn per global name, so the values differ: the tests copy ours into PEFT)."""
    from collections import OrderedDict

    torch.manual_seed(0)
    tiny = peft.get_peft_model(
        torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(32, 16))), peft.LoraConfig(r=4, target_modules=["proj"])
    )
    (theirs,) = [p for n, p in tiny.named_parameters() if "lora_A" in n]
    ours = full_run["initial"]["decoder.layers.0.self_attention.linear_qkv.lora.A.q_proj"]
    assert theirs.shape == ours.shape == (4, 32)
    for a in (theirs, ours):
        assert 0.85 / 32**0.5 < float(a.abs().max()) <= 1 / 32**0.5
