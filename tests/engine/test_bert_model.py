"""arch bert against transformers' BertForMaskedLM, and on every layout against one rank.

Three launches (1, 4 and 2 ranks) each check several things, to keep CI cheap:
- the imported tiny random BertForMaskedLM gives transformers' logits and MLM loss (<= 1e-5,
  fp32, with a padding mask and two token types) on 1 rank, on TP=2+SP x DP=2 with
  optim_grads_params (loaded from the 1-rank checkpoint), and on PP=2; a BertForPreTraining
  gives its MLM and next-sentence logits and summed loss on TP=2+SP x DP=2;
- a random-init job with the next-sentence head trained on `data.source: mlm` sentence pairs gives the same losses, grad norms,
  gradients and parameters on those layouts (TP+SP+DP with full recompute) as on one rank;
- a PP=2 run resumed from its checkpoint continues bitwise; the 1-rank checkpoint loads on
  TP=2+SP x DP=2 (optim_grads_params) with transformers' logits;
- import -> checkpoint -> `elastron export --format hf` gives the same safetensors bytes (both
  families).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

from engine import parallel_state as ps
from engine.data.sft import IGNORE_INDEX
from engine.hf.exporter import export_hf
from engine.jobspec import parse_job
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine import hf_harness as h
from tests.engine import parallel_harness as ph

SEQ, VOCAB = 16, 300
TINY_BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=SEQ,
)
RESERVED = {"cls_id": 257, "sep_id": 258, "pad_id": 259, "mask_id": 260}  # past the byte tokenizer's ids
MLM_DATA = {"source": "mlm", "tokenizer": "byte", "mlm": RESERVED}
NSP_DATA = {**MLM_DATA, "mlm": {**RESERVED, "next_sentence": True}}
RTOL = 1e-5


def _inputs() -> dict[str, torch.Tensor]:
    """A fixed batch of 2 rows: the second padded after 11 tokens, two token types, labels on ~1/4."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 11:] = 0
    types = torch.zeros(2, SEQ, dtype=torch.long)
    types[:, 7:] = 1
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels[torch.rand(2, SEQ, generator=g) > 0.25] = IGNORE_INDEX
    labels[1, 11:] = IGNORE_INDEX
    return {
        "tokens": tokens, "attention_mask": mask, "token_type_ids": types, "labels": labels,
        "next_sentence_label": torch.tensor([1, 0]),
    }  # fmt: skip


def _full_logits(trainer: Trainer, batch: dict) -> torch.Tensor | None:
    """Logits [b, s, vocab] of `batch`, whole on the last pipeline stage (None elsewhere); with a
    binary head, (those, the next-sentence logits [b, 2])."""
    out = h.full_logits(
        trainer, batch["tokens"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
    )
    chunk = trainer.model_chunks[0]
    if out is not None and chunk.binary_head is not None:
        return out, chunk.binary_head.last_logits.float()
    return out


def _import_job(folder, ranks: int, checkpoint=None, data=MLM_DATA, **sections) -> dict:
    spec = h.job(folder, ranks, model={"seq_length": SEQ}, data=data, **sections)
    if checkpoint is not None:
        spec["checkpoint"] = {"path": str(checkpoint)}
    return spec


def _train_job(ranks: int, **sections) -> dict:
    base = {
        "model": {
            "arch": "bert", "vocab_size": 261, "seq_length": SEQ, "hidden_size": 32, "num_query_groups": 4,
            "bert_binary_head": True,
        },
        "data": NSP_DATA,
        "training": {"train_iters": 4},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return ph.job(ranks, **base)


def _rank(import_spec: dict, train_spec: dict, resume_spec: dict | None, reshard_spec: dict | None = None) -> dict:
    """On every rank: (1) a random-init MLM job trained, its gradients and parameters gathered;
    (2) the imported model's logits of the fixed batch, a checkpoint before any step (export);
    (3) optionally a job stopped at iteration 2 and resumed from its checkpoint; (4) optionally
    the logits of a job loading another layout's checkpoint (`reshard_spec`)."""
    out = {"train": ph._train_and_collect(train_spec)}
    trainer = Trainer(parse_job(import_spec))
    if import_spec.get("checkpoint"):
        trainer.checkpointer.save()
        trainer.checkpointer.wait()
    out["logits"] = _full_logits(trainer, _inputs())
    ps.destroy_model_parallel()
    if reshard_spec is not None:
        trainer = Trainer(parse_job(reshard_spec))
        out["resharded"] = (trainer.iteration, _full_logits(trainer, _inputs()))
        ps.destroy_model_parallel()
    if resume_spec is not None:
        first = ph.train_until(resume_spec, 2)
        rest = ph.train_until(resume_spec, 4)
        out["resume"] = (first, rest)
    return out if out["logits"] is not None or dist.get_rank() == 0 else {"train": out["train"]}


def _launch(ranks: int, *args) -> list[dict]:
    return spawn(_rank, ranks, args, timeout_s=240)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    model = h.save_tiny(folder, BertConfig, BertForMaskedLM, **TINY_BERT)
    b = _inputs()
    with torch.no_grad():
        logits = model(
            input_ids=b["tokens"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"]
        ).logits
    return folder, logits


@pytest.fixture(scope="module")
def pretraining(tmp_path_factory):
    """A tiny BertForPreTraining (the MLM and next-sentence heads): its logits and loss."""
    folder = tmp_path_factory.mktemp("bert-pretraining")
    model = h.save_tiny(folder, BertConfig, BertForPreTraining, seed=1, **TINY_BERT)
    b = _inputs()
    with torch.no_grad():
        out = model(
            input_ids=b["tokens"], attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"],
            labels=b["labels"], next_sentence_label=b["next_sentence_label"],
        )  # fmt: skip
    return folder, out.prediction_logits, out.seq_relationship_logits, float(out.loss)


@pytest.fixture(scope="module")
def one_rank(bert, tmp_path_factory):
    folder, _ = bert
    ckpt = tmp_path_factory.mktemp("ckpt1")
    (got,) = _launch(1, _import_job(folder, 1, ckpt), _train_job(1), None)
    return got, ckpt


def _loss(logits: torch.Tensor) -> float:
    labels = _inputs()["labels"]
    return float(torch.nn.functional.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), labels.reshape(-1)))


def _assert_like_hf(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    ours = ours[..., :VOCAB]
    real = _inputs()["attention_mask"].bool()  # padded positions' outputs are not compared
    diff = float((ours[real] - theirs[real]).abs().max() / theirs.abs().max())
    assert diff < RTOL, f"logits differ from transformers' by {diff:.2e} (relative)"
    assert _loss(ours) == pytest.approx(_loss(theirs), rel=RTOL)


def test_one_rank_matches_transformers_and_round_trips(bert, one_rank, tmp_path):
    folder, theirs = bert
    got, ckpt = one_rank
    _assert_like_hf(got["logits"], theirs)
    out = tmp_path / "hf"
    export_hf(str(ckpt / "hf"), str(out), dtype="fp32")
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["vocab_size"] == VOCAB
    assert config["layer_norm_eps"] == 1e-12 and config["type_vocab_size"] == 2


def test_tp2_sp_dp2_full_sharding_equals_one_rank_and_transformers(bert, pretraining, one_rank, tmp_path):
    folder, theirs = bert
    parallel = {"tensor": 2, "sequence_parallel": True, "data_parallel_sharding": "optim_grads_params"}
    train = _train_job(4, parallel=parallel, training={"recompute": "full"})
    # the 1-rank checkpoint of the imported model, loaded on this layout without the import
    reshard = _train_job(4, parallel=parallel, checkpoint={"resume_from": str(one_rank[1] / "hf")}, data=MLM_DATA)
    reshard["model"].update(
        num_layers=2, vocab_size=VOCAB, ffn_hidden_size=64, norm_epsilon=1e-12, bert_binary_head=False
    )
    # BertForPreTraining imported here: both heads' logits, the summed loss, and its round trip
    pre_folder, pre_logits, pre_binary, pre_loss = pretraining
    imported = _import_job(pre_folder, 4, tmp_path / "ckpt", data=NSP_DATA, parallel=parallel)
    got = _launch(4, imported, train, None, reshard)
    ours, binary = got[0]["logits"]
    _assert_like_hf(ours, pre_logits)
    assert float((binary - pre_binary).abs().max() / pre_binary.abs().max()) < RTOL
    nsp = float(torch.nn.functional.cross_entropy(binary, _inputs()["next_sentence_label"]))
    assert _loss(ours) + nsp == pytest.approx(pre_loss, rel=RTOL)
    ph.assert_same_training(got[0]["train"], one_rank[0]["train"])
    assert float(one_rank[0]["train"]["grads"]["binary_head.classifier.bias"].abs().sum()) > 0  # NSP trains
    iteration, resharded = got[0]["resharded"]
    assert iteration == 0
    _assert_like_hf(resharded, theirs)
    export_hf(str(tmp_path / "ckpt" / "hf"), str(tmp_path / "out"), dtype="fp32")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (pre_folder / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["BertForPreTraining"]


def test_pp2_equals_one_rank_and_resumes_bitwise(bert, one_rank, tmp_path):
    folder, theirs = bert
    parallel = {"pipeline": 2}
    resume = _train_job(2, parallel=parallel, checkpoint={"path": str(tmp_path / "r")})
    train = _train_job(2, parallel=parallel)
    got = _launch(2, _import_job(folder, 2, parallel=parallel), train, resume)
    last = next(r for r in got if r.get("logits") is not None)
    _assert_like_hf(last["logits"], theirs)
    ph.assert_same_training(got[0]["train"], one_rank[0]["train"])
    assert got[0]["train"]["tied_copy_diff"] == 0.0  # the last stage's decoder weight is the embedding
    first, rest = got[0]["resume"]
    assert rest["start"] == 2
    assert first["losses"] + rest["losses"] == got[0]["train"]["losses"]  # bitwise
