"""Re-execute a step whose result looks wrong, to tell a flaky device from a real bug.

Megatron-Core's design, in this engine's terms. The training step runs

    while rsm.should_run_forward_backward(data_iterator):
        loss = forward_backward(); rsm.validate_result(loss, is_nan_or_inf, "loss is NaN or Inf")
    decision = rsm.should_checkpoint_and_exit()   # before the optimizer step

and the machine decides whether to run the forward-backward again, in place, with the RNG
streams (and the data iterator, if it has state) put back to where the iteration started:

- initial run rejected (any rank) -> re-run in place on the same ranks;
- the re-run differs -> TRANSIENT error (a flaky device): train on the re-run's result;
- the re-run reproduces a fatal rejection -> save a checkpoint and exit 16, so the orchestrator
  resumes on other hardware and runs the iteration a third time there;
- that run differs from the first -> PERSISTENT error of the first device: exit 17 with that
  diagnosis (its checkpoint is re-saved without the pending rerun, so the resume that follows
  on healthy hardware simply trains on);
- it reproduces again -> CORRECT result, the data or the code produces it: exit 17, or with
  `resilience.skip_bad_batches` skip that global batch and go on;
- scheduled again on the suspect device (same node id and device) -> exit 16 again.

Every decision is agreed over all ranks with one SUM all-reduce of flags (any rank counts).
Where this differs from Megatron-Core: a transient error always continues with the re-run's
result when that result itself passes validation (Megatron-Core exits 17 on a fatal transient);
the re-run already is a validated result, and the event record names the flaky device for the
orchestrator. The node identity is the one the launcher gave `train_rank` (engine/rank_hooks.py:
Ray workers give the Ray node id), else `ELASTRON_NODE_ID` when set (a drill on one machine sets
it to pretend a move), else the host name.

`report_determinism_stats` re-runs every step once and reports how far the two runs differ per
validated value. Error injection (`resilience.error_injection_rate` / `_type`) rejects a result
with probability 1/rate, deterministic for the seed (the draw counter is checkpointed), and
rigs the later comparisons so the injected kind gets its diagnosis.

Every event (iteration, rank, host, device, result, diagnosis) is appended as one JSON line to
the rank's event record (event_log.py); what of the machine a checkpoint keeps, and its JSON form,
is checkpoint_state.py's. This module is the decisions alone: when to re-run, what a re-run's
result means, and what the loop does next.
"""

from __future__ import annotations

import logging
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from engine import device

# The exit codes a decision carries, named with the wire: the service explains them.
from engine.jobspec.contract import EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE
from engine.rerun.checkpoint_state import CommonState, RankState, checkpoint_entry, own_entry
from engine.rerun.event_log import EventLog, node_identity
from engine.tensor_parallel.random import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)



class RerunMode(StrEnum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(StrEnum):
    NOT_RUNNING_YET = "not_running_yet"
    INITIAL_RUN = "initial_run"
    RERUNNING_IN_PLACE = "rerunning_in_place"
    WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
    RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"
    RERUNNING_AGAIN_FROM_CHECKPOINT = "rerunning_again_from_checkpoint"


class Diagnosis(StrEnum):
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"
    CORRECT_RESULT = "correct_result"


class RerunExit(RuntimeError):
    """Raised on every rank when the job must stop with a rerun exit code (16 or 17)."""

    def __init__(self, exit_code: int, message: str, diagnosis: str | None = None):
        super().__init__(message)
        self.exit_code, self.message, self.diagnosis = exit_code, message, diagnosis

    def __reduce__(self):
        return (RerunExit, (self.exit_code, self.message, self.diagnosis))


@dataclass
class RerunDecision:
    """What the loop does after the forward-backward passes, before the optimizer step."""

    checkpoint: bool = False
    exit_code: int = 0
    skip_batch: bool = False
    diagnosis: Diagnosis | None = None
    message: str = ""


def is_nan_or_inf(value: Any) -> bool:
    return not math.isfinite(float(value))


def compare_floats(a: float, b: float) -> float:
    """Relative difference; two NaNs (or equal infinities) are the same result."""
    if (math.isnan(a) and math.isnan(b)) or a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


class ErrorInjector:
    """Rejects a validation with probability 1/rate; decides what the re-runs will show."""

    def __init__(self, rate: int, kind: Diagnosis, seed: int):
        self.rate, self.kind, self.seed, self.draws = rate, kind, seed, 0

    def maybe_inject(self) -> bool:
        if self.rate <= 0:
            return False
        self.draws += 1
        # A fresh generator per draw: the decision depends on (seed, draw) only, so a resumed
        # job (draws come back from the checkpoint) injects exactly where the first one would.
        return random.Random(self.seed * 1_000_003 + self.draws).random() < 1.0 / self.rate

    def rerun_differs(self, state: RerunState) -> bool:
        if state == RerunState.RERUNNING_IN_PLACE:
            return self.kind == Diagnosis.TRANSIENT_ERROR
        return self.kind == Diagnosis.PERSISTENT_ERROR


@dataclass
class _QuickStats:
    count: int = 0
    min: float = math.inf
    max: float = 0.0
    total: float = 0.0

    def record(self, diff: float) -> None:
        self.count += 1
        self.min, self.max, self.total = min(self.min, diff), max(self.max, diff), self.total + diff

    def summary(self) -> dict[str, float]:
        return {
            "count": self.count,
            "min": self.min,
            "max": self.max,
            "mean": self.total / max(self.count, 1),
        }


class RerunStateMachine:
    """One rank's machine, driven by the Trainer's step as the module docstring shows; every
    decision it returns is the same on every rank."""

    def __init__(
        self,
        mode: RerunMode | str = RerunMode.VALIDATE_RESULTS,
        *,
        seed: int = 0,
        tolerance: float = 0.0,
        injection_rate: int = 0,
        injection_type: Diagnosis | str = Diagnosis.TRANSIENT_ERROR,
        skip_bad_batches: bool = False,
        events: EventLog | None = None,
    ):
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.tolerance = tolerance
        self.skip_bad_batches = skip_bad_batches
        self.injector = ErrorInjector(injection_rate, Diagnosis(injection_type), seed)
        self.events = events or EventLog(None, "job")
        self.current_iteration = 0
        self.rank_state = RankState()
        self.counts = {"reruns": 0, "transient_errors": 0, "persistent_errors": 0, "correct_results": 0}
        self.skipped_batches: list[dict] = []
        self.diagnoses: list[dict] = []
        self._reset_flags()
        self._saved_rng: dict | None = None
        self._saved_data: Any = None
        self._call_seq: dict[str, int] = defaultdict(int)
        self._initial_results: dict[tuple[str, int], float] = {}
        self.stats: dict[str, _QuickStats] = defaultdict(_QuickStats)
        self._pending: RerunDecision | None = None
        # resilience.on_rank_failure replace_replica: this process group is one replica, and the
        # others must take every decision with it (a re-run is a second reduction over the
        # replicas, which they all must join): flags -> the flags OR-ed over the replicas
        # (engine/fault_tolerance/replica_quorum.py's any_over_replicas).
        self.across_replicas: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_spec(cls, resilience, seed: int, events: EventLog | None = None) -> RerunStateMachine:
        return cls(
            resilience.rerun_mode,
            seed=seed,
            tolerance=resilience.rerun_tolerance,
            injection_rate=resilience.error_injection_rate,
            injection_type=resilience.error_injection_type,
            skip_bad_batches=resilience.skip_bad_batches,
            events=events,
        )

    def _reset_flags(self) -> None:
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.persistent_found = False
        self.correct_found = False

    def follow_iteration(self, iteration: int) -> None:
        """Count the trainer's steps, not the tries: under replace_replica a step a replica
        failed in is not committed and is taken again, as the same iteration (the events name
        it). Only between steps: a re-run resumed from a checkpoint keeps the step it re-runs."""
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration = iteration

    # ------------------------------------------------------------------ agreement
    def _any(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over every rank (one all-reduce for all of them), and over the other
        replicas where `across_replicas` is set."""
        in_group = dist.is_initialized() and dist.get_world_size() > 1
        if not in_group and self.across_replicas is None:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device.current_device())
        if in_group:
            dist.all_reduce(t)
        if self.across_replicas is not None:
            t = self.across_replicas(t)
        return [bool(v) for v in t.tolist()]

    def _save_position(self, data_iterator: Any) -> None:
        self._saved_rng = capture_rng_state()
        self._saved_data = data_iterator.state_dict() if hasattr(data_iterator, "state_dict") else None

    def _restore_position(self, data_iterator: Any) -> None:
        restore_rng_state(self._saved_rng)
        if self._saved_data is not None:
            data_iterator.load_state_dict(self._saved_data)

    def _event(self, kind: str, only_rank0: bool = False, **fields: Any) -> None:
        if only_rank0 and dist.is_initialized() and dist.get_rank() != 0:
            return
        self.events.append(kind, iteration=self.current_iteration, **fields)

    # ------------------------------------------------------------------ the loop's calls
    def should_run_forward_backward(self, data_iterator: Any = None) -> bool:
        """Whether to (re)run the forward-backward of the current iteration.

        `data_iterator` is anything with state_dict()/load_state_dict() to rewind for a re-run,
        or None when batches are addressed by the consumed-sample count, which a step only
        advances after its optimizer update (this engine's samplers)."""
        self._call_seq = defaultdict(int)
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            self._reset_flags()
            self._forget_suspect()
            self._pending = None
            if self.mode != RerunMode.DISABLED:
                self._save_position(data_iterator)
            return True
        if self.state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED or not self._any(self.rerun_requested)[0]:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            self.counts["reruns"] += 1
            self.state = RerunState.RERUNNING_IN_PLACE
            self._restore_position(data_iterator)
            if self.mode == RerunMode.VALIDATE_RESULTS:
                self._event("rerun_in_place", only_rank0=True)
            return True
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            (reproduced,) = self._any(self.checkpoint_requested)
            if reproduced:
                # The checkpoint must hold the iteration's starting point, RNG included.
                self._restore_position(data_iterator)
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
                self._pending = RerunDecision(
                    checkpoint=True,
                    exit_code=EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                    message=f"iteration {self.current_iteration}: a rejected result reproduced in place; "
                    "resume from the checkpoint on other hardware to diagnose it",
                )
                self._event(
                    "rerun_from_checkpoint_needed", only_rank0=True, exit_code=self._pending.exit_code
                )
            else:
                self.state = RerunState.NOT_RUNNING_YET
            return False
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            self._save_position(data_iterator)
            self._event("rerun_from_checkpoint", only_rank0=True)
            return True
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            again, correct, persistent = self._any(
                self.restart_again_requested, self.correct_found, self.persistent_found
            )
            self._restore_position(data_iterator)
            self._pending = self._verdict(again, correct, persistent)
            if self.state == RerunState.NOT_RUNNING_YET:
                self._forget_suspect()
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {self.state.value}")

    def _forget_suspect(self) -> None:
        rs = self.rank_state
        rs.failed_call, rs.initial_result, rs.injected, rs.fatal, rs.suspicious = (
            None,
            None,
            False,
            True,
            None,
        )

    def _verdict(self, again: bool, correct: bool, persistent: bool) -> RerunDecision:
        it = self.current_iteration
        if again:
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            return RerunDecision(
                exit_code=EXIT_CODE_RESUME_TO_DISAMBIGUATE,
                message=f"iteration {it}: resumed on the suspect device again; resume on other hardware",
            )
        if correct:
            self.counts["correct_results"] += 1
            self._record_diagnosis(Diagnosis.CORRECT_RESULT)
            if self.skip_bad_batches:
                self.state = RerunState.NOT_RUNNING_YET
                return RerunDecision(skip_batch=True, diagnosis=Diagnosis.CORRECT_RESULT)
            return RerunDecision(
                exit_code=EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                diagnosis=Diagnosis.CORRECT_RESULT,
                message=f"iteration {it}: correct result: the rejected result reproduces on other hardware, so the data or "
                "the code produces it (set resilience.skip_bad_batches: true to skip this batch)",
            )
        if persistent:
            self.counts["persistent_errors"] += 1
            suspect = self._record_diagnosis(Diagnosis.PERSISTENT_ERROR)
            # Re-saved without the pending rerun: the next resume, on healthy hardware, trains on.
            self.state = RerunState.NOT_RUNNING_YET
            return RerunDecision(
                checkpoint=True,
                exit_code=EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                diagnosis=Diagnosis.PERSISTENT_ERROR,
                message=f"iteration {it}: persistent error of the first device ({suspect}): its result does "
                "not reproduce on other hardware; exclude it and resume",
            )
        # Nothing was pending on any rank (e.g. the state came from another layout): train on.
        self.state = RerunState.NOT_RUNNING_YET
        return RerunDecision()

    def _record_diagnosis(self, diagnosis: Diagnosis) -> str:
        suspect = (
            ", ".join(f"{h}/{d}" for h, d in {tuple(s) for s in self._gather_suspects()}) or "unknown device"
        )
        entry = {"iteration": self.current_iteration, "diagnosis": diagnosis.value, "suspects": suspect}
        self.diagnoses.append(entry)
        self._event("diagnosis", only_rank0=True, diagnosis=diagnosis.value, suspects=suspect)
        return suspect

    def _gather_suspects(self) -> list[tuple[str, str]]:
        mine = self.rank_state.suspicious
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [mine] if mine else []
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return [s for s in everyone if s]

    def should_checkpoint_and_exit(self) -> RerunDecision:
        """Checkpoint / exit / skip, decided before the optimizer step (agreed on every rank)."""
        decision, self._pending = (self._pending or RerunDecision()), None
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return RerunDecision()
        if decision.skip_batch:
            entry = {"iteration": self.current_iteration, "diagnosis": Diagnosis.CORRECT_RESULT.value}
            self.skipped_batches.append(entry)
            self._event("batch_skipped", only_rank0=True)
            self.current_iteration -= 1  # the iteration is done again, on the next batch
        if decision.exit_code:
            self._event(
                "exit",
                only_rank0=True,
                exit_code=decision.exit_code,
                diagnosis=decision.diagnosis.value if decision.diagnosis else None,
                message=decision.message,
            )
        return decision

    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], bool],
        message: str,
        comparison_func: Callable[[float, float], float] | None = None,
        tolerance: float | None = None,
        fatal: bool = True,
    ) -> None:
        """Check a result of the forward-backward; a rejection on any rank re-runs the step.

        `fatal` results that reproduce go through the checkpoint-and-resume diagnosis; non-fatal
        ones (a loss spike) are trained on when they reproduce in place."""
        compare = comparison_func or compare_floats
        tol = self.tolerance if tolerance is None else tolerance
        if self.mode == RerunMode.DISABLED:
            if rejection_func(result):
                text = f"iteration {self.current_iteration}: unexpected result {float(result)} ({message})"
                self._event("result_rejected", result=float(result), message=message, fatal=fatal)
                if fatal:
                    raise RuntimeError(text)
                log.warning(text)
            return
        seq = self._call_seq[message]
        self._call_seq[message] += 1
        call = (message, seq)
        value = float(result)
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self._initial_results[call] = value
            elif self.state == RerunState.RERUNNING_IN_PLACE and call in self._initial_results:
                self.stats[message].record(compare(self._initial_results.pop(call), value))
            return
        rs = self.rank_state
        if self.state == RerunState.INITIAL_RUN and not self.rerun_requested:
            injected = self.injector.maybe_inject()
            if injected or rejection_func(result):
                rs.failed_call, rs.initial_result, rs.injected, rs.fatal = call, value, injected, fatal
                self.rerun_requested = True
                self._event("result_rejected", result=value, message=message, injected=injected, fatal=fatal)
            return
        if self.state not in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT):
            return
        if rs.failed_call is None or tuple(rs.failed_call) != call:
            return
        if rs.injected:
            differs = self.injector.rerun_differs(self.state)
        else:
            differs = compare(rs.initial_result, value) > tol
        fields = {
            "result": value,
            "initial_result": rs.initial_result,
            "message": message,
            "injected": rs.injected,
        }
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if differs and not (rs.fatal and not rs.injected and rejection_func(result)):
                self.counts["transient_errors"] += 1
                self._event("diagnosis", diagnosis=Diagnosis.TRANSIENT_ERROR.value, **fields)
                self.diagnoses.append(
                    {"iteration": self.current_iteration, "diagnosis": Diagnosis.TRANSIENT_ERROR.value}
                )
                rs.failed_call = None
            elif rs.fatal:
                self.checkpoint_requested = True
                rs.suspicious = node_identity(self.events.node_id)
                self._event("rerun_reproduced", **fields)
            else:
                self._event("rerun_reproduced", continuing=True, **fields)
                rs.failed_call = None
            return
        if tuple(node_identity(self.events.node_id)) == tuple(rs.suspicious or ()):
            self.restart_again_requested = True
            self._event("rerun_on_suspect_device", **fields)
        elif differs:
            self.persistent_found = True
            self._event("rerun_differs_elsewhere", **fields)
        else:
            self.correct_found = True
            self._event("rerun_reproduced_elsewhere", **fields)

    def is_unexpectedly_large(
        self, result: Any, threshold: float, context: str, num_samples: int = 100
    ) -> bool:
        """A rejection function: |result| >= threshold x the largest of the first `num_samples`
        values seen for `context` (NaN/Inf are left to is_nan_or_inf)."""
        value = abs(float(result))
        if not math.isfinite(value):
            return False
        rs = self.rank_state
        count = rs.spike_count.get(context, 0)
        if count < num_samples:
            rs.spike_count[context] = count + 1
            rs.spike_max[context] = max(rs.spike_max.get(context, 0.0), value)
            return False
        return value >= threshold * rs.spike_max[context]

    # ------------------------------------------------------------------ reporting and checkpoints
    def summary(self) -> dict[str, Any]:
        """Counters for the metrics record (and determinism stats in that mode)."""
        out: dict[str, Any] = dict(self.counts)
        out["skipped_batches"] = len(self.skipped_batches)
        if self.stats:
            out["determinism"] = {k: v.summary() for k, v in self.stats.items()}
        return out

    def state_dict(self) -> tuple[CommonState, dict]:
        """(state common to every rank, this rank's own), both JSON-able (checkpoint_state.py)."""
        common = CommonState(
            mode=self.mode.value,
            state=self.state.value,
            current_iteration=self.current_iteration,
            injector_draws=self.injector.draws,
            counts=dict(self.counts),
            skipped_batches=list(self.skipped_batches),
            diagnoses=list(self.diagnoses),
        )
        return common, self.rank_state.to_json()

    def load_state_dict(self, common: CommonState, mine: dict | None) -> None:
        """Restore from a checkpoint; `mine` is None when the layout changed, in which case a
        pending rerun cannot be compared rank by rank and is dropped (the iteration simply runs
        again and is validated afresh)."""
        self.injector.draws = common["injector_draws"]
        self.counts.update(common["counts"])
        self.skipped_batches = list(common["skipped_batches"])
        self.diagnoses = list(common["diagnoses"])
        if mine is not None:
            self.rank_state = RankState.from_json(mine)
        state = RerunState(common["state"])
        if state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            if self.mode != RerunMode.VALIDATE_RESULTS or mine is None:
                why = "rerun_mode changed" if mine is not None else "the layout changed"
                self._event("rerun_abandoned", only_rank0=True, reason=why)
                return
            self.state = state
            self.current_iteration = common["current_iteration"]

    # ------------------------------------------------------------------ checkpoints
    # The machine's state as a checkpoint keeps it (checkpoint_state.py; engine/checkpointing/
    # stateful.py's RerunMachineState stores it in the manifest's meta["rerun"], a snapshot in its
    # meta).

    def checkpoint_state(self, gather: bool = True) -> dict[str, Any]:
        """{"common": ..., "ranks": [every rank's own]}: a collective unless `gather=False`
        (checkpoint_state.checkpoint_entry)."""
        return checkpoint_entry(*self.state_dict(), gather=gather)

    def load_checkpoint_state(self, saved: dict[str, Any] | None, same_layout: bool) -> None:
        """Restore what `checkpoint_state` gave. This rank's own state comes back only on the layout
        that saved it (otherwise a pending rerun is dropped: `load_state_dict`); checkpoints written
        before the machine existed have none (`saved` empty): nothing is restored then."""
        if not saved:
            return
        self.load_state_dict(saved["common"], own_entry(saved, same_layout))

    def resume_at(self, iteration: int) -> None:
        """Training continues after `iteration` (a resume, a snapshot restore): count from there,
        unless a rerun from the checkpoint is pending (it re-runs the iteration it saved)."""
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration = iteration
