"""HSDP replicas as fault domains without Ray (engine/fault_tolerance/replica_group.py and
replica_quorum.py): two replicas of two ranks each (HSDP 2x2, ZeRO-1 inside each replica), every
rank a process of its own on gloo, the rendezvous of rounds served from this process (as the job
registry does on Ray), torchft's Lighthouse here too.

SIGKILL one rank of replica 1 (shard rank 0: its store and torchft server die with it): its peer
in replica 1 leaves the quorum and exits by itself once the dead rank's replacement joined (no
hang), replica 0 keeps stepping alone, the two replacements (started as Ray would: one right
after the kill, one once the peer is gone) form a new round, heal rank for rank from replica 0 and rejoin; both replicas
end bitwise equal shard rank for shard rank. Before the kill, the run's losses equal the plain
HSDP 2x2 engine run's (the same data per rank, grads averaged over the same four ranks).
About 15 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta
from multiprocessing.managers import BaseManager

import pytest

from engine.fault_tolerance.replica_quorum import ReplicaQuorum
from tests.engine.replica_messages import drain_until
from tests.tiny_jobs import TINY_LLAMA
from tests.tools import require_module

require_module("torchft", "torchft (a main dependency: pip install -e '.[dev]') is not installed")

ITERS = 150
KILL_AT = 12
S = 2

SPEC = {
    "name": "hsdp-quorum",
    "model": dict(TINY_LLAMA),
    "data": {"source": "text"},
    "parallel": {"data_parallel_sharding": "optim", "data_parallel_shard_size": S},
    "training": {"global_batch_size": 8, "micro_batch_size": 1, "train_iters": ITERS, "seed": 7, "log_interval": 1000},
    "optimizer": {"lr": 2e-3, "lr_warmup_iters": 1},
    "resilience": {"on_rank_failure": "replace_replica"},
    "resources": {"ranks": 2 * S, "device": "cpu"},
}
AUTHKEY = b"hsdp-rounds"


class _Rounds(BaseManager):
    pass


class _Quorum(ReplicaQuorum):
    """Writes this rank's state digest after the last step (before the loop tears down)."""

    final: dict = {}

    def shutdown(self) -> None:
        if self.trainer is not None and self.trainer.iteration == self.trainer.spec.training.train_iters:
            _Quorum.final["digest"] = self.state_digest()
        super().shutdown()


def _rank(
    replica: int, shard: int, lighthouse: tuple[str, str], rounds_at: tuple, outdir: str, spec: dict, die_at: int | None
) -> None:
    """One rank of one replica: joins its replica's round, trains `spec`; writes what it saw to a
    file of its own (a queue shared with a SIGKILLed process can stay locked). `die_at`: it
    SIGKILLs itself once it has reported that iteration."""
    import torch

    from engine.fault_tolerance.replica_group import form_replica_group
    from engine.jobspec import resolve_job
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank
    from workers.replicas import replica_job

    torch.set_num_threads(1)
    pid = os.getpid()
    sink = open(os.path.join(outdir, f"{replica}-{shard}-{pid}.jsonl"), "a")  # noqa: SIM115 - lives as long as the process

    def put(*message) -> None:
        sink.write(json.dumps(message) + "\n")
        sink.flush()

    put("started", replica, shard, pid)
    _Rounds.register("rounds")
    manager = _Rounds(address=tuple(rounds_at), authkey=AUTHKEY)
    manager.connect()
    group = form_replica_group(
        manager.rounds(), replica, shard, spec["resources"]["ranks"] // 2, backend="gloo", host="127.0.0.1", timeout=timedelta(seconds=20),
        setup_timeout_s=60,
    )
    put("formed", replica, shard, pid, group.round)
    quorum = _Quorum(
        replica,
        2,
        lighthouse_addr=lighthouse[0],
        liveness_addr=lighthouse[1],
        timeout_s=5,
        group=group,
        redistribute=spec["resilience"].get("lost_replica_share") == "redistribute",
    )

    def on_record(r: dict) -> None:
        put("record", replica, shard, pid, r["iteration"], r["replicas"], r["loss"], r["tokens"], time.time())
        if r["iteration"] == die_at:
            os.kill(pid, signal.SIGKILL)

    def on_event(e: dict) -> None:
        if e["kind"] in ("replica_rejoined", "replica_lost"):
            put("event", replica, shard, pid, e)

    try:
        train_rank(
            replica_job(resolve_job(spec)),
            quiet=True,
            hooks=RankHooks(on_record=on_record, on_event=on_event, quorum=quorum),
        )
    except BaseException:
        group.hold_if_lost()  # as workers/rank.py: exit once the dead peer was replaced
        raise
    group.close()
    put("done", replica, shard, pid, _Quorum.final.get("digest"))


def _reference(steps: int, spec: dict = SPEC) -> list[float] | None:
    """The plain HSDP 2x2 engine run of `spec` (one process group of four ranks, restart_group),
    stopped after `steps` steps: its losses."""
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank

    spec = {**spec, "resilience": {}}
    asked = [0]

    def stop() -> bool:
        asked[0] += 1
        return asked[0] > steps

    records = train_rank(spec, quiet=True, hooks=RankHooks(should_stop=stop))
    return [r["loss"] for r in records] if records else None


@contextlib.contextmanager
def _replicas(outdir, spec: dict, die_at: dict | None = None):
    """The rounds' server and torchft's Lighthouse in this process, and `start(replica, shard)`,
    which starts one rank process of `spec` (`die_at[(replica, shard)]`: the iteration after
    which it kills itself); every process and server stopped after."""
    from engine.fault_tolerance.lighthouse import Lighthouse
    from engine.fault_tolerance.replica_group import ReplicaRounds

    rounds = ReplicaRounds()
    lock = threading.Lock()

    class _Locked:  # the manager serves each connection on a thread of its own
        def join(self, *a):
            with lock:
                return rounds.join(*a)

        def round(self, *a):
            with lock:
                return rounds.round(*a)

    served = _Locked()
    _Rounds.register("rounds", callable=lambda: served)
    server = _Rounds(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()

    def serve() -> None:
        with contextlib.suppress(SystemExit):  # how serve_forever ends when stop_event is set
            server.serve_forever()

    threading.Thread(target=serve, daemon=True).start()
    lighthouse = Lighthouse(silent_timeout_ms=500)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "engine.device", "engine.train_loop"])
    procs: dict[tuple[int, int], list] = {}
    addresses = (lighthouse.address(), lighthouse.liveness_address())

    def start(replica: int, shard: int):
        dies = (die_at or {}).get((replica, shard))
        p = ctx.Process(
            target=_rank, args=(replica, shard, addresses, server.address, str(outdir), spec, dies), daemon=True
        )
        p.start()
        procs.setdefault((replica, shard), []).append(p)
        return p

    try:
        yield start, procs
    finally:
        for ps in procs.values():
            for p in ps:
                if p.is_alive():
                    p.kill()
        lighthouse.shutdown()
        server.stop_event.set()


def test_hsdp_replica_loses_a_rank_the_other_replica_goes_on_and_the_rebuilt_one_heals(tmp_path):
    from engine.launcher import spawn

    messages: list = []

    def drain(until, timeout_s: float = 60.0, what: str = ""):
        drain_until(tmp_path, messages, until, timeout_s, what)

    def records(replica: int) -> list:
        return [m for m in messages if m[0] == "record" and m[1] == replica]

    def reached(replica: int) -> int:
        return max((m[4] for m in records(replica)), default=0)

    with _replicas(tmp_path, SPEC) as (start, procs):
        for r in range(2):
            for s in range(S):
                start(r, s)
        drain(lambda: reached(0) >= KILL_AT, what=f"iteration {KILL_AT}")
        # Shard rank 0: the one that hosts the replica's store and its torchft ManagerServer
        # (tests/workers/test_ray_replace_replica_hsdp.py kills shard rank 1).
        victim, peer = procs[(1, 0)][0], procs[(1, 1)][0]
        before = reached(0)
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        start(1, 0)  # Ray replaces the dead worker at once
        peer.join(15)
        peer_exit_s = time.monotonic() - killed_at
        assert peer.exitcode is not None, "replica 1's surviving rank hung instead of exiting"
        start(1, 1)  # and then the one that exited once its peer's replacement had joined
        drain(lambda: reached(0) > before + 3, what="replica 0 stepping on")
        drain(
            lambda: sum(m[0] == "done" for m in messages) == 2 * S,
            timeout_s=90,
            what="every rank done",
        )

    assert peer.exitcode != 0 and peer_exit_s < 10, (peer.exitcode, peer_exit_s)
    done = {(m[1], m[2]): m for m in messages if m[0] == "done"}
    for s in range(S):
        assert done[(0, s)][4] is not None and done[(0, s)][4] == done[(1, s)][4], f"shard rank {s} differs"
    assert done[(0, 0)][4] != done[(0, 1)][4]  # each rank's digest is its own shard's
    alone = [m for m in records(0) if m[5] == 1]
    assert alone, "replica 0 never stepped alone"
    together = {m[4]: m for m in records(0) if m[5] == 2}
    assert all(m[7] * 2 == together[min(together)][7] for m in alone), "tokens trained by one replica of two"
    events = [(m[1], m[4]) for m in messages if m[0] == "event"]
    healed = [e for r, e in events if r == 1 and "heal_s" in e]
    assert {e["shard_rank"] for e in healed} == set(range(S)), healed
    # The replica that served the heal, rank for rank: the same digest at the step it rejoined.
    served = {(e["iteration"], e["shard_rank"]): e["state_digest"] for r, e in events if r == 0 and "rejoin_s" in e}
    assert all(served[(e["iteration"], e["shard_rank"])] == e["state_digest"] for e in healed), (healed, served)
    assert any(r == 0 and e["kind"] == "replica_lost" for r, e in events), events
    # Before the kill the run is the plain HSDP 2x2 run: the same samples per rank, the grads
    # averaged over the same four ranks (each replica's mean of two, then the mean of the two
    # replicas), so the losses agree to fp32 rounding: the loss is averaged in another order
    # (over the replicas, then within one, instead of over all four; measured: equal to ~1e-7,
    # not bitwise).
    first = sorted(i for i in together if i <= before)
    reference = spawn(_reference, 2 * S, args=(len(first),))[0]
    got = [together[i][6] for i in first]
    assert first == list(range(1, len(first) + 1))
    assert got == pytest.approx(reference[: len(got)], rel=1e-6, abs=1e-6)


# Replicas of two ranks: an HSDP shard group (ZeRO-1), or two pipeline stages (with a resize:
# live job's replica groups on Ray, workers/replicas.py; here torchft's replicas directly).
# layout: (parallel, model overrides, ranks per replica); pp3's middle stage reads no batches.
REPLICA_LAYOUTS = {
    "hsdp": (SPEC["parallel"], {}, S),
    "pp2": ({"pipeline": 2}, {}, 2),
    "pp3": ({"pipeline": 3}, {"num_layers": 3}, 3),
}


@pytest.mark.parametrize("layout", sorted(REPLICA_LAYOUTS))
def test_a_lost_replicas_share_is_taken_with_the_losses_of_the_uninterrupted_run(tmp_path, layout):
    """resilience.lost_replica_share: redistribute with replicas of several ranks: every rank of
    replica 1 dies after iteration 6 (a lost node) and is not replaced; replica 0 steps on alone,
    each of its ranks taking the same rank's share of replica 1 (its microbatches, read as
    that data-parallel rank) at half weight: with HSDP two shard ranks each read half of it, with
    pipeline parallelism every stage runs its microbatches after their own in one 1F1B schedule
    (engine/training.py, each target tagged with its share; with three stages the middle one
    reads no batches and counts them). Every iteration's loss, before and after the loss, equals
    the plain run's (one process group of both replicas' ranks: HSDP 2x2, PP=2 x DP=2 or
    PP=3 x DP=2) within 1e-6 relative, as the steps before a kill do in the test above."""
    from engine.launcher import spawn

    iters = 16
    spec = json.loads(json.dumps(SPEC))
    spec["training"]["train_iters"] = iters
    spec["resilience"]["lost_replica_share"] = "redistribute"
    spec["parallel"], model, size = REPLICA_LAYOUTS[layout]
    spec["model"].update(model)
    spec["resources"]["ranks"] = 2 * size
    messages: list = []
    with _replicas(tmp_path, spec, die_at={(1, s): 6 for s in range(size)}) as (start, procs):
        for r in range(2):
            for s in range(size):
                start(r, s)
        drain_until(
            tmp_path,
            messages,
            lambda: sum(m[0] == "done" and m[1] == 0 for m in messages) == size,
            timeout_s=90,
            what="replica 0's ranks done",
        )
    got = {m[4]: m for m in messages if m[0] == "record" and m[1] == 0 and m[2] == 0}
    assert sorted(got) == list(range(1, iters + 1)), sorted(got)
    assert [got[i][5] for i in sorted(got)] == [2] * 6 + [1] * (iters - 6)
    assert len({m[7] for m in got.values()}) == 1, "a step alone trained fewer tokens than the global batch"
    reference = spawn(_reference, 2 * size, args=(iters, spec))[0]
    assert [got[i][6] for i in sorted(got)] == pytest.approx(reference, rel=1e-6, abs=1e-6)


def test_rounds_a_rejoining_shard_rank_starts_the_next_round_and_supersedes_the_last():
    from engine.fault_tolerance.replica_group import ReplicaRounds

    rounds = ReplicaRounds()
    assert rounds.join(1, 1, 2, None) == 0
    assert not rounds.round(1, 0)["complete"]
    assert rounds.join(1, 0, 2, ("h", 5)) == 0
    assert rounds.round(1, 0) == {"complete": True, "superseded": False, "store": ("h", 5)}
    assert rounds.join(0, 0, 2, ("g", 6)) == 0  # replicas are independent
    # Shard rank 1 died and its replacement joins: a new round, the old one is superseded.
    assert rounds.join(1, 1, 2, None) == 1
    assert rounds.round(1, 0)["superseded"] and not rounds.round(1, 1)["complete"]
    assert rounds.join(1, 0, 2, ("h", 7)) == 1
    assert rounds.round(1, 1) == {"complete": True, "superseded": False, "store": ("h", 7)}
    assert rounds.round(1, 5) == {"complete": False, "superseded": False, "store": None}
