"""The job registry: one small actor per running job, pinned to the driver's node.

Ray Train tells the driver *that* ranks failed, not where they ran, and a rank killed by its
watchdog cannot say why. Ranks therefore write here, and the driver (and tests, and the bench)
read from here:

- `group_started(attempt, ranks)`: rank 0 registers each worker group as it starts (also the
  groups an elastic resize starts inside one attempt): per rank its node id, hardware id, pid
  and host.
- `report_watchdog(attempt, rank, pid, message)`: a rank's watchdog leaves its message before
  killing the process.
- `telemetry_settings()`: where to send telemetry, for ranks whose environment does not say.
- `progress(iteration, ts)` / `last_progress()`: rank 0's newest finished step, so a restart can
  say how many steps it lost (restart_group: every step; replace_replica: the quorum's first
  replica, at most once a second, read only by a fallback to the persistent checkpoint).
- `replica_join(...)` / `replica_round(...)`: `resilience.on_rank_failure: replace_replica` with
  replicas of several ranks (HSDP): the rendezvous by rounds through which a replica's ranks form
  their process group again after one of them was replaced (engine/fault_tolerance/replica_group.py).
- `release(slot)` / `released(slot)` / `replica_placed(slot, ranks)` / `replica_stepping(slot)` /
  `replicas()`: `resilience.resize: live` (workers/replica_fits.py): the driver releases a replica
  group, whose ranks poll for it and leave at a step boundary; each group says where its ranks
  run and when it first stepped, which is what the driver's `resized` reports.
- `snapshot_holders(node_ids)`: the in-memory snapshots' holder on each node, started here when
  missing, so that the driver's side owns them (workers/snapshots.py): they outlive the ranks and
  die with the driver.

The actor is named `elastron-job-<job_id>` in namespace `elastron` (`registry_name`), holds no
resources, and is killed by the driver when the job ends.
"""

from __future__ import annotations

import time
from typing import Any

from workers.snapshots import NAMESPACE  # the job's named actors' one namespace

__all__ = ["NAMESPACE", "JobRegistry", "registry_name"]


def registry_name(job_id: str) -> str:
    return f"elastron-job-{job_id}"


class JobRegistry:
    def __init__(self, job_id: str, telemetry: dict[str, str] | None = None):
        self.job_id = job_id
        self._telemetry = dict(telemetry or {})
        self._groups: list[dict[str, Any]] = []
        self._watchdog: list[dict[str, Any]] = []
        self._progress: tuple[int, float] | None = None  # rank 0's newest iteration, when
        self._holders: list[Any] = []  # every snapshot holder handle this actor obtained
        self._replicas_ended: set[int] = set()  # replace_replica: attempts whose replicas left the loop
        self._rounds: Any = None  # replace_replica with HSDP: the replicas' rendezvous
        # resilience.resize: live, per replica slot: released by the driver; where its ranks run
        # (set by the group's rank 0 as it starts); whether it has stepped since it started.
        self._released: set[int] = set()
        self._placed: dict[int, list[dict[str, Any]]] = {}
        self._controllers: dict[int, Any] = {}  # resilience.resize: live: each slot's run's controller
        self._stepping: set[int] = set()

    def ping(self) -> bool:
        return True

    def telemetry_settings(self) -> dict[str, str]:
        """The driver's ELASTRON_API_URL / _TOKEN / ELASTRON_SPOOL_DIR, for ranks whose environment
        lacks them (kept here rather than in the run's config, which Ray may display)."""
        return dict(self._telemetry)

    def group_started(self, attempt: int, ranks: list[dict[str, Any]]) -> int:
        self._groups.append(
            {"attempt": attempt, "index": len(self._groups), "started_at": time.time(), "ranks": ranks}
        )
        return len(self._groups) - 1

    def groups(self) -> list[dict[str, Any]]:
        return list(self._groups)

    def last_group(self, attempt: int | None = None) -> dict[str, Any] | None:
        for group in reversed(self._groups):
            if attempt is None or group["attempt"] == attempt:
                return group
        return None

    def report_watchdog(self, attempt: int, rank: int, pid: int, message: str) -> None:
        self._watchdog.append({"attempt": attempt, "rank": rank, "pid": pid, "message": message})

    def watchdog_reports(self, attempt: int) -> list[dict[str, Any]]:
        return [w for w in self._watchdog if w["attempt"] == attempt]

    def progress(self, iteration: int, ts: float) -> None:
        """Rank 0 reports the steps it finished (replace_replica: the quorum's first replica, at
        most once a second): a restart's steps lost count from here."""
        if self._progress is None or iteration >= self._progress[0] or ts > self._progress[1]:
            self._progress = (iteration, ts)

    def last_progress(self) -> int | None:
        return self._progress[0] if self._progress is not None else None

    def replica_ended(self, attempt: int) -> None:
        """replace_replica: a replica left the training loop on its own (the last step, or a stop
        the quorum agreed on): every replica of the quorum left at that step, so a replacement
        still joining has nothing to train and must not wait for them."""
        self._replicas_ended.add(attempt)

    def replicas_ended(self, attempt: int) -> bool:
        return attempt in self._replicas_ended

    def release(self, slot: int, released: bool = True) -> None:
        """Ask replica slot `slot`'s ranks to leave at their next step boundary (False: a new group
        for the slot starts, and must not leave)."""
        (self._released.add if released else self._released.discard)(slot)

    def released(self, slot: int) -> bool:
        return slot in self._released

    def replica_placed(self, slot: int, ranks: list[dict[str, Any]]) -> None:
        """A new group for `slot` started (it has not stepped yet)."""
        self._placed[slot] = ranks
        self._stepping.discard(slot)

    def replica_stepping(self, slot: int) -> None:
        self._stepping.add(slot)

    def replicas(self) -> dict[str, Any]:
        """Where each slot's ranks run ({slot: ranks}) and the slots that stepped since they started."""
        return {"placed": dict(self._placed), "stepping": sorted(self._stepping)}

    def replica_gone(self, slot: int) -> None:
        self._placed.pop(slot, None)
        self._stepping.discard(slot)

    def controller_started(self, slot: int, controller: Any) -> None:
        """The handle of the controller of `slot`'s run (workers/trainer.py AnnounceController)."""
        self._controllers[slot] = controller

    def controllers(self) -> dict[int, Any]:
        return {slot: c for slot, c in self._controllers.items() if c is not None}

    def replica_join(self, replica: int, shard_rank: int, size: int, address: tuple[str, int] | None) -> int:
        from engine.fault_tolerance.replica_group import ReplicaRounds

        if self._rounds is None:
            self._rounds = ReplicaRounds()
        return self._rounds.join(replica, shard_rank, size, address)

    def replica_round(self, replica: int, number: int) -> dict[str, Any]:
        from engine.fault_tolerance.replica_group import ReplicaRounds

        return (self._rounds or ReplicaRounds()).round(replica, number)

    def snapshot_holders(self, node_ids: list[str]) -> dict[str, Any]:
        """node id -> handle of this job's snapshot holder there (started by this actor, which
        the driver owns, when there is none yet)."""
        from workers.snapshots import holder

        handles = {node: holder(self.job_id, node) for node in node_ids}
        # Every handle is kept for the job's life: Ray ends a non-detached actor once its owner
        # has no handle left (the ranks' go with the ranks), and a holder that already runs comes
        # back as a looked-up handle, which does not count; the one that started it must stay.
        self._holders.extend(handles.values())
        return handles
