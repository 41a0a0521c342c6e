"""The seam a launcher calls the per-rank loop through (engine/rank_hooks.py): the engine's events
reach `RankHooks.on_event` in-process (the checkpointer's background save's too) and name the
node the launcher gave in `RankIdentity`, whatever the environment says; the events file is
still written for `elastron train`; a hook given twice is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.launcher import spawn
from engine.rank_hooks import RankHooks, RankIdentity
from engine.train_loop import train_rank
from tests.engine.parallel_harness import job


def _train_with_hooks(spec: dict, events_out: str) -> dict:
    events: list[dict] = []
    records: list[int] = []

    train_rank(
        spec,
        quiet=True,
        events_out=events_out,
        hooks=RankHooks(on_event=events.append, on_record=lambda r: records.append(r["iteration"])),
        identity=RankIdentity(node_id="node-from-launcher", job_id="j", rank=0, world_size=1),
    )
    return {"events": events, "records": records}


def test_events_reach_the_hook_in_process_with_the_launchers_node_id(tmp_path):
    spec = job(1, training={"train_iters": 4}, checkpoint={"path": str(tmp_path / "ckpt"), "interval": 2})
    events_out = tmp_path / "events.jsonl"
    (result,) = spawn(
        _train_with_hooks,
        1,
        (spec, str(events_out)),
        env={"ELASTRON_NODE_ID": "node-from-env"},
        timeout_s=240,
    )
    saved = [e for e in result["events"] if e["kind"] == "checkpoint_saved"]
    assert [e["iteration"] for e in saved] == [2, 4]
    assert {e["host"] for e in result["events"]} == {"node-from-launcher"}
    assert result["records"] == [1, 2, 3, 4]
    # the file `elastron train` keeps holds the same events
    written = [json.loads(line) for line in Path(events_out).read_text().splitlines()]
    assert [(e["kind"], e["iteration"], e["host"]) for e in written] == [
        (e["kind"], e["iteration"], e["host"]) for e in result["events"]
    ]


def test_a_hook_given_twice_is_refused():
    with pytest.raises(TypeError, match="on_record given both"):
        train_rank({}, on_record=print, hooks=RankHooks(on_record=print))


def _train_as(spec: dict, rank: int) -> str:
    try:
        train_rank(spec, quiet=True, identity=RankIdentity(node_id="n", rank=rank, world_size=1))
    except ValueError as err:
        return str(err)
    return "trained"


def test_an_identity_that_names_another_rank_is_refused():
    spec = job(1, training={"train_iters": 1})
    assert spawn(_train_as, 1, (spec, 3), timeout_s=120) == [
        "train_rank: the launcher says rank 3 of 1, the process group 0 of 1"
    ]


def _train_until_asked(spec: dict, stop_after: int | None) -> list[tuple[int, float]]:
    """Rank 0 alone is asked to stop once `stop_after` steps are done (None: never)."""
    import torch.distributed as dist

    box: dict = {}
    asked = stop_after is not None and dist.get_rank() == 0
    hooks = RankHooks(
        on_trainer=lambda t: box.setdefault("trainer", t),
        should_stop=lambda: asked and box["trainer"].iteration >= stop_after,
    )
    records = train_rank(spec, quiet=True, hooks=hooks)
    return [(r["iteration"], r["loss"]) for r in records]


def test_a_stop_request_to_one_rank_saves_the_current_step_on_all_and_loses_nothing(tmp_path):
    """Preemption's engine half: rank 0 alone is asked; both ranks stop at the same step (an
    agreed flag), save it although no save is due, and the resumed run ends with the losses of
    an uninterrupted one, bitwise."""
    ckpt = {"path": str(tmp_path / "ckpt"), "interval": 100}  # no save due before the end
    spec = job(2, training={"train_iters": 8}, checkpoint=ckpt)
    first = spawn(_train_until_asked, 2, (spec, 3), timeout_s=240)[0]
    assert [i for i, _ in first] == [1, 2, 3]
    committed = sorted(p.parent.name for p in (tmp_path / "ckpt").rglob("manifest.json"))
    assert committed == ["iter_0000003"], committed
    rest = spawn(_train_until_asked, 2, (spec, None), timeout_s=240)[0]
    assert [i for i, _ in rest] == [4, 5, 6, 7, 8]
    reference = spawn(
        _train_until_asked, 2, (job(2, training={"train_iters": 8}), None), timeout_s=240
    )[0]
    assert first + rest == reference
