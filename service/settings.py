"""Control-plane settings, read from `ELASTRON_*` environment variables.

One object so the API, the reconciler, `elastron up` and the tests agree on every default; the
tests build a `Settings(...)` directly instead of patching the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path.home() / ".elastron"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ELASTRON_", extra="ignore")

    home: Path = Field(
        default_factory=default_home,
        description="Local state: the SQLite store, the token file, pid and log files of `elastron up`, checkpoints.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL; default sqlite:///<home>/elastron.db. Postgres: postgresql+psycopg://...",
    )
    ray_address: str = Field(
        "http://127.0.0.1:8265", description="The Ray dashboard (Jobs API) address jobs are submitted to."
    )
    api_url: str = Field(
        "http://127.0.0.1:8000",
        description="Where workers reach this API (passed to them as ELASTRON_API_URL).",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="Checkpoint root for jobs that set no checkpoint.path: each such job writes under "
        "<checkpoint_dir>/<tenant>/<job id>/<job name>/ (the path chosen is recorded in the spec as run). "
        "Default: <home>/checkpoints, right for one machine; on a cluster give a place every node "
        "reaches (s3://bucket/prefix or a shared file system).",
    )
    shared_read_roots: list[str] = Field(
        default_factory=list,
        description="Storage roots every tenant's jobs may READ (data, tokenizer, init_from), never write, e.g. "
        'an operator\'s datasets: a JSON list, ELASTRON_SHARED_READ_ROOTS=\'["/data/sets", "s3://corpora"]\'. '
        "Each tenant may also use <checkpoint_dir>/<tenant>/, <home>/exports/<tenant>/ and the roots an admin "
        "grants (`elastron tenants set-storage`); anything else is a 422 (service/storage_policy.py).",
    )
    allowed_endpoints: list[str] = Field(
        default_factory=list,
        description="S3 endpoint URLs a job's checkpoint.endpoint_url may name (JSON list); default none: jobs "
        "use the default endpoint (AWS_ENDPOINT_URL / boto3's chain). The cloud metadata address never passes.",
    )
    tenant_credentials: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="Per-tenant storage credentials for its jobs and exports instead of the service's own, as "
        'JSON: {"acme": {"AWS_PROFILE": "acme"}} or {"acme": {"AWS_ACCESS_KEY_ID": "$ACME_KEY_ID", '
        '"AWS_SECRET_ACCESS_KEY": "$ACME_SECRET"}} (a value starting with $ is read from that variable of the '
        "API's environment, so no secret sits in this setting).",
    )
    ray_dashboard_url: str | None = Field(
        None,
        description="The Ray dashboard as users' browsers reach it, for a link in the web UI (none: no link; "
        "ELASTRON_RAY_ADDRESS, the API's own way in, is never shown).",
    )
    grafana_url: str | None = Field(
        None, description="Grafana's address, for a link in the web UI (none: no link)."
    )
    worker_entrypoint: str = Field(
        "elastron worker-run {job_id}", description="The Ray job's entrypoint; {job_id} is filled in."
    )
    export_entrypoint: str = Field(
        "elastron export",
        description="The command a checkpoint export runs (as its own Ray job); the checkpoint, --format, "
        "--output and --dtype are appended.",
    )
    eval_entrypoint: str = Field(
        "elastron eval",
        description="The command a checkpoint evaluation runs (as its own Ray job); the tasks, layout, "
        "--print-json and the checkpoint are appended.",
    )
    ray_timeout_s: float = Field(5.0, gt=0, description="Longest wait on one Ray Jobs API call.")
    reconcile_interval_s: float = Field(2.0, gt=0, description="How often non-final jobs are polled.")
    dispatch_batch: int = Field(16, ge=1, description="Queued jobs launched per reconcile pass.")
    preempt_grace_s: float = Field(
        120.0,
        ge=0,
        description="A job the scheduler preempts is first asked, in the answers to its telemetry, to "
        "save its current step and stop (nothing lost); one still running after this long gets the "
        "graceful stop signal (it loses the steps since its last checkpoint).",
    )
    scheduler_grow_after_s: float = Field(
        300.0,
        ge=0,
        description="An elastic job admitted below its size grows into free room only after running this long "
        "since its last launch: each resize is a save of its current step and a restart (a job with "
        "resilience.resize: live grows at once: its grow restarts nothing).",
    )
    max_launch_attempts: int = Field(5, ge=1, description="Failed submissions before a job is failed.")
    lost_job_requeues: int = Field(
        3,
        ge=0,
        description="Times a running job whose Ray job vanished (a head node lost, its job table with it) is "
        "queued again from its newest checkpoint before it is failed; a job's resilience.max_restarts, if "
        "larger, is its budget instead (service/fencing.py).",
    )
    export_num_cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs an export's Ray job asks for (entrypoint_num_cpus): more than 0 keeps it off a head "
        "node started with num-cpus 0, as the Helm chart's is.",
    )
    export_memory_gib: float = Field(
        0.0, ge=0, description="Memory an export's Ray job asks for (entrypoint_memory; 0: no request)."
    )
    driver_num_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs a job's driver (its Ray job's entrypoint) asks for; 0 lets Ray run it on the head "
        "node (it loads no model). Counted by Ray, not by elastron's scheduler.",
    )
    scheduler_aging_s: float = Field(
        3600.0,
        gt=0,
        description="A queued job gains one priority level per this many seconds waited (so none waits forever).",
    )
    max_priority: int = Field(
        100,
        ge=-1000,
        le=1000,
        description="The highest scheduling.priority a tenant's jobs may ask for unless its quota's max_priority "
        "says otherwise (admins: any); above it a submission is a 422.",
    )
    max_exports_per_tenant: int = Field(
        8, ge=1, description="Exports of one tenant's checkpoints pending or running at once (more: 429)."
    )
    max_exports_per_checkpoint: int = Field(
        4, ge=1, description="Exports of one checkpoint pending or running at once (more: 429)."
    )
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Largest response sent (a larger one is a 400 naming this setting; streamed logs and "
        "/metrics excepted).",
    )
    submit_rate_per_minute: float = Field(
        120.0,
        gt=0,
        description="Job submissions per tenant per minute. This and the other rates are kept in the store, "
        "so they hold across API replicas.",
    )
    submit_burst: int = Field(
        30, ge=1, description="Submissions a tenant may make at once before the rate applies."
    )
    export_rate_per_minute: float = Field(30.0, gt=0, description="Export requests per tenant per minute.")
    export_burst: int = Field(10, ge=1, description="Export requests a tenant may make at once.")
    parse_rate_per_minute: float = Field(
        120.0, gt=0, description="Job files the web UI parses (/ui/parse-job) per tenant per minute."
    )
    parse_burst: int = Field(30, ge=1, description="Job file parses a tenant may ask for at once.")
    log_rate_per_minute: float = Field(
        120.0, gt=0, description="Log reads and streams (GET /v1/jobs/{id}/logs) per tenant per minute."
    )
    log_burst: int = Field(30, ge=1, description="Log reads a tenant may make at once.")
    metrics_retention_s: float = Field(
        86400.0, ge=0, description="How long a finished job's series stay on /metrics."
    )
    metrics_require_token: bool = Field(
        True,
        description="Require a bearer token on /metrics: ELASTRON_METRICS_TOKEN or an admin token (false: open "
        "to anyone who reaches the API, and it lists every tenant's job ids).",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="The scrape token Prometheus sends on /metrics (Authorization: Bearer ...); admin tokens "
        "are accepted too. Generate one, e.g. `openssl rand -hex 32`.",
    )

    @property
    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint_dir or str(self.home / "checkpoints")

    @property
    def exports_dir(self) -> Path:
        """Local root for checkpoint exports: <home>/exports/<tenant>/... (see POST .../export)."""
        return self.home / "exports"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'elastron.db'}"

    @property
    def token_file(self) -> Path:
        """Where `elastron up` stores the local admin token (mode 0600)."""
        return self.home / "token"
