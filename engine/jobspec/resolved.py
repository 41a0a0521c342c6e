"""A job resolved once: the validated spec and the facts derived from it, carried together.

Validation happens where a job enters (the API, `elastron train`, the workers' driver); what
travels after that is this object (or its spec's JSON, parsed once at the far side), so a rank
never re-derives a layout fact differently from the driver that sized it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.jobspec import layout
from engine.jobspec.job import JobSpec, derive_job, parse_job

# The least a rank's setup (imports, model build, checkpoint resume, process-group and replica
# joins, before its first step) may take before the watchdog calls it hung, whatever the step
# timeout: a cold start on a busy node takes minutes where a step takes seconds.
SETUP_TIMEOUT_FLOOR_S = 600.0
# The most a replica-quorum round waits for its peers before it goes on with those it has.
QUORUM_TIMEOUT_CAP_S = 60.0


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

    @property
    def setup_timeout_s(self) -> float:
        """Seconds a rank's setup may take before its watchdog calls it hung (and how long a
        replica waits for its peers' first quorum): the step timeout, never under
        SETUP_TIMEOUT_FLOOR_S."""
        return max(self.spec.resilience.step_timeout_s, SETUP_TIMEOUT_FLOOR_S)

    @property
    def process_group_timeout_s(self) -> int:
        """The process group's own collective timeout: the backstop behind the step watchdog
        (a collective that outlives the step timeout is a hang the watchdog reports first), so
        never shorter than the setup or two steps."""
        return int(max(self.setup_timeout_s, 2 * self.spec.resilience.step_timeout_s))

    @property
    def quorum_timeout_s(self) -> float:
        """replace_replica: how long one quorum round waits for the other replicas."""
        return min(QUORUM_TIMEOUT_CAP_S, self.spec.resilience.step_timeout_s)

    @property
    def warm_restart(self) -> bool:
        """resilience.warm_restart as it applies: unset, it follows checkpoint.local_interval
        (a job that asked for fast in-memory recovery also gets processes started ahead) and
        resilience.resize: live (a grow's new replica group starts in them: 1.2 s instead of
        9 s from the request to stepping on this 2-core machine, tests/workers/test_ray_live_resize.py)."""
        chosen = self.spec.resilience.warm_restart
        if chosen is not None:
            return chosen
        return bool(self.spec.checkpoint.local_interval) or self.spec.live_resize

    def with_ranks(self, ranks: int) -> ResolvedJob:
        """The same job on another rank count (an elastic resize), validated again."""
        return resolve_job(derive_job(self.spec, resources={"ranks": ranks}))


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
