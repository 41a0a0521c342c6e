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
    on_save_failure: Literal["continue", "fail"] = Field(
        "continue",
        description=(
            "A save that still fails after its retries: continue = skip it (a checkpoint_failed event) and "
            "try again at the next interval; fail = stop the job with the storage error."
        ),
    )
    save_retries: int = Field(
        3, ge=0, le=20, strict=True, description="Times a failed save is tried again before it counts as failed."
    )
    save_retry_backoff_s: float = Field(
        2.0,
        ge=0.0,
        le=600.0,
        description="Wait before the first retry; it doubles for each further one (2, 4, 8 s by default).",
    )
    max_consecutive_failures: PositiveInt = Field(
        3,
        description=(
            "Failed saves in a row after which the job fails with the storage error (on_save_failure: continue), "
            "so a job never trains for days without a checkpoint."
        ),
    )
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
