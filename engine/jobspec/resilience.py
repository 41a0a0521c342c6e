"""`resilience`: restarts, the step watchdog, and the rerun state machine that tells a flaky
device from a real bug.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.jobspec.common import NonNegativeInt, PositiveInt, _Section


class ResilienceSpec(_Section):
    """Restarts, and the rerun state machine that tells a flaky device from a real bug."""

    max_restarts: NonNegativeInt = Field(0, description="Worker-group restarts allowed before the job fails.")
    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = Field(
        "validate_results",
        description="validate_results: re-run a step whose loss or grad norm is rejected and diagnose it; "
        "report_determinism_stats: re-run every step once and report how far the two runs differ; "
        "disabled: a NaN/Inf loss fails the job at once.",
    )
    rerun_tolerance: float = Field(
        0.0, ge=0.0, description="Relative difference under which a re-run counts as reproducing the result."
    )
    spike_threshold: float | None = Field(
        None,
        gt=1.0,
        description="Reject a loss at least this many times the largest of the first spike_window losses "
        "(non-fatal: a reproducible spike is trained on). Default: no spike check.",
    )
    spike_window: PositiveInt = Field(100, description="Losses sampled before spike detection starts.")
    error_injection_rate: NonNegativeInt = Field(
        0, description="Drills: inject a rejected result with probability 1/N per validation (0: never)."
    )
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = Field(
        "transient_error", description="What an injected rejection turns out to be when re-run."
    )
    skip_bad_batches: bool = Field(
        False,
        description="When a re-run on other hardware reproduces a rejected result (the data or the code "
        "produces it), skip that global batch and go on instead of failing the job.",
    )
    step_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="A rank whose step (plus the checkpoint save after it) makes no progress for this long "
        "is failed with the step and phase it hangs in, and the job restarts from its last checkpoint.",
    )
    warm_restart: bool | None = Field(
        None,
        description="On Ray: once a rank has trained a step, start one process per rank ahead on its node, "
        "with torch and the engine imported, for the ranks of the next restart (seconds less downtime; "
        "about 0.3 GB of host memory each, no GPU). Default: on with checkpoint.local_interval or resize: live, "
        "off otherwise.",
    )
    on_rank_failure: Literal["restart_group", "replace_replica"] = Field(
        "restart_group",
        description="restart_group: a failed rank restarts the whole worker group from the newest checkpoint "
        "(exact: no step differs from an uninterrupted run). replace_replica (Ray): each data-parallel replica "
        "is a fault domain; the others keep stepping while the failed one is replaced and healed from a live "
        "peer, and the steps taken meanwhile average over fewer replicas (their missing samples are skipped, or "
        "taken by the others: lost_replica_share; the step record's `replicas` says how many). A replica is one rank, or with "
        "parallel.data_parallel_shard_size (HSDP) one shard group of that many ranks, which is rebuilt as a "
        "whole when one of its ranks dies; with resize: live also its tensor- and pipeline-parallel ranks "
        "(parallel.tensor and pipeline > 1 need resize: live). Needs parallel.context and expert = 1 and at "
        "least 2 replicas (resources.ranks >= 2 x the ranks of a replica group); each replaced rank counts "
        "against max_restarts.",
    )
    lost_replica_share: Literal["skip", "redistribute"] = Field(
        "skip",
        description="replace_replica: what a step does with the share of the global batch of a replica that "
        "is missing from its quorum (dead, or healing in that step). skip: the step averages over the replicas "
        "it has and that share is not trained on (the data position still advances by the whole global batch); "
        "steps keep their time and the quorum stays asynchronous. redistribute: the replicas in the quorum "
        "split the missing share's microbatches between them (more gradient accumulation), so the step trains "
        "on the same samples with the same math as the uninterrupted run (losses equal within fp32 rounding); "
        "each such step takes longer by the missing share, and every step waits for its quorum before the "
        "forward (a heal's transfer is then no longer hidden behind the survivors' forward and backward). "
        "Not with model.mtp_num_layers.",
    )
    resize: Literal["restart", "live"] = Field(
        "restart",
        description="How the scheduler resizes or preempts part of this elastic job (resources.min_ranks). "
        "restart: save the current step, stop and launch again at the new size (no step lost; every rank "
        "starts again). live (needs on_rank_failure: replace_replica): each replica group runs as its own Ray "
        "Train run, so a shrink releases whole replica groups at a step boundary (their Ray workers and "
        "resources freed, the others train on) and a grow starts new ones that heal from a live peer, with no "
        "checkpoint, stop or restart of the survivors. With lost_replica_share: redistribute a step after a "
        "resize trains the same samples with the same math as the uninterrupted run. A job of one size (no "
        "resources.min_ranks) is never resized: live changes nothing there.",
    )
    replica_heartbeat_timeout_ms: int = Field(
        500,
        ge=20,
        le=60_000,
        description="replace_replica: a replica whose host goes silent for this long (a lost node, a cut network: "
        "no ping, sent every fifth of this, reaches the Lighthouse) is dropped from the next quorum. A replica "
        "whose process dies is dropped within about 0.1 s whatever this is (its connection to the Lighthouse's "
        "liveness relay closes). Raise it where a loaded host or network can miss pings (a live replica dropped "
        "by mistake heals and rejoins, costing a step); lower it to notice a lost node sooner.",
    )

    @model_validator(mode="after")
    def _check_lost_share(self) -> ResilienceSpec:
        if self.lost_replica_share != "skip" and self.on_rank_failure != "replace_replica":
            raise ValueError(
                "resilience.lost_replica_share: redistribute is for on_rank_failure: replace_replica (restart_group "
                "never steps without a replica); set on_rank_failure: replace_replica or drop lost_replica_share"
            )
        if self.resize == "live" and self.on_rank_failure != "replace_replica":
            raise ValueError(
                "resilience.resize: live releases and adds replica groups, which needs on_rank_failure: "
                "replace_replica; set it, or resize: restart"
            )
        return self
