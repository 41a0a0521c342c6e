"""resilience.on_rank_failure: replace_replica on the shared 2-node cluster (conftest.py: two
one-CPU worker nodes, one replica per node): SIGKILL one replica's rank; the other replica keeps
stepping (its records go on, averaged over one replica) while Ray Train's controller replaces the
dead one, which heals from its live peer (the same state digest on both sides) and rejoins the
quorum; more kills of the replacement as it starts do not deadlock; the job finishes.

The job takes a missing replica's share (`resilience.lost_replica_share: redistribute`), so
every step's loss is compared with the uninterrupted run's (`elastron train`, DP=2,
restart_group). tests/workers/test_ray_replace_replica_hsdp.py runs the default, `skip`.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.ray_helpers import elastron_train, run

# Three kills on Ray (each replacement a new Ray worker process: ~5 s apiece on 2 cores once the
# warm process is used up); ten in a row are tests/engine/test_replica_quorum.py's, without Ray
# (FT_KILLS=10 FT_ITERS=600 runs ten here).
# Steps are ~15 ms on an idle 2-core machine: the survivor must outlast the three replacements.
ITERS = int(os.environ.get("FT_ITERS", 1000))
KILLS = int(os.environ.get("FT_KILLS", 3))


def _spec(tmp_path, **resilience) -> dict:
    return job(
        training={"train_iters": ITERS, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 80},
        resilience={"max_restarts": KILLS + 2, **resilience},
    )


def _replica_pid(telemetry, job_id: str, replica: int, after: float = 0.0) -> int | None:
    started = [
        e for e in telemetry.events(job_id, "replica_started") if e["replica"] == replica and e["ts"] > after
    ]
    return started[-1]["ranks"][0]["pid"] if started else None


def test_a_killed_replica_is_replaced_while_the_other_keeps_stepping(ray_cluster, telemetry, tmp_path):
    """Over 30 s: three replacements of a replica, each a new Ray worker process (~5 s on 2 cores),
    which the survivor's 1000 steps must outlast, and the reference run."""
    job_id = "ft-replace"
    seen: dict = {"kills": []}

    def interfere():
        pid = wait_for(lambda: _replica_pid(telemetry, job_id, 1), what="replica 1 started", timeout_s=120)
        # Late enough that each node's warm process is ready (workers/warm_processes.py).
        wait_for(lambda: any(r["iteration"] >= 60 for r in telemetry.records(job_id)), what="iteration 60")
        killed_at = time.time()
        reached = max(r["iteration"] for r in telemetry.records(job_id))
        os.kill(pid, signal.SIGKILL)
        seen["kills"].append(pid)
        healed = lambda after: [  # noqa: E731
            e for e in telemetry.events(job_id, "replica_rejoined") if e["ts"] > after and "heal_s" in e
        ]
        back = wait_for(lambda: healed(killed_at), what="replica 1 healed and back", timeout_s=120)[0]
        # The survivor kept stepping on its own while replica 1 was replaced.
        time.sleep(0.5)  # its records reach the receiver every 0.1 s
        seen["survivor_steps_alone"] = [
            r["iteration"]
            for r in telemetry.records(job_id)
            if r["replicas"] == 1 and r["iteration"] > reached and r["ts"] <= back["ts"]
        ]
        seen["first_rejoin_s"] = round(time.time() - killed_at, 2)
        # More in a row: each replacement killed as soon as it has started.
        for _ in range(KILLS - 1):
            pid = wait_for(
                lambda: (p := _replica_pid(telemetry, job_id, 1)) not in seen["kills"] and p,
                what="a replacement of replica 1",
                timeout_s=120,
            )
            os.kill(pid, signal.SIGKILL)
            seen["kills"].append(pid)
        seen["kills_s"] = round(time.time() - killed_at, 1)
        # The last replacement is left alone: it heals and trains to the end with its peer, or
        # (a fast machine) joins after its peer finished and ends too.
        seen["done"] = True

    threading.Thread(target=interfere, daemon=True).start()
    spec = _spec(tmp_path, on_rank_failure="replace_replica", warm_restart=True, lost_replica_share="redistribute")
    result = run(job_id, spec, tmp_path / "runs")
    assert result.exit_code == 0, result.reason
    # The survivor stepped on its own while replica 1 was out: steps averaged over one replica.
    # (After the first kill a warm replacement can rejoin before the survivor has dropped the dead
    # replica from its quorum: CI saw it back in 1.06 s, no step alone. The later replacements
    # start cold, seconds each, so the survivor steps alone then on any machine.)
    alone = [i for i, r in telemetry.final_records(job_id).items() if r["replicas"] == 1]
    assert alone, seen
    assert seen.get("done") and len(seen["kills"]) == KILLS, seen
    rejoined = telemetry.events(job_id, "replica_rejoined")
    healed = [e for e in rejoined if "heal_s" in e]
    survivors = [e for e in rejoined if "heal_s" not in e]  # the replica that served the heal
    assert healed and survivors, rejoined
    # Bitwise: the healed replica's state and its peer's at the step it rejoined.
    by_step = {e["iteration"]: e["state_digest"] for e in survivors}
    assert any(by_step.get(e["iteration"]) == e["state_digest"] for e in healed), (healed, survivors)
    for e in healed:
        if e["iteration"] in by_step:
            assert by_step[e["iteration"]] == e["state_digest"], (e, by_step)
    assert telemetry.events(job_id, "replica_lost")
    # Each replacement healed from the survivor, none is taken for a resume from the checkpoint.
    assert not telemetry.events(job_id, "recovered"), telemetry.events(job_id, "recovered")
    records = telemetry.final_records(job_id)
    assert max(records) == ITERS
    assert {r["replicas"] for r in records.values()} == {1, 2}
    # Every step against the uninterrupted run (elastron train, DP=2, restart_group): the steps
    # one replica took alone trained the missing replica's microbatch too (the same samples:
    # `tokens` is the whole batch's) with the same math, and the heals brought the survivor's
    # state, so each step's loss equals the reference's. Within 1e-5 relative, not bitwise: a
    # survivor adds the taken microbatch's gradient into its own buffer before the reduction,
    # where DP sums the two ranks' in the all-reduce (fp32 order; ~1e-7 a step in
    # tests/engine/test_replica_quorum.py, left room to grow over 1000 steps; measured here: 0.0).
    reference = {r["iteration"]: r["loss"] for r in elastron_train(_spec(tmp_path / "ref"), tmp_path / "ref")}
    assert sorted(records) == sorted(reference) == list(range(1, ITERS + 1))
    gap = max(abs(records[i]["loss"] - reference[i]) / reference[i] for i in reference)
    print(f"{len(alone)} steps alone; largest relative loss difference from the uninterrupted run: {gap:.2e}")
    assert gap < 1e-5, gap
    assert len({r["tokens"] for r in records.values()}) == 1, "a step alone trained fewer tokens than the batch"
    assert [records[i]["consumed_samples"] for i in range(1, ITERS + 1)] == [4 * i for i in range(1, ITERS + 1)]


def test_a_rerun_exit_of_the_replicas_goes_to_the_driver_at_once(ray_cluster, telemetry, tmp_path):
    """An injected persistent error: every replica re-runs the step, reproduces it and exits 16
    together (the decision is agreed over them: tests/engine/test_replica_quorum.py). Ray's
    controller hands that to the driver at once (workers/trainer.py's RerunExitToDriver) instead
    of restarting the replicas on the same nodes, where each exits 16 again, within max_restarts:
    measured before, four restarts of ~7 s in the first attempt, and the job's failure after
    196 s. On this 2-node cluster both nodes are suspect, so the driver fails the job with 16
    naming them (with a node to spare it resumes there: tests/workers/test_ray_elastic.py)."""
    job_id = "ft-rerun-exit"
    spec = job(
        training={"train_iters": 60, "log_interval": 40},
        checkpoint={"path": str(tmp_path / "ckpt"), "interval": 10},
        resilience={
            "on_rank_failure": "replace_replica",
            "max_restarts": 4,
            "error_injection_rate": 40,
            "error_injection_type": "persistent_error",
        },
    )
    result = run(job_id, spec, tmp_path / "runs")
    assert result.exit_code == 16 and "no room" in result.reason, result.reason
    (failed,) = telemetry.events(job_id, "attempt_failed")
    assert failed["attempt"] == 0 and {c["exit_code"] for c in failed["causes"]} == {16}, failed
    # Each replica started once: no restart inside the attempt.
    assert sorted(e["replica"] for e in telemetry.events(job_id, "replica_started")) == [0, 1]
    exits = [e for e in telemetry.events(job_id, "exit") if e["exit_code"] == 16]
    assert len(exits) == 2 and len({e["iteration"] for e in exits}) == 1, exits


def test_jobs_replace_replica_cannot_run_are_refused_naming_the_field():
    from engine.jobspec import parse_job, resolve_job
    from workers.replicas import check_replace_replica, replica_job

    def why(**sections):
        return check_replace_replica(parse_job(job(resilience={"on_rank_failure": "replace_replica"}, **sections)))

    assert why() is None
    assert check_replace_replica(parse_job(job(parallel={"tensor": 2}))) is None  # restart_group: no rule
    assert "parallel.tensor" in why(parallel={"tensor": 2})
    # HSDP: a replica is one shard group (tests/workers/test_ray_replace_replica_hsdp.py); two of them at least.
    hsdp = {"data_parallel_shard_size": 2, "data_parallel_sharding": "optim_grads_params"}
    assert why(parallel=hsdp, resources={"ranks": 4}, training={"global_batch_size": 8}) is None
    assert "resources.ranks >= 2 x 2 (the ranks of a replica group)" in why(parallel=hsdp, resources={"ranks": 2})
    assert "parallel.tensor" in why(parallel={**hsdp, "tensor": 2}, resources={"ranks": 8}, training={"global_batch_size": 8})
    assert "resources.ranks >= 2" in why(resources={"ranks": 1})
    one = replica_job(resolve_job(job(resilience={"on_rank_failure": "replace_replica"})))
    assert one.spec.resources.ranks == 1 and one.data_parallel_size == 1
    two = replica_job(resolve_job(job(parallel=hsdp, resources={"ranks": 4}, training={"global_batch_size": 8},
                                      resilience={"on_rank_failure": "replace_replica"})))
    assert two.spec.resources.ranks == 2 and two.data_parallel_size == 2
    assert two.spec.parallel.data_parallel_shard_size is None  # sharded over the whole replica
    # Tensor-parallel replica groups: only as runs of their own (resilience.resize: live).
    assert "needs resilience.resize: live" in why(parallel={"tensor": 2}, resources={"ranks": 4, "min_ranks": 2})
    live = {"on_rank_failure": "replace_replica", "resize": "live"}
    tp = job(parallel={"tensor": 2}, resources={"ranks": 4, "min_ranks": 2}, resilience=live)
    assert check_replace_replica(parse_job(tp)) is None
    group = replica_job(resolve_job(tp))
    assert (group.spec.resources.ranks, group.spec.parallel.tensor, group.data_parallel_size) == (2, 2, 1)
    # Pipeline-parallel replica groups likewise (tests/engine/test_replica_quorum_hsdp.py, tests/workers/test_ray_live_resize_groups.py).
    assert "parallel.pipeline = 2 needs resilience.resize: live" in why(parallel={"pipeline": 2}, resources={"ranks": 4, "min_ranks": 2})
    pp = job(parallel={"pipeline": 2}, resources={"ranks": 4, "min_ranks": 2}, resilience=live)
    assert check_replace_replica(parse_job(pp)) is None
    group = replica_job(resolve_job(pp))
    assert (group.spec.resources.ranks, group.spec.parallel.pipeline, group.data_parallel_size) == (2, 2, 1)
    # torch's interleaved 1F1B cannot take a missing share's microbatches on top of a step's.
    vp = {**pp, "parallel": {"pipeline": 2, "virtual_pipeline": 2}, "model": {**pp["model"], "num_layers": 4},
          "training": {**pp["training"], "global_batch_size": 8, "micro_batch_size": 1}}
    vp_redistribute = {**vp, "resilience": {**live, "lost_replica_share": "redistribute"}}
    assert check_replace_replica(parse_job(vp)) is None
    assert "cannot take parallel.virtual_pipeline (2)" in check_replace_replica(parse_job(vp_redistribute))
    cp = job(parallel={"context": 2}, resources={"ranks": 4, "min_ranks": 2}, resilience=live)
    assert "parallel.context = 1" in check_replace_replica(parse_job(cp))


def test_the_ray_internals_the_torchft_config_overrides_exist():
    """workers/trainer.py's torchft_config subclasses Ray's private _TorchftBackend and replaces
    its `_maybe_create_lighthouse_actor` and extends `on_start` (the liveness relay's address to
    every worker): an upgrade that moves them fails here, naming Ray."""
    import inspect

    import ray
    from ray.train.v2.torch import torchft_config as ft

    from engine.fault_tolerance.lighthouse import Lighthouse

    assert hasattr(ft, "_TorchftBackend"), ray.__version__
    assert hasattr(ft._TorchftBackend, "_maybe_create_lighthouse_actor"), ray.__version__
    assert "lighthouse_actor" in inspect.getsource(ft._TorchftBackend.__init__), ray.__version__
    from workers.trainer import torchft_config

    config = torchft_config(60, heartbeat_timeout_ms=300)
    assert issubclass(config.backend_cls, ft._TorchftBackend)
    # The kwargs are our Lighthouse's: the job's timeout is the silent one, not the relay's.
    assert set(config.lighthouse_kwargs) <= set(inspect.signature(Lighthouse).parameters)
    assert config.lighthouse_kwargs["silent_timeout_ms"] == 300
