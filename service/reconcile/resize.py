"""A resize of a running elastic job carried out in the store: when it may go ahead, the request
recorded, and the job held ready for its relaunch once it stopped.

Elastic jobs are admitted at a size in [min_ranks, ranks], shrunk to make room and grown back into
free room (the scheduler chooses: service/scheduling/victims.py, service/scheduling/growth.py).
Each resize is a save of the current step, a stop and a launch at the new size: the request is a
preemption's (`preempt_requested_at`, with `resize_to` and `resize_placement` beside it), the end
is a preemption's (service/reconcile/preemption.py, `stopped_as_asked`), and the relaunch comes
with the next scheduling pass, ahead of every queued job (service/reconcile/scheduling_pass.py).

A job with `resilience.resize: live` (its demand's `live_group`) is resized inside its running
attempt instead: the request is `resize_to` alone (no preemption), which its driver hears in the
answers to its telemetry (`TelemetryAck.replicas`, service/store/telemetry.py `live_target`); it releases replica groups at a
step boundary or starts new ones that heal from a live peer, and reports `resized` with the
seconds it took and where its ranks now run, which ends the resize (`live_resized` there). Until then
the job holds the larger of both rooms, as a restart-based resize does.

Store writes only, inside the caller's transaction: it chooses no size and never calls the
launcher.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.launcher import LaunchStatus
from service.reconcile.preemption import stopped_as_asked
from service.scheduling.model import Resize
from service.scheduling.state import SchedulerInputs
from service.states import FINAL
from service.store import scheduler_stats
from service.store.jobs import add_event, get_job
from service.store.models import Job
from service.store.telemetry import live_group


def may_resize(z: Resize, inputs: SchedulerInputs, now: float, grow_after_s: float) -> bool:
    """Shrinks always go ahead (a job waits for their room); a grow costs the job a stop and a
    restart, so it waits until the job has run `grow_after_s` (scheduler_grow_after_s) at its
    size. A live-resized job's grow costs its new replica groups a start (~2 s) and the others
    nothing: it takes free room back at once (only when nothing waits for it: growth.py)."""
    if z.ranks < sum(inputs.placements.get(z.job_id, {}).values()):
        return True
    demand = inputs.demands.get(z.job_id)
    if demand is not None and demand.live_group:
        return True
    return now - inputs.launched_at.get(z.job_id, now) >= grow_after_s


def record_resize(s: Session, z: Resize, now: float) -> None:
    """Ask a running elastic job to save its step and stop, to be launched again at once at
    its new size (a preemption's request, then `stopped_for_resize`). A grow takes its new
    room now (read_inputs counts the larger of both placements), so nothing else is admitted
    into it while the job restarts."""
    job = get_job(s, z.job_id)
    if job is None or job.state in FINAL or job.submission_id is None or job.preempt_requested_at:
        return
    if job.resize_to is not None:  # a live resize in flight: one at a time
        return
    old = dict(job.placement or {})
    scheduler_stats.count(
        s, "resizes", job.tenant, job.priority or 0, "grow" if z.ranks > sum(old.values()) else "shrink"
    )
    group = live_group(job)
    if group:
        job.resize_to, job.resize_placement = z.ranks, dict(z.placement)
        add_event(
            s,
            job,
            "resizing",
            f"{z.reason}: asking {job.submission_id} to go on with {z.ranks // group} replica groups instead "
            f"of {sum(old.values()) // group}, without a restart",
            data={
                "from_ranks": sum(old.values()),
                "to_ranks": z.ranks,
                "from_replicas": sum(old.values()) // group,
                "to_replicas": z.ranks // group,
                "placement": z.placement,
                "live": True,
            },
        )
        return
    job.preempt_requested_at = now
    job.preempt_reason = z.reason
    job.resize_to, job.resize_placement = z.ranks, dict(z.placement)
    add_event(
        s,
        job,
        "resizing",
        f"{z.reason}: asking {job.submission_id} to save its step and stop, to go on with "
        f"{z.ranks} ranks instead of {sum(old.values())}",
        data={"from_ranks": sum(old.values()), "to_ranks": z.ranks, "placement": z.placement},
    )


def stopped_for_resize(s: Session, job: Job, sid: str, status: LaunchStatus, now: float) -> None:
    """A resized job saved its step and stopped: queued for a moment, holding the room of its
    new size (service/scheduling/state.py counts it as running), and launched at that size by
    the next scheduling pass, ahead of every queued job (service/reconcile/scheduling_pass.py)."""
    data = {
        "from_ranks": sum((job.placement or {}).values()) or None,
        "to_ranks": job.resize_to,
        "placement": job.resize_placement,
    }
    what = f"{job.preempt_reason}; relaunching on {job.resize_to} ranks"
    stopped_as_asked(s, job, sid, status, "resized", "resizes", what, data, now)
    job.queue_position, job.waiting_reason = None, f"resizing: relaunching on {job.resize_to} ranks"

