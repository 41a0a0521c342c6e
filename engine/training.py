"""The Trainer: one rank's training state, built from a JobSpec, and one step over it.

`Trainer` is what every launcher drives (the local `elastron train`, Ray workers), through
engine/train_loop.py: built once, then one `train_step` per iteration that returns the iteration's
record. All collectives a step needs are inside `train_step`, so every rank calls it the same
number of times.

What the Trainer owns: putting the rank's parts together once (the rank grid and seeds; model,
optimizer and schedule from engine.model_setup; the objective; the data sources; the event record,
the rerun state machine, the persistent checkpointer and the in-memory snapshots), the counters
that say where training is (`iteration`, `consumed_samples`, and the `phase` a watchdog names),
and the order of a step: the quorum, the validated forward-backward, acting on the rerun decision,
the optimizer step, the record.

What it must not own: how any part does its job. The loss is the objective's; what a checkpoint
holds of a part is that part's (engine/checkpointing/stateful.py); the diagnosis of a bad result is
the rerun state machine's (engine/rerun/: the Trainer acts on its decision); a replica's place in
the quorum, and which replica writes the job's checkpoints, are the replica quorum's
(engine/fault_tolerance/replica_quorum.py); how a step is measured for its record is the step meter's
(engine/step_meter.py). Nor a launcher's concerns: watchdogs, snapshot stores and telemetry reach
the Trainer through the hooks of engine/rank_hooks.py; the loop over the steps is
engine/train_loop.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from engine import device
from engine import parallel_state as ps
from engine.checkpointing.checkpointer import Checkpointer, layout_signature
from engine.checkpointing.memory import HostSnapshot
from engine.checkpointing.snapshot_manager import SnapshotManager
from engine.checkpointing.state import ModelState, OptimizerState, RNGState
from engine.checkpointing.stateful import (
    DataPosition,
    GradScalerState,
    JobRecord,
    RerunMachineState,
    SchedulerState,
    Stateful,
)
from engine.data.builder import build_datasets
from engine.data.tokenizer import build_tokenizer
from engine.distributed.finalize_grads import finalize_model_grads
from engine.evaluation import evaluate
from engine.fault_tolerance.sync import ReplicaSync
from engine.hf.base_record import LoRABase
from engine.jobspec import JobSpec, ResolvedJob, resolve_job
from engine.jobspec.layout import num_microbatches
from engine.microbatches import MicrobatchCalculator
from engine.model_setup import build_model_and_optimizer
from engine.models import LanguageModel
from engine.objective import TrainingObjective
from engine.rank_hooks import RankIdentity
from engine.rerun.event_log import EventLog
from engine.rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    RerunExit,
    RerunStateMachine,
    is_nan_or_inf,
)
from engine.step_batches import StepBatches
from engine.step_meter import StepMeter
from engine.step_metrics import StepMetrics
from engine.tensor_parallel import model_parallel_manual_seed
from engine.timers import Timers
from engine.transformer.config import TransformerConfig
from engine.transformer.moe import TopKRouter


class Trainer:
    """One rank's training state. Needs an initialised torch.distributed default group.

    Built from parts that each own one idea: the model, optimizer and schedule
    (engine.model_setup), the objective (engine.objective), the data sources (each reads its
    own microbatches), the persistent checkpointer and the in-memory snapshots
    (engine.checkpointing); the Trainer runs one step over them and reports it."""

    def __init__(
        self,
        job: JobSpec | ResolvedJob,
        timer_level: int = 1,
        events_path: str | Path | None = None,
        *,
        identity: RankIdentity | None = None,
        on_event: Callable[[dict], None] | None = None,
        quorum: ReplicaSync | None = None,
    ):
        """`identity`: who runs this rank (default: this host); `on_event`: the launcher's hook
        for every event this rank records (engine/rank_hooks.py); `quorum`: this replica group's
        membership when replicas are fault domains (resilience.on_rank_failure: replace_replica,
        engine/fault_tolerance/replica_quorum.py): the group's process group holds its own ranks only,
        the data-parallel reduction over replicas goes through the quorum."""
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
        built = build_model_and_optimizer(spec, self.config, self.device, import_hf=self._will_import())
        self.model_chunks, self.ddp_chunks = built.model_chunks, built.ddp_chunks
        self.stage_indices, self.num_stages = built.stage_indices, built.num_stages
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.grad_scaler, self.pipeline, self.hf_import = built.grad_scaler, built.pipeline, built.hf_import
        moe = self.config.moe
        self._biased_routers = (
            [m for chunk in self.model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
            if moe is not None and moe.expert_bias
            else []
        )
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.replicas = self.dp_size * p.context  # the ranks the DP reduction averages over
        self.objective = TrainingObjective(
            self.model_chunks,
            self.config.mtp_num_layers,
            self.config.mtp_loss_scaling_factor,
            replicas=self.replicas,
            reads_labels=self.pipeline is None or self.pipeline.has_last,
            pipelined=self.pipeline is not None,
            device=self.device,
        )
        self.last_mtp_loss: float | None = None
        # The job's replicas, as the step sees them (engine/fault_tolerance/sync.py): one, or
        # replace_replica's quorum.
        self.replica_sync = quorum if quorum is not None else ReplicaSync()
        data_dp = self.replica_sync.data_rank(self.dp_size, self.dp_rank)  # the data this rank reads
        self.microbatches = MicrobatchCalculator.from_spec(t, data_dp[0])
        datasets = build_datasets(
            spec,
            tokenizer,
            self.config.seq_length,
            t.seed,
            num_samples=self._planned_samples(),
            synthetic_vocab_size=self.config.true_vocab_size,
        )
        self.source, self.valid_source = datasets.train, datasets.valid
        self.batches = StepBatches(
            t.micro_batch_size, data_dp[0], data_dp[1], self.pipeline, spec.data.packing, self.device
        )
        self.timers = Timers(log_level=timer_level)
        self.iteration = 0
        self.consumed_samples = 0
        # What this rank is doing now, for a watchdog to name when a step hangs.
        self.phase = "setup"
        self.meter = StepMeter(
            self.config,
            self.timers,
            device_type=self.device.type,
            log_interval=t.log_interval,
            dp_size=self.dp_size,
            replica_sync=self.replica_sync,
        )
        self.events = EventLog(events_path, spec.name, (identity or RankIdentity.local()).node_id, on_event)
        self.rerun = RerunStateMachine.from_spec(spec.resilience, t.seed, self.events)
        self.snapshots = SnapshotManager(
            self.checkpoint_parts,
            self.model_chunks,
            self.ddp_chunks,
            self.optimizer,
            self.rerun,
            job_name=spec.name,
            layout=layout_signature(p),
            local_interval=spec.checkpoint.local_interval,
            train_iters=t.train_iters,
        )
        # Last: a resume overwrites the counters, weights, optimizer, schedule and rerun state.
        self.checkpointer = None
        if spec.checkpoint.path or spec.checkpoint.resume_from:
            self.checkpointer = self.make_checkpointer()
            self.checkpointer.maybe_resume()  # the rerun machine's part moves it to our iteration
        self.replica_sync.attach(self)  # after the resume: what a peer heals from is this state
        self.rerun.across_replicas = self.replica_sync.across_replicas

    def _will_import(self) -> bool:
        """model.init_from's weights are loaded unless the job resumes: its checkpoint has newer
        weights."""
        c = self.spec.checkpoint
        if self.spec.model.init_from is None:
            return False
        if self.spec.model.lora is not None:  # its checkpoints hold the adapters, never the base
            return True
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
            **({"lora_base": LoRABase(self.spec.model.init_from, self.spec.training.seed)} if self.spec.model.lora else {}),
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

    # The in-memory snapshot calls launchers make (engine.checkpointing.snapshot_manager).
    def snapshot_due(self) -> bool:
        return self.snapshots.due(self.iteration)

    def capture_snapshot(self, buffer: bytearray | None = None) -> HostSnapshot:
        return self.snapshots.capture(buffer)

    def parse_snapshot(self, blob: bytes | bytearray | memoryview) -> HostSnapshot:
        return self.snapshots.parse(blob)

    def restore_snapshot(self, blob: bytes | bytearray | memoryview | HostSnapshot) -> int:
        return self.snapshots.restore(blob)

    def save_checkpoint_if_due(self) -> bool:
        """Save after iterations that are a multiple of checkpoint.interval, and after the last."""
        c = self.spec.checkpoint
        if self.checkpointer is None or c.path is None:
            return False
        if not self.replica_sync.writes_checkpoint:
            return False
        last = self.iteration == self.spec.training.train_iters
        if last or (c.interval is not None and self.iteration % c.interval == 0):
            self.phase = "checkpoint-save"
            self.meter.pause()  # energy per step is training energy, as in Megatron-Core
            with self.timers("checkpoint-save", 1):
                self.checkpointer.save()  # with async_save: the time training is blocked
            self.meter.resume()
            return True
        return False

    @property
    def model(self) -> LanguageModel:
        """The whole model when there is no pipeline parallelism."""
        if len(self.model_chunks) != 1 or self.pipeline is not None:
            raise AttributeError("this rank holds pipeline stages: use model_chunks")
        return self.model_chunks[0]

    def evaluate(self) -> dict[str, float]:
        """Validation loss and perplexity (engine.evaluation). A collective."""
        t = self.spec.training
        self.phase = "evaluate"
        self.meter.pause()  # energy per step stays training energy
        result = evaluate(
            self.model_chunks,
            self.batches,
            self.valid_source,
            eval_iters=t.eval_iters,
            global_batch_size=t.global_batch_size,
            num_microbatches=num_microbatches(t, self.dp_size),
            replicas=self.replicas,
            device=self.device,
        )
        self.meter.resume()
        return result

    def evaluate_if_due(self, metrics: StepMetrics) -> None:
        """Evaluate after iterations that are a multiple of training.eval_interval, and after the
        last one; the figures go into that iteration's metrics record."""
        t = self.spec.training
        if t.eval_interval is None or self.valid_source is None:
            return
        if self.iteration % t.eval_interval == 0 or self.iteration == t.train_iters:
            result = self.evaluate()
            metrics.valid_loss, metrics.valid_ppl = result["valid_loss"], result["valid_ppl"]

    def forward_backward(self, num_microbatches: int) -> torch.Tensor:
        """Accumulate grads of the step's loss (the mean over the global batch's label tokens,
        engine.objective) into the DP buffers; returns this rank's share of it times dp x cp (on
        every pipeline stage): its mean over DP x CP is the step's loss. A replica that takes the
        shares of replicas missing from its quorum (`ReplicaSync.step_shares`) runs their
        microbatches too, each share weighted by its own label tokens, and scales the whole by
        the quorum's part of the job, so the quorum's average is the uninterrupted run's."""
        scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        # Shares of replicas missing from the quorum this rank takes (lost_replica_share:
        # redistribute; engine/fault_tolerance/sync.py): more backward passes into the buffers.
        shares = self.replica_sync.step_shares(num_microbatches, self.dp_size, self.dp_rank)
        for ddp in self.ddp_chunks:
            ddp.start_step(num_microbatches + shares.extra_microbatches)
        if self.replica_sync.sits_out:
            # This replica heals in this step and gives zeros to its reduction
            # (engine/fault_tolerance/replica_quorum.py): nothing to compute.
            return torch.zeros((), device=self.device)
        with self.timers("data", 1):
            batches = self.batches.read(self.source, self.consumed_samples, num_microbatches)
            # A missing share is read whole: its loss is the mean over its own label tokens.
            taken = [
                (self.batches.read(self.source, self.consumed_samples, num_microbatches, rank), picked)
                for rank, picked in shares.extra
            ]
        # Share 0 is this rank's own, then each missing replica's it takes (its microbatches
        # `picked`); a middle pipeline stage reads none (step_batches.StepBatches.read).
        work = [batches, *([whole[m] for m in picked] if whole else [] for whole, picked in taken)]
        losses = self.objective.begin_shares(
            [[b.labels for b in batches], *([b.labels for b in whole] for whole, _ in taken)],
            scale * shares.weight,
            num_microbatches,
        )
        runner, with_mtp = self.pipeline, self.objective.mtp is not None
        if runner is None:
            scaled: list[torch.Tensor] = []
            model = self.ddp_chunks[0]
            for share, microbatches in enumerate(work):
                fn = losses.of(share)
                for tokens, labels, packed, inputs in microbatches:
                    mtp_labels = labels if with_mtp else None
                    with self.timers("forward", 1):
                        logits = model(tokens, packed_seq_params=packed, mtp_labels=mtp_labels, **(inputs or {}))
                        loss = fn(logits, labels)
                    with self.timers("backward", 1):
                        loss.backward()
                    scaled.append(loss.detach())
        else:
            # Every share's microbatches in one schedule (torch's 1F1B needs at least as many as
            # stages, which one taken share may not have); with taken shares each target names
            # its share (MTP is refused with redistribute: engine/jobspec/job.py).
            microbatches = [b for share in work for b in share]
            tokens, labels, packed, inputs = self.batches.pipeline_inputs(microbatches)
            loss_fn = losses.of(0)
            if taken:
                loss_fn = losses.tagged
                labels = torch.cat([losses.tag(b.labels, i) for i, share in enumerate(work) for b in share]) if runner.has_last else None
            count = num_microbatches + shares.extra_microbatches  # a middle stage holds no batches
            scaled = runner.run(count, tokens, labels, loss_fn, packed=packed, mtp=with_mtp, inputs=inputs)
        self.last_mtp_loss = self.objective.mtp_loss(num_microbatches)
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
            loss = self.replica_sync.reduce(self.ddp_chunks, loss)  # over replicas
            self.timers("grads-finalize", 1).stop()
            if self.replica_sync.waits_for_peers:
                continue  # no result: nothing to validate, and nothing kept (not committed)
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
            if self.replica_sync.writes_checkpoint:  # every replica takes the decision (agreed)
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
        self.meter.start()
        self.phase = "quorum"
        # May heal: iteration and data position are the peer's.
        if not self.replica_sync.start_step(self.spec.training.train_iters):
            return None
        self.rerun.follow_iteration(self.iteration)
        self.microbatches.update(self.consumed_samples)
        n, gbs = self.microbatches.num_microbatches, self.microbatches.current_global_batch_size
        lr = self.optimizer.param_groups[0]["lr"]

        loss = self._validated_forward_backward(n)
        if self._act_on_rerun_decision(gbs):
            return None
        if not self.replica_sync.should_commit():
            return None  # a replica failed during the reduction: the step is taken again
        self.phase = "optimizer"
        self.timers("optimizer", 1).start()
        result = self.optimizer.step()
        if not result.skipped:  # a skipped (overflowing) step does not advance the schedule
            self.scheduler.step()
        self._update_expert_bias()
        self.timers("optimizer", 1).stop()

        # Each DP x CP rank's loss is its share of the global mean times dp x cp: average them.
        if self.replicas > 1:
            dist.all_reduce(loss, group=ps.get_group("dp_cp"))
            loss /= self.replicas
        self.iteration += 1
        self.consumed_samples += gbs
        self.meter.stop()
        self.phase = "metrics"  # the energy and timer collectives
        return self.meter.record(
            iteration=self.iteration,
            loss=float(loss),
            lr=lr,
            result=result,
            global_batch_size=gbs,
            consumed_samples=self.consumed_samples,
            rerun=self.rerun.summary(),
            mtp_loss=self.last_mtp_loss,
        )
