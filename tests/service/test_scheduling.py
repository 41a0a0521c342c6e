"""The scheduler wired into the service, with a fake launcher that reports a capacity: gang
admission never over capacity, priority and fair-share order, backfill and its reclaim,
preemption as a graceful stop then requeue and relaunch, quotas (wait with a reason, 403/422/429
at submission), GET /v1/queue, the job record's queue fields, metrics, the CLI, an API restart."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from elastron.cli import app as cli_app
from service.launcher import LauncherUnavailable, LaunchStatus
from service.scheduling.model import Node
from service.store.models import Job
from tests.service.conftest import ApiServer
from tests.service.launchers import FakeLauncher
from tests.service.test_attack_surfaces import scrape
from tests.waiting import wait_for

# Two nodes of 2 CPUs: 4 one-CPU ranks at most.
NODES = [Node("n1", cpus=2, gpus=0), Node("n2", cpus=2, gpus=0)]


def spec(name: str, ranks: int = 1, priority: int = 0, interval: int | None = 2, **scheduling) -> dict:
    body = {
        "name": name,
        "training": {"train_iters": 8, "global_batch_size": 8},
        "resources": {"ranks": ranks, "device": "cpu"},
        "scheduling": {"priority": priority, **scheduling},
    }
    if interval:
        body["checkpoint"] = {"interval": interval}
    return body


def submit(env, body: dict, who: str = "alice") -> str:
    with env.client(who) as c:
        r = c.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture
def fake() -> FakeLauncher:
    launcher = FakeLauncher()
    launcher.nodes = list(NODES)
    return launcher


def scheduled(env) -> None:
    """Wait until the reconciler has read the capacity (it then refuses what could never fit)."""
    wait_for(lambda: env.server.ctx.reconciler.capacity is not None, what="the first scheduling pass")


def events(env, job_id: str, kind: str) -> list[dict]:
    with env.client("admin") as c:
        return [e for e in c.get(f"/v1/jobs/{job_id}/events").json()["events"] if e["kind"] == kind]


def admitted_ranks(env, job_ids) -> int:
    return sum(e["data"]["ranks"] for j in job_ids for e in events(env, j, "admitted")[-1:])


def sid_of(env, job_id: str) -> str:
    return env.job(job_id, "admin")["submission_id"]


def test_order_gang_admission_backfill_reclaim_and_relaunch(start_env, fake):
    fake.up = False  # everything is queued before the first pass
    env = start_env(fake)
    a = submit(env, spec("big", ranks=4))
    b = submit(env, spec("urgent", ranks=2, priority=5))
    c = submit(env, spec("small", ranks=2))
    d = submit(env, spec("bobs", ranks=1), who="bob")
    fake.up = True
    # Priority first (b); then fair share at equal priority: bob holds nothing, alice b's 2 CPUs,
    # so d goes before alice's a and c; a (4 ranks) does not fit in the 1 CPU left and reserves.
    env.wait_state(b, "starting")
    env.wait_state(d, "starting")
    job_a = wait_for(lambda: (j := env.job(a))["queue_position"] == 1 and j, what="a first in the queue")
    assert job_a["state"] == "queued" and job_a["waiting_reason"].startswith("needs 4 ranks x (1 CPU, 0 GPU), 1 free")
    job_c = env.job(c)
    assert job_c["queue_position"] == 2 and "behind 1 job(s) of priority >= 0" in job_c["waiting_reason"]
    assert admitted_ranks(env, [b, d]) == 3
    (adm,) = events(env, b, "admitted")
    assert sum(adm["data"]["placement"].values()) == 2 and len(adm["data"]["placement"]) == 1  # gang, one node

    with env.client() as cl:
        queue = cl.get("/v1/queue").json()
    assert [j["id"] for j in queue["jobs"]] == [a, c] and [j["position"] for j in queue["jobs"]] == [1, 2]
    assert queue["cluster"] == {**queue["cluster"], "nodes": 2, "cpus": 4.0, "allocated_cpus": 3.0}
    with env.client("bob") as cl:
        assert cl.get("/v1/queue").json()["jobs"] == []  # a tenant sees its own
    with env.client("admin") as cl:
        assert [j["id"] for j in cl.get("/v1/queue").json()["jobs"]] == [a, c]

    # b ends: 3 CPUs free, still not 4 for a; c starts as backfill a may take back.
    fake.set_status(sid_of(env, b), LaunchStatus.SUCCEEDED)
    env.wait_state(c, "starting")
    (adm_c,) = events(env, c, "admitted")
    assert adm_c["data"]["backfilled_for"] == a
    assert env.job(a)["state"] == "queued"
    # d ends: a's 4 ranks fit only without c: c is preempted (a graceful stop), requeued behind a.
    fake.set_status(sid_of(env, d), LaunchStatus.SUCCEEDED)
    first_c = sid_of(env, c)
    env.wait_state(a, "starting")
    assert first_c in fake.stopped
    requeued = env.job(c, "admin")
    assert requeued["state"] == "queued" and requeued["attempt"] == 1
    (pre,) = events(env, c, "preempted")
    assert pre["data"]["submission_id"] == first_c
    assert [e["data"]["to"] for e in events(env, c, "state")][-1] == "queued"
    assert admitted_ranks(env, [a]) == 4
    # a ends: c is launched again (same job: it resumes from its newest checkpoint).
    fake.set_status(sid_of(env, a), LaunchStatus.SUCCEEDED)
    again = env.wait_state(c, "starting")
    assert again["attempt"] == 2 and again["submission_id"] == f"elastron-{c}-2"
    assert fake.env_of(c)["ELASTRON_JOB_ID"] == c
    assert json.loads(fake.env_of(c)["ELASTRON_PLACEMENT"]) == events(env, c, "admitted")[-1]["data"]["placement"]


def test_a_higher_priority_job_preempts_only_preemptible_lower_ones(start_env, fake):
    env = start_env(fake)
    scheduled(env)
    keep = submit(env, spec("no-ckpt", ranks=2, interval=None))  # saves no checkpoint: never preempted
    low = submit(env, spec("low", ranks=2))
    env.wait_state(keep, "starting")
    env.wait_state(low, "starting")
    high = submit(env, spec("high", ranks=2, priority=10))
    env.wait_state(low, "queued")  # stopped, back in the queue
    env.wait_state(high, "starting")
    assert env.job(keep)["state"] == "starting" and sid_of(env, keep) not in fake.stopped
    (stop,) = events(env, low, "preempting")
    assert stop["data"]["for_job"] == high and "priority 10 > 0" in stop["message"]
    # Another urgent one finds nothing it may preempt: it waits, saying so.
    more = submit(env, spec("high2", ranks=2, priority=10))
    reason = wait_for(lambda: env.job(more)["waiting_reason"], what="a waiting reason")
    assert reason == "needs 2 ranks x (1 CPU, 0 GPU), 0 free" and env.job(more)["queue_position"] == 1
    assert "behind 1 job(s) of priority >= 0" in env.job(low)["waiting_reason"]
    text = scrape(env)
    assert 'elastron_preemptions_total{priority="0",tenant="alice"} 1.0' in text
    assert 'elastron_queue_jobs{tenant="alice",priority="0"} 1.0' in text
    assert 'elastron_cluster_capacity{resource="cpu"} 4.0' in text
    assert 'elastron_cluster_allocated{resource="cpu"} 4.0' in text
    assert 'elastron_queue_wait_seconds_count{priority="10",tenant="alice"} 1.0' in text


def test_quotas_wait_with_a_reason_and_refuse_what_never_fits(start_env, fake):
    env = start_env(fake)
    scheduled(env)
    with env.client() as c:
        assert c.put("/v1/tenants/alice/quota", json={"cpus": 2}).status_code == 403  # admins only
    with env.client("admin") as c:
        r = c.put("/v1/tenants/alice/quota", json={"cpus": 2, "queued": 1, "max_priority": 5})
        assert r.status_code == 200 and r.json()["cpus"] == 2 and r.json()["ranks"] is None
    with env.client() as c:
        assert c.get("/v1/tenants/alice/quota").json()["queued"] == 1
        assert c.get("/v1/tenants/bob/quota").status_code == 404

    first = submit(env, spec("q1", ranks=2))
    env.wait_state(first, "starting")
    second = submit(env, spec("q2", ranks=2))
    reason = wait_for(lambda: env.job(second)["waiting_reason"], what="a quota reason")
    assert reason == "tenant alice at its quota: 2/2 CPUs in use, the job needs 2"
    assert env.job(second)["state"] == "queued"
    with env.client() as c:
        full = c.post("/v1/jobs", json=spec("q3"))
        assert full.status_code == 429 and "1 jobs queued, its quota's limit is 1" in full.json()["detail"]
    # Could never run: over the quota, or over the whole cluster (bob has no quota).
    with env.client() as c:
        r = c.post("/v1/jobs", json=spec("huge", ranks=4))
        assert r.status_code == 422, r.text
        (problem,) = r.json()["detail"]
        assert problem["loc"] == ["body", "resources", "ranks"]
        assert "tenant alice quota: 0/2 CPUs in use, the job needs 4" in problem["msg"]
    with env.client("bob") as c:
        r = c.post("/v1/jobs", json=spec("huge", ranks=8))
    assert r.status_code == 422
    assert "holds at most 4" in r.json()["detail"][0]["msg"] and "4 CPUs" in r.json()["detail"][0]["msg"]
    # Who may ask for what.
    with env.client() as c:
        r = c.post("/v1/jobs", json=spec("pinned", preemptible=False))
        assert r.status_code == 403 and "scheduling.preemptible" in r.json()["detail"]
        r = c.post("/v1/jobs", json=spec("vip", priority=6))
        assert r.status_code == 422 and "scheduling.priority: 6" in r.json()["detail"][0]["msg"]
    assert submit(env, spec("pinned", preemptible=False), who="admin")


def test_cli_queue_and_set_quota(start_env, fake):
    fake.up = False
    env = start_env(fake)
    runner = CliRunner()

    def cli(*args: str, who: str = "alice"):
        environ = {"ELASTRON_API_URL": env.server.url, "ELASTRON_API_TOKEN": env.tokens[who]}
        return runner.invoke(cli_app, list(args), env=environ)

    r = cli("tenants", "set-quota", "alice", "--gpus", "8", "--cpus", "3", "--ranks", "3", "--queued", "5", who="admin")
    assert r.exit_code == 0, r.output
    assert "tenant alice: ranks 3, GPUs 8, CPUs 3, queued jobs 5" in r.stdout
    r = cli("tenants", "set-quota", "alice", "--cpus", "1")
    assert r.exit_code == 1 and "needs an admin token" in r.stderr
    assert "CPUs 3" in cli("tenants", "quota", "alice").stdout
    first = submit(env, spec("one", ranks=2))
    second = submit(env, spec("two", ranks=2))
    r = cli("queue")
    assert "capacity unknown" in r.stdout and first in r.stdout and second in r.stdout
    fake.up = True
    env.wait_state(first, "starting")
    wait_for(lambda: env.job(second)["waiting_reason"], what="the second job's reason")
    r = cli("queue")
    assert "cluster: 2 nodes, CPUs 2/4 allocated" in r.stdout
    assert first not in r.stdout and second in r.stdout and "at its quota: 2/3 ranks" in r.stdout
    assert "queue        #1: tenant alice at its quota: 2/3 ranks" in cli("status", second).stdout


class SlowToStop(FakeLauncher):
    """While `slow`: a stop is asked for, but the job ends only when the test says so."""

    slow = True

    def stop(self, submission_id):
        if not self.slow:
            return super().stop(submission_id)
        self.stopped.append(submission_id)
        return True


def test_api_restart_with_jobs_queued_running_and_being_preempted(start_env):
    slow = SlowToStop()
    slow.nodes = list(NODES)
    env = start_env(slow)
    scheduled(env)
    low = submit(env, spec("low", ranks=4))
    env.wait_state(low, "starting")
    waiting = [submit(env, spec(f"w{i}", ranks=2, priority=i)) for i in range(3)]
    # w2 outranks low: low is asked to stop; everyone waits for it, in order.
    wait_for(lambda: all(env.job(j)["queue_position"] for j in waiting), what="queue positions")
    wait_for(lambda: slow.stopped, what="the stop request")
    before = {j: (env.job(j)["queue_position"], env.job(j)["waiting_reason"]) for j in waiting}
    assert before[waiting[2]] == (1, "needs 2 ranks x (1 CPU, 0 GPU), 0 free; waiting for 1 job(s) to stop or shrink")
    assert [before[j][0] for j in waiting] == [3, 2, 1]
    counters = ('elastron_preemptions_total{priority="0",tenant="alice"} 1.0', 'elastron_queue_wait_seconds_count{priority="0",tenant="alice"} 1.0')
    assert all(c in scrape(env) for c in counters)
    env.server.stop()
    env.server = ApiServer(env.settings, slow, env.server.port).start()
    try:
        wait_for(lambda: env.server.ctx.reconciler.capacity is not None, what="a pass of the new API")
        after = {j: (env.job(j)["queue_position"], env.job(j)["waiting_reason"]) for j in waiting}
        assert after == before and env.job(low)["state"] == "starting"
        text = scrape(env)
        assert all(c in text for c in counters), "the scheduler's counters restarted from zero"
        assert slow.submissions.keys() == {f"elastron-{low}-1"}  # nothing launched twice or over
        slow.set_status(f"elastron-{low}-1", LaunchStatus.STOPPED)  # the stop lands after the restart
        slow.slow = False
        env.wait_state(waiting[2], "starting")
        env.wait_state(waiting[1], "starting")
        assert env.job(low)["state"] == "queued" and len(events(env, low, "preempted")) == 1
        # low keeps its submission time: first at its priority, ahead of w0
        wait_for(lambda: env.job(low)["queue_position"] == 1, what="low first in the queue again")
        assert env.job(waiting[0])["queue_position"] == 2
        for j in waiting[1:]:  # (if a pass sees only one end, w0 backfills, then yields to low)
            slow.set_status(sid_of(env, j), LaunchStatus.SUCCEEDED)
        env.wait_state(low, "starting")
        assert env.job(low)["attempt"] == 2 and env.job(waiting[0])["state"] == "queued"
    finally:
        env.server.stop()


def test_no_launch_while_the_capacity_cannot_be_read(start_env, fake):
    blind = {"on": True}
    read = fake.capacity

    def capacity():
        if blind["on"]:
            raise LauncherUnavailable("the State API is down")
        return read()

    fake.capacity = capacity
    env = start_env(fake)
    job_id = submit(env, spec("patient", ranks=2))
    wait_for(lambda: len(events(env, job_id, "state")) == 1 and env.server.ctx.reconciler.ray_checked_at, what="passes")
    passes_seen = env.server.ctx.reconciler.ray_checked_at
    wait_for(lambda: env.server.ctx.reconciler.ray_checked_at > passes_seen, what="another pass")
    assert env.job(job_id)["state"] == "queued" and fake.submissions == {}
    assert env.server.ctx.reconciler.ray_reachable  # Ray itself answers: /readyz stays ready
    blind["on"] = False
    env.wait_state(job_id, "starting")


def test_one_scheduler_per_postgres_store(fresh_pg_db):
    """API replicas sharing a store: the first to take the lease schedules, the others wait until
    it goes (its connection closed: stopped or crashed)."""
    from service.scheduling.lease import SchedulerLease
    from service.store.db import make_engine

    one, two = make_engine(fresh_pg_db), make_engine(fresh_pg_db)
    try:
        first, second = SchedulerLease(one), SchedulerLease(two)
        assert first.held() and first.held()
        assert not second.held()
        first.release()
        assert second.held() and not first.held()
        second.release()
    finally:
        one.dispose()
        two.dispose()


def test_a_preempted_job_is_first_asked_to_save_its_step_and_stop(start_env, fake):
    """With a grace period the job hears the preemption in its telemetry answers (no signal
    yet); when it ends "succeeded" short of train_iters (it saved its step and stopped), it is
    requeued, not finished; the urgent job then starts."""
    env = start_env(fake, preempt_grace_s=3600.0)
    scheduled(env)
    low = submit(env, spec("low", ranks=4))
    env.wait_state(low, "starting")
    with env.client("admin") as admin:
        ack = admin.post(f"/v1/internal/jobs/{low}/telemetry", json={"records": []}).json()
        assert ack["stop"] is None
        high = submit(env, spec("high", ranks=4, priority=10))
        wait_for(lambda: events(env, low, "preempting"), what="the preemption")
        record = {"iteration": 3, "loss": 1.0, "tokens": 8, "step_time_s": 0.1}
        ack = admin.post(f"/v1/internal/jobs/{low}/telemetry", json={"records": [record]}).json()
    assert ack["stop"] == "checkpoint"
    assert sid_of(env, low) not in fake.stopped  # asked, not signalled
    fake.set_status(sid_of(env, low), LaunchStatus.SUCCEEDED)  # it stopped by itself at step 3 of 8
    env.wait_state(high, "starting")
    (pre,) = events(env, low, "preempted")
    assert pre["data"]["stopped_at_iteration"] == 3
    assert env.job(low)["state"] == "queued"


def test_an_elastic_job_shrinks_for_an_urgent_one_and_grows_back(start_env, fake):
    """A running elastic job is resized as a preemption is asked (save the step, stop), then
    launched again at once at its new size and placement, holding that room meanwhile: 4 ranks ->
    2 while an urgent job runs -> 4 again when it has ended (scheduler_grow_after_s=0 here)."""
    env = start_env(fake, scheduler_grow_after_s=0.0)
    scheduled(env)
    body = spec("flex", ranks=4)
    body["resources"]["min_ranks"] = 2
    flex = submit(env, body)
    env.wait_state(flex, "starting")
    first = sid_of(env, flex)
    urgent = submit(env, spec("urgent", ranks=2, priority=10))
    env.wait_state(urgent, "starting")
    assert first in fake.stopped  # asked to stop (grace 0 here), not failed
    shrunk = env.wait_state(flex, "starting")
    assert shrunk["attempt"] == 2 and shrunk["submission_id"] == f"elastron-{flex}-2"
    (resizing,) = events(env, flex, "resizing")
    assert (resizing["data"]["from_ranks"], resizing["data"]["to_ranks"]) == (4, 2)
    (resized,) = events(env, flex, "resized")
    assert resized["data"]["to_ranks"] == 2 and resized["data"]["submission_id"] == first
    assert json.loads(fake.env_of(flex)["ELASTRON_JOB_SPEC"])["resources"]["ranks"] == 2
    assert not events(env, flex, "preempted") and len(events(env, flex, "admitted")) == 1
    assert env.job(flex, "admin")["state"] == "starting"
    assert admitted_ranks(env, [urgent]) == 2  # 2 + 2: never more than the 4 CPUs
    text = scrape(env)
    assert 'elastron_resizes_total{direction="shrink",priority="0",tenant="alice"} 1.0' in text

    fake.set_status(sid_of(env, urgent), LaunchStatus.SUCCEEDED)
    env.wait_state(urgent, "succeeded")
    wait_for(lambda: len(events(env, flex, "resized")) == 2, what="flex grown back")
    grown = env.wait_state(flex, "starting")
    assert grown["attempt"] == 3
    assert json.loads(fake.env_of(flex)["ELASTRON_JOB_SPEC"])["resources"]["ranks"] == 4
    assert [e["data"]["to_ranks"] for e in events(env, flex, "resizing")] == [2, 4]
    assert 'elastron_resizes_total{direction="grow",priority="0",tenant="alice"} 1.0' in scrape(env)


def test_replicas_started_one_by_one_move_the_placement_with_their_replacements(start_env, fake):
    """replace_replica: no ranks_started; each replica reports its own start, and a replacement
    Ray put on another node moves that replica's rank there in what the scheduler counts."""
    env = start_env(fake)
    scheduled(env)
    a = submit(env, spec("a", ranks=2))
    env.wait_state(a, "starting")
    ((meant, _),) = events(env, a, "admitted")[0]["data"]["placement"].items()
    other = next(n.id for n in NODES if n.id != meant)

    def started(eid: str, rank: int, node: str) -> None:
        event = {"kind": "replica_started", "id": eid, "replica": rank, "world_size": 2,
                 "ranks": [{"rank": rank, "node_id": node, "pid": 100 + rank}]}
        with env.client("admin") as c:
            r = c.post(f"/v1/internal/jobs/{a}/telemetry", json={"events": [event]})
        assert r.status_code == 200, r.text

    def placement():
        with env.server.ctx.sessions() as s:
            return s.scalars(select(Job.placement).where(Job.id == a)).one()

    started("r0", 0, meant)
    assert placement() == {meant: 2}  # one replica reported: the admission's placement stands
    started("r1", 1, meant)
    assert placement() == {meant: 2}
    started("r1-again", 1, other)  # replica 1 replaced on another node
    assert placement() == {meant: 1, other: 1}


def test_the_scheduler_counts_where_ray_put_the_ranks(start_env, fake):
    """The admission says where a job should go; its ranks_started event says where Ray put it,
    and from then on the scheduler counts that (a rank group Ray placed elsewhere, or an
    elastic group shrunk onto the nodes left)."""
    env = start_env(fake)
    scheduled(env)
    a = submit(env, spec("a", ranks=2))
    env.wait_state(a, "starting")
    ((meant, k),) = events(env, a, "admitted")[0]["data"]["placement"].items()
    other = next(n.id for n in NODES if n.id != meant)
    ranks = [{"rank": i, "node_id": other, "pid": 100 + i} for i in range(2)]
    with env.client("admin") as c:
        r = c.post(f"/v1/internal/jobs/{a}/telemetry", json={"events": [{"kind": "ranks_started", "id": "g1", "ranks": ranks}]})
    assert r.status_code == 200, r.text
    with env.server.ctx.sessions() as s:
        assert s.scalars(select(Job.placement).where(Job.id == a)).one() == {other: 2}
    b = submit(env, spec("b", ranks=2))
    env.wait_state(b, "starting")
    assert events(env, b, "admitted")[0]["data"]["placement"] == {meant: 2}  # the room Ray left


@pytest.mark.parametrize("group", [1, 2], ids=["one-rank-groups", "tp2-groups"])
def test_a_live_job_is_resized_through_its_telemetry_answers_without_a_stop(start_env, fake, group):
    """resilience.resize: live: the scheduler's shrink is asked in the job's telemetry answers
    (`replicas`, in replica groups: one rank each, or with parallel.tensor = 2 two), not as a
    stop; the room stays held until the driver reports `resized`, and only then is the urgent job
    admitted into it; the grow back goes the same way. One launch throughout; the grow comes at
    once (scheduler_grow_after_s, 300 s by default, holds only the grows that restart a job). A
    preemption asked during a live resize supersedes it (the job is requeued, not relaunched at
    the resize's size). The driver's side of each layout: tests/workers/test_ray_live_resize*.py."""
    env = start_env(fake)
    scheduled(env)
    body = spec("flex", ranks=4)
    body["resources"]["min_ranks"] = 2
    if group == 2:
        body["parallel"] = {"tensor": 2}
    full, half = 4 // group, 2 // group  # the job's replica groups, and those of 2 ranks
    body["resilience"] = {"on_rank_failure": "replace_replica", "resize": "live", "lost_replica_share": "redistribute"}
    flex = submit(env, body)
    env.wait_state(flex, "starting")
    first = sid_of(env, flex)
    assert json.loads(fake.env_of(flex)["ELASTRON_JOB_SPEC"])["resources"]["max_ranks"] == 4  # its slots

    # Asked every 0.5 s, as a driver does (ASK_EVERY_S): a tighter loop of write transactions
    # kept the reconciler's own from the SQLite store on a loaded machine.
    def ack(events_: list[dict] | None = None) -> dict:
        with env.client("admin") as c:
            r = c.post(f"/v1/internal/jobs/{flex}/telemetry", json={"events": events_ or []})
        assert r.status_code == 200, r.text
        return r.json()

    assert ack()["replicas"] is None  # no resize asked
    urgent = submit(env, spec("urgent", ranks=2, priority=10))
    wait_for(lambda: ack()["replicas"] == half, 120, "the shrink asked in the telemetry answer", interval_s=0.5)
    assert first not in fake.stopped and ack()["stop"] is None  # no stop, no preemption
    (resizing,) = events(env, flex, "resizing")
    assert resizing["data"]["live"] and (resizing["data"]["from_replicas"], resizing["data"]["to_replicas"]) == (full, half)
    assert env.job(urgent, "admin")["state"] == "queued"  # its room is not free until the driver says so
    placement = events(env, flex, "admitted")[0]["data"]["placement"]
    node = sorted(placement)[0]
    ranks = [{"rank": i, "node_id": node, "pid": 100 + i} for i in range(2)]
    ack([{"kind": "resized", "id": "z1", "live": True, "from_replicas": full, "to_replicas": half, "seconds": 1.5, "ranks": ranks}])
    env.wait_state(urgent, "starting")
    assert ack()["replicas"] is None
    with env.server.ctx.sessions() as s:
        assert s.scalars(select(Job.placement).where(Job.id == flex)).one() == {node: 2}
    assert env.job(flex, "admin")["attempt"] == 1 and sid_of(env, flex) == first

    fake.set_status(sid_of(env, urgent), LaunchStatus.SUCCEEDED)
    env.wait_state(urgent, "succeeded")
    wait_for(lambda: ack()["replicas"] == full, 120, "the grow asked", interval_s=0.5)
    assert [e["data"]["to_replicas"] for e in events(env, flex, "resizing")] == [half, full]
    # A preemption now (a more urgent job than it) supersedes the grow in flight.
    big = submit(env, spec("big", ranks=4, priority=20))
    wait_for(lambda: ack()["stop"] == "checkpoint", 120, "the preemption asked", interval_s=0.5)
    assert ack()["replicas"] is None
    fake.set_status(first, LaunchStatus.SUCCEEDED)  # the job saved its step and stopped
    env.wait_state(big, "starting")
    assert env.job(flex, "admin")["state"] == "queued" and events(env, flex, "preempted")
