"""Per-rank step times (the record's `timers_per_rank`, engine/step_metrics.py) and the straggler
flag computed from them (service/stragglers.py): a rank slowed on purpose stands out by its rank,
and is flagged, where the timers' min/max only say that some rank is slow."""

from __future__ import annotations

import time

from engine.launcher import spawn
from engine.rank_hooks import RankHooks
from engine.train_loop import train_rank
from service import stragglers
from tests.engine.parallel_harness import job

SLOW_S = 0.05  # added to every forward of rank 1


def _train_with_a_slow_rank(spec: dict) -> list[dict]:
    import torch.distributed as dist

    def slow_down(trainer) -> None:
        if dist.get_rank() != 1:
            return
        model = trainer.ddp_chunks[0]
        forward = model.forward

        def slowed(*args, **kwargs):
            time.sleep(SLOW_S)
            return forward(*args, **kwargs)

        model.forward = slowed

    return train_rank(spec, quiet=True, hooks=RankHooks(on_trainer=slow_down))


def test_a_rank_slowed_on_purpose_is_named_and_flagged():
    spec = job(2, training={"train_iters": 8, "global_batch_size": 4, "log_interval": 1})
    records = spawn(_train_with_a_slow_rank, 2, (spec,), timeout_s=240)[0]
    per_rank = [r["timers_per_rank"]["forward-backward"] for r in records]
    assert all(len(v) == 2 for v in per_rank)
    # Every step: rank 1's own compute holds the sleep, rank 0's does not.
    assert all(slow - fast > 0.8 * SLOW_S for fast, slow in per_rank), per_rank
    lo, hi = records[-1]["timers"]["forward-backward"]
    assert (lo, hi) == (min(per_rank[-1]), max(per_rank[-1]))  # the same numbers min/max summarise

    stats: dict = {}
    events = [e for r in records for e in stragglers.observe(stats, r)]
    assert stats["stragglers"] == [1]
    (flag,) = [e for e in events if e["kind"] == "straggler"]
    assert flag["data"]["rank"] == 1 and flag["iteration"] == stragglers.MIN_STEPS
    assert "rank 1 is a straggler" in flag["message"]


def test_no_straggler_without_one():
    stats: dict = {}
    records = [{"iteration": i, "timers_per_rank": {"forward-backward": [0.1, 0.11, 0.1, 0.105]}} for i in range(20)]
    assert [e for r in records for e in stragglers.observe(stats, r)] == []
    assert stats["stragglers"] == [] and max(stats["rank_slowness"]) < 1 + stragglers.MARGIN
    # Rank 2 slows down: flagged once its average passes the margin; cleared when it recovers.
    slow = [{"iteration": 20 + i, "timers_per_rank": {"forward-backward": [0.1, 0.1, 0.3, 0.1]}} for i in range(5)]
    kinds = [(e["kind"], e["data"]["rank"]) for r in slow for e in stragglers.observe(stats, r)]
    assert kinds == [("straggler", 2)]
    kinds = [(e["kind"], e["data"]["rank"]) for r in records for e in stragglers.observe(stats, r)]
    assert kinds == [("straggler_cleared", 2)]
    # A resize starts again: no verdict from fewer than MIN_STEPS samples.
    assert stragglers.observe(stats, {"iteration": 99, "timers_per_rank": {"forward-backward": [0.1, 0.5]}}) == []
    assert stats["stragglers"] == [] and stats["rank_steps"] == 1
