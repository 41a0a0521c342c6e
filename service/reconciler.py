"""The background loop between the store and the launcher: its passes, in order, and what it
knows of Ray between them.

Every pass (every `reconcile_interval_s`, or sooner when a request nudges it):
1. ask whether the launcher (Ray) is reachable; if not, stop here: queued jobs wait, running
   jobs keep their last known state, and /readyz says why;
2. once per API process, before anything else: reconcile every non-final job with Ray and
   record what was found (still running, finished while the API was away, vanished);
3. poll the submitted non-final jobs and apply what Ray reports (service/reconcile/watch.py);
4. send stop requests for jobs whose cancel (or preemption) was recorded
   (service/reconcile/stops.py);
5. launch queued jobs: when the launcher reports the cluster's capacity and this replica holds
   the scheduler lease, the scheduler decides who is admitted where, who is preempted or resized,
   and each waiting job's position and reason (service/reconcile/scheduling_pass.py); when it
   cannot tell, oldest first, `dispatch_batch` per pass, as Ray Jobs queues them itself
   (service/reconcile/launch.py, which also says why a crash at any point of a launch is safe);
6. checkpoint exports (service/export_runs.py): submit the recorded ones as their own Ray jobs
   with resource requests, poll the unfinished ones and record how they ended;
7. checkpoint evaluations (service/eval_runs.py): the same for `elastron eval`, their scores
   read back from its log.
Between 4 and 5, running sweeps are advanced (service/reconcile/sweeps.py: metrics to the study,
pruned trials asked to stop, new trials recorded as queued jobs, which step 5 then launches), and
retired attempts that Ray never confirmed ended are watched and stopped should
they show up (service/fencing.py: fencing tokens, orphan attempts, lost jobs requeued).

Its own module: the loop's schedule, the order of its steps and what the API reads of it (is Ray
reachable, the cluster as last read, the scheduler lease). It must not do a step's work itself:
each step is its own module, and none of them imports this one. Ray calls run in the loop's
worker thread, never in a request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from service import fencing
from service.eval_runs import EvalRuns
from service.export_runs import ExportRuns
from service.launcher import Launcher, LauncherUnavailable
from service.metrics import SchedulerMetrics
from service.reconcile.launch import Launching
from service.reconcile.scheduling_pass import SchedulingPass
from service.reconcile.stops import GracefulStops
from service.reconcile.sweeps import SweepTrials
from service.reconcile.watch import LaunchWatch
from service.scheduling.lease import SchedulerLease
from service.scheduling.model import Node
from service.settings import Settings

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        launcher: Launcher,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        metrics: SchedulerMetrics | None = None,
    ):
        self.sessions, self.launcher, self.settings, self.clock = sessions, launcher, settings, clock
        # The cluster as last read (None: unknown): the scheduler's and the submission check's.
        self.capacity: list[Node] | None = None
        self.capacity_at: float | None = None
        self.lease = SchedulerLease(sessions.kw["bind"])
        self.ray_reachable: bool | None = None  # None: not checked yet
        self.ray_checked_at: float | None = None
        self.reconciled_on_start = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._tick_lock = threading.Lock()
        self.watch = LaunchWatch(sessions, launcher, settings, self.clock, self._stopping)
        self.stops = GracefulStops(sessions, launcher, settings, self.clock, self._stopping)
        # Retired attempts Ray never confirmed ended: stopped should they turn up (orphans).
        self.orphans = fencing.OrphanWatch(sessions, launcher, self.clock, 10 * settings.reconcile_interval_s)
        self.launching = Launching(sessions, launcher, settings, self.clock, self._stopping)
        self.scheduling = SchedulingPass(
            sessions, settings, self.clock, self._stopping, self.launching, self.stops, metrics
        )
        self.exports = ExportRuns(sessions, launcher, settings, self.clock, self._stopping)
        self.evals = EvalRuns(sessions, launcher, settings, self.clock, self._stopping)
        self.sweeps = SweepTrials(sessions, launcher, settings, self.clock, self._stopping)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while not self._stopping.is_set():
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                log.exception("reconcile pass failed; the next pass retries")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.settings.reconcile_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    def stop(self) -> None:
        self._stopping.set()
        self.nudge()
        # A pass in flight launches nothing more once _stopping is set.
        self.lease.release()

    def nudge(self) -> None:
        """Run a pass soon (after a submission or a cancel); safe from any thread."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def tick(self) -> None:
        with self._tick_lock:
            if not self._check_launcher():
                return
            try:
                if not self.reconciled_on_start:
                    self.watch.run_pass(on_start=True)
                    self.reconciled_on_start = True
                else:
                    self.watch.run_pass(on_start=False)
                self.stops.run_pass()
                self.orphans.run_pass()
                if self.lease.held():  # one replica advances sweeps, as one schedules
                    self.sweeps.run_pass(self.capacity)
                self._dispatch()
                self.exports.run_pass()
                self.evals.run_pass()
            except LauncherUnavailable as err:  # Ray went away during the pass: try again later
                self.ray_reachable = False
                log.warning("reconcile pass cut short: %s", err)

    def _check_launcher(self) -> bool:
        ok = self.launcher.reachable()
        if ok != self.ray_reachable:
            (log.info if ok else log.warning)(
                "%s is %s", self.launcher.describe(), "reachable" if ok else "unreachable: queued jobs wait"
            )
        self.ray_reachable, self.ray_checked_at = ok, self.clock()
        return ok

    def _dispatch(self) -> None:
        """Read the cluster, then launch: by the scheduler when the launcher reports the cluster's
        nodes (on the replica that holds the scheduler lease), else oldest first."""
        try:
            nodes = self.launcher.capacity()
        except LauncherUnavailable as err:
            # Not knowing the cluster this pass is no reason to hand Ray jobs that may not fit:
            # nothing is launched until the next pass reads it.
            log.warning("cluster capacity unknown this pass, no job launched: %s", err)
            return
        self.capacity, self.capacity_at = nodes, self.clock()
        if nodes is None:
            launched = self.launching.oldest_first()
        elif self.lease.held():  # else another API replica schedules
            launched = self.scheduling.run(nodes)
        else:
            launched = True
        if not launched:  # a submit could not reach the launcher: the next pass retries
            self.ray_reachable = False
