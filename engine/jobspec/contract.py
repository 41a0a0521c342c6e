"""The wire between the service and the workers, named once: both sides import these names.

The service launches a Ray job with an environment (service/launcher.py) that the workers read
(workers/spec_on_ray.py, workers/telemetry.py); the workers post telemetry that the service stores
(service/store/telemetry.py). Spelled as string literals on both sides, a rename on one side
would break the other silently; here, it breaks an import. The telemetry wire format itself is
described in workers/telemetry.py and service/METRICS.md.
"""

from __future__ import annotations

# -- the environment of a job's Ray job (set by the service, read by the workers) ----------------
ENV_JOB_ID = "ELASTRON_JOB_ID"
ENV_JOB_SPEC = "ELASTRON_JOB_SPEC"  # the spec as run, JSON
ENV_API_URL = "ELASTRON_API_URL"  # where the workers post telemetry
ENV_API_TOKEN = "ELASTRON_API_TOKEN"  # the job token: good for this job's telemetry only
ENV_PLACEMENT = "ELASTRON_PLACEMENT"  # {Ray node id: ranks}, JSON: where the scheduler admitted the job
ENV_SPOOL_DIR = "ELASTRON_SPOOL_DIR"  # where telemetry waits while the API is unreachable
ENV_FENCING_TOKEN = "ELASTRON_FENCING_TOKEN"  # this attempt's fencing token (an integer; it only grows)
FENCING_HEADER = "X-Elastron-Fencing-Token"  # telemetry carries the attempt's fencing token
FENCED_CODE = "attempt_fenced"  # the 409's code: a newer attempt runs; this one must stop, unsaved
# Set by the workers for the engine: the hardware identity the rerun state machine compares.
ENV_NODE_ID = "ELASTRON_NODE_ID"

# -- telemetry ------------------------------------------------------------------------------------
TELEMETRY_PATH = "/v1/internal/jobs/{job_id}/telemetry"

# Keys the workers add to the engine's metrics record: which run of the job it comes from (the
# store keeps, per iteration, the record of the newest `group`, else `attempt`) and the layout.
RECORD_ATTEMPT = "attempt"
RECORD_GROUP = "group"
RECORD_WORLD_SIZE = "world_size"
RECORD_DATA_PARALLEL_SIZE = "data_parallel_size"
RECORD_TS = "ts"


def record_epoch(record: dict, default: int) -> int:
    """Which run of the job a metrics record comes from: its `group`, else its `attempt` (a
    replica's records other than the first replica's carry no group), else `default`. Of two
    records for one iteration, the store keeps the one of the higher epoch."""
    for field in (RECORD_GROUP, RECORD_ATTEMPT):
        value = record.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default

# The driver's event for a worker-group restart, with its short cause.
EVENT_RESTART = "restart"
EVENT_CAUSE = "cause"

# The driver's last event when the job failed: the process' exit code and its reason (the
# driver's verdict, which the service keeps as the job's failure cause).
EVENT_JOB_FAILED = "job_failed"
EXIT_CODE = "exit_code"
REASON = "reason"
# Exit codes of the rerun state machine (engine/rerun/state_machine.py), which a job's process
# exits with and the service explains: the job must resume on other hardware to tell a transient
# fault from a persistent one; a result failed validation.
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17


# A worker group's start (sent by rank 0): RANKS lists each rank with the Ray node it runs on,
# from which the scheduler counts where the job really is (Ray may place it otherwise than the
# scheduler's placement said, and an elastic group shrinks onto the nodes that are left).
EVENT_RANKS_STARTED = "ranks_started"
RANKS = "ranks"


def telemetry_url(api_url: str, job_id: str) -> str:
    return api_url.rstrip("/") + TELEMETRY_PATH.format(job_id=job_id)


# A rank group's resume after a restart (sent by rank 0): where the state came from and what it
# cost. RECOVERED_FROM is one of RECOVERED_SOURCES.
EVENT_RECOVERED = "recovered"
RECOVERED_FROM = "recovered_from"
RECOVERED_SOURCES = ("memory", "replica", "persistent")
STEPS_LOST = "steps_lost"
# {phase: seconds} of the restart ("seconds" alone is a number on the wire: checkpoint_saved's).
RECOVERY_PHASES = "phase_seconds"


# resilience.on_rank_failure replace_replica (engine/fault_tolerance/replica_quorum.py): a replica's
# start, the survivors stepping without one (with the step's `replicas` and the survivors'
# `stall_s`), and a replaced replica back in the quorum (`rejoin_s` from the survivors' side,
# `heal_s` from the healed replica's).
EVENT_REPLICA_STARTED = "replica_started"
EVENT_REPLICA_LOST = "replica_lost"
EVENT_REPLICA_REJOINED = "replica_rejoined"
# A replica that left the quorum because it was released (a live shrink, RankHooks.should_leave),
# with the iteration it had finished: the others went on without it.
EVENT_REPLICA_LEFT = "replica_left"
# resilience.resize: live: the driver's replica groups went from/to the count the scheduler asked
# for (`resized`, with `seconds`, `live: true` and the ranks where they run)
EVENT_RESIZED = "resized"
# A replica's rank failing itself because the job's Lighthouse is gone (no quorum can form until
# a new one serves the replicas started again); a rank's step watchdog firing.
EVENT_LIGHTHOUSE_LOST = "lighthouse_lost"
EVENT_WATCHDOG_TIMEOUT = "watchdog_timeout"
