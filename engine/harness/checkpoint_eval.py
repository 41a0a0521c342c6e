"""`elastron eval CHECKPOINT --tasks ...`: lm-eval's tasks on a committed checkpoint, no export.

The checkpoint's manifest carries the job spec that saved it; the evaluation is that job with
another layout (`--ranks`, `--tensor`, `--pipeline`, `--sequence-parallel`; the rest of the ranks
are data-parallel replicas), `checkpoint.resume_from` pointing at it, and nothing to train: so
the Trainer builds the model and loads the weights through the resume every job uses, resharding
from whatever layout saved them (engine/checkpointing). Data-side settings that only training
reads are dropped (the data source becomes synthetic: its tokenizer stays). Every rank runs
lm-eval on the same requests with our backend (backend.py); rank 0's results are the answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import read_manifest, resolve_checkpoint
from engine.harness.tasks import ResolvedTasks
from engine.jobspec.evaluation import metric_scores
from engine.jobspec.layout import split_checkpoint_uri

DECODERS = ("gpt2", "llama")  # families lm-eval's causal-LM requests fit (bert and t5 do not)
# The ranks' environment: no hub (a miss fails at once instead of timing out).
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message names the input and the fix."""


@dataclass(frozen=True)
class Layout:
    """How the evaluation's ranks split the model (data-parallel replicas take the rest)."""

    ranks: int = 1
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False

    def parallel(self) -> dict[str, Any]:
        if self.ranks % (self.tensor * self.pipeline):
            raise EvalError(f"--ranks {self.ranks} is not a multiple of --tensor x --pipeline = {self.tensor * self.pipeline}")
        return {"tensor": self.tensor, "pipeline": self.pipeline, "sequence_parallel": self.sequence_parallel}

    @property
    def data_parallel(self) -> int:
        return self.ranks // (self.tensor * self.pipeline)


@dataclass(frozen=True)
class EvalRun:
    """Everything a rank needs (picklable: it travels to every rank)."""

    job: dict[str, Any]
    tasks: ResolvedTasks
    limit: int | float | None = None
    num_fewshot: int | None = None
    rows_per_pass: int = 8
    max_gen_toks: int = 256
    seed: int = 1234
    samples: bool = False
    # training.loggers of the job that saved the checkpoint, its spec and run name: rank 0 logs the
    # scores there as eval/<task>/<metric> at the checkpoint's iteration, beside its curves.
    loggers: tuple[str, ...] = ()
    log_spec: dict[str, Any] | None = None
    run_name: str | None = None


def saved_job(checkpoint: str, *, endpoint_url: str | None = None, region: str | None = None) -> tuple[int, dict]:
    """(iteration, the job spec that saved it) of a committed checkpoint: a job's checkpoint root
    (its newest) or one iter_NNNNNNN folder. Reads the manifest only."""
    root_uri, key = split_checkpoint_uri(checkpoint)
    storage = open_storage(root_uri, endpoint_url=endpoint_url, region=region)
    try:
        found = resolve_checkpoint(storage, key)
    except ValueError as err:
        raise EvalError(f"CHECKPOINT {checkpoint}: {err}") from None
    if found is None:
        raise EvalError(f"CHECKPOINT {checkpoint}: no committed checkpoint there")
    job_root, iteration = found
    job = read_manifest(storage, job_root, iteration).get("meta", {}).get("job")
    if not isinstance(job, dict):
        raise EvalError(f"CHECKPOINT {checkpoint} carries no job record (saved by an older elastron): cannot tell its model")
    return iteration, job


def eval_job(saved: dict, checkpoint: str, layout: Layout, *, device: str, endpoint_url=None, region=None) -> dict:
    """The job spec of an evaluation of `checkpoint` (saved by job `saved`) on `layout`."""
    arch = saved.get("model", {}).get("arch", "llama")
    if arch not in DECODERS:
        raise EvalError(
            f"CHECKPOINT {checkpoint}: model.arch {arch!r} is not a decoder-only language model; "
            f"lm-eval's requests need one of {', '.join(DECODERS)}"
        )
    job = json.loads(json.dumps(saved))
    training = job.get("training", {})
    job.update(
        name=f"{saved.get('name', 'job')}-eval"[:63],
        parallel=layout.parallel(),
        data={"source": "synthetic", "tokenizer": saved.get("data", {}).get("tokenizer", "byte")},
        training={
            "global_batch_size": layout.data_parallel,
            "micro_batch_size": 1,
            "train_iters": training.get("train_iters", 1),
            "seed": training.get("seed", 1234),
            "precision": training.get("precision", "fp32"),
        },
        checkpoint={"resume_from": checkpoint, "endpoint_url": endpoint_url, "region": region},
        resilience={},
        resources={"ranks": layout.ranks, "device": device},
    )
    job.pop("scheduling", None)
    return job


def eval_rank(run: EvalRun) -> dict | None:
    """One rank: the Trainer resumes the checkpoint on this layout, lm-eval runs the tasks on our
    backend; rank 0 returns lm-eval's results, the others None."""
    import torch.distributed as dist
    from lm_eval import simple_evaluate

    from engine import parallel_state as ps
    from engine.data.tokenizer import build_tokenizer
    from engine.harness.backend import ElastronLM
    from engine.harness.forward import LayoutForward
    from engine.jobspec import parse_job
    from engine.training import Trainer

    spec = parse_job(run.job)
    trainer = Trainer(spec)
    try:
        forward = LayoutForward(trainer, rows_per_pass=run.rows_per_pass)
        lm = ElastronLM(forward, build_tokenizer(spec.data.tokenizer), max_gen_toks=run.max_gen_toks)
        start = time.perf_counter()
        # lm-eval's progress bars and task warnings: rank 0's (every rank runs the same).
        quiet = contextlib.redirect_stderr(open(os.devnull, "w")) if dist.get_rank() else contextlib.nullcontext()  # noqa: SIM115
        with quiet:
            out = simple_evaluate(
                model=lm,
                tasks=run.tasks.specs,
                task_manager=run.tasks.task_manager(),
                num_fewshot=run.num_fewshot,
                limit=run.limit,
                bootstrap_iters=1000,
                log_samples=run.samples,
                random_seed=run.seed,
                numpy_random_seed=run.seed,
                torch_random_seed=run.seed,
                fewshot_random_seed=run.seed,
            )
        seconds = time.perf_counter() - start
        tokens = [0] * dist.get_world_size()  # each replica's count, once (its rank 0 in TP x PP)
        dist.all_gather_object(tokens, forward.tokens_read if ps.get_rank_in("mp") == 0 else 0)
        if dist.get_rank() != 0:
            return None
        if run.loggers:
            log_scores(run, trainer.iteration, out["results"])
        answer = {
            "iteration": trainer.iteration,
            "results": out["results"],
            "n-samples": out.get("n-samples", {}),
            "seconds": seconds,
            "tokens": sum(tokens),
        }
        if run.samples:
            answer["samples"] = per_sample(out["samples"])
        return answer
    finally:
        ps.destroy_model_parallel()


def score_tags(results: dict) -> dict[str, float]:
    """lm-eval's results as `eval/<task>/<metric>` scalars (engine/jobspec/evaluation.py metric_scores)."""
    return {f"eval/{task}/{metric}": value for task, metrics in metric_scores(results).items() for metric, value in metrics.items()}


def log_scores(run: EvalRun, iteration: int, results: dict) -> None:
    from engine.loggers import Loggers

    loggers = Loggers(run.log_spec or run.job, list(run.loggers), run.run_name or run.job["name"])
    try:
        loggers.log_values(iteration, score_tags(results))
    finally:
        loggers.close()


def per_sample(samples: dict) -> dict[str, list[dict]]:
    """lm-eval's logged samples cut to what tells two backends apart: each document's requests
    and the model's answers to them (before and after the task's filters)."""
    keep = ("doc_id", "arguments", "resps", "filtered_resps")
    return {task: [{k: s[k] for k in keep if k in s} for s in rows] for task, rows in samples.items()}


def evaluate_checkpoint(
    checkpoint: str,
    tasks: ResolvedTasks,
    layout: Layout = Layout(),
    *,
    device: str = "cpu",
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    rows_per_pass: int = 8,
    max_gen_toks: int = 256,
    endpoint_url: str | None = None,
    region: str | None = None,
    timeout_s: float = 3600.0,
    samples: bool = False,
    loggers: list[str] | None = None,
    run_name: str | None = None,
) -> dict:
    """lm-eval's results of `tasks` on `checkpoint`, evaluated on `layout` by local processes:
    {"checkpoint", "iteration", "layout", "results": {task: {metric: value}}, "n-samples",
    "seconds" (lm-eval's run, loading excluded), "tokens" (fed to the model, padding not)}, and
    with `samples` each document's requests and answers ("samples": per_sample). The scores go
    to `loggers` (default: the saving job's training.loggers) as that job's run `run_name`
    (default: its name; the service passes the job id its training logged under)."""
    from engine.device import resolve_device_type
    from engine.launcher import spawn
    from engine.loggers import require as require_loggers

    iteration, saved = saved_job(checkpoint, endpoint_url=endpoint_url, region=region)
    job = eval_job(saved, checkpoint, layout, device=device, endpoint_url=endpoint_url, region=region)
    names = tuple(loggers if loggers is not None else (saved.get("training") or {}).get("loggers") or ())
    try:
        require_loggers(list(names))  # before any rank starts, not after the evaluation
    except RuntimeError as err:
        raise EvalError(str(err)) from None
    run = EvalRun(
        job, tasks, limit, num_fewshot, rows_per_pass, max_gen_toks,
        samples=samples, loggers=names, log_spec=saved, run_name=run_name or saved.get("name"),
    )  # fmt: skip
    passed = ("AWS_", "HF_HOME", "ELASTRON_", "MLFLOW_", "WANDB_")  # storage, caches, roots, loggers
    env = {**OFFLINE, **{k: v for k, v in os.environ.items() if k.startswith(passed)}}
    answer = spawn(eval_rank, layout.ranks, (run,), device_type=resolve_device_type(device), timeout_s=timeout_s, env=env)[0]
    if answer["iteration"] != iteration:  # the resume loaded another checkpoint than the one asked
        raise RuntimeError(f"evaluated iteration {answer['iteration']}, asked for {iteration} ({checkpoint})")
    return {
        "checkpoint": checkpoint,
        "iteration": iteration,
        "layout": {"ranks": layout.ranks, **layout.parallel()},
        "results": answer["results"],
        "n-samples": answer["n-samples"],
        "seconds": answer["seconds"],
        "tokens": answer["tokens"],
        **({"samples": answer["samples"]} if samples else {}),
    }
