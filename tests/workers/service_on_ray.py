"""The API on the shared Ray test cluster, for the tests of the scheduler against real Ray: the
service's reconciler and scheduler with RayJobsLauncher, jobs launched as `elastron worker-run`
Ray jobs, and a sampler of Ray's own placement groups to check the scheduler's accounting
against what Ray really holds."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import ray

from engine.launcher import free_port
from service.launcher import RayJobsLauncher
from tests.service.conftest import ApiServer, make_settings, make_tokens
from tests.waiting import wait_for


@dataclass
class ServiceOnRay:
    server: ApiServer
    tokens: dict[str, str]

    def restart(self) -> None:
        """Stop the API and start a new one over the same store (jobs keep running on Ray)."""
        self.server.stop()
        self.server.start()
        wait_for(lambda: self.server.ctx.reconciler.capacity, 60, "the new API's first read of the cluster")

    def client(self, who: str = "alice") -> httpx.Client:
        return httpx.Client(
            base_url=self.server.url, headers={"Authorization": f"Bearer {self.tokens[who]}"}, timeout=30
        )


class JobView:
    """A tenant's view of its jobs over the API."""

    def __init__(self, api: httpx.Client):
        self.api = api

    def submit(self, spec: dict) -> dict:
        r = self.api.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def get(self, job_id: str, what: str = "") -> dict:
        return self.api.get(f"/v1/jobs/{job_id}{what}").json()

    def events(self, job_id: str, kind: str | None = None) -> list[dict]:
        events = self.get(job_id, "/events?limit=500")["events"]
        return [e for e in events if kind is None or e["kind"] == kind]

    def state(self, job_id: str, *states: str, timeout: float = 180) -> dict:
        return wait_for(lambda: (j := self.get(job_id))["state"] in states and j, timeout, f"{job_id} {states}")


@contextlib.contextmanager
def service_on_ray(ray_cluster, tmp_path: Path, **overrides) -> Iterator[ServiceOnRay]:
    """The API (reconciling every 0.5 s) launching jobs on the shared test cluster."""
    port = free_port()
    entrypoint = f"{sys.executable} -m elastron.cli worker-run {{job_id}} --storage {tmp_path / 'runs'}"
    values = dict(
        ray_address=f"http://{ray_cluster.webui_url}", ray_timeout_s=30.0, reconcile_interval_s=0.5,
        worker_entrypoint=entrypoint, preempt_grace_s=120.0,
    )  # fmt: skip
    settings = make_settings(tmp_path / "home", None, port, **{**values, **overrides})
    tokens = make_tokens(settings)
    launcher = RayJobsLauncher(settings.ray_address, entrypoint=entrypoint, timeout_s=30.0)
    server = ApiServer(settings, launcher, port).start()
    try:
        yield ServiceOnRay(server, tokens)
    finally:
        server.stop()


class PlacementSampler(threading.Thread):
    """Ray's placement groups every 0.25 s: the most CPUs the placed ones held at once, and the
    longest any one waited to be placed (a gang the scheduler admitted into room Ray did not have
    would wait)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.most_cpus = 0.0
        self.longest_pending = 0.0
        self.seen: set[str] = set()
        self._pending_since: dict[str, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.25):
            now, held = time.monotonic(), 0.0
            for pg_id, pg in ray.util.placement_group_table().items():
                self.seen.add(pg_id)
                if pg["state"] == "CREATED":
                    held += sum(b.get("CPU", 0.0) for b in pg["bundles"].values())
                    self._pending_since.pop(pg_id, None)
                elif pg["state"] in ("PENDING", "RESCHEDULING"):
                    since = self._pending_since.setdefault(pg_id, now)
                    self.longest_pending = max(self.longest_pending, now - since)
            self.most_cpus = max(self.most_cpus, held)

    def __enter__(self) -> PlacementSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(5)

    def check(self, cpus: float) -> str:
        assert self.seen and self.most_cpus <= cpus, f"placement groups held {self.most_cpus} CPUs of {cpus}"
        assert self.longest_pending < 10.0, f"a placement group waited {self.longest_pending:.1f} s for room"
        return f"placement groups: at most {self.most_cpus:g} CPUs held, longest wait {self.longest_pending:.1f} s"
