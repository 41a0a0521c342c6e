"""`scheduling`: where a job stands in the queue of a shared cluster (the service decides who runs:
service/scheduling/).
"""

from __future__ import annotations

from pydantic import Field

from engine.jobspec.common import _Section

PRIORITY_MAX = 1000


class SchedulingSpec(_Section):
    priority: int = Field(
        0,
        ge=-PRIORITY_MAX,
        le=PRIORITY_MAX,
        strict=True,
        description="Higher runs first and may preempt lower-priority jobs when the cluster is full; a job "
        "gains one level per hour it waits, so none waits forever. Over REST, above the service's ceiling "
        "(ELASTRON_MAX_PRIORITY, default 100) only for admins and tenants whose quota allows it.",
    )
    preemptible: bool = Field(
        True,
        strict=True,
        description="false: never stopped or shrunk for another job (admins, or tenants an admin allows). "
        "A job that saves no checkpoints it resumes from (no checkpoint.interval, or checkpoint.resume: "
        "never) is never preempted either: it would lose its work.",
    )
