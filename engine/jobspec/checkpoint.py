"""`checkpoint`: where and how often a job saves, and what it resumes from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.jobspec.common import PositiveInt, _Section


class CheckpointSpec(_Section):
    path: str | None = Field(
        None,
        description="Checkpoint root: a local path, file://path or s3://bucket/prefix. Jobs write <root>/<name>/.",
    )
    interval: PositiveInt | None = Field(
        None, description="Save every N iterations (and at the end of training)."
    )
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: continue from the newest committed checkpoint under path, if any."
    )
    resume_from: str | None = Field(
        None,
        description="Load another job's checkpoint instead: its root (newest) or one iter_NNNNNNN folder.",
    )
    keep: PositiveInt = Field(
        3, description="Committed checkpoints kept; older ones are deleted after a newer commits."
    )
    async_save: bool = Field(False, description="Write shards in the background while training continues.")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint (default: the boto3 chain, e.g. AWS_ENDPOINT_URL)."
    )
    region: str | None = Field(None, description="S3 region (default: the boto3 chain).")
    local_interval: PositiveInt | None = Field(
        None,
        description=(
            "In-memory checkpoints: every N iterations each rank's state goes to host memory that "
            "outlives its process (on Ray: a per-node holder), and a restart of the same layout resumes "
            "from the newest one every rank still has. Off by default; persistent checkpoints keep `interval`."
        ),
    )
    local_replicas: int = Field(
        1,
        ge=0,
        le=8,
        strict=True,
        description="Copies of each in-memory checkpoint kept on other nodes (survive the loss of a node); 0: own node only.",
    )
