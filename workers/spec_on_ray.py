"""The job spec as the ranks on Ray get it, and where the driver reads it from.

The ranks run in Ray's worker processes: on other nodes, in another working directory, possibly
long after the driver that launched them was restarted. So before a job's first attempt its spec
is made to mean the same thing there: local paths made absolute, and checkpoints namespaced by
the job id (`<checkpoint.path>/<job_id>/`), so that two jobs of the same name never resume each
other's checkpoints and a restarted driver of this job finds its own. The driver
(workers/driver.py) does this once per job; a spec that cannot be launched as given is a
`JobInputError` (exit 2).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from engine.jobspec import JobSpec, contract, derive_job, parse_job_text
from engine.jobspec.layout import job_checkpoint_path, join_location

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SPEC_ENV = contract.ENV_JOB_SPEC


class JobInputError(ValueError):
    """The job cannot be launched as given (exit 2)."""


def _absolute(path: str) -> str:
    if "://" in path and not path.startswith("file://"):
        return path
    if path.startswith("file://"):
        return "file://" + str(Path(path[len("file://") :]).expanduser().resolve())
    return str(Path(path).expanduser().resolve())


def prepare_spec(job_id: str, spec: JobSpec, storage_path: str | None = None) -> dict[str, Any]:
    """The spec the ranks get: local paths made absolute (Ray workers do not share the driver's
    working directory) and checkpoints namespaced by job id: `<checkpoint.path>/<job_id>/`
    (default `<storage_path>/<job_id>/checkpoints`), so two jobs with the same name never
    resume each other's checkpoints and a restarted driver of this job finds them."""
    if not JOB_ID.match(job_id):
        raise JobInputError(
            f"job id {job_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    c, d = spec.checkpoint, spec.data
    root = c.path or join_location(storage_path or default_storage_path(), f"{job_id}/checkpoints")
    checkpoint: dict[str, Any] = {"path": job_checkpoint_path(_absolute(root), job_id) if c.path else _absolute(root)}
    if c.resume_from:
        checkpoint["resume_from"] = _absolute(c.resume_from)
    data: dict[str, Any] = {key: _absolute(getattr(d, key)) for key in ("path", "cache_dir") if getattr(d, key)}
    if d.blend:
        data["blend"] = [[w, _absolute(prefix)] for w, prefix in d.blend]
    kind, sep, where = (d.tokenizer or "").partition(":")
    if sep and kind in ("hf", "sentencepiece"):
        data["tokenizer"] = f"{kind}:{_absolute(where)}"
    return derive_job(spec, checkpoint=checkpoint, data=data).model_dump(mode="json")


def default_storage_path() -> str:
    return os.environ.get("ELASTRON_RAY_STORAGE") or str(Path("~/ray_results").expanduser())


def load_spec(spec_file: str | Path | None) -> JobSpec:
    """From --spec FILE (YAML or JSON), else from $ELASTRON_JOB_SPEC (the spec as JSON)."""
    from engine.jobspec import load_job

    if spec_file is not None:
        return load_job(spec_file)
    text = os.environ.get(SPEC_ENV)
    if not text:
        raise JobInputError(f"no job spec: pass --spec FILE or set {SPEC_ENV} to the spec as JSON")
    return parse_job_text(text, SPEC_ENV, "json")
