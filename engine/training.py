"""Build a rank's training state from a JobSpec and run the loop.

`Trainer` is what every launcher drives (the local `elastron train`, and Ray workers later):
the rank grid, seeds, model, optimizer, scheduler, microbatch calculator and data source, then
one `train_step` per iteration that returns the iteration's metrics record. All collectives a
step needs are inside `train_step`, so every rank calls it the same number of times.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from engine import device
from engine import parallel_state as ps
from engine.checkpointing import memory as memory_snapshot
from engine.checkpointing.checkpointer import Checkpointer, layout_signature
from engine.checkpointing.local_shards import ModelShards, OptimizerShards
from engine.checkpointing.state import ModelState, OptimizerState, RNGState
from engine.checkpointing.stateful import (
    DataPosition,
    GradScalerState,
    JobRecord,
    RerunMachineState,
    SchedulerState,
    Stateful,
)
from engine.compile import compile_layers
from engine.data.builder import build_datasets
from engine.data.packing import PackedSFTSource, packed_micro_batch
from engine.data.sft import IGNORE_INDEX, SFTSource, sft_micro_batch
from engine.data.sources import micro_batch
from engine.data.tokenizer import build_tokenizer
from engine.distributed.data_parallel import DataParallel
from engine.distributed.finalize_grads import finalize_model_grads
from engine.energy_monitor import EnergyMonitor
from engine.flops import mfu, model_flops_per_iteration, peak_flops
from engine.hf.importer import hf_architecture, import_hf_weights
from engine.jobspec import JobSpec, ResolvedJob, resolve_job
from engine.jobspec.layout import num_microbatches
from engine.microbatches import MicrobatchCalculator
from engine.models import GPTModel
from engine.optimizer.grad_scaler import DynamicGradScaler
from engine.optimizer.optimizer import TrainingOptimizer
from engine.optimizer.scheduler import OptimizerParamScheduler
from engine.pipeline_parallel import PipelineRunner, stage_layer_ranges, virtual_stages_of
from engine.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EventLog,
    RerunExit,
    RerunState,
    RerunStateMachine,
    is_nan_or_inf,
)
from engine.tensor_parallel import model_parallel_manual_seed
from engine.timers import Timers
from engine.transformer import context_parallel
from engine.transformer.config import TransformerConfig
from engine.transformer.initialization import initialize_weights
from engine.transformer.moe import TopKRouter, set_aux_loss_scale
from engine.transformer.mtp import shifted
from engine.transformer.packed_seq import PackedSeqParams

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


class MicroBatch(NamedTuple):
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s], IGNORE_INDEX where no loss is taken (fine-tuning masks)
    packed: PackedSeqParams | None = None  # rows holding several samples (data.packing)


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


class Trainer:
    """One rank's training state. Needs an initialised torch.distributed default group."""

    def __init__(
        self, job: JobSpec | ResolvedJob, timer_level: int = 1, events_path: str | Path | None = None
    ):
        self.job = job if isinstance(job, ResolvedJob) else resolve_job(job)
        self.spec = spec = self.job.spec
        p, t = spec.parallel, spec.training
        ps.initialize_model_parallel(
            tensor=p.tensor,
            pipeline=p.pipeline,
            context=p.context,
            expert=p.expert,
            virtual_pipeline=p.virtual_pipeline,
            expert_tensor=1,  # MoE experts are whole on their EP rank (no expert TP yet)
            data_parallel_shard=p.data_parallel_shard_size,
        )
        model_parallel_manual_seed(t.seed)
        tokenizer = build_tokenizer(spec.data.tokenizer)
        self.config = TransformerConfig.from_job(spec, tokenizer.vocab_size)
        self.device = device.current_device()
        importing = self._will_import()
        self.model_chunks = self._build_model_chunks(initialize=not importing)
        self.hf_import = None
        if importing:
            uri = spec.model.init_from
            self.hf_import = import_hf_weights(
                self.model_chunks,
                uri,
                hf_architecture(uri),
                self.config,
                # what the checkpoint has no weights for (MTP depths it lacks)
                initialize=lambda chunk, only: initialize_weights(chunk, t.seed, only=only),
            )
        grad_dtype = torch.float32 if p.grad_reduce_in_fp32 else self.config.params_dtype
        # Weights are replicated over context parallelism as well: gradients are averaged over
        # DP x CP and the distributed optimizer shards over it (Megatron-Core's dp_cp group).
        grad_group = ps.get_group("dp_cp") if p.context > 1 else ps.get_group("dp")
        # Hybrid sharding: shard within groups of data_parallel_shard_size, all-reduce across them.
        hybrid = ps.has_group("dp_shard")
        self.ddp_chunks = [
            DataParallel(
                chunk,
                grad_group,
                grad_dtype=grad_dtype,
                bucket_size=p.grad_bucket_size,
                overlap=p.overlap_grad_reduce,
                sharding=p.data_parallel_sharding,
                expert_group=ps.get_group("edp") if self.config.moe else None,
                shard_group=ps.get_group("dp_shard") if hybrid else None,
                replica_group=ps.get_group("dp_replica") if hybrid else None,
            )
            for chunk in self.model_chunks
        ]
        self.grad_scaler = None
        if t.precision == "fp16":
            self.grad_scaler = DynamicGradScaler(
                t.initial_loss_scale,
                t.min_loss_scale,
                growth_interval=t.loss_scale_window,
                hysteresis=t.hysteresis,
            )
        self.optimizer = TrainingOptimizer(
            self.ddp_chunks,
            spec.optimizer,
            # Replicas over DP hold the same grads unless the distributed optimizer split them.
            norm_group=self._norm_group(),
            grad_scaler=self.grad_scaler,
            expert_norm_group=self._expert_norm_group(),
        )
        self.scheduler = OptimizerParamScheduler.from_spec(self.optimizer, spec.optimizer, t.train_iters)
        moe = self.config.moe
        self._biased_routers = (
            [m for chunk in self.model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
            if moe is not None and moe.expert_bias
            else []
        )
        # The multi-token prediction depths, on the rank holding the last stage.
        self._mtp = next((c.mtp for c in self.model_chunks if c.mtp is not None), None)
        self.last_mtp_loss: float | None = None
        self.pipeline = None
        if p.pipeline > 1:
            self.pipeline = PipelineRunner(
                self.ddp_chunks, self.stage_indices, self.num_stages, ps.get_group("pp"), self.device
            )
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.microbatches = MicrobatchCalculator.from_spec(t, self.dp_size)
        datasets = build_datasets(
            spec,
            tokenizer,
            self.config.seq_length,
            t.seed,
            num_samples=self._planned_samples(),
            synthetic_vocab_size=self.config.true_vocab_size,
        )
        self.source, self.valid_source = datasets.train, datasets.valid
        self.timers = Timers(log_level=timer_level)
        self.iteration = 0
        self.consumed_samples = 0
        # What this rank is doing now, for a watchdog to name when a step hangs.
        self.phase = "setup"
        self.energy = EnergyMonitor(self.device.type)
        self.energy.setup()
        self.peak_flops_per_device = self._peak_flops()
        self.events = EventLog(events_path, spec.name)
        self.rerun = RerunStateMachine.from_spec(spec.resilience, t.seed, self.events)
        self._snapshot_parts: dict[str, Stateful] | None = None
        # Last: a resume overwrites the counters, weights, optimizer, schedule and rerun state.
        self.checkpointer = None
        if spec.checkpoint.path or spec.checkpoint.resume_from:
            self.checkpointer = self.make_checkpointer()
            self.checkpointer.maybe_resume()
        if self.rerun.state == RerunState.NOT_RUNNING_YET:
            self.rerun.current_iteration = self.iteration

    def _norm_group(self) -> dist.ProcessGroup | None:
        """The ranks whose squared gradients add up to the global norm once each: the
        model-parallel group when DP replicas hold the same gradients; every rank under the
        distributed optimizer (each DP rank holds its own slice); under hybrid sharding, the
        ranks of one replica (a new group, made on every rank in the same order)."""
        p = self.spec.parallel
        if not p.distributed_optimizer:
            return ps.get_group("mp")
        if not ps.has_group("dp_shard"):
            return None
        # Replica r: every rank whose DP index lies in the r-th block of data_parallel_shard_size.
        grid, size, mine = ps.get_grid(), p.data_parallel_shard_size, None
        members: dict[int, list[int]] = {}
        for rank in range(grid.world_size):
            members.setdefault(grid.coords(rank)["dp"] // size, []).append(rank)
        for key in sorted(members):
            group = dist.new_group(members[key])
            if dist.get_rank() in members[key]:
                mine = group
        return mine

    def _expert_norm_group(self) -> dist.ProcessGroup | None:
        """The ranks whose squared expert gradients add up to the experts' share of the norm once
        each: one of every expert (expert TP x EP x PP); with sharded optimizer state each expert
        is also split over the expert data-parallel group, so every rank (the world group)."""
        if not self.config.moe:
            return None
        if self.spec.parallel.distributed_optimizer and dist.get_world_size(ps.get_group("edp")) > 1:
            return dist.group.WORLD
        return ps.get_group("emp")

    def _will_import(self) -> bool:
        """model.init_from's weights are loaded (before the optimizer copies them into its fp32
        masters, and instead of a random init: the import writes every element, the vocabulary
        padding included) unless the job resumes: its checkpoint has newer weights."""
        c = self.spec.checkpoint
        if self.spec.model.init_from is None:
            return False
        if c.path or c.resume_from:
            probe = Checkpointer({}, c, job_name=self.spec.name, events=None, layout="")
            return not probe.will_resume()
        return True

    def _planned_samples(self) -> tuple[int, int | None, None]:
        """Samples the run will read (train, valid): sizes the cached sample indexes ahead."""
        t = self.spec.training
        gbs = t.global_batch_size
        valid = None
        if t.eval_interval is not None:
            valid = t.eval_iters * gbs  # every evaluation reads the same validation batches
        return t.train_iters * gbs, valid, None

    def _peak_flops(self) -> float:
        """Peak FLOP/s of one device, for MFU. Rank 0 looks it up (GPU table) or measures it once
        (CPU, cached on disk) while the other ranks wait, so the measurement is not slowed by
        ranks sharing its cores; every rank gets the same figure."""
        box = [None]
        if dist.get_rank() == 0:
            box[0] = peak_flops(self.device.type, self.config.params_dtype).flops_per_s
        dist.broadcast_object_list(box, src=0)
        return float(box[0])

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """What a checkpoint of this rank holds, by part name (the first component of the part's
        shard keys: "model/...", "optim/...", "rng/..."), in the order every rank saves them."""
        return {
            "model": ModelState(self.model_chunks, self.ddp_chunks),
            "optim": OptimizerState(self.optimizer, self.model_chunks, self.ddp_chunks),
            "rng": RNGState(self.spec.training.seed),
            "data": DataPosition(self),
            "scheduler": SchedulerState(self.scheduler),
            "grad_scaler": GradScalerState(self.grad_scaler),
            "rerun": RerunMachineState(self.rerun),
            "job": JobRecord(lambda: self.spec.model_dump(mode="json")),
        }

    def make_checkpointer(self) -> Checkpointer:
        """A checkpointer of this rank's parts, as the job's checkpoint section says."""
        return Checkpointer(
            self.checkpoint_parts(),
            self.spec.checkpoint,
            job_name=self.spec.name,
            events=self.events,
            layout=layout_signature(self.spec.parallel),
        )

    def snapshot_parts(self) -> dict[str, Stateful]:
        """The parts an in-memory snapshot holds: the checkpoint's, less the job record (never
        restored, and the restarted rank has its spec), with the model and optimizer as this rank
        holds them instead of in global, parameter-shaped form (local_shards.py) and the rerun
        state of this rank only (a snapshot is restored by the same rank of the same layout: no
        assembly, no gather). Built once: a snapshot may
        be taken every step, and the parts cache what they work out about the model."""
        if self._snapshot_parts is None:
            parts = {name: part for name, part in self.checkpoint_parts().items() if name != "job"}
            parts["model"] = ModelShards(self.model_chunks, self.ddp_chunks)
            parts["optim"] = OptimizerShards(self.optimizer, self.ddp_chunks)
            parts["rerun"] = RerunMachineState(self.rerun, gather=False)
            self._snapshot_parts = parts
        return self._snapshot_parts

    def snapshot_due(self) -> bool:
        """After iterations that are a multiple of checkpoint.local_interval (not the last)."""
        n = self.spec.checkpoint.local_interval
        return n is not None and self.iteration % n == 0 and self.iteration < self.spec.training.train_iters

    def capture_snapshot(self, buffer: bytearray | None = None) -> memory_snapshot.HostSnapshot:
        """This rank's state copied to host memory (engine/checkpointing/memory.py): a collective,
        every rank captures at the same iteration. The result's payload lives in `buffer` when it is
        big enough, so the caller must be done with the previous snapshot before reusing it."""
        return memory_snapshot.capture(
            self.snapshot_parts(),
            job=self.spec.name,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            layout=layout_signature(self.spec.parallel),
            buffer=buffer,
        )

    def parse_snapshot(self, blob: bytes | bytearray | memoryview) -> memory_snapshot.HostSnapshot:
        """`blob` checked for this rank (checksum; same job, rank, world size, layout): SnapshotError
        if it must not be used."""
        return memory_snapshot.parse(
            blob,
            job=self.spec.name,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            layout=layout_signature(self.spec.parallel),
        )

    def restore_snapshot(self, blob: bytes | bytearray | memoryview | memory_snapshot.HostSnapshot) -> int:
        """Continue from an in-memory snapshot of this rank (bytes, or `parse_snapshot`'s result):
        checked before anything is loaded; SnapshotError if it must not be used. A collective only
        where the parts' loads are (none today). Returns its iteration."""
        snap = blob if isinstance(blob, memory_snapshot.HostSnapshot) else self.parse_snapshot(blob)
        memory_snapshot.restore(self.snapshot_parts(), snap)
        if self.rerun.state == RerunState.NOT_RUNNING_YET:
            self.rerun.current_iteration = self.iteration
        return snap.iteration

    def save_checkpoint_if_due(self) -> bool:
        """Save after iterations that are a multiple of checkpoint.interval, and after the last."""
        c = self.spec.checkpoint
        if self.checkpointer is None or c.path is None:
            return False
        last = self.iteration == self.spec.training.train_iters
        if last or (c.interval is not None and self.iteration % c.interval == 0):
            self.phase = "checkpoint-save"
            self.energy.pause()  # energy per step is training energy, as in Megatron-Core
            with self.timers("checkpoint-save", 1):
                self.checkpointer.save()  # with async_save: the time training is blocked
            self.energy.resume()
            return True
        return False

    def _build_model_chunks(self, initialize: bool = True) -> list[GPTModel]:
        """This rank's model chunks: one per virtual pipeline stage it holds (one without PP)."""
        p = self.spec.parallel
        vp = p.virtual_pipeline or 1
        self.num_stages = p.pipeline * vp
        self.stage_indices = virtual_stages_of(ps.get_pipeline_model_parallel_rank(), p.pipeline, vp)
        ranges = stage_layer_ranges(self.config.num_layers, self.num_stages, p.pipeline_layers)
        chunks = []
        for idx in self.stage_indices:
            offset, count = ranges[idx]
            chunk = GPTModel(
                self.config,
                pre_process=idx == 0,
                post_process=idx == self.num_stages - 1,
                layer_offset=offset,
                num_layers=count,
            ).to(self.device)
            if initialize:
                initialize_weights(chunk, self.spec.training.seed)
            if self.spec.training.compile:
                compile_layers(chunk)
            chunks.append(chunk)
        return chunks

    @property
    def model(self) -> GPTModel:
        """The whole model when there is no pipeline parallelism."""
        if len(self.model_chunks) != 1 or self.pipeline is not None:
            raise AttributeError("this rank holds pipeline stages: use model_chunks")
        return self.model_chunks[0]

    def _microbatch(self, m: int, source=None, consumed: int | None = None) -> MicroBatch:
        """This DP rank's microbatch m of the global batch starting at sample `consumed` (default:
        the next training batch). Under context parallelism every CP rank of a DP replica reads the
        same microbatch and keeps its two sequence chunks of tokens and labels (no packing there)."""
        t = self.spec.training
        source = self.source if source is None else source
        consumed = self.consumed_samples if consumed is None else consumed
        where = (consumed, m, t.micro_batch_size, self.dp_size, self.dp_rank)
        if isinstance(source, PackedSFTSource):
            tokens, labels, positions, segments = packed_micro_batch(source, *where)
            packed = PackedSeqParams(positions, segments).to(self.device)
            return MicroBatch(tokens.to(self.device), labels.to(self.device), packed)
        if isinstance(source, SFTSource):
            tokens, labels = sft_micro_batch(source, *where)
        else:
            tokens, labels = micro_batch(source, *where)
        tokens, labels = (context_parallel.shard_sequence(x, 1) for x in (tokens, labels))
        return MicroBatch(tokens.to(self.device), labels.to(self.device))

    def _stage_batches(self, n: int, source=None, consumed: int | None = None) -> list[MicroBatch]:
        """The step's n microbatches where this rank reads them: every rank without pipelining;
        under it the first stage (tokens), the last (labels) and, for packed rows, every stage
        (each needs the rows' positions and attention mask; reading is deterministic)."""
        runner = self.pipeline
        if runner is None or runner.has_first or runner.has_last or self.spec.data.packing:
            return [self._microbatch(m, source, consumed) for m in range(n)]
        return []

    def _pipeline_inputs(self, batches: list[MicroBatch]):
        """(tokens, labels, packed) of the whole step for the pipeline schedule, which cuts them
        into microbatches again: tokens on the first stage, labels on the last, packing on all."""
        runner = self.pipeline
        tokens = torch.cat([b.tokens for b in batches]) if runner.has_first else None
        labels = torch.cat([b.labels for b in batches]) if runner.has_last else None
        packed = None
        if self.spec.data.packing:
            packed = PackedSeqParams(
                torch.cat([b.packed.position_ids for b in batches]),
                torch.cat([b.packed.segment_ids for b in batches]),
            )
        return tokens, labels, packed

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss (token cross entropy, the mean over every label token that is not
        IGNORE_INDEX, as in training) and perplexity over the first `training.eval_iters` global
        batches of the validation split: the same batches every time, so evaluations compare
        across the run and across resumes. A collective."""
        t = self.spec.training
        gbs = t.global_batch_size
        n = num_microbatches(t, self.dp_size)
        self.phase = "evaluate"
        self.energy.pause()  # energy per step stays training energy
        for chunk in self.model_chunks:
            chunk.eval()

        def sum_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = GPTModel.loss_from_logits(logits, labels).float()
            return (loss * (labels != IGNORE_INDEX)).sum()

        total = torch.zeros(2, dtype=torch.float32, device=self.device)  # loss sum, label tokens
        for k in range(t.eval_iters):
            batches = self._stage_batches(n, self.valid_source, k * gbs)
            if self.pipeline is None or self.pipeline.has_last:
                total[1] += self._label_tokens(batches)
            if self.pipeline is None:
                for tokens, labels, packed in batches:
                    total[0] += sum_loss(self.model_chunks[0](tokens, packed_seq_params=packed), labels)
                continue
            tokens, labels, packed = self._pipeline_inputs(batches)
            for loss in self.pipeline.evaluate(n, tokens, labels, sum_loss, packed=packed):
                total[0] += loss
        if self.pipeline is not None:  # only the last stage has losses and counts
            dist.all_reduce(total, group=ps.get_group("pp"))
        if self.dp_size * self.spec.parallel.context > 1:
            dist.all_reduce(total, group=ps.get_group("dp_cp"))
        loss = float(total[0]) / max(float(total[1]), 1.0)
        self.energy.resume()
        return {"valid_loss": loss, "valid_ppl": math.exp(min(loss, 50.0))}

    def evaluate_if_due(self, metrics: StepMetrics) -> None:
        """Evaluate after iterations that are a multiple of training.eval_interval, and after the
        last one; the figures go into that iteration's metrics record."""
        t = self.spec.training
        if t.eval_interval is None or self.valid_source is None:
            return
        if self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters:
            result = self.evaluate()
            metrics.valid_loss, metrics.valid_ppl = result["valid_loss"], result["valid_ppl"]

    def _label_tokens(self, batches: list[MicroBatch]) -> torch.Tensor:
        """How many labels of these microbatches take a loss (fp32, on the device: no sync)."""
        return torch.stack([(b.labels != IGNORE_INDEX).sum() for b in batches]).sum().float()

    def _loss_weight(self, batches: list[MicroBatch], scale: float) -> torch.Tensor:
        """What a token's loss is multiplied by so that the step's loss is the mean over the
        global batch's label tokens (those not IGNORE_INDEX): the sum over every microbatch, DP
        and CP rank of the token losses, divided by their global count. The data-parallel
        reduction averages gradients over DP x CP, hence the factor dp x cp; times the fp16 loss
        scale. So the loss does not depend on the layout or on which samples share a microbatch
        (a per-microbatch mean would weight a token by its microbatch's count of label tokens,
        which differs a lot between fine-tuning samples). For pre-training every label counts
        and this is the plain mean. A global batch without any label token (conversations whose
        assistant turns were all truncated away) has loss 0 and zero gradients, never NaN.
        A collective over dp_cp on the ranks that read labels."""
        count = self._label_tokens(batches).reshape(1)
        replicas = self.dp_size * self.spec.parallel.context
        if replicas > 1:
            dist.all_reduce(count, group=ps.get_group("dp_cp"))
        return (replicas * scale) / count.clamp(min=1.0).reshape(())

    def _set_mtp_weights(self, batches: list[MicroBatch], scale: float) -> torch.Tensor | None:
        """Multi-token prediction (last stage): each depth's loss weight for this step, so that
        its loss is the mean over the global batch's tokens that have a target at that depth
        (engine.transformer.mtp); returns this rank's target counts per depth."""
        if self._mtp is None:
            return None
        c, d = self.config, self.config.mtp_num_layers
        local = torch.stack(
            [
                torch.stack([(shifted(b.labels, k, IGNORE_INDEX) != IGNORE_INDEX).sum() for b in batches]).sum()
                for k in range(1, d + 1)
            ]
        ).float()
        counts = local.clone()
        replicas = self.dp_size * self.spec.parallel.context
        if replicas > 1:
            dist.all_reduce(counts, group=ps.get_group("dp_cp"))
        factor = c.mtp_loss_scaling_factor / d * replicas * scale
        self._mtp.loss_weights = [factor / max(n, 1.0) for n in counts.tolist()]
        self._mtp.depth_sums.clear()
        return local

    def _mtp_loss(self, local_counts: torch.Tensor | None, num_microbatches: int) -> float | None:
        """The step's multi-token prediction loss, the mean over depths of each depth's mean token
        loss, on every rank (a collective over DP x CP and the pipeline when MTP is on)."""
        d = self.config.mtp_num_layers
        if not d:
            return None
        vec = torch.zeros(2 * d, device=self.device)
        if self._mtp is not None:
            vec[:d] = torch.stack(self._mtp.depth_sums[-num_microbatches:]).sum(dim=0)
            vec[d:] = local_counts
        if self.dp_size * self.spec.parallel.context > 1:
            dist.all_reduce(vec, group=ps.get_group("dp_cp"))
        if self.pipeline is not None:
            dist.all_reduce(vec, group=ps.get_group("pp"))
        return float((vec[:d] / vec[d:].clamp(min=1.0)).mean())

    def forward_backward(self, num_microbatches: int) -> torch.Tensor:
        """Accumulate grads of the step's loss (the mean over the global batch's label tokens,
        see _loss_weight) into the DP buffers; returns this rank's share of it times dp x cp (on
        every pipeline stage): its mean over DP x CP is the step's loss."""
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        set_aux_loss_scale(scale / num_microbatches)  # MoE balancing losses, scaled like the loss
        for ddp in self.ddp_chunks:
            ddp.start_step(num_microbatches)
        with self.timers("data", 1):
            batches = self._stage_batches(num_microbatches)
        runner = self.pipeline
        weight = self._loss_weight(batches, scale) if runner is None or runner.has_last else None
        mtp_counts = self._set_mtp_weights(batches, scale)

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            """The microbatch's share of the step's loss, times the fp16 loss scale."""
            loss = GPTModel.loss_from_logits(logits, labels).float()
            return (loss * (labels != IGNORE_INDEX)).sum() * weight

        if runner is None:
            scaled: list[torch.Tensor] = []
            model = self.ddp_chunks[0]
            for tokens, labels, packed in batches:
                mtp_labels = labels if self._mtp is not None else None
                with self.timers("forward", 1):
                    loss = loss_fn(model(tokens, packed_seq_params=packed, mtp_labels=mtp_labels), labels)
                with self.timers("backward", 1):
                    loss.backward()
                scaled.append(loss.detach())
        else:
            tokens, labels, packed = self._pipeline_inputs(batches)
            scaled = runner.run(num_microbatches, tokens, labels, loss_fn, packed=packed, mtp=self._mtp is not None)
        self.last_mtp_loss = self._mtp_loss(mtp_counts, num_microbatches)
        total = torch.stack(scaled).sum() if scaled else torch.zeros((), device=self.device)
        if self.pipeline is not None:  # only the last stage computed the loss
            total = total.reshape(1)
            dist.all_reduce(total, group=ps.get_group("pp"))
        return total.reshape(()) / scale

    def _validated_forward_backward(self, num_microbatches: int) -> torch.Tensor:
        """forward-backward + grad reduction, re-run by the rerun state machine while it asks;
        returns this DP rank's loss of the run that is kept."""
        rsm, res = self.rerun, self.spec.resilience
        loss = None
        while rsm.should_run_forward_backward(None):
            self.phase = "forward-backward"
            self.timers("forward-backward", 1).start()
            loss = self.forward_backward(num_microbatches)
            self.timers("forward-backward", 1).stop()
            self.phase = "grads-finalize"
            self.timers("grads-finalize", 1).start()
            finalize_model_grads(self.ddp_chunks)
            self.timers("grads-finalize", 1).stop()
            rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf")
            if res.spike_threshold is not None:
                rsm.validate_result(
                    loss,
                    lambda v: rsm.is_unexpectedly_large(v, res.spike_threshold, "loss", res.spike_window),
                    "loss spike",
                    fatal=False,
                )
            self.phase = "grad-norm"
            prepared = self.optimizer.prepare()
            # Under fp16 loss scaling an inf norm is the scaler's business (skip, lower the scale).
            if self.grad_scaler is None:
                rsm.validate_result(prepared.grad_norm, is_nan_or_inf, "grad norm is NaN or Inf")
        return loss

    def _act_on_rerun_decision(self, gbs: int) -> bool:
        """Checkpoint / exit / skip as the rerun state machine decided; True when the batch is
        skipped (no optimizer step, the samples count as consumed)."""
        decision = self.rerun.should_checkpoint_and_exit()
        if decision.checkpoint:
            if self.checkpointer is None or self.spec.checkpoint.path is None:
                raise RerunExit(
                    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                    f"{decision.message}; but checkpoint.path is not set, so it cannot be re-run elsewhere",
                    decision.diagnosis,
                )
            self.checkpointer.save()
            self.checkpointer.wait()
        if decision.exit_code:
            raise RerunExit(decision.exit_code, decision.message, decision.diagnosis)
        if decision.skip_batch:
            self.consumed_samples += gbs
            return True
        return False

    def _update_expert_bias(self) -> None:
        """Aux-loss-free MoE balancing: after the step, every router moves its expert bias with the
        step's token counts summed over every rank of its pipeline stage (each routed its own
        tokens: DP ranks, and TP ranks under sequence parallelism)."""
        for router in self._biased_routers:
            router.update_expert_bias(ps.get_group("tp_cp_dp"))

    def train_step(self) -> StepMetrics | None:
        """One iteration; None when the rerun state machine skipped its batch instead."""
        for chunk in self.model_chunks:
            chunk.train()
        device.synchronize()
        device.reset_peak_memory()
        start = time.perf_counter()
        self.microbatches.update(self.consumed_samples)
        n, gbs = self.microbatches.num_microbatches, self.microbatches.current_global_batch_size
        lr = self.optimizer.param_groups[0]["lr"]

        loss = self._validated_forward_backward(n)
        if self._act_on_rerun_decision(gbs):
            return None
        self.phase = "optimizer"
        self.timers("optimizer", 1).start()
        result = self.optimizer.step()
        if not result.skipped:  # a skipped (overflowing) step does not advance the schedule
            self.scheduler.step()
        self._update_expert_bias()
        self.timers("optimizer", 1).stop()

        # Each DP x CP rank's loss is its share of the global mean times dp x cp: average them.
        replicas = self.dp_size * self.spec.parallel.context
        if replicas > 1:
            dist.all_reduce(loss, group=ps.get_group("dp_cp"))
            loss /= replicas
        self.iteration += 1
        self.consumed_samples += gbs
        device.synchronize()
        elapsed = time.perf_counter() - start
        tokens = gbs * self.config.seq_length
        flops = model_flops_per_iteration(self.config, gbs)
        self.phase = "metrics"  # the energy and timer collectives
        lap = self.energy.lap()
        memory = device.memory_bytes()
        timers = {}
        if self.iteration % self.spec.training.log_interval == 0:
            timers = {k: [lo, hi] for k, (lo, hi) in self.timers.aggregate(STEP_TIMERS).items()}
        return StepMetrics(
            iteration=self.iteration,
            loss=float(loss),
            lr=lr,
            grad_norm=result.grad_norm,
            tokens=tokens,
            step_time_s=elapsed,
            tokens_per_s=tokens / elapsed,
            global_batch_size=gbs,
            consumed_samples=self.consumed_samples,
            loss_scale=result.loss_scale,
            skipped=result.skipped,
            timers=timers,
            rerun=self.rerun.summary(),
            model_flops=flops,
            mfu=mfu(flops, elapsed, dist.get_world_size(), self.peak_flops_per_device),
            energy_j=lap.energy_j if lap else None,
            power_w=lap.power_w if lap else None,
            energy_cumulative_j=lap.cumulative_j if lap else None,
            mtp_loss=self.last_mtp_loss,
            memory_allocated_bytes=memory[0] if memory else None,
            memory_peak_bytes=memory[1] if memory else None,
        )
