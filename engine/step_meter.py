"""Measuring a training step for its record: time, throughput, FLOPs and MFU, energy, memory, and
the timers over ranks.

The record (engine/step_metrics.py's `StepMetrics`) says what a step did; how each figure is
measured is a separate concern from running the step, with its own rules: the clock runs from an
idle device to an idle device, energy and time spent outside training (evaluation, checkpoint
saves) are left out as in Megatron-Core, the peak FLOP/s behind MFU is one figure agreed by every
rank, and under replicas as fault domains a step counts only the samples of the replicas that
trained it. The Trainer starts and stops the meter around each step and hands it what the step
returned; the meter owns the rest.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine import device
from engine.energy_monitor import EnergyMonitor
from engine.flops import mfu, model_flops_per_iteration, peak_flops
from engine.step_metrics import PER_RANK_MAX, PER_RANK_TIMERS, STEP_TIMERS, StepMetrics

if TYPE_CHECKING:
    from engine.fault_tolerance.sync import ReplicaSync
    from engine.optimizer.optimizer import StepResult
    from engine.timers import Timers
    from engine.transformer.config import TransformerConfig


class StepMeter:
    """One rank's measurements of its steps. `timers` are the Trainer's (the step's phases time
    themselves into them); `dp_size` the data-parallel ranks of this process group; `replica_sync`
    the job's replicas as the step sees them (engine/fault_tolerance/sync.py: the step's
    replicas, samples and devices come from it).

    Built once per Trainer: it sets up the energy counters and agrees the peak FLOP/s (both
    collectives)."""

    def __init__(
        self,
        config: TransformerConfig,
        timers: Timers,
        *,
        device_type: str,
        log_interval: int,
        dp_size: int,
        replica_sync: ReplicaSync,
    ):
        self.config, self.timers, self.log_interval = config, timers, log_interval
        self.dp_size, self.replica_sync = dp_size, replica_sync
        self.energy = EnergyMonitor(device_type)
        self.energy.setup()
        self.peak_flops_per_device = self._peak_flops(device_type, config.params_dtype)
        self._started = self._elapsed = 0.0

    @staticmethod
    def _peak_flops(device_type: str, dtype: torch.dtype) -> float:
        """Peak FLOP/s of one device, for MFU. Rank 0 looks it up (GPU table) or measures it once
        (CPU, cached on disk) while the other ranks wait, so the measurement is not slowed by
        ranks sharing its cores; every rank gets the same figure."""
        box = [None]
        if dist.get_rank() == 0:
            box[0] = peak_flops(device_type, dtype).flops_per_s
        dist.broadcast_object_list(box, src=0)
        return float(box[0])

    # ------------------------------------------------------------------ around a step
    def start(self) -> None:
        """A step begins: the device idle, its peak memory reset, the clock started."""
        device.synchronize()
        device.reset_peak_memory()
        self._started = time.perf_counter()

    def stop(self) -> None:
        """The step's work is done (on the device too): the clock stops."""
        device.synchronize()
        self._elapsed = time.perf_counter() - self._started

    def pause(self) -> None:
        """Work that is not training begins (evaluation, a checkpoint save): its energy is not the
        step's."""
        self.energy.pause()

    def resume(self) -> None:
        self.energy.resume()

    # ------------------------------------------------------------------ the record
    def record(
        self,
        *,
        iteration: int,
        loss: float,
        lr: float,
        result: StepResult,
        global_batch_size: int,
        consumed_samples: int,
        rerun: dict[str, Any],
        mtp_loss: float | None,
    ) -> StepMetrics:
        """The stopped step's record. Collectives (energy, and the timers every log interval):
        every rank calls it."""
        elapsed, gbs = self._elapsed, global_batch_size
        # With replicas as fault domains a step may average over fewer of them: the missing
        # replicas' samples are skipped, not re-assigned (engine/fault_tolerance/replica_quorum.py).
        replicas, trained, device_share = self.replica_sync.step_share(gbs, self.dp_size)
        tokens = trained * self.config.seq_length
        # What the step trained, on the devices that trained it: every replica's ranks in the
        # quorum (this process group holds one replica's).
        flops = model_flops_per_iteration(self.config, trained)
        devices = dist.get_world_size() * device_share
        lap = self.energy.lap()
        memory = device.memory_bytes()
        timers, per_rank = {}, {}
        if iteration % self.log_interval == 0:
            timers = {k: [lo, hi] for k, (lo, hi) in self.timers.aggregate(STEP_TIMERS).items()}
            if dist.get_world_size() <= PER_RANK_MAX:
                per_rank = {
                    k: v for k, v in self.timers.last_per_rank.items() if k in PER_RANK_TIMERS and k in timers
                }
        return StepMetrics(
            iteration=iteration,
            loss=loss,
            lr=lr,
            grad_norm=result.grad_norm,
            tokens=tokens,
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed,
            global_batch_size=gbs,
            consumed_samples=consumed_samples,
            loss_scale=result.loss_scale,
            skipped=result.skipped,
            timers=timers,
            timers_per_rank=per_rank,
            rerun=rerun,
            model_flops=flops,
            mfu=mfu(flops, elapsed, devices, self.peak_flops_per_device),
            energy_j=lap.energy_j if lap else None,
            power_w=lap.power_w if lap else None,
            energy_cumulative_j=lap.cumulative_j if lap else None,
            mtp_loss=mtp_loss,
            memory_allocated_bytes=memory[0] if memory else None,
            memory_peak_bytes=memory[1] if memory else None,
            replicas=replicas,
        )
