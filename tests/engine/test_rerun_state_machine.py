"""The rerun state machine on its own (one process, results fed by hand): every path through
the diagnosis, agreement-free. The multi-rank runs live in test_rerun_training.py."""

from __future__ import annotations

import json
import math

import pytest

from engine.rerun.event_log import EventLog
from engine.rerun.state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Diagnosis,
    ErrorInjector,
    RerunState,
    RerunStateMachine,
    compare_floats,
    is_nan_or_inf,
)


def step(rsm: RerunStateMachine, results: list[float], fatal: bool = True) -> tuple[int, object]:
    """One iteration: run the loop, feeding results[k] to the k-th pass; returns (passes, decision)."""
    passes = 0
    while rsm.should_run_forward_backward(None):
        rsm.validate_result(results[passes], is_nan_or_inf, "loss", fatal=fatal)
        passes += 1
    return passes, rsm.should_checkpoint_and_exit()


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_compare_floats_treats_nans_alike_and_is_relative():
    assert compare_floats(math.nan, math.nan) == 0.0
    assert compare_floats(math.inf, math.inf) == 0.0
    assert compare_floats(math.inf, math.nan) == math.inf
    assert compare_floats(2.0, 2.2) == pytest.approx(0.2 / 2.2)


def test_healthy_step_runs_once_and_decides_nothing(tmp_path):
    rsm = RerunStateMachine(events=EventLog(tmp_path / "ev.jsonl", "j"))
    passes, decision = step(rsm, [1.0])
    assert passes == 1 and decision.exit_code == 0 and not decision.checkpoint
    assert rsm.state == RerunState.NOT_RUNNING_YET and rsm.current_iteration == 1
    assert not (tmp_path / "ev.jsonl").exists()


def test_rerun_that_differs_is_a_transient_error_and_training_goes_on(tmp_path):
    log = tmp_path / "ev.jsonl"
    rsm = RerunStateMachine(events=EventLog(log, "j"))
    passes, decision = step(rsm, [math.nan, 1.5])
    assert passes == 2 and decision.exit_code == 0 and not decision.checkpoint
    assert rsm.counts["transient_errors"] == 1
    kinds = [e["kind"] for e in events(log)]
    assert kinds == ["result_rejected", "rerun_in_place", "diagnosis"]
    assert events(log)[-1]["diagnosis"] == "transient_error"


def test_rerun_that_reproduces_asks_for_a_checkpoint_and_exit_16():
    rsm = RerunStateMachine()
    passes, decision = step(rsm, [math.nan, math.nan])
    assert passes == 2
    assert decision.checkpoint and decision.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert rsm.state == RerunState.WILL_RERUN_FROM_CHECKPOINT


def test_a_rerun_that_differs_but_is_rejected_too_is_not_trusted():
    rsm = RerunStateMachine()
    _, decision = step(rsm, [math.inf, math.nan])
    assert decision.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE


def _resumed(rsm: RerunStateMachine, monkeypatch, node: str, **kwargs) -> RerunStateMachine:
    """A fresh machine on `node` loaded from `rsm`'s checkpointed state."""
    common, mine = rsm.state_dict()
    common, mine = json.loads(json.dumps(common)), json.loads(json.dumps(mine))  # as the manifest stores it
    monkeypatch.setenv("ELASTRON_NODE_ID", node)
    fresh = RerunStateMachine(**kwargs)
    fresh.load_state_dict(common, mine)
    return fresh


def test_it_follows_the_trainers_iteration_between_steps_only(monkeypatch):
    """replace_replica retakes a step a replica failed in (the Trainer calls follow_iteration
    before each): the retake is the same iteration. A re-run resumed from a checkpoint keeps the
    step it re-runs (the trainer's iteration is the one before it)."""
    monkeypatch.setenv("ELASTRON_NODE_ID", "node-a")
    rsm = RerunStateMachine()
    step(rsm, [1.0])
    step(rsm, [1.0])  # a try that was not committed
    rsm.follow_iteration(1)
    step(rsm, [1.0])
    assert rsm.current_iteration == 2
    step(rsm, [math.nan, math.nan])  # iteration 3 reproduces: exit 16
    resumed = _resumed(rsm, monkeypatch, "node-b")
    resumed.follow_iteration(2)  # the checkpoint's, the step before the one re-run
    assert resumed.current_iteration == 3


@pytest.mark.parametrize(
    ("third_result", "node", "expected_code", "expected"),
    [
        (math.nan, "node-b", EXIT_CODE_FAILED_ON_RESULT_VALIDATION, Diagnosis.CORRECT_RESULT),
        (1.25, "node-b", EXIT_CODE_FAILED_ON_RESULT_VALIDATION, Diagnosis.PERSISTENT_ERROR),
        (math.nan, "node-a", EXIT_CODE_RESUME_TO_DISAMBIGUATE, None),  # back on the suspect device
    ],
)
def test_rerun_from_checkpoint_diagnoses(monkeypatch, third_result, node, expected_code, expected):
    monkeypatch.setenv("ELASTRON_NODE_ID", "node-a")
    first = RerunStateMachine()
    step(first, [1.0])
    step(first, [math.nan, math.nan])
    resumed = _resumed(first, monkeypatch, node)
    assert resumed.state == RerunState.WILL_RERUN_FROM_CHECKPOINT and resumed.current_iteration == 2
    passes, decision = step(resumed, [third_result])
    assert passes == 1
    assert decision.exit_code == expected_code and decision.diagnosis == expected
    # Only a persistent error re-saves the checkpoint: without the pending rerun, so the next
    # resume (on healthy hardware) trains on; the others leave the checkpoint to rerun again.
    assert decision.checkpoint == (expected == Diagnosis.PERSISTENT_ERROR)
    if expected == Diagnosis.PERSISTENT_ERROR:
        assert resumed.state_dict()[0]["state"] == "not_running_yet"
        assert resumed.diagnoses[-1]["suspects"] == "node-a/cpu"


def test_correct_result_with_skip_bad_batches_skips_and_keeps_the_iteration_number(monkeypatch):
    monkeypatch.setenv("ELASTRON_NODE_ID", "node-a")
    first = RerunStateMachine()
    step(first, [math.nan, math.nan])
    resumed = _resumed(first, monkeypatch, "node-b", skip_bad_batches=True)
    _, decision = step(resumed, [math.nan])
    assert decision.skip_batch and decision.exit_code == 0
    assert resumed.skipped_batches == [{"iteration": 1, "diagnosis": "correct_result"}]
    passes, decision = step(resumed, [2.0])
    assert passes == 1 and not decision.skip_batch and resumed.current_iteration == 1


def test_a_pending_rerun_is_dropped_when_the_layout_changed(monkeypatch):
    first = RerunStateMachine()
    step(first, [math.nan, math.nan])
    common, _ = first.state_dict()
    fresh = RerunStateMachine()
    fresh.load_state_dict(common, None)
    assert fresh.state == RerunState.NOT_RUNNING_YET
    passes, decision = step(fresh, [1.0])
    assert passes == 1 and decision.exit_code == 0


def test_non_fatal_rejection_that_reproduces_is_trained_on():
    rsm = RerunStateMachine()
    passes, decision = step(rsm, [math.nan, math.nan], fatal=False)
    assert passes == 2 and decision.exit_code == 0 and not decision.checkpoint


def test_disabled_mode_fails_at_once_on_a_fatal_rejection_and_never_reruns():
    rsm = RerunStateMachine("disabled")
    assert step(rsm, [1.0])[0] == 1
    with pytest.raises(RuntimeError, match="unexpected result nan"):
        step(rsm, [math.nan])


def test_determinism_stats_mode_reruns_every_step_and_records_the_difference():
    rsm = RerunStateMachine("report_determinism_stats")
    for results in ([1.0, 1.0], [2.0, 2.5]):
        passes, decision = step(rsm, results)
        assert passes == 2 and decision.exit_code == 0
    stats = rsm.summary()["determinism"]["loss"]
    assert stats["count"] == 2 and stats["min"] == 0.0 and stats["max"] == pytest.approx(0.2)


def test_spike_detection_after_the_sampling_window():
    rsm = RerunStateMachine()
    samples = [3.0, 5.0, 4.0]
    assert not any(rsm.is_unexpectedly_large(v, 10.0, "loss", num_samples=3) for v in samples)
    assert not rsm.is_unexpectedly_large(49.0, 10.0, "loss", num_samples=3)
    assert rsm.is_unexpectedly_large(50.0, 10.0, "loss", num_samples=3)
    assert not rsm.is_unexpectedly_large(math.nan, 10.0, "loss", num_samples=3)  # NaN is not a spike


def test_injection_is_deterministic_for_a_seed_and_about_one_in_rate():
    def draws(seed: int) -> list[bool]:
        inj = ErrorInjector(10, Diagnosis.TRANSIENT_ERROR, seed)
        return [inj.maybe_inject() for _ in range(2000)]

    assert draws(3) == draws(3) and draws(3) != draws(4)
    assert 150 < sum(draws(3)) < 250
    assert not any(ErrorInjector(0, Diagnosis.TRANSIENT_ERROR, 3).maybe_inject() for _ in range(100))


@pytest.mark.parametrize(
    ("kind", "in_place_code", "after_move"),
    [
        ("transient_error", 0, None),
        ("persistent_error", EXIT_CODE_RESUME_TO_DISAMBIGUATE, Diagnosis.PERSISTENT_ERROR),
        ("correct_result", EXIT_CODE_RESUME_TO_DISAMBIGUATE, Diagnosis.CORRECT_RESULT),
    ],
)
def test_injected_kind_gets_its_diagnosis_on_healthy_results(monkeypatch, kind, in_place_code, after_move):
    monkeypatch.setenv("ELASTRON_NODE_ID", "node-a")
    rsm = RerunStateMachine(injection_rate=1, injection_type=kind)  # inject at the first validation
    _, decision = step(rsm, [1.0, 1.0])
    assert decision.exit_code == in_place_code
    if after_move is None:
        assert rsm.counts["transient_errors"] == 1
        return
    resumed = _resumed(rsm, monkeypatch, "node-b", injection_rate=1, injection_type=kind)
    _, decision = step(resumed, [1.0])
    assert decision.diagnosis == after_move and decision.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
