"""The scheduler's pure decision (service/scheduling/decision.py and the modules it calls): its
rules one by one, then properties under random arrivals, completions and preemptions replayed on a
simulated clock: never more admitted than a node holds, never a tenant past its quota, every job
admitted and finished."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.scheduling.decision import decide
from service.scheduling.model import Job, Node, Policy, Quota, Running, Shape
from service.scheduling.placement import never_fits
from service.scheduling.simulate import Simulation, TraceJob

GPU = Shape(cpus=1, gpus=1)
TWO_NODES = [Node("a", cpus=8, gpus=4), Node("b", cpus=8, gpus=4)]


def job(id, ranks=1, tenant="t", priority=0, at=0.0, shape=GPU, **kw) -> Job:
    return Job(id, tenant, shape, ranks, priority=priority, submitted_at=at, **kw)


def running(j: Job, **placement) -> Running:
    return Running(j, placement or {"a": j.ranks})


def test_a_job_is_admitted_whole_or_not_at_all():
    d = decide(TWO_NODES, [], [job("big", 6), job("next", 3)], {}, now=0)
    assert [(a.job_id, a.ranks) for a in d.admit] == [("big", 6)]
    assert sum(d.admit[0].placement.values()) == 6 and max(d.admit[0].placement.values()) <= 4
    assert d.waiting["next"].reason.startswith("needs 3 ranks x (1 CPU, 1 GPU), 2 free")


def test_per_node_fit_not_the_cluster_total():
    # 2 + 2 GPUs free, but a rank needs 4 GPUs on one node.
    busy = [running(job("x", 2), a=2), running(job("y", 2), b=2)]
    d = decide(TWO_NODES, busy, [job("wide", 1, shape=Shape(1, 4))], {}, now=0)
    assert not d.admit and "0 free" in d.waiting["wide"].reason


def test_priority_then_submission_time():
    queue = [job("old-low", 8, at=0), job("new-high", 8, priority=5, at=10)]
    d = decide(TWO_NODES, [], queue, {}, now=20)
    assert [a.job_id for a in d.admit] == ["new-high"]
    assert d.waiting["old-low"].position == 1


def test_fair_share_by_dominant_resource_at_equal_priority():
    # Tenant a already holds half the GPUs; b holds nothing: b's job goes first though a's is older.
    busy = [running(job("a-run", 4, tenant="a"), a=4)]
    queue = [job("a-2", 4, tenant="a", at=1), job("b-1", 4, tenant="b", at=2)]
    d = decide(TWO_NODES, busy, queue, {}, now=3, policy=Policy(backfill=False))
    assert [a.job_id for a in d.admit] == ["b-1"]
    # A CPU-heavy tenant's dominant share is its CPUs: 14 of 16 CPUs beats 4 of 8 GPUs.
    cpu = Shape(cpus=7, gpus=0)
    busy = [running(job("c-run", 2, tenant="c", shape=cpu), a=1, b=1), running(job("g-run", 4, tenant="g"), a=0, b=4)]
    queue = [job("c-1", 1, tenant="c", at=1, shape=Shape(1, 1)), job("g-1", 1, tenant="g", at=2)]
    d = decide(TWO_NODES, busy, queue, {}, now=3)
    assert [a.job_id for a in d.admit][0] == "g-1"


def test_aging_lifts_a_waiting_job_without_bound():
    queue = [job("old", 8, at=0), job("urgent", 8, priority=3, at=95)]
    assert [a.job_id for a in decide(TWO_NODES, [], queue, {}, now=100, policy=Policy(aging_s=10)).admit] == ["old"]
    assert [a.job_id for a in decide(TWO_NODES, [], queue, {}, now=100, policy=Policy(aging_s=1e9)).admit] == [
        "urgent"
    ]


def test_backfill_only_with_jobs_the_blocked_job_may_take_back():
    busy = [running(job("r", 4), a=4)]  # 4 GPUs free on b
    queue = [job("big", 8, at=0), job("small-pre", 2, at=1), job("small-fixed", 1, at=2, preemptible=False)]
    d = decide(TWO_NODES, busy, queue, {}, now=3)
    assert [(a.job_id, a.backfilled_for) for a in d.admit] == [("small-pre", "big")]
    assert "behind 1 job(s) of priority >= 0" in d.waiting["small-fixed"].reason
    # Once the blocked job could start by taking its room back, it does (equal priority).
    busy = [running(job("small-pre", 2), b=2)]
    busy[0] = Running(busy[0].job, {"b": 2}, backfilled_for="big")
    d = decide(TWO_NODES, busy, [job("big", 8, at=0)], {}, now=4)
    assert [p.job_id for p in d.preempt] == ["small-pre"] and "backfilled ahead" in d.preempt[0].reason


def test_preemption_needs_higher_priority_and_a_preemptible_victim():
    low = running(job("low", 8), a=4, b=4)
    d = decide(TWO_NODES, [low], [job("high", 4, priority=1)], {}, now=0)
    assert [p.job_id for p in d.preempt] == ["low"] and not d.admit
    assert "making room: 1 job(s)" in d.waiting["high"].reason
    same = decide(TWO_NODES, [low], [job("peer", 4, priority=0)], {}, now=0)
    assert not same.preempt
    fixed = running(job("fixed", 8, preemptible=False), a=4, b=4)
    d = decide(TWO_NODES, [fixed], [job("high", 4, priority=1)], {}, now=0)
    assert not d.preempt and not d.resize
    # Nothing is chosen again while its stop is under way.
    d = decide(TWO_NODES, [low], [job("high", 4, priority=1)], {}, now=1, stopping={"low"})
    assert not d.preempt and "waiting for 1 job(s) to stop" in d.waiting["high"].reason


def test_an_elastic_job_shrinks_before_anything_is_stopped_and_the_fewest_are_touched():
    elastic = running(job("elastic", 4, min_ranks=2, max_ranks=4, size_step=2), a=4)
    other = running(job("other", 4), b=4)
    d = decide(TWO_NODES, [elastic, other], [job("high", 2, priority=2)], {}, now=0)
    assert [(z.job_id, z.ranks) for z in d.resize] == [("elastic", 2)] and not d.preempt
    assert sum(d.resize[0].placement.values()) == 2


def test_a_job_stopped_whole_and_shrunk_is_only_shrunk_when_that_is_enough():
    """The stop pass takes the smallest victim first; once a bigger one is stopped too, the
    smaller (elastic) one needs only to shrink: the cheapest set is a shrink and one stop."""
    one = [Node("a", cpus=64, gpus=8)]
    elastic = running(job("elastic", 2, min_ranks=1, max_ranks=2), a=2)
    low = running(job("low", 4), a=4)
    busy = running(job("busy", 2, priority=9), a=2)
    d = decide(one, [elastic, low, busy], [job("high", 5, priority=5)], {}, now=0)
    assert [(z.job_id, z.ranks) for z in d.resize] == [("elastic", 1)]
    assert [p.job_id for p in d.preempt] == ["low"]
    d = decide(one, [elastic, low, busy], [job("high", 5, priority=5)], {}, now=0, policy=Policy(shrink=False))
    assert not d.resize and sorted(p.job_id for p in d.preempt) == ["elastic", "low"]


def test_without_shrinking_a_whole_job_is_stopped_instead():
    elastic = running(job("elastic", 4, min_ranks=2, max_ranks=4, size_step=2), a=4)
    other = running(job("other", 4), b=4)
    d = decide(TWO_NODES, [elastic, other], [job("high", 2, priority=2)], {}, now=0, policy=Policy(shrink=False))
    assert not d.resize and [p.job_id for p in d.preempt] == ["elastic"]  # the lowest priority, then the id


def test_elastic_jobs_grow_into_free_room_when_nothing_waits():
    elastic = running(job("e", 2, min_ranks=2, max_ranks=8, size_step=2), a=2)
    d = decide(TWO_NODES, [elastic], [], {}, now=0)
    assert [(z.job_id, z.ranks) for z in d.resize] == [("e", 8)]
    d = decide(TWO_NODES, [elastic], [job("big", 8)], {}, now=0)
    assert not d.resize  # a waiting job has the room first


def test_quota_waits_with_the_numbers_and_blocks_nobody_else():
    quotas = {"alice": Quota(gpus=4)}
    busy = [running(job("a-run", 2, tenant="alice"), a=2)]
    queue = [job("a-2", 4, tenant="alice", at=0), job("b-1", 2, tenant="bob", at=1)]
    d = decide(TWO_NODES, busy, queue, quotas, now=2)
    assert [a.job_id for a in d.admit] == ["b-1"]
    assert d.waiting["a-2"].reason == "tenant alice at its quota: 2/4 GPUs in use, the job needs 4"


def test_never_fits_names_the_numbers():
    assert never_fits(job("x", 9), TWO_NODES) == (
        "needs 9 ranks x (1 CPU, 1 GPU) but the whole cluster (2 nodes, 16 CPUs, 8 GPUs) holds at most 8"
    )
    assert "quota" in never_fits(job("x", 4, tenant="al"), TWO_NODES, Quota(gpus=2))
    assert never_fits(job("x", 4), TWO_NODES, Quota(gpus=4)) is None
    dead = [Node("a", 8, 4), Node("b", 8, 4, alive=False)]
    assert "holds at most 4" in never_fits(job("x", 8), dead)


# -- properties on random traces ------------------------------------------------------------------


@st.composite
def scenarios(draw):
    nodes = [
        Node(f"n{i}", cpus=draw(st.sampled_from([4, 8])), gpus=draw(st.sampled_from([0, 2, 4])))
        for i in range(draw(st.integers(1, 3)))
    ]
    tenants = ["t0", "t1", "t2"]
    quotas = {t: Quota(gpus=draw(st.sampled_from([None, 2, 4]))) for t in tenants}
    trace = []
    for i in range(draw(st.integers(1, 12))):
        ranks = draw(st.integers(1, 4))
        elastic = draw(st.booleans())
        shape = Shape(cpus=draw(st.sampled_from([1, 2])), gpus=draw(st.sampled_from([0, 1, 2])))
        j = Job(
            f"j{i}",
            draw(st.sampled_from(tenants)),
            shape,
            ranks,
            priority=draw(st.integers(0, 3)),
            submitted_at=draw(st.floats(0, 500)),
            min_ranks=1 if elastic else None,
            max_ranks=ranks + 2 if elastic else None,
            preemptible=draw(st.booleans()),
        )
        trace.append(TraceJob(j, work_s=draw(st.floats(1, 400))))
    return nodes, quotas, trace


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scenarios(),
    st.sampled_from([Policy(aging_s=300), Policy(aging_s=300, backfill=False), Policy(grow=False)]),
    st.sampled_from([None, 2.0]),  # elastic jobs resized by a restart, or live
)
def test_random_traces_never_over_admit_never_breach_a_quota_and_finish_every_job(scenario, policy, live_s):
    nodes, quotas, trace = scenario
    capacity = {n.id: (n.cpus, n.gpus) for n in nodes}

    def observe(now, decision, before, queued):
        # What holds room after the decision: the running jobs (at their new size where they
        # grow; a shrink or stop frees room only once done) and the admissions.
        held = {r.job.id: (r.job, dict(r.placement)) for r in before}
        for z in decision.resize:
            if z.ranks > sum(held[z.job_id][1].values()):
                held[z.job_id] = (held[z.job_id][0], z.placement)
        jobs = {j.id: j for j in queued}
        for a in decision.admit:
            assert a.job_id not in held
            assert jobs[a.job_id].lo <= a.ranks <= jobs[a.job_id].ranks
            held[a.job_id] = (jobs[a.job_id], a.placement)
        used = defaultdict(lambda: [0.0, 0.0])
        tenant_gpus = defaultdict(float)
        for j, placement in held.values():
            for n, k in placement.items():
                used[n][0] += k * j.shape.cpus
                used[n][1] += k * j.shape.gpus
                tenant_gpus[j.tenant] += k * j.shape.gpus
        for n, (cpu, gpu) in used.items():
            assert cpu <= capacity[n][0] + 1e-9 and gpu <= capacity[n][1] + 1e-9, (now, n, used[n])
        for t, gpus in tenant_gpus.items():
            limit = quotas[t].gpus
            # Admissions and growth never take a tenant past its quota.
            grew = any(held[a.job_id][0].tenant == t for a in decision.admit) or any(
                held[z.job_id][0].tenant == t for z in decision.resize
            )
            assert limit is None or not grew or gpus <= limit + 1e-9, (t, gpus, limit)

    sim = Simulation(nodes, quotas, policy, checkpoint_s=5, restart_s=5, live_resize_s=live_s, observe=observe)
    result = sim.run(trace, horizon_s=10_000_000)
    for o in result.outcomes.values():
        if o.refused:
            assert never_fits(o.job, nodes, quotas[o.job.tenant]) == o.refused
            continue
        assert o.admitted_at is not None and o.finished_at is not None, (o, result.end)
    assert result.decisions < 20 * len(trace) + 50  # no preemption ping-pong


def test_a_live_resize_costs_only_the_released_and_added_ranks_seconds():
    """An elastic 4-rank job (min 2) gives 2 ranks to an urgent job and takes them back: by a
    restart, each resize costs every rank of the job its checkpoint and/or restart; live, only the
    2 ranks released or added lose `live_resize_s` each way, and the others never stop."""
    nodes = [Node("a", cpus=4, gpus=4)]
    trace = [
        TraceJob(job("flex", 4, min_ranks=2), work_s=1000),
        TraceJob(job("urgent", 2, priority=10, at=100.0), work_s=50),
    ]
    restart = Simulation(nodes, checkpoint_s=10, restart_s=10).run(trace)
    live = Simulation(nodes, checkpoint_s=10, restart_s=10, live_resize_s=2).run(trace)
    for result in (restart, live):
        assert result.outcomes["flex"].resizes == 2 and result.outcomes["flex"].preemptions == 0
    assert restart.lost_gpu_s == restart.lost_resize_gpu_s == 4 * (10 + 10) + 4 * 10  # shrink, grow
    assert live.lost_gpu_s == live.lost_resize_gpu_s == 2 * 2 + 2 * 2
    assert live.outcomes["urgent"].admitted_at == 102.0 and restart.outcomes["urgent"].admitted_at == 110.0
    # Live, flex trained on 2 ranks while the urgent job ran and never paused: it ends sooner.
    assert live.outcomes["flex"].finished_at < restart.outcomes["flex"].finished_at


@pytest.mark.parametrize("arrives", [0.0, 1.0, 30.0])
def test_a_stream_of_urgent_jobs_does_not_starve_an_old_one(arrives):
    """The aging proof on a trace built to starve: a 1-rank priority-5 job every 50 s (each runs
    120 s, so 2-3 hold the node at any time) keeps a 4-rank priority-0 job from ever fitting,
    until aging (a level per 300 s) lifts it past priority 5 and the stream's jobs drain."""
    nodes = [Node("a", cpus=4, gpus=4)]
    trace = [TraceJob(Job("victim", "v", GPU, 4, submitted_at=arrives), work_s=100)]
    trace += [TraceJob(Job(f"u{i}", "u", GPU, 1, priority=5, submitted_at=50.0 * i), work_s=120) for i in range(200)]
    aged = Simulation(nodes, policy=Policy(aging_s=300, backfill=False)).run(trace).outcomes["victim"]
    # It waits 6 levels x 300 s in all (its waits add up across preemptions; a running job is not
    # preempted once its credit passes 5), then the 2-3 running jobs drain (<= 120 s) and it runs
    # 100 s; with slack for the times it ran and was preempted (60 s save + 60 s restart each).
    assert aged.finished_at is not None and aged.finished_at <= arrives + 6 * 300 + 120 + 100 + 1000
    assert aged.preemptions <= 6
    never = Simulation(nodes, policy=Policy(aging_s=1e12, backfill=False)).run(trace).outcomes["victim"]
    assert never.finished_at > 199 * 50  # without aging it waits for the whole stream
