"""Checkpoint evaluations: the command that runs, and the scores read back from its log.

The evaluation itself is `elastron eval` (engine/cli.py, engine/harness/), run as its own
launcher submission (a Ray job) by the reconciler, as an export is: it loads the whole model
and runs for minutes, so never in a request. What it reads is what an export reads (the
checkpoint folder the job's spec as run writes, service/exports.py), the tasks are the shipped
ones only (service/schemas_evals.py), and it writes nothing: its scores come back as the last
`eval-result {JSON}` line of its log, parsed as JSON (data, never code) and cut to numbers.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from engine.jobspec.evaluation import metric_scores
from service.settings import Settings

RESULT_PREFIX = "eval-result "
MAX_RESULT_CHARS = 256 * 1024  # a few tasks' metrics are a few KB: more is not a result of ours


def eval_command(
    settings: Settings, *, source: str, tasks: list[str], options: dict[str, Any], endpoint_url: str | None, run: str
) -> list[str]:
    """`elastron eval --tasks T --ranks R --tensor T --pipeline P [--limit L] [--num-fewshot K]
    --run JOB_ID --print-json [--endpoint-url U] -- CHECKPOINT` (the checkpoint after `--`: no name
    is an option; `--run`: the job's training.loggers get the scores under its run)."""
    argv = [*shlex.split(settings.eval_entrypoint), "--tasks", ",".join(tasks)]
    for name in ("ranks", "tensor", "pipeline"):
        argv += [f"--{name}", str(int(options.get(name, 1)))]
    if options.get("limit") is not None:
        argv += ["--limit", str(int(options["limit"]))]
    if options.get("num_fewshot") is not None:
        argv += ["--num-fewshot", str(int(options["num_fewshot"]))]
    argv += ["--run", run, "--print-json"]
    if endpoint_url:
        argv += ["--endpoint-url", endpoint_url]
    return [*argv, "--", source]


def scores_from_log(text: str) -> dict[str, dict[str, float]] | None:
    """{task: {metric: value}} from the last `eval-result` line of a log (lm-eval's
    "metric,filter" keys cut to the metric; stderr and non-numbers dropped); None without one."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(RESULT_PREFIX)]
    if not lines or len(lines[-1]) > MAX_RESULT_CHARS:
        return None
    try:
        result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    except ValueError:
        return None
    tasks = result.get("results") if isinstance(result, dict) else None
    return metric_scores(tasks) if isinstance(tasks, dict) else None
