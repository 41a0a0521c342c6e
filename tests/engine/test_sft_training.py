"""Fine-tuning (data.source sft): the loss is the mean over the global batch's assistant tokens on
every layout, packing is exact, a packed run resumes exactly, and the job spec refuses what
cannot run.

Data: short prompt/response conversations rendered with the plain template and the byte
tokenizer (no files but the JSON lines), with responses of 1-4 or 45-70 characters, so the
samples' counts of assistant tokens differ by up to 5x and a per-microbatch mean would differ
from the global one. Tolerances (fp32): the harness's, 1e-5 relative on losses and grad norms,
1e-4 of each tensor's largest value on gradients and parameters; the largest gradient
difference seen is asserted below 1e-5 as well where gradients are compared.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from engine import parallel_state as ps
from engine.data.packing import PackedSFTSource
from engine.data.sft import IGNORE_INDEX, ChatRenderer, load_conversations, read_chat_template
from engine.data.tokenizer import ByteTokenizer, HFTokenizer
from engine.jobspec import JobSpec, JobSpecError, parse_job
from engine.launcher import spawn
from engine.training import Trainer
from tests.engine.parallel_harness import assert_same_training, job, max_rel_diff, run_job, train_until
from tests.engine.test_sft_data import llama_dir  # noqa: F401 - the fixture: a Llama-3 style tokenizer

SEQ = 256
MODEL = {"seq_length": SEQ}
WORDS = "list tuple dict set module import class yield lambda scope frame thread lock queue".split()


def _text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


def conversations(n: int = 12, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = _text(rng, rng.randint(4, 30))
        response = _text(rng, rng.randint(1, 4) if i % 2 else rng.randint(45, 70))
        if i % 3 == 0:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "terse"},
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": response},
                    ]
                }
            )
        else:
            out.append({"prompt": prompt, "response": response})
    return out


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    return str(path)


def sft_job(ranks: int, path: str, packing: bool = False, **sections) -> dict:
    data = {"source": "sft", "path": path, "packing": packing, **sections.pop("data", {})}
    model = {**MODEL, **sections.pop("model", {})}
    return job(ranks, data=data, model=model, **sections)


def packed_rows(path: str, seed: int = 7) -> int:
    return PackedSFTSource(path, ByteTokenizer(), SEQ, seed).num_samples


# ----------------------------------------------------------------------------- the masked loss


def _masked_loss_case(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    t = trainer.spec.training
    n = t.global_batch_size // t.micro_batch_size
    batches = [trainer.batches.microbatch(trainer.source, trainer.consumed_samples, m) for m in range(n)]
    with torch.no_grad():
        logits = torch.cat([trainer.model(b.tokens) for b in batches]).float()
    labels = torch.cat([b.labels for b in batches])
    vocab = logits.shape[-1]
    reference = F.cross_entropy(logits.view(-1, vocab), labels.view(-1), ignore_index=IGNORE_INDEX)
    per_microbatch = (
        sum(
            F.cross_entropy(lg.view(-1, vocab), lb.view(-1), ignore_index=IGNORE_INDEX)
            for lg, lb in zip(logits.chunk(n), labels.chunk(n), strict=True)
        )
        / n
    )
    valid = trainer.valid_source
    valid_batches = [trainer.batches.microbatch(valid, 0, m) for m in range(n)]
    with torch.no_grad():
        valid_logits = torch.cat([trainer.model(b.tokens) for b in valid_batches]).float()
    valid_labels = torch.cat([b.labels for b in valid_batches])
    valid_reference = F.cross_entropy(
        valid_logits.view(-1, vocab), valid_labels.view(-1), ignore_index=IGNORE_INDEX
    )
    evaluated = trainer.evaluate()["valid_loss"]
    step = trainer.train_step()
    ps.destroy_model_parallel()
    return {
        "loss": step.loss,
        "reference": float(reference),
        "per_microbatch_mean": float(per_microbatch),
        "label_tokens": [int((b.labels != IGNORE_INDEX).sum()) for b in batches],
        "valid_loss": evaluated,
        "valid_reference": float(valid_reference),
    }


def test_step_loss_is_the_mean_over_assistant_tokens_with_a_chat_template(tmp_path, llama_dir):  # noqa: F811
    """One rank, four microbatches of one conversation each, the Llama-3 chat template of an hf:
    tokenizer: the step's loss is F.cross_entropy over the whole batch's assistant tokens, and
    evaluate() is the same mean over the validation split (data.split 2:1)."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(12)))
    spec = sft_job(
        1,
        str(path),
        data={"tokenizer": f"hf:{llama_dir}", "split": [2, 1]},
        training={"global_batch_size": 4, "micro_batch_size": 1, "train_iters": 1, "eval_interval": 1},
    )
    got = spawn(_masked_loss_case, 1, (spec,))[0]
    assert got["loss"] == pytest.approx(got["reference"], rel=1e-6), got
    assert got["valid_loss"] == pytest.approx(got["valid_reference"], rel=1e-6), got
    assert max(got["label_tokens"]) > 2 * min(got["label_tokens"]), got  # the data discriminates
    # At initialisation every token's loss is near ln(vocab), so a per-microbatch mean is only a
    # little off; still 100x beyond the tolerance the step's loss is held to.
    assert abs(got["per_microbatch_mean"] - got["reference"]) > 1e-4 * got["reference"], got


def test_chat_template_masks_only_assistant_turns_of_the_built_source(tmp_path, llama_dir):  # noqa: F811
    """The builder renders with the tokenizer_config.json chat template of an hf: tokenizer."""
    from engine.data.builder import build_datasets

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "Name a module.", "response": "The os module."}) + "\n")
    spec = parse_job(sft_job(1, str(path), data={"tokenizer": f"hf:{llama_dir}"}))
    tok = HFTokenizer(llama_dir)
    source = build_datasets(spec, tok, SEQ, seed=1).train
    ids, mask = source[0].tolist(), source.loss_mask(0).tolist()
    trained = tok._tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert trained == "<|start_header_id|>assistant<|end_header_id|>\n\nThe os module.<|eot_id|>"
    template, bos, eos = read_chat_template(llama_dir)
    rendered, _ = ChatRenderer(tok, template, bos, eos).render(load_conversations(path)[0])
    assert ids[: len(rendered)] == rendered


def _no_label_step(spec_dict: dict) -> dict:
    trainer = Trainer(JobSpec.model_validate(spec_dict))
    m = trainer.train_step()
    ps.destroy_model_parallel()
    return {"loss": m.loss, "grad_norm": m.grad_norm}


def test_a_global_batch_without_assistant_tokens_has_loss_zero(tmp_path):
    """Every assistant turn truncated away: loss 0 and grad norm 0, no NaN (documented in
    Trainer._loss_weight); on DP=2."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "x" * (2 * SEQ), "response": "ok"}) + "\n")
    spec = sft_job(2, str(path), training={"global_batch_size": 2, "micro_batch_size": 1, "train_iters": 1})
    got = spawn(_no_label_step, 2, (spec,))[0]
    assert got == {"loss": 0.0, "grad_norm": 0.0}


# ----------------------------------------------------------------------------- layouts

TRAINING = {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": 3}


@pytest.fixture(scope="module")
def sft_reference(chat_file):
    return run_job(sft_job(1, chat_file, training=TRAINING))


LAYOUTS = {
    "tp2": ({"tensor": 2}, {}),
    "pp2": ({"pipeline": 2}, {}),
    "dp2": ({}, {"micro_batch_size": 4}),
    "dp2-two-microbatches": ({}, {}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_loss_and_gradients_do_not_depend_on_the_layout(chat_file, sft_reference, layout):
    parallel, training = LAYOUTS[layout]
    got = run_job(sft_job(2, chat_file, parallel=parallel, training={**TRAINING, **training}))
    assert_same_training(got, sft_reference)
    diff, where = max_rel_diff(got["grads"], sft_reference["grads"])
    assert diff < 1e-5, f"gradient of {where} differs by {diff:.2e}"


# ----------------------------------------------------------------------------- packing


@pytest.fixture(scope="module")
def rows(chat_file):
    n = packed_rows(chat_file)
    assert 2 <= n < len(conversations()) // 2, n  # several conversations per row
    return n


@pytest.fixture(scope="module")
def unpacked_reference(chat_file):
    """The same conversations one per row, a global batch of all 12, on one rank (per arch)."""
    cache: dict[str, dict] = {}

    def get(arch: dict) -> dict:
        key = json.dumps(arch, sort_keys=True)
        if key not in cache:
            training = {"global_batch_size": 12, "micro_batch_size": 2, "train_iters": 3}
            cache[key] = run_job(sft_job(1, chat_file, model=arch, training=training))
        return cache[key]

    return get


@pytest.mark.parametrize(
    ("arch", "ranks", "parallel"),
    [
        ({}, 1, None),
        ({"arch": "gpt2", "num_query_groups": None}, 1, None),
        ({}, 2, {"tensor": 2, "sequence_parallel": True}),
        ({"arch": "gpt2", "num_query_groups": None}, 2, {"tensor": 2, "sequence_parallel": True}),
        ({}, 2, {"pipeline": 2}),
    ],
    ids=["llama", "gpt2-learned-positions", "llama-tp2-sp", "gpt2-tp2-sp", "llama-pp2"],
)
def test_packed_rows_train_exactly_like_one_conversation_per_row(
    chat_file, rows, unpacked_reference, arch, ranks, parallel
):
    """All rows per step (the same conversations as the unpacked run's global batch of 12):
    same losses, gradients and parameters over 3 steps."""
    training = {"global_batch_size": rows, "micro_batch_size": 1, "train_iters": 3}
    got = run_job(
        sft_job(ranks, chat_file, packing=True, model=arch, parallel=parallel or {}, training=training)
    )
    ref = unpacked_reference(arch)
    assert_same_training(got, ref)
    # The third step's gradients, after two Adam steps on float-noise-different weights: measured
    # up to 1.4e-5 (gpt2, TP=2+SP), 2e-6 elsewhere; tighter than the harness's 1e-4.
    diff, where = max_rel_diff(got["grads"], ref["grads"])
    assert diff < 3e-5, f"gradient of {where} differs by {diff:.2e}"


def test_packed_rows_hold_whole_conversations_with_masked_boundaries(chat_file):
    source = PackedSFTSource(chat_file, ByteTokenizer(), SEQ, 7)
    assert sorted(i for row in source.rows for i in row) == list(range(len(conversations())))
    for r in range(source.num_samples):
        tokens, mask, seg, pos = source[r], source.loss_mask(r), source.segment_ids(r), source.position_ids(r)
        starts = [0] + [j for j in range(1, SEQ + 1) if seg[j] != seg[j - 1]]
        for j in starts:
            assert not mask[j] and pos[j] == 0  # a label there would cross into the next sample
        assert int(seg.max()) == len(source.rows[source._row(r)])
        assert tokens.shape == (SEQ + 1,)


def test_packed_run_resumes_exactly(chat_file, rows, tmp_path):
    """4 iterations straight vs 2 + save + resume + 2, packed rows on DP=2 with a global batch
    of 2 rows (so the epochs wrap mid-run): identical losses."""
    training = {"global_batch_size": 2, "micro_batch_size": 1, "train_iters": 4}

    def spec(path):
        return sft_job(
            2, chat_file, packing=True, training=training, checkpoint={"path": str(path), "interval": 2}
        )

    straight = spawn(train_until, 2, (spec(tmp_path / "a"), 4))[0]["losses"]
    first = spawn(train_until, 2, (spec(tmp_path / "b"), 2))[0]
    second = spawn(train_until, 2, (spec(tmp_path / "b"), 4))[0]
    assert second["start"] == 2
    assert first["losses"] + second["losses"] == straight


# ----------------------------------------------------------------------------- the job spec


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ({"data": {"source": "text", "packing": True}}, r"data\.packing applies to data\.source sft only"),
        (
            {"data": {"source": "sft", "path": "c.jsonl", "packing": True}, "parallel": {"context": 2}},
            r"data\.packing is not supported with parallel\.context > 1",
        ),
        ({"data": {"source": "sft"}}, r"data\.source sft needs data\.path"),
    ],
    ids=["packing-without-sft", "packing-with-context-parallel", "sft-without-path"],
)
def test_job_spec_refuses(spec, pattern):
    spec = {**spec, "resources": {"ranks": 2}} if "parallel" in spec else spec
    with pytest.raises(JobSpecError, match=pattern):
        parse_job(spec)


def test_sft_without_packing_runs_on_context_parallel_spec():
    assert (
        parse_job(
            {
                "data": {"source": "sft", "path": "c.jsonl"},
                "parallel": {"context": 2},
                "resources": {"ranks": 2},
            }
        ).data.source
        == "sft"
    )


def test_conversations_load_from_s3(s3_bucket, chat_file):
    import boto3

    with open(chat_file, "rb") as f:
        boto3.client("s3").put_object(Bucket=s3_bucket, Key="data/chat.jsonl", Body=f.read())
    assert load_conversations(f"s3://{s3_bucket}/data/chat.jsonl") == load_conversations(chat_file)
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_conversations(f"s3://{s3_bucket}/data/missing.jsonl")
