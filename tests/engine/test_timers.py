import time

import pytest

from engine.launcher import spawn
from engine.timers import NOOP_TIMER, Timer, Timers


def test_elapsed_measures_a_sleep():
    timers = Timers()
    t = timers("work")
    t.start()
    time.sleep(0.05)
    t.stop()
    seconds = t.elapsed()
    assert 0.04 <= seconds <= 1.0
    assert t.elapsed() == 0.0  # the first read reset it
    assert 0.04 <= t.active_time() <= 1.0  # active time survives resets


def test_elapsed_accumulates_and_reads_without_reset():
    t = Timers()("acc")
    for _ in range(2):
        t.start()
        time.sleep(0.03)
        t.stop()
    assert 0.05 <= t.elapsed(reset=False) <= 1.0
    assert 0.05 <= t.elapsed() <= 1.0
    assert t.elapsed() == 0.0


def test_elapsed_of_a_running_timer_keeps_it_running():
    t = Timers()("running")
    t.start()
    time.sleep(0.02)
    assert t.elapsed() > 0.0
    assert t.running
    t.stop()


def test_same_name_returns_same_timer():
    timers = Timers()
    assert timers("a", 1) is timers("a", 1)
    assert isinstance(timers("a", 1), Timer)


def test_level_filtering_returns_the_noop_timer():
    timers = Timers(log_level=1)
    assert isinstance(timers("iteration", 0), Timer)
    assert isinstance(timers("step", 1), Timer)
    t = timers("per-microbatch", 2)
    assert t is NOOP_TIMER
    assert timers("other-frequent", 2) is t  # shared
    t.start()
    time.sleep(0.01)
    t.stop()
    t.stop()  # never complains
    assert t.elapsed() == 0.0
    assert t.active_time() == 0.0
    assert "per-microbatch" not in timers.names()
    assert timers.aggregate(["per-microbatch"]) == {}


def test_errors():
    t = Timers()("x")
    with pytest.raises(RuntimeError, match=r"timer 'x' is not running"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match=r"timer 'x' is already running"):
        t.start()
    t.stop()
    with pytest.raises(ValueError, match=r"log_level must be one of"):
        Timers(log_level=3)
    timers = Timers(log_level=2)
    timers("y", 1)
    with pytest.raises(
        ValueError, match=r"timer 'y' was created with log_level 1, now requested with log_level 2"
    ):
        timers("y", 2)


def test_context_manager():
    timers = Timers()
    with timers("ctx"):
        time.sleep(0.02)
    assert 0.015 <= timers("ctx").elapsed() <= 1.0


def test_aggregate_single_rank_without_distributed():
    timers = Timers()
    t = timers("fwd")
    t.start()
    time.sleep(0.02)
    t.stop()
    out = timers.aggregate(["fwd", "never-ran"], reset=False)
    assert set(out) == {"fwd"}
    lo, hi = out["fwd"]
    assert lo == hi and 0.015 <= lo <= 1.0
    halved = timers.aggregate(["fwd"], normalizer=2.0)["fwd"]
    assert halved[0] == pytest.approx(lo / 2)
    assert timers.aggregate(["fwd"]) == {}  # the previous call reset it


def test_format():
    line = Timers.format({"forward": (0.0123, 0.014), "backward": (0.0201, 0.0225)})
    assert line == "forward: 12.3/14.0 ms | backward: 20.1/22.5 ms"
    assert Timers.format({}) == ""


def _two_rank_timers() -> tuple[dict[str, tuple[float, float]], str]:
    import torch.distributed as dist

    rank = dist.get_rank()
    timers = Timers(log_level=2)
    with timers("step", 0):
        time.sleep(0.05 if rank == 0 else 0.15)
    if rank == 1:
        with timers("only-rank1", 1):
            time.sleep(0.1)
    aggregated = timers.aggregate(["step", "only-rank1", "nobody"], reset=False)
    line = timers.log_string(["step", "only-rank1"])
    return aggregated, line


def test_aggregate_min_max_over_two_ranks():
    results = spawn(_two_rank_timers, world_size=2, timeout_s=120)
    (agg0, line0), (agg1, line1) = results
    assert agg0 == agg1  # every rank gets the same answer
    assert set(agg0) == {"step", "only-rank1"}
    step_min, step_max = agg0["step"]
    assert 0.04 <= step_min <= 0.14  # rank 0's ~0.05 s
    assert 0.14 <= step_max <= 1.0  # rank 1's ~0.15 s
    assert step_max - step_min >= 0.05
    only_min, only_max = agg0["only-rank1"]
    assert only_min > 0.0  # rank 0's zero is excluded from the min
    assert only_min == only_max
    assert 0.09 <= only_min <= 1.0
    assert line0 == line1
    assert line0.startswith("step: ") and " | only-rank1: " in line0 and line0.endswith(" ms")
