"""`elastron eval` (engine/harness/): lm-eval's tasks on our checkpoints, on any layout, no export.

One tiny Llama and one tiny GPT-2 (random weights, a 300-token BPE vocabulary) are imported and
trained two steps on DP=2 with ZeRO-1, saving a checkpoint. Their scores on the three shipped
tasks (multiple choice, rolling perplexity, greedy generation) from our backend equal lm-eval's
own Hugging Face backend on the exported model, document by document: every loglikelihood
within 1e-4, every is_greedy flag and every generation identical, so every metric is too. The
Llama's scores are the same on one rank, TP=2 with sequence parallelism and PP=2, all from the
one checkpoint the DP=2 run saved. Bad input ends with exit 2 and a line naming it.
"""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from elastron.cli import app
from engine.harness.checkpoint_eval import (
    EvalError,
    Layout,
    eval_job,
    evaluate_checkpoint,
    per_sample,
    saved_job,
)
from engine.harness.tasks import TaskError, resolve_tasks
from engine.hf.exporter import export_hf
from engine.launcher import spawn
from tests.engine import hf_harness as h

SEQ = 64
TASKS = ["elastron_mc", "elastron_ppl", "elastron_gen"]
LOGLIKELIHOOD_ATOL = 1e-4
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(h.TINY_LLAMA, max_position_embeddings=SEQ)),
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0),
    ),
}


def _save(family: str, root) -> tuple[str, object]:
    """(checkpoint, exported HF folder) of a family's model after two DP=2 ZeRO-1 steps."""
    config_cls, model_cls, fields = FAMILIES[family]
    folder = root / "hf-in"
    folder.mkdir()
    h.save_tiny(folder, config_cls, model_cls, **fields)
    h.write_tokenizer(folder, 300)
    spec = h.job(
        folder,
        2,
        model={"seq_length": SEQ},
        data={"tokenizer": f"hf:{folder}"},
        parallel={"data_parallel_sharding": "optim"},
        checkpoint={"path": str(root / "ckpt")},
        training={"train_iters": 2},
    )
    spawn(h.train_then_logits, 2, (spec, 300), timeout_s=240)
    checkpoint = str(root / "ckpt" / "hf")
    export_hf(checkpoint, str(root / "hf-out"), dtype="fp32")
    return checkpoint, root / "hf-out"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _save("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return _save("gpt2", tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def tasks():
    return resolve_tasks(TASKS)


def _hf_backend(folder, tasks) -> dict:
    """lm-eval's own Hugging Face backend on the exported model: results and per-document answers."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), backend="causal", batch_size=4, device="cpu", dtype="float32")
    out = simple_evaluate(
        model=lm, tasks=tasks.specs, task_manager=tasks.task_manager(), bootstrap_iters=1000, log_samples=True
    )
    return {"results": out["results"], "samples": per_sample(out["samples"])}


def _same(ours, theirs, where: str) -> None:
    """Answers equal: floats (loglikelihoods) within LOGLIKELIHOOD_ATOL, everything else exactly."""
    if isinstance(theirs, float) and not isinstance(theirs, bool):
        assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_ATOL), where
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def _same_scores(ours: dict, theirs: dict) -> None:
    assert sorted(ours["samples"]) == sorted(TASKS)
    for task in TASKS:
        a = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and a, task
        for x, y in zip(a, b, strict=True):
            assert x["arguments"] == y["arguments"], (task, x["doc_id"])  # the same requests
            _same(x["resps"], y["resps"], f"{task} doc {x['doc_id']}")
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "_stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-6), (task, metric)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scores_equal_lm_evals_hugging_face_backend(family, tasks, request):
    checkpoint, exported = request.getfixturevalue(family)
    ours = evaluate_checkpoint(checkpoint, tasks, Layout(ranks=1), samples=True)
    theirs = _hf_backend(exported, tasks)
    assert ours["iteration"] == 2
    _same_scores(ours, theirs)
    generations = [s["resps"][0][0] for s in ours["samples"]["elastron_gen"]]
    assert any(generations), "every generation empty: the comparison would prove nothing"
    greedy = [r[0][1] for s in ours["samples"]["elastron_mc"] for r in s["resps"]]
    assert len(greedy) == 48 and isinstance(greedy[0], bool)


@pytest.mark.parametrize(
    "layout",
    [Layout(ranks=2, tensor=2, sequence_parallel=True), Layout(ranks=2, pipeline=2)],
    ids=["tp2-sp", "pp2"],
)
def test_the_same_scores_on_another_layout_than_the_one_that_saved(llama, tasks, layout):
    checkpoint, _ = llama
    one = evaluate_checkpoint(checkpoint, tasks, Layout(ranks=1), samples=True)
    other = evaluate_checkpoint(checkpoint, tasks, layout, samples=True)
    _same_scores(other, one)


def test_the_command_writes_results_and_data_parallel_ranks_split_the_rows(llama, tmp_path):
    checkpoint, _ = llama
    out = tmp_path / "scores.json"
    result = CliRunner().invoke(
        app, ["eval", checkpoint, "--tasks", "elastron_mc,elastron_ppl", "--ranks", "2", "--device", "cpu", "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "elastron_mc  acc  " in result.output and "evaluated iteration 2" in result.output
    written = json.loads(out.read_text())
    assert written["layout"] == {"ranks": 2, "tensor": 1, "pipeline": 1, "sequence_parallel": False}
    one = evaluate_checkpoint(checkpoint, resolve_tasks(["elastron_mc", "elastron_ppl"]), Layout(ranks=1))
    for task in ("elastron_mc", "elastron_ppl"):
        for metric, value in one["results"][task].items():
            if isinstance(value, float) and "_stderr" not in metric:
                assert written["results"][task][metric] == pytest.approx(value, rel=1e-6), (task, metric)


def test_bad_input_is_refused_naming_it(llama, tmp_path):
    checkpoint, _ = llama
    runner = CliRunner()

    def refused(*args: str) -> str:
        result = runner.invoke(app, ["eval", *args, "--device", "cpu"])
        assert result.exit_code == 2, result.output
        return result.output

    assert "unknown task 'elastron_mcq'" in refused(checkpoint, "--tasks", "elastron_mcq")
    assert "no committed checkpoint" in refused(str(tmp_path / "nothing"), "--tasks", "elastron_mc")
    assert "not a multiple of --tensor" in refused(checkpoint, "--tasks", "elastron_mc", "--ranks", "3", "--tensor", "2")
    # A registry task whose rows live on the Hub: refused before any rank starts.
    with pytest.raises(TaskError, match="'hellaswag' reads dataset 'Rowan/hellaswag' from the Hugging Face Hub"):
        resolve_tasks(["hellaswag"])
    # A user's task over a file that is not there, and one over files that are.
    mine = tmp_path / "tasks"
    mine.mkdir()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "a small document"}) + "\n")
    task = {
        "dataset_path": "json",
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}],
    }
    (mine / "gone.yaml").write_text(json.dumps({**task, "task": "gone", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "gone.jsonl")}}}))
    (mine / "here.yaml").write_text(json.dumps({**task, "task": "here", "dataset_kwargs": {"data_files": {"test": str(rows)}}}))
    with pytest.raises(TaskError, match="'gone': data file .*gone.jsonl does not exist"):
        resolve_tasks(["gone"], [str(mine)])
    resolved = resolve_tasks(["here", "elastron_mc"], [str(mine)])
    assert resolved.specs[0] == "here" and not resolved.registry  # found without the registry's index
    # A checkpoint of a model lm-eval's requests do not fit.
    _, job = saved_job(checkpoint)
    with pytest.raises(EvalError, match="model.arch 'bert' is not a decoder-only language model"):
        eval_job({**job, "model": {**job["model"], "arch": "bert"}}, checkpoint, Layout(), device="cpu")


def _greedy_with_and_without_cache(job: dict, rows: list[list[int]], budget: int) -> tuple[list, list]:
    """On every rank: the same rows decoded greedily from the KV cache and by re-reading them."""
    from engine import parallel_state as ps
    from engine.harness.forward import LayoutForward
    from engine.jobspec import parse_job
    from engine.training import Trainer

    forward = LayoutForward(Trainer(parse_job(job)), rows_per_pass=2)
    never = lambda i, made: False  # noqa: E731 - every row runs its whole budget
    try:
        return forward.greedy(rows, [budget] * len(rows), never), forward.greedy(rows, [budget] * len(rows), never, kv_cache=False)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(
    "family,layout",
    [("llama", Layout()), ("llama", Layout(ranks=2, tensor=2, sequence_parallel=True)), ("gpt2", Layout(ranks=2, tensor=2))],
    ids=["llama-1", "llama-tp2-sp", "gpt2-tp2"],
)
def test_decoding_from_the_kv_cache_equals_rereading_every_row(family, layout, request):
    """Rows of different lengths, three per pass of two (a pass with one row too), 40 tokens each:
    the cache's tokens are the re-read ones (RoPE and learned positions per row, TP-sharded
    cache, sequence parallelism's decode windows)."""
    checkpoint, _ = request.getfixturevalue(family)
    _, saved = saved_job(checkpoint)
    job = eval_job(saved, checkpoint, layout, device="cpu")
    rows = [[5, 17, 42], list(range(10, 30)), [7]]
    cached, reread = spawn(_greedy_with_and_without_cache, layout.ranks, (job, rows, 40), timeout_s=240)[0]
    assert cached == reread
    assert [len(m) for m in cached] == [40, 40, 40] and len({tuple(m) for m in cached}) == 3


def test_the_tasks_the_service_offers_are_the_shipped_ones():
    from engine.harness.tasks import shipped_tasks
    from engine.jobspec.evaluation import SHIPPED_TASKS

    assert sorted(shipped_tasks()) == list(SHIPPED_TASKS)


def test_the_scores_go_to_the_training_runs_loggers_at_the_checkpoints_iteration(llama, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    checkpoint, _ = llama
    monkeypatch.setenv("ELASTRON_TENSORBOARD_DIR", str(tmp_path))
    got = evaluate_checkpoint(checkpoint, resolve_tasks(["elastron_mc"]), loggers=["tensorboard"], run_name="the-run")
    acc = EventAccumulator(str(tmp_path / "the-run" / "tensorboard"))
    acc.Reload()
    (point,) = acc.Scalars("eval/elastron_mc/acc")
    assert point.step == got["iteration"] == 2
    assert point.value == pytest.approx(got["results"]["elastron_mc"]["acc,none"], rel=1e-6)
    assert "eval/elastron_mc/acc_norm" in acc.Tags()["scalars"]
    assert not any("stderr" in t for t in acc.Tags()["scalars"])
