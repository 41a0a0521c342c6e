"""model.arch t5 against transformers' T5ForConditionalGeneration, on one rank and on every layout.

Tiny random T5 v1.1 models (gated-GELU) are written in the test: a tied one as transformers 5
saves it (`shared.weight` only, the decoder output scaled by d_model**-0.5 before the head) and
an untied one as a T5 v1.1 folder has it (its own `lm_head.weight`, no scaling). On them:
- one rank: our logits of a batch with encoder padding equal transformers' (fp32, 1e-5), and
  the first step's loss equals transformers' loss of the global batch; import -> checkpoint ->
  export gives a byte-identical model.safetensors; a resumed run continues bitwise;
- four ranks, one launch: TP=2 + SP with DP=2 under optim_grads_params, PP=2 (encoder |
  decoder) with DP=2 under optim_grads_params, and PP=2 with TP=2 + SP: the same logits and
  the same training as one rank, PP=2's checkpoint resuming on TP=2 + SP; and a fresh
  (meta-built, deferred-initialised) model with full recompute on TP=2 + SP x DP=2
  optim_grads_params trains as on one rank.
Two launches in all (one rank, four ranks) keep the CI cost low.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine import parallel_state as ps
from engine.data.seq2seq import Seq2SeqSource
from engine.data.tokenizer import ByteTokenizer
from engine.hf.exporter import export_hf
from engine.jobspec import parse_job
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.hf_harness import full_logits
from tests.engine.parallel_harness import LOSS_RTOL
from tests.tools import require_module

transformers = require_module("transformers", "transformers (a test dependency: pip install -e '.[dev]') is not installed")

SEQ, VOCAB, SEED, MBS = 16, 300, 5, 2
TINY_T5 = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=20,
    feed_forward_proj="gated-gelu",
    decoder_start_token_id=0,
    dropout_rate=0.0,
)
WORDS = "the cat sat on a mat while seven quick foxes jumped over lazy dogs near our old barn".split()


def _pairs(path) -> None:
    """Input -> target pairs of varied lengths (encoder padding in every batch)."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(24):
            n, m = 1 + i % 4, 1 + (i * 7) % 3
            pick = lambda k: " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (k,), generator=g).tolist())  # noqa: E731
            f.write(json.dumps({"input": pick(n), "target": pick(m)}) + "\n")


def _save_tied(folder) -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(**TINY_T5)
    config.architectures = ["T5ForConditionalGeneration"]
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)


def _save_untied(folder) -> None:
    """A T5 v1.1 folder: its own lm_head.weight, tie_word_embeddings false (written by hand:
    transformers 5 always ties T5's head when it saves)."""
    torch.manual_seed(1)
    config = transformers.T5Config(**TINY_T5, tie_word_embeddings=False)
    config.architectures = ["T5ForConditionalGeneration"]
    model = transformers.T5ForConditionalGeneration(config)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if "embed_tokens" not in k}
    tensors["lm_head.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(2)) * 0.2
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["tie_word_embeddings"] = False
    cfg.pop("scale_decoder_outputs", None)
    (folder / "config.json").write_text(json.dumps(cfg))


def _reference(folder):
    """transformers' model of `folder` as the folder means it (an untied head kept untied)."""
    cfg = json.loads((folder / "config.json").read_text())
    model = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    if cfg.get("tie_word_embeddings") is False:
        from safetensors.torch import load_file

        model.lm_head = torch.nn.Linear(32, VOCAB, bias=False)
        model.lm_head.weight.data.copy_(load_file(folder / "model.safetensors")["lm_head.weight"])
        model.config.scale_decoder_outputs = False
    return model


def _batch(pairs_path, count):
    return Seq2SeqSource(pairs_path, ByteTokenizer(), SEQ, SEED).micro_batch(0, 0, count, 1, 0)


def _hf_logits_and_loss(folder, pairs_path, count):
    b = _batch(pairs_path, count)
    with torch.no_grad():
        out = _reference(folder)(
            input_ids=b.tokens,
            attention_mask=b.inputs["attention_mask"].long(),
            decoder_input_ids=b.inputs["decoder_input_ids"],
            labels=b.labels,
        )
    return out.logits, float(out.loss)


def _job(folder, pairs_path, ranks=1, init=True, **sections) -> dict:
    model = {"init_from": str(folder), "seq_length": SEQ} if init else {**_fields(), "seq_length": SEQ}
    spec = {
        "name": "t5",
        "model": model,
        "data": {"source": "seq2seq", "path": str(pairs_path), "tokenizer": "byte"},
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 3, "seed": SEED},
        "optimizer": {"lr": 3e-3, "clip_grad": 0.0, "adam_eps": 1e-6, "lr_warmup_iters": 1},
        "resources": {"ranks": ranks, "device": "cpu"},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def _fields() -> dict:
    return {
        "arch": "t5",
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "kv_channels": 8,
        "ffn_hidden_size": 48,
        "vocab_size": VOCAB,
        "t5": {"relative_attention_num_buckets": 8, "relative_attention_max_distance": 20},
    }


def _full_logits(trainer: Trainer, batch) -> torch.Tensor | None:
    """Logits [b, s, vocab] of `batch`, whole on the last stage's TP rank 0 (None elsewhere)."""
    out = full_logits(trainer, batch.tokens, **batch.inputs)
    if out is None or ps.get_tensor_model_parallel_rank() != 0:
        return None
    return out[..., :VOCAB]


def run_jobs(specs: list[dict], pairs_path: str) -> list[dict]:
    """On every rank, one job after the other: the logits of the first micro-batch pair and the
    training losses (a job with a checkpoint path saves iteration 0 first, then as it says). A
    job's `resume`: that job again, from the given checkpoint, to the end."""
    out = []
    for spec in specs:
        resume = spec.pop("resume", None)
        trainer = Trainer(parse_job(spec))
        if spec.get("checkpoint"):
            trainer.checkpointer.save()  # iteration 0: the imported weights as they are
        logits = _full_logits(trainer, _batch(pairs_path, MBS))
        losses = []
        while trainer.iteration < spec["training"]["train_iters"]:
            losses.append(trainer.train_step().loss)
            trainer.save_checkpoint_if_due()
        if trainer.checkpointer is not None:
            trainer.checkpointer.wait()
        ps.destroy_model_parallel()
        resumed = None
        if resume is not None:
            again = Trainer(parse_job(resume))
            start = again.iteration
            resumed = {"start": start, "losses": [again.train_step().loss for _ in range(len(losses) - start)]}
            ps.destroy_model_parallel()
        out.append({"logits": logits, "losses": losses, "resumed": resumed})
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    tied, untied = root / "tied", root / "untied"
    tied.mkdir()
    untied.mkdir()
    _save_tied(tied)
    _save_untied(untied)
    _pairs(root / "pairs.jsonl")
    return root, tied, untied


@pytest.fixture(scope="module")
def one_rank(folders):
    root, tied, untied = folders
    pairs = root / "pairs.jsonl"
    specs = [
        _job(tied, pairs, checkpoint={"path": str(root / "ckpt_tied"), "interval": 2}, training={"train_iters": 4}),
        _job(untied, pairs, checkpoint={"path": str(root / "ckpt_untied")}),
        _job(tied, pairs, init=False),
    ]
    specs[0]["resume"] = {
        **specs[0],
        "checkpoint": {"path": str(root / "resumed"), "resume_from": str(root / "ckpt_tied" / "t5" / "iter_0000002")},
    }
    return spawn(run_jobs, 1, (specs, str(pairs)), timeout_s=240)[0]


@pytest.fixture(scope="module")
def four_ranks(folders):
    root, tied, _ = folders
    pairs = root / "pairs.jsonl"
    tp_dp = {"tensor": 2, "sequence_parallel": True, "data_parallel_sharding": "optim_grads_params"}
    pp_dp = {"pipeline": 2, "data_parallel_sharding": "optim_grads_params"}
    saved = str(root / "ckpt_pp" / "t5" / "iter_0000002")
    specs = [
        _job(tied, pairs, 4, parallel=tp_dp),
        _job(tied, pairs, 4, parallel=pp_dp, checkpoint={"path": str(root / "ckpt_pp"), "interval": 2}),
        _job(tied, pairs, 4, init=False, parallel=tp_dp, training={"recompute": "full"}),
        _job(tied, pairs, 4, parallel={"pipeline": 2, "tensor": 2, "sequence_parallel": True}),
    ]
    # Resharding: PP=2 x DP=2's checkpoint of iteration 2 resumes on TP=2 + SP x DP=2.
    specs[1]["resume"] = _job(tied, pairs, 4, parallel=tp_dp, checkpoint={"path": str(root / "resharded"), "resume_from": saved})
    results = spawn(run_jobs, 4, (specs, str(pairs)), timeout_s=300)
    # The logits are whole on the last stage's TP rank 0: rank 0 without PP, else a rank of the
    # second stage (the grid puts TP fastest, then DP, then PP), whichever holds them.
    merged = []
    for i in range(len(specs)):
        logits = next(r[i]["logits"] for r in results if r[i]["logits"] is not None)
        merged.append({**results[0][i], "logits": logits})
    return merged


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_one_rank_equals_transformers(folders, one_rank, which):
    root, tied, untied = folders
    folder, result = (tied, one_rank[0]) if which == "tied" else (untied, one_rank[1])
    logits, _ = _hf_logits_and_loss(folder, root / "pairs.jsonl", MBS)
    _close(result["logits"], logits)
    _, loss = _hf_logits_and_loss(folder, root / "pairs.jsonl", 4)  # the first step's global batch
    assert result["losses"][0] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_import_export_is_byte_identical(folders, one_rank, tmp_path, which):
    root = folders[0]
    out = tmp_path / "hf"
    export_hf(str(root / f"ckpt_{which}" / "t5" / "iter_0000000"), str(out), dtype="fp32")
    original = (root / which / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() == original
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"]
    assert config["tie_word_embeddings"] == (which == "tied")


def test_resume_is_exact(one_rank):
    result = one_rank[0]
    assert result["resumed"]["start"] == 2
    assert result["resumed"]["losses"] == result["losses"][2:]  # bitwise


def test_layouts_equal_transformers_and_one_rank(folders, one_rank, four_ranks):
    root, tied, _ = folders
    logits, _ = _hf_logits_and_loss(tied, root / "pairs.jsonl", MBS)
    reference = one_rank[0]["losses"][:3]
    names = ["tp2+sp dp2 optim_grads_params", "pp2 dp2 optim_grads_params", None, "pp2 tp2+sp"]
    for name, result in zip(names, four_ranks, strict=True):
        if name is None:
            continue
        _close(result["logits"], logits)
        assert result["losses"] == pytest.approx(reference, rel=LOSS_RTOL), name
    fresh = four_ranks[2]
    assert fresh["losses"] == pytest.approx(one_rank[2]["losses"], rel=LOSS_RTOL)
    resharded = four_ranks[1]["resumed"]
    assert resharded["start"] == 2 and resharded["losses"] == pytest.approx(reference[2:], rel=LOSS_RTOL)
