"""One scheduling pass applied: the scheduler's decision (service/scheduling/decision.py) on the
store's state, carried out.

In order: the resized jobs that stopped are launched again at their new size, ahead of every
queued job (their room is held); then the decision: waiting jobs' positions and reasons written
where they changed (this runs every pass), preemptions and resizes recorded and sent as graceful
stops, admissions launched (`dispatch_batch` per pass; the rest shown as "admitted: launching").
It also keeps what the launched jobs hold of the cluster (`allocated`, for /v1/queue and the
metrics).

Only one API replica runs it at a time (the reconcile loop holds the scheduler lease:
service/scheduling/lease.py). It takes no scheduling decision of its own beyond holding a grow
back (service/reconcile/resize.py), and calls the launcher only through the launch and stop steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy import bindparam, update
from sqlalchemy.orm import Session, sessionmaker

from service.metrics import SchedulerMetrics
from service.reconcile.launch import Launching
from service.reconcile.preemption import record_preemption
from service.reconcile.resize import may_resize, record_resize
from service.reconcile.stops import GracefulStops
from service.scheduling.decision import decide
from service.scheduling.demand import Demand
from service.scheduling.model import Admission, Node, Policy
from service.scheduling.state import read_inputs
from service.settings import Settings
from service.states import JobState
from service.store.db import in_transaction
from service.store.models import Job


class SchedulingPass:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        settings: Settings,
        clock: Callable[[], float],
        stopping: threading.Event,
        launching: Launching,
        stops: GracefulStops,
        metrics: SchedulerMetrics | None = None,
    ):
        self.sessions, self.settings, self.clock = sessions, settings, clock
        self._stopping = stopping
        self.launching, self.stops, self.metrics = launching, stops, metrics
        self.policy = Policy(aging_s=settings.scheduler_aging_s)
        self.allocated: tuple[float, float] = (0.0, 0.0)  # CPUs, GPUs given to launched jobs
        self._demands: dict[str, Demand] = {}  # job id -> its demand (read_inputs' cache)

    def run(self, nodes: list[Node]) -> bool:
        """One scheduling pass on the cluster `nodes`: the decision on the store's state, applied.
        False when the launcher became unavailable (nothing more is launched this pass)."""
        now = self.clock()
        with self.sessions() as s:
            inputs = read_inputs(s, nodes, self._demands)
        for job_id, (ranks, placement) in inputs.relaunch.items():  # resized: their room is held
            if self._stopping.is_set():
                return True
            admission = Admission(job_id, ranks, placement)
            if not self.launching.launch(job_id, admission, inputs.demands[job_id], resized=True):
                return False
        decision = decide(nodes, inputs.running, inputs.queued, inputs.quotas, now, self.policy, inputs.stopping)
        grow_after_s = self.settings.scheduler_grow_after_s
        decision.resize = [z for z in decision.resize if may_resize(z, inputs, now, grow_after_s)]
        alive = [n for n in nodes if n.alive]
        capacity = (sum(n.cpus for n in alive), sum(n.gpus for n in alive))
        held = [(r.ranks, r.job.shape) for r in inputs.running]
        shapes = {j.id: j.shape for j in inputs.queued}
        held += [(a.ranks, shapes[a.job_id]) for a in decision.admit[: self.settings.dispatch_batch]]
        self.allocated = (sum(k * sh.cpus for k, sh in held), sum(k * sh.gpus for k, sh in held))
        if self.metrics is not None:
            self.metrics.cluster(capacity, self.allocated)
        batch = self.settings.dispatch_batch
        shown = {job_id: (w.position, w.reason[:4000]) for job_id, w in decision.waiting.items()}
        for a in decision.admit[batch:]:  # admitted, launched in a later pass (dispatch_batch)
            shown[a.job_id] = (None, "admitted: launching")
        changed = [
            {"job_id": job_id, "position": pos, "reason": reason}
            for job_id, (pos, reason) in shown.items()
            if inputs.shown.get(job_id) != (pos, reason)
        ]
        if changed:
            # Plain UPDATEs, not ORM writes: advisory fields that must not bump the row's version
            # (a telemetry write racing with this would otherwise be retried for nothing).
            stmt = (
                update(Job)
                .where(Job.id == bindparam("job_id"), Job.state == JobState.QUEUED.value)
                .values(queue_position=bindparam("position"), waiting_reason=bindparam("reason"))
            )
            in_transaction(self.sessions, lambda s: s.connection().execute(stmt, changed))
        for p in decision.preempt:
            in_transaction(self.sessions, lambda s, p=p: record_preemption(s, p, self.clock()))
        for z in decision.resize:
            in_transaction(self.sessions, lambda s, z=z: record_resize(s, z, self.clock()))
        if decision.preempt or decision.resize:
            self.stops.run_pass()
        for admission in decision.admit[: self.settings.dispatch_batch]:
            if self._stopping.is_set():
                return True
            if not self.launching.launch(admission.job_id, admission, inputs.demands[admission.job_id]):
                return False
        return True
