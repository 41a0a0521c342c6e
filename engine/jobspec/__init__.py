"""The job specification: the one contract shared by the CLI, the REST API and the workers.

It is pure pydantic (no torch, and nothing else of the engine) so the control plane can
validate a job on a machine without torch. Every rule that can be checked before a single
process starts is checked here, and each error names the field and says how to fix it; anything
a running engine would trip over later (heads that do not split over tensor ranks, a batch that
does not divide) belongs here, not in the engine.

One module per section (model, parallel, data, training and optimizer, checkpoint, resilience,
resources, scheduling), the rules spanning sections and the parsing in `job.py`, the facts
derived from a layout in `layout.py`, what a job asks of a cluster (its sizes and per-rank
resources) in `demand.py`, a job resolved once in `resolved.py`, and the service <-> workers
wire names in `contract.py`. Hugging Face models: the registry of families (`hf_families.py`),
config.json <-> `model` fields (`hf_fields.py`, `hf_export_config.py`) and the one step that
reads config.json (`hf_config.resolve_hf_config`, run by `parse_job`; validation itself reads
nothing). Import from here: `from engine.jobspec import JobSpec, parse_job`.
"""

from engine.jobspec.checkpoint import CheckpointSpec
from engine.jobspec.data import DataSpec, parse_tokenizer_spec
from engine.jobspec.hf_config import resolve_hf_config
from engine.jobspec.job import (
    JobSpec,
    JobSpecError,
    check_local_run,
    derive_job,
    format_validation_error,
    json_schema,
    load_job,
    parse_job,
    parse_job_text,
)
from engine.jobspec.model import ModelSpec, MoESpec
from engine.jobspec.parallel import ParallelSpec
from engine.jobspec.resilience import ResilienceSpec
from engine.jobspec.resolved import ResolvedJob, resolve_job
from engine.jobspec.resources import ResourcesSpec
from engine.jobspec.scheduling import SchedulingSpec
from engine.jobspec.training import OptimizerSpec, TrainingSpec

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "JobSpec",
    "JobSpecError",
    "ModelSpec",
    "MoESpec",
    "OptimizerSpec",
    "ParallelSpec",
    "ResilienceSpec",
    "ResolvedJob",
    "ResourcesSpec",
    "SchedulingSpec",
    "TrainingSpec",
    "check_local_run",
    "derive_job",
    "format_validation_error",
    "json_schema",
    "load_job",
    "parse_job",
    "parse_job_text",
    "parse_tokenizer_spec",
    "resolve_hf_config",
    "resolve_job",
]
