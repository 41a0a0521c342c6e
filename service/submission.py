"""Turn a submitted job specification into the one the job runs with.

The body is taken as a plain JSON object (`SpecBody`, documented as `JobSpec`) and validated by
`accept_spec` in the route's worker thread, not by FastAPI on the event loop: parsing reads
`model.init_from`'s config.json (over S3 too), once, and stores its fields and digest in the
spec, so nothing after submission reads it again.

Two service-side rules on top of engine/jobspec/:
- a job without `checkpoint.path` checkpoints under `<ELASTRON_CHECKPOINT_DIR>/<tenant>`
  (default `<ELASTRON_HOME>/checkpoints/<tenant>`), recorded in the spec as run, so
  `checkpoint.interval` alone is enough over REST;
- `checkpoint.resume_from: job:ID` (or `job:ID/iter_0000100`) starts from another job's
  checkpoint: the reference is resolved to where that job wrote them, only among the jobs the
  caller may see.
Where a job writes: the workers namespace every job by its id and the engine adds the job's
name, `<checkpoint.path>/<job id>/<name>/`, both composed by engine/jobspec/layout.py.
The result is validated again with the same rules as the submission.
Storage confinement (service/storage_policy.py) runs in accept_spec before anything is parsed
or read.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any

from pydantic_core import core_schema
from sqlalchemy.orm import Session

from engine.jobspec import JobSpec, JobSpecError, derive_job, parse_job
from engine.jobspec.layout import ITERATION_FOLDER, checkpoint_location, job_checkpoint_path, join_location
from engine.jobspec.storage_roots import StorageRoots
from service.settings import Settings
from service.storage_policy import body_problems
from service.store.jobs import get_job
from service.store.tokens import Principal

_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+|\[\d+\])*)")


class SpecProblem(ValueError):
    """A job specification the service cannot accept: (field path, message naming the fix)."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("\n".join(m for _, m in problems))
        self.problems = problems


def problems_from_text(text: str) -> list[tuple[str, str]]:
    """Split a JobSpecError's lines into (field, message); the field is where the line starts."""
    out = []
    for line in text.splitlines():
        match = _FIELD.match(line)
        out.append((match.group(1) if match and "." in match.group(1) else "", line))
    return out


class _DocumentedAsJobSpec:
    """OpenAPI shows the body as `JobSpec` (a $ref, as when FastAPI validated it) although the
    route receives the plain object and validates it itself."""

    @classmethod
    def __get_pydantic_json_schema__(cls, _schema, handler):
        spec = JobSpec.__pydantic_core_schema__
        return handler(
            core_schema.definitions_schema(core_schema.definition_reference_schema(spec["ref"]), [spec])
        )


SpecBody = Annotated[dict[str, Any], _DocumentedAsJobSpec]


def accept_spec(body: dict[str, Any], roots: StorageRoots | None = None) -> JobSpec:
    """A submitted job specification, validated, with `model.init_from`'s config.json read into
    it (blocking I/O: call this off the event loop). A `model.hf_config_digest` the client sent
    is dropped: the API reads the folder itself rather than trust a digest it did not compute.

    Every path, bucket and endpoint the body names is checked against `roots` (the caller's,
    service/storage_policy.py; None: an admin, unconfined) FIRST, before anything is read."""
    confinement = body_problems(body, roots)
    if confinement:
        raise SpecProblem(confinement)
    model = body.get("model")
    if isinstance(model, dict) and "hf_config_digest" in model:
        body = {**body, "model": {k: v for k, v in model.items() if k != "hf_config_digest"}}
    try:
        return parse_job(body)
    except JobSpecError as err:
        raise SpecProblem(problems_from_text(str(err))) from None


def request_hash(spec: JobSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def effective_spec(
    spec: JobSpec, *, job_id: str, caller: Principal, settings: Settings, session: Session
) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {}
    resume_from = spec.checkpoint.resume_from or ""
    if resume_from.startswith("job:"):
        checkpoint["resume_from"] = _resolve_job_checkpoint(resume_from, caller, session)
    if spec.checkpoint.path is None:
        checkpoint["path"] = join_location(settings.resolved_checkpoint_dir, caller.tenant)
    try:
        return derive_job(spec, checkpoint=checkpoint).model_dump(mode="json")
    except JobSpecError as err:
        raise SpecProblem(problems_from_text(str(err))) from None


def _resolve_job_checkpoint(ref: str, caller: Principal, session: Session) -> str:
    field = "checkpoint.resume_from"
    source_id, _, sub = ref.removeprefix("job:").partition("/")
    source = get_job(session, source_id) if source_id else None
    if source is None or not caller.can_see(source.tenant):
        raise SpecProblem(
            [(field, f"{field}: no job {source_id!r} to resume from (job:ID names one of your jobs)")]
        )
    root = (source.spec.get("checkpoint") or {}).get("path")
    if not root:
        raise SpecProblem(
            [(field, f"{field}: job {source_id} has no checkpoint.path, so it saved no checkpoints")]
        )
    if sub and not ITERATION_FOLDER.match(sub):
        raise SpecProblem(
            [
                (
                    field,
                    f"{field}: {sub!r} is not a checkpoint folder: use job:{source_id} (newest) "
                    f"or job:{source_id}/iter_NNNNNNN",
                )
            ]
        )
    location = checkpoint_location(job_checkpoint_path(root, source.id), source.spec["name"])
    return f"{location}/{sub}" if sub else location
