"""What one training step reports: the record rank 0 hands on every iteration (to the metrics
file, the Ray driver's telemetry, Prometheus), the timers it carries, and its progress line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Reported min/max over ranks every log interval. "data" is fetching batches, "forward" and
# "backward" are per microbatch summed (without pipelining: the pipeline schedule interleaves
# them with its own p2p, all inside "forward-backward"), "grads-finalize" is the DP gradient
# reduction not hidden behind backward, "checkpoint-save" the time a save blocks training.
STEP_TIMERS = [
    "data",
    "forward",
    "backward",
    "forward-backward",
    "grads-finalize",
    "optimizer",
    "checkpoint-save",
]

# Also reported per rank (the record's `timers_per_rank`, one value per rank in rank order): the
# rank's own compute time in a step, where a slow rank stands out (its peers wait for it later,
# in the gradient reduction, outside this timer). service/stragglers.py flags a straggler from it.
PER_RANK_TIMERS = ["forward-backward"]
PER_RANK_MAX = 512  # ranks: the telemetry's bound on a list (service/METRICS.md); beyond, min/max only


@dataclass
class StepMetrics:
    iteration: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    global_batch_size: int
    consumed_samples: int
    loss_scale: float = 1.0
    skipped: bool = False
    timers: dict[str, list[float]] = field(default_factory=dict)
    timers_per_rank: dict[str, list[float]] = field(default_factory=dict)
    rerun: dict[str, Any] = field(default_factory=dict)
    model_flops: float = 0.0
    mfu: float = 0.0
    # Energy summed over the job's devices for this step; None where no counter is readable.
    energy_j: float | None = None
    power_w: float | None = None
    energy_cumulative_j: float | None = None
    # Multi-token prediction (model.mtp_num_layers): the depths' mean loss, beside the main loss.
    mtp_loss: float | None = None
    # Device memory held by this rank (rank 0's: ranks of one layout hold about the same) after
    # the step and at its peak, in bytes; None on CPU (engine.device.memory_bytes).
    memory_allocated_bytes: int | None = None
    memory_peak_bytes: int | None = None
    # Set on the iterations that evaluate (training.eval_interval).
    valid_loss: float | None = None
    valid_ppl: float | None = None
    # Data-parallel replicas the step's reduction averaged over: the data-parallel size, or with
    # resilience.on_rank_failure replace_replica the replicas in the step's quorum (fewer while a
    # replaced one rejoins: the missing ones' samples of that step are skipped).
    replicas: int | None = None


def progress_line(m: StepMetrics, total: int) -> str:
    return (
        f"iter {m.iteration:>5}/{total} | loss {m.loss:.4f} | lr {m.lr:.3e} | grad_norm {m.grad_norm:.3f} "
        f"| {m.tokens_per_s:,.0f} tok/s | {m.step_time_s * 1000:.0f} ms | MFU {m.mfu:.1%}"
        + (f" | mtp loss {m.mtp_loss:.4f}" if m.mtp_loss is not None else "")
        + (f" | {m.power_w:.0f} W" if m.power_w is not None else "")
        + (f" | valid loss {m.valid_loss:.4f} ppl {m.valid_ppl:.2f}" if m.valid_loss is not None else "")
    )
