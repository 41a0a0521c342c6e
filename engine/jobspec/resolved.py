"""A job resolved once: the validated spec and the facts derived from it, carried together.

Validation happens where a job enters (the API, `elastron train`, the workers' driver); what
travels after that is this object (or its spec's JSON, parsed once at the far side), so a rank
never re-derives a layout fact differently from the driver that sized it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.jobspec import layout
from engine.jobspec.job import JobSpec, parse_job


@dataclass(frozen=True)
class ResolvedJob:
    spec: JobSpec
    model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool  # effective: requested and tensor > 1
    num_microbatches: int  # per data-parallel rank and step, at the full global batch
    pipeline_stages: int  # pipeline x virtual pipeline

    @property
    def checkpoint_location(self) -> str | None:
        """Where this job's `iter_NNNNNNN` folders go; None when it does not checkpoint."""
        path = self.spec.checkpoint.path
        return None if path is None else layout.checkpoint_location(path, self.spec.name)

    def with_ranks(self, ranks: int) -> ResolvedJob:
        """The same job on another rank count (an elastic resize), validated again."""
        data = self.spec.model_dump(mode="json")
        data["resources"]["ranks"] = ranks
        return resolve_job(data)


def resolve_job(job: JobSpec | dict[str, Any]) -> ResolvedJob:
    """Validate (a dict; a JobSpec is validated already) and derive the layout facts."""
    spec = job if isinstance(job, JobSpec) else parse_job(job)
    p = spec.parallel
    dp = layout.data_parallel_size(spec.resources.ranks, p)
    return ResolvedJob(
        spec=spec,
        model_parallel_size=layout.model_parallel_size(p),
        data_parallel_size=dp,
        sequence_parallel=layout.sequence_parallel_effective(p),
        num_microbatches=layout.num_microbatches(spec.training, dp),
        pipeline_stages=layout.pipeline_stages(p),
    )
