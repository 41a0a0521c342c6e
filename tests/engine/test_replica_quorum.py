"""engine/fault_tolerance/replica_quorum.py without Ray: two data-parallel replicas, each a one-rank
process group of its own (forked from a forkserver with torch and the engine imported, so a
replacement starts in a fraction of a second), and torchft's Lighthouse in this process.

Ten SIGKILLs in a row of replica 1, each replacement killed at another moment of its life (as
soon as its process runs, while it builds, while it joins and heals, five steps after it
rejoined): the survivor never stops stepping, nothing deadlocks, the last replacement heals and
the two replicas end bitwise equal.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from tests.engine.replica_messages import drain_until, read_messages
from tests.tiny_jobs import TINY_LLAMA
from tests.tools import require_module

require_module("torchft", "torchft (a main dependency: pip install -e '.[dev]') is not installed")

KILLS = 10
ITERS = 1000  # the survivor must not finish before the tenth kill: ~10 ms steps idle
# The rerun state machine's events the replicas report (with the quorum's own).
RERUN_KINDS = ("rerun_in_place", "diagnosis", "exit", "checkpoint_saved")
SILENT_MS = 30_000  # a replica silent this long is dropped: far beyond the wait after a kill

SPEC = {
    "name": "quorum",
    "model": dict(TINY_LLAMA),
    "data": {"source": "text"},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": ITERS, "seed": 7, "log_interval": 1000},
    "optimizer": {"lr": 2e-3, "lr_warmup_iters": 1},
    "resilience": {"on_rank_failure": "replace_replica"},
    "resources": {"ranks": 1, "device": "cpu"},
}


def _replica(
    index: int,
    count: int,
    lighthouse: tuple[str, str],
    outdir: str,
    spec: dict | None = None,
    timeout_s: float = 5.0,
    delay_s: float = 0.0,
    die_at: int | None = None,
    leave_at: int | None = None,
) -> None:
    """One replica: a one-rank gloo group on a free port, the quorum, the engine's loop. It writes
    what it saw to a file of its own (a multiprocessing queue shared with a process that is then
    SIGKILLed can stay locked for every other writer). `lighthouse`: torchft's address and the
    liveness relay's (engine/fault_tolerance/lighthouse.py); `spec`: SPEC unless given; `delay_s`:
    it starts that much later (a peer built slower); `die_at`: it SIGKILLs itself once it has
    reported that iteration (a replica lost at a known step); `leave_at`: it is released (leaves
    the quorum, RankHooks.should_leave) once it has reported that iteration."""
    import json

    time.sleep(delay_s)
    import torch
    import torch.distributed as dist

    from engine.fault_tolerance.replica_quorum import ReplicaQuorum
    from engine.launcher import free_port
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    # A replacement killed while it joins can leave the survivor waiting on its store for the
    # manager's timeout: short here (steps take tens of milliseconds), so that costs seconds.
    spec = spec or SPEC
    quorum = ReplicaQuorum(
        index,
        count,
        lighthouse_addr=lighthouse[0],
        liveness_addr=lighthouse[1],
        timeout_s=timeout_s,
        redistribute=spec["resilience"].get("lost_replica_share") == "redistribute",
    )
    pid = os.getpid()
    sink = open(os.path.join(outdir, f"{index}-{pid}.jsonl"), "a")  # noqa: SIM115 - lives as long as the process

    class _Out:
        @staticmethod
        def put(message) -> None:
            sink.write(json.dumps(message) + "\n")
            sink.flush()

    out = _Out()

    final = {}
    released = []

    def on_record(r: dict) -> None:
        # mfu x step time: the step's FLOPs over its devices' peak (each replica's own time).
        out.put(
            (
                "record", index, pid, r["iteration"], r["replicas"], time.time(), r["loss"],
                r["mfu"] * r["step_time_s"], r["consumed_samples"],
            )
        )  # fmt: skip
        if r["iteration"] == spec["training"]["train_iters"]:  # the state after the last step
            final["digest"] = quorum.state_digest()
        if r["iteration"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if r["iteration"] == leave_at:
            released.append(r["iteration"])

    def on_event(e: dict) -> None:
        if e["kind"] in ("replica_rejoined", "replica_lost", "replica_left", "recovered", *RERUN_KINDS):
            out.put(("event", index, pid, e))

    iters = spec["training"]["train_iters"]
    out.put(("started", index, pid))
    hooks = RankHooks(on_record=on_record, on_event=on_event, quorum=quorum, should_leave=lambda: bool(released))
    train_rank(spec, quiet=True, hooks=hooks)
    out.put(("done", index, pid, iters if final else None, final.get("digest")))


def _addresses(lighthouse) -> tuple[str, str]:
    return lighthouse.address(), lighthouse.liveness_address()


def test_ten_kills_in_a_row_neither_stop_the_survivor_nor_deadlock(tmp_path):
    """Over 30 s: ten kills, each followed by a new replica process that imports torch and the
    engine before it rejoins (a forkserver preloads them, still ~2-3 s each on 2 cores).

    The Lighthouse would keep a silent replica for SILENT_MS (the job's
    replica_heartbeat_timeout_ms): the survivor goes on within seconds of each kill only because
    the killed process's closed connection to the liveness relay ends its heartbeats at once."""
    from engine.fault_tolerance.lighthouse import Lighthouse

    lighthouse = Lighthouse(silent_timeout_ms=SILENT_MS, join_timeout_ms=500)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    procs = []
    messages: list = []

    def start(index: int):
        p = ctx.Process(target=_replica, args=(index, 2, _addresses(lighthouse), str(tmp_path)), daemon=True)
        p.start()
        procs.append(p)
        return p

    def drain(until, timeout_s: float = 60.0):
        drain_until(tmp_path, messages, until, timeout_s)

    def together_after(t: float) -> int:
        return sum(m[0] == "record" and m[1] == 1 and m[4] == 2 and m[5] > t for m in messages)

    def survivor_iteration() -> int:
        return max((m[3] for m in messages if m[0] == "record" and m[1] == 0), default=0)

    try:
        start(0)
        victim = start(1)
        drain(lambda: any(m[0] == "record" and m[4] == 2 for m in messages))
        kills = []
        for k in range(KILLS):
            # Each replacement dies at another moment: as soon as its process runs, while it
            # builds, while it joins and heals, five steps after it rejoined.
            if k % 4 == 3:
                since = time.time()
                drain(lambda s=since: together_after(s) >= 5, timeout_s=60)
            else:
                time.sleep((0.0, 0.3, 0.8)[k % 4])
            reached = survivor_iteration()
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            kills.append(reached)
            # It goes on: well before the Lighthouse would have dropped a silent replica.
            drain(lambda r=reached: survivor_iteration() > r + 2, timeout_s=SILENT_MS / 1000 / 2)
            victim = start(1)
        assert survivor_iteration() < ITERS, "the survivor finished before the kills did: raise ITERS"
        drain(lambda: sum(m[0] == "done" for m in messages) == 2, timeout_s=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()

    done = {m[1]: m for m in messages if m[0] == "done"}
    assert done[0][3] == done[1][3] == ITERS
    assert done[0][4] == done[1][4], "the replicas ended with different states"
    healed = [m[3] for m in messages if m[0] == "event" and m[1] == 1 and m[3]["kind"] == "replica_rejoined"]
    assert healed and healed[-1]["heal_s"] is not None
    alone = [m for m in messages if m[0] == "record" and m[1] == 0 and m[4] == 1]
    assert alone, "the survivor never stepped alone"
    assert len(kills) == KILLS and kills == sorted(kills)


def _alone(spec: dict) -> None:
    """The job on one rank without a quorum (restart_group): a checkpoint to resume from."""
    import torch.distributed as dist

    from engine.launcher import free_port
    from engine.train_loop import train_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    train_rank(spec, quiet=True)


def test_a_replica_resumed_from_an_older_checkpoint_heals_from_the_newer_one(tmp_path):
    """Both replicas dead at once (or a replacement that built before a newer checkpoint was
    committed): each resumes whatever checkpoint it finds. The quorum must see who is behind by
    the iteration it trains, not by the steps its process took: replica 1, which found none, heals
    from replica 0 (resumed at iteration 6) and the two end equal. Only replica 0 writes the
    TensorBoard run (each replica is rank 0 of its own group)."""

    def spec(folder: str, iters: int, **resilience) -> dict:
        out = json.loads(json.dumps(SPEC))
        out["training"].update(train_iters=iters, loggers=["tensorboard"])
        out["checkpoint"] = {"path": str(tmp_path / folder), "interval": 1000}
        out["resilience"] = resilience or out["resilience"]
        return out

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    ahead = ctx.Process(target=_alone, args=(spec("a", 6, on_rank_failure="restart_group"),))
    ahead.start()
    ahead.join(120)
    assert ahead.exitcode == 0
    messages = _run_replicas([spec("a", 12), spec("b", 12)], tmp_path / "out")
    done = {m[1]: m for m in messages if m[0] == "done"}
    assert done[0][3] == done[1][3] == 12, done
    assert done[0][4] == done[1][4], "the replicas ended with different states"
    healed = [m[3] for m in messages if m[0] == "event" and m[1] == 1 and "heal_s" in m[3]]
    assert healed and healed[0]["iteration"] == 6, healed
    first = min(m[3] for m in messages if m[0] == "record" and m[1] == 1)
    assert first == 7  # replica 1 never trained iterations 1-6 itself
    # The quorum's first replica says the job resumed its checkpoint (replica 1 healed from it).
    resumed = [m for m in messages if m[0] == "event" and m[3]["kind"] == "recovered"]
    said = [(m[1], m[3]["iteration"], m[3]["recovered_from"]) for m in resumed]
    assert said == [(0, 6, "persistent")], resumed
    # TensorBoard: replica 0's run only (the first launch alone wrote its own there too).
    assert (tmp_path / "a" / "tensorboard").is_dir() and not (tmp_path / "b" / "tensorboard").exists()


def _run_replicas(
    specs: list[dict], outdir, delays: list[float] | None = None, die_at: list[int | None] | None = None
) -> list:
    """One replica per spec (of `len(specs)`), each to its end (replica i started `delays[i]`
    seconds late, and killed after its iteration `die_at[i]`); the messages they wrote. The
    quorum waits up to 60 s (not the kill test's 5): on a loaded CI machine the last of three
    replicas can take longer than 5 s to build, and the others' first quorum then fails."""
    from engine.fault_tolerance.lighthouse import Lighthouse

    lighthouse = Lighthouse(silent_timeout_ms=500)
    outdir.mkdir()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    procs = [
        ctx.Process(
            target=_replica,
            args=(
                i,
                len(specs),
                _addresses(lighthouse),
                str(outdir),
                spec,
                60.0,
                (delays or [0.0] * len(specs))[i],
                (die_at or [None] * len(specs))[i],
            ),
            daemon=True,
        )
        for i, spec in enumerate(specs)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return read_messages(outdir)


def test_replicas_resume_on_another_count_with_the_losses_of_data_parallelism(tmp_path):
    """A resize (the scheduler's, or Ray's elastic one) restarts the replicas at another count
    from the persistent checkpoint: 2 replicas for 8 steps, then 3 from there to 16. Against the
    same resize of a plain data-parallel job (restart_group, DP 2 then 3): the same losses within
    1e-5 (the reduction over replicas is torchft's average of each replica's mean instead of the
    engine's over data-parallel ranks, which could reorder fp32 sums; measured: bitwise equal)."""
    from engine.launcher import spawn
    from engine.train_loop import train_rank

    def spec(folder: str, iters: int, ranks: int, mode: str) -> dict:
        out = json.loads(json.dumps(SPEC))
        # 12 samples: 3 micro-batches of 2 per replica on 2, 2 on 3.
        out["training"].update(train_iters=iters, global_batch_size=12)
        out["checkpoint"] = {"path": str(tmp_path / folder), "interval": 1000}
        out["resilience"] = {"on_rank_failure": mode}
        out["resources"]["ranks"] = ranks
        return out

    got = {}
    for count, iters in ((2, 8), (3, 16)):
        messages = _run_replicas([spec("c", iters, 1, "replace_replica")] * count, tmp_path / f"out{count}")
        done = {m[1]: m for m in messages if m[0] == "done"}
        assert sorted(done) == list(range(count)) and {m[3] for m in done.values()} == {iters}, done
        assert len({m[4] for m in done.values()}) == 1, "the replicas ended with different states"
        records = [m for m in messages if m[0] == "record"]
        assert {m[4] for m in records} == {count}  # every step averaged over all of them
        # Every replica resumed the checkpoint (none healed): the first one says so, once.
        events = [m for m in messages if m[0] == "event"]
        resumed = [(m[1], m[3]["iteration"]) for m in events if m[3]["kind"] == "recovered"]
        assert resumed == ([(0, 8)] if count == 3 else []), resumed
        got.update({m[3]: m for m in records if m[1] == 0})
    assert sorted(got) == list(range(1, 17))  # the second launch resumed at 8, nothing repeated

    want, work = {}, {}
    for ranks, iters in ((2, 8), (3, 16)):
        (records, *_) = spawn(train_rank, ranks, (spec("ref", iters, ranks, "restart_group"), None, True))
        want.update({r["iteration"]: r["loss"] for r in records})
        work.update({r["iteration"]: r["mfu"] * r["step_time_s"] for r in records})
    # MFU counts every replica's devices, as data parallelism counts its ranks.
    assert all(abs(got[i][7] - work[i]) <= 1e-9 * work[i] for i in work), (got, work)
    losses = {i: m[6] for i, m in got.items()}
    gap = max(abs(losses[i] - want[i]) for i in want)
    print(f"largest loss difference over 16 steps: {gap:.2e}")
    assert gap < 1e-5, (losses, want)


def test_the_survivors_take_a_lost_replicas_share_with_the_losses_of_the_uninterrupted_run(tmp_path):
    """resilience.lost_replica_share: redistribute. Three replicas, three microbatches each, on
    fine-tuning data whose samples' counts of label tokens differ by up to 5x (so a share taken
    over must be weighted by its own count, not its taker's); replica 2 dies after iteration 4
    and is not replaced: from then on replicas 0 and 1 split its three microbatches (two and one)
    and weight their gradients by 2/3. Every iteration's loss equals the uninterrupted three
    replicas' within 1e-5 relative (fp32: the same samples and the same math, only the order of
    the sums differs, as a survivor adds a taken microbatch's gradient into its own before the
    reduction; measured 1e-7), and the consumed samples match. Shown failing: with `skip` the
    gap is 1e-2 (on the plain-text data, where every sample has the same count)."""
    from tests.engine.test_sft_training import conversations

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations()))

    def spec(**resilience) -> dict:
        out = json.loads(json.dumps(SPEC))
        out["model"]["seq_length"] = 128
        out["data"] = {"source": "sft", "path": str(chat)}
        out["training"].update(train_iters=12, global_batch_size=18)  # 3 microbatches of 2 per replica
        out["resilience"] = {"on_rank_failure": "replace_replica", "lost_replica_share": "redistribute", **resilience}
        return out

    def losses(messages: list, replicas: list[int]) -> dict[int, list]:
        done = {m[1]: m for m in messages if m[0] == "done"}
        assert sorted(done) == replicas and {m[3] for m in done.values()} == {12}, done
        assert len({m[4] for m in done.values()}) == 1, "the replicas ended with different states"
        got = {m[3]: m for m in messages if m[0] == "record" and m[1] == 0}
        assert sorted(got) == list(range(1, 13))  # one record per iteration
        return got

    got = losses(_run_replicas([spec()] * 3, tmp_path / "lost", die_at=[None, None, 4]), [0, 1])
    assert [got[i][4] for i in range(1, 13)] == [3] * 4 + [2] * 8  # replica 2 gone from iteration 5
    want = losses(_run_replicas([spec()] * 3, tmp_path / "whole"), [0, 1, 2])
    assert {want[i][4] for i in want} == {3}
    gap = max(abs(got[i][6] - want[i][6]) / abs(want[i][6]) for i in want)
    print(f"largest relative loss difference over 12 steps: {gap:.2e}")
    assert gap < 1e-5, ({i: m[6] for i, m in got.items()}, {i: m[6] for i, m in want.items()})
    assert [got[i][8] for i in want] == [want[i][8] for i in want]


def test_a_released_replica_leaves_at_a_step_boundary_and_a_new_one_grows_the_job_back(tmp_path):
    """A live resize, without Ray: 3 replicas, replica 2 released once it reported iteration 5 (the
    release travels with step 6's reduction; it leaves the quorum at the step boundary after it
    and its process ends), then a new replica 2 started: it heals from a live peer and trains on. Replicas 0 and 1 never stop and take replica 2's share while it
    is away (`redistribute`). No step of theirs fails (a release is not a loss: no
    `replica_lost`, and one record per iteration), and every iteration's loss equals the
    uninterrupted three replicas': within 1e-6 relative up to ten steps after the grow (fp32
    order of sums), within 1e-4 over the whole run (that rounding, amplified by training)."""
    from engine.fault_tolerance.lighthouse import Lighthouse

    iters = 200  # the new replica's start (a fork of a server with torch: ~4 steps here) well inside the run
    spec = json.loads(json.dumps(SPEC))
    spec["training"].update(train_iters=iters, global_batch_size=18)
    spec["resilience"]["lost_replica_share"] = "redistribute"
    lighthouse = Lighthouse(silent_timeout_ms=SILENT_MS, join_timeout_ms=500)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    out = tmp_path / "resize"
    out.mkdir()
    procs, messages = [], []

    def start(index: int, leave_at: int | None = None) -> None:
        args = (index, 3, _addresses(lighthouse), str(out), spec, 60.0, 0.0, None, leave_at)
        procs.append(ctx.Process(target=_replica, args=args, daemon=True))
        procs[-1].start()

    try:
        start(0), start(1), start(2, leave_at=5)
        drain_until(out, messages, lambda: any(m[0] == "done" and m[1] == 2 for m in messages), what="replica 2 released")
        assert procs[2].join(10) is None and procs[2].exitcode == 0
        start(2)  # the job grows back to three replicas
        drain_until(out, messages, lambda: sum(m[0] == "done" for m in messages) == 4, timeout_s=120, what="the end")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()

    events = [(m[1], m[3]) for m in messages if m[0] == "event"]
    assert [(r, e["iteration"]) for r, e in events if e["kind"] == "replica_left"] == [(2, 6)], events
    assert not [e for _, e in events if e["kind"] == "replica_lost"], events  # a release, not a loss
    assert [e for r, e in events if r == 2 and "heal_s" in e], events  # the new replica healed
    got = {}
    for m in messages:  # the record of each iteration, from whichever replica sent it
        if m[0] == "record":
            assert m[3] not in got or got[m[3]][4] == m[4], (got.get(m[3]), m)
            got.setdefault(m[3], m)
    assert sorted(got) == list(range(1, iters + 1))
    sizes = [got[i][4] for i in sorted(got)]
    assert sizes[:6] == [3] * 6 and sizes[6] == 2 and sizes[-1] == 3, sizes  # 3 -> 2 -> 3
    done = {m[2]: m for m in messages if m[0] == "done" and m[3] == iters}
    assert len(done) == 3 and len({m[4] for m in done.values()}) == 1, "the replicas ended with different states"

    whole = json.loads(json.dumps(spec))
    want = {m[3]: m for m in _run_replicas([whole] * 3, tmp_path / "whole") if m[0] == "record" and m[1] == 0}
    gaps = {i: abs(got[i][6] - want[i][6]) / abs(want[i][6]) for i in want}
    back = max(i for i in got if got[i][4] == 2) + 10  # ten steps after the job is whole again
    near, gap = max(gaps[i] for i in gaps if i <= back), max(gaps.values())
    print(f"3 -> 2 -> 3: {sizes.count(2)} steps on two replicas; largest relative loss difference {near:.2e} "
          f"up to iteration {back}, {gap:.2e} over {iters}")  # fmt: skip
    # Around the resize the losses differ by fp32 rounding only (the survivors sum a taken
    # microbatch's gradient in another order: measured <= 1.2e-7). Training then amplifies that
    # rounding as it amplifies any (measured up to 2.5e-5 by iteration 200, in no trend).
    assert near < 1e-6, gaps
    assert gap < 1e-4, gaps
    assert [got[i][8] for i in want] == [want[i][8] for i in want]


def test_a_missing_share_is_dealt_to_the_training_replicas_in_turn():
    """step_shares: the missing replicas' microbatches go round the training replicas in slot
    order (each computes the same deal from the same slots), read as the missing replica's data
    rank, and every training replica weights its gradients by its quorum's part of the job."""
    from engine.fault_tolerance.replica_quorum import ReplicaQuorum

    def deal(index: int, count: int, slots: list[int] | None, microbatches: int, dp_size: int = 1, dp_rank: int = 0):
        q = ReplicaQuorum(index, count, lighthouse_addr="unused:0", redistribute=True)
        q._slots = slots
        return q.step_shares(microbatches, dp_size, dp_rank)

    a, b = deal(0, 3, [0, 2], 3), deal(2, 3, [0, 2], 3)
    assert (a.extra, a.weight) == (((1, (0, 2)),), 2 / 3)
    assert (b.extra, b.weight) == (((1, (1,)),), 2 / 3)
    # Two missing of four, two microbatches each, on a replica of two ranks (its shard rank 1).
    c, d = deal(1, 4, [1, 3], 2, dp_size=2, dp_rank=1), deal(3, 4, [1, 3], 2, dp_size=2, dp_rank=1)
    assert c.extra == ((1, (0,)), (5, (0,))) and d.extra == ((1, (1,)), (5, (1,)))
    assert c.extra_microbatches + d.extra_microbatches == 4 and c.weight == 0.5
    assert deal(0, 3, None, 3).extra == () and deal(0, 3, None, 3).weight == 1.0  # all train
    assert deal(1, 3, [0, 2], 3).extra == ()  # not training this step (healing): nothing


def test_a_rejected_result_is_re_run_by_every_replica_or_by_none(tmp_path):
    """The rerun state machine (resilience.rerun_mode validate_results, the default) under
    replace_replica. A re-run is a second reduction over the replicas, so every replica of the
    quorum must re-run the step or none: its decisions are agreed over the quorum (each replica's
    own process group holds its ranks only). Injected transient errors (each replica draws its
    own: the draws count the steps a replica took, committed or not): both replicas re-run, train
    every step and end bitwise equal. Before the agreement a replica re-ran alone, waited for its
    peer until the quorum timeout and was lost (measured: 120 s, one replica left). Injected
    persistent errors: both exit 16, with the checkpoint the next run resumes from written
    (test_a_rerun_checkpoint_is_written_by_one_replica: by the quorum's first replica only)."""

    def spec(kind: str) -> dict:
        out = json.loads(json.dumps(SPEC))
        out["training"]["train_iters"] = 16
        out["checkpoint"] = {"path": str(tmp_path / kind), "interval": 1000}
        out["resilience"].update(error_injection_rate=4, error_injection_type=kind)
        return out

    def said(messages, kind: str) -> list[tuple[int, dict]]:
        return [(m[1], m[3]) for m in messages if m[0] == "event" and m[3]["kind"] == kind]

    messages = _run_replicas([spec("transient_error")] * 2, tmp_path / "transient")
    done = {m[1]: m for m in messages if m[0] == "done"}
    assert sorted(done) == [0, 1] and done[0][3] == done[1][3] == 16, done
    assert done[0][4] == done[1][4], "the replicas ended with different states"
    assert {replica for replica, _ in said(messages, "rerun_in_place")} == {0, 1}
    diagnoses = {e["diagnosis"] for _, e in said(messages, "diagnosis")}
    assert diagnoses == {"transient_error"}, diagnoses

    messages = _run_replicas([spec("persistent_error")] * 2, tmp_path / "persistent")
    assert not [m for m in messages if m[0] == "done"]  # both left the loop by the exit
    assert {(replica, e["exit_code"]) for replica, e in said(messages, "exit")} == {(0, 16), (1, 16)}
    # Written (by the quorum's first replica, which is replica 0 once both joined; a replica that
    # started late can instead resume the checkpoint its peer just wrote alone, and exits 16 at
    # once: resumed on the suspect device).
    assert said(messages, "checkpoint_saved"), messages


def test_a_replica_alone_before_its_peers_join_neither_trains_nor_decides_a_rerun(tmp_path):
    """A job's first replica up waits for the others: alone in its quorum it cannot commit a
    step, so it sits the steps out (no forward, backward or validation) until its peer joins.
    Before, it trained those steps alone (CPU taken from its peers' start) and validated them
    alone: with injected errors it re-ran steps, or exited 16, by itself. Here replica 1 starts
    4 s late under transient errors every ~4 validations: each replica re-runs exactly the steps
    the other does (the same iterations, as often), both end bitwise equal."""
    out = json.loads(json.dumps(SPEC))
    out["training"]["train_iters"] = 12
    out["checkpoint"] = {"path": str(tmp_path / "ckpt"), "interval": 1000}
    out["resilience"].update(error_injection_rate=4, error_injection_type="transient_error")
    messages = _run_replicas([out, out], tmp_path / "late", delays=[0.0, 4.0])
    done = {m[1]: m for m in messages if m[0] == "done"}
    assert sorted(done) == [0, 1] and done[0][3] == done[1][3] == 12, done
    assert done[0][4] == done[1][4], "the replicas ended with different states"
    reruns = {
        i: Counter(m[3]["iteration"] for m in messages if m[0] == "event" and m[1] == i and m[3]["kind"] == "rerun_in_place")
        for i in (0, 1)
    }
    assert reruns[0] and reruns[0] == reruns[1], reruns


def test_a_rerun_checkpoint_is_written_by_one_replica():
    """The checkpoint before a rerun's exit 16: every replica of the quorum takes the decision,
    the quorum's first replica alone writes it (two writing one checkpoint would race)."""
    from engine.fault_tolerance.replica_quorum import ReplicaQuorum
    from engine.rerun.state_machine import RerunDecision, RerunExit
    from engine.training import Trainer

    class _QuorumAt(ReplicaQuorum):  # the quorum's answer at a participating rank, no torchft
        def __init__(self, participating_rank: int) -> None:
            self._at = participating_rank

        @property
        def participating_rank(self) -> int:
            return self._at

    for participating_rank, writes in ((0, 1), (1, 0)):
        saves: list[str] = []
        exit_16 = RerunDecision(checkpoint=True, exit_code=16)
        trainer = SimpleNamespace(
            rerun=SimpleNamespace(should_checkpoint_and_exit=lambda d=exit_16: d),
            checkpointer=SimpleNamespace(save=functools.partial(saves.append, "save"), wait=lambda: None),
            spec=SimpleNamespace(checkpoint=SimpleNamespace(path="/ckpt")),
            replica_sync=_QuorumAt(participating_rank),
        )
        with pytest.raises(RerunExit):
            Trainer._act_on_rerun_decision(trainer, 4)
        assert len(saves) == writes, (participating_rank, saves)
