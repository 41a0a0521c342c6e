"""The fault matrix's API row (test_fault_matrix.API_ROW): the API process killed between
recording a job's launch and launching it.

The reconciler commits its intent (the submission id, the `launch` event) before it calls the
launcher; here the launcher's first call kills the reconciler as the process dying at that
instant would (a BaseException no handler stops), so the launch never reaches it, and the API is
then stopped. A new API over the same store finds the submission missing at the launcher,
queues the job again and launches it once, on the real engine (engine_worker.py, one CPU rank,
reporting through the workers' telemetry sender). The row's checks: the job finishes, its records
are every iteration once with losses bitwise those of the same job run directly, its checkpoint
is committed and whole, and the time to recover (the crash to the first record) is printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.tools import require_module

require_module("fastapi", "fastapi (a main dependency) is not installed")

from engine.checkpointing.backends import open_storage  # noqa: E402
from engine.launcher import spawn  # noqa: E402
from tests.faults.matrix import check_storage  # noqa: E402
from tests.faults.run import train_with_faults  # noqa: E402
from tests.service.conftest import ApiServer, start_env  # noqa: E402, F401
from tests.service.launchers import ProcessLauncher  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "crash",
    "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_query_groups": 2, "seq_length": 32},
    "data": {"source": "text"},
    "training": {"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 6, "seed": 7},
    "checkpoint": {"interval": 2},
    "resources": {"ranks": 1, "device": "cpu"},
}


class ApiKilled(BaseException):
    """The API process dying: nothing in it handles this."""


class DiesOnFirstLaunch(ProcessLauncher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.died_at: float | None = None

    def submit(self, job_id, spec_json, env, *, submission_id=None):
        if self.died_at is None:
            self.died_at = time.time()
            raise ApiKilled(f"killed before launching {submission_id}")
        return super().submit(job_id, spec_json, env, submission_id=submission_id)


def test_the_api_killed_between_recording_and_launching(start_env, tmp_path):  # noqa: F811
    command = [sys.executable, "-m", "tests.faults.engine_worker"]
    extra = {"PYTHONPATH": str(ROOT)}
    dying = DiesOnFirstLaunch(tmp_path / "launches", command=command, extra_env=extra)
    env = start_env(dying)
    try:
        with env.client() as c:
            job_id = c.post("/v1/jobs", json=SPEC).json()["id"]
        deadline = time.monotonic() + 30
        while dying.died_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dying.died_at is not None, "the reconciler never tried to launch"
        recorded = env.job(job_id)
        assert recorded["state"] == "queued" and recorded["submission_id"]  # the intent, committed
        env.server.stop()
        relaunching = ProcessLauncher(tmp_path / "launches", command=command, extra_env=extra)
        env.server = ApiServer(env.settings, relaunching, env.server.port).start()
        wait_for(lambda: (env.job(job_id)["iteration"] or 0) >= 1, 240, "the relaunched job's first record")
        recovered_s = time.time() - dying.died_at
        done = env.wait_state(job_id, ("succeeded", "failed"), timeout_s=240)
        assert done["state"] == "succeeded", done
        with env.client() as c:
            records = c.get(f"/v1/jobs/{job_id}/metrics").json()["records"]
            events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
    finally:
        dying.kill_all()
        # The restarted API is not start_env's (that one stops the first): stopped here, or its
        # reconciler ran on until the interpreter's exit, logging a failed pass per tick.
        env.server.stop()
    launched = sorted(p.name for p in (tmp_path / "launches").iterdir())
    assert launched == [f"elastron-{job_id}-2"], launched  # the lost launch never ran; one did
    assert done["attempt"] == 2 and [e["kind"] for e in events].count("launch") == 2
    clean = spawn(train_with_faults, 1, ({**SPEC, "checkpoint": {"path": str(tmp_path / "ref"), "interval": 2}},
                                         None, str(tmp_path / "ref.jsonl")))[0]["records"]
    assert [(r["iteration"], r["loss"]) for r in records] == clean  # once each, bitwise
    ckpt = done["spec"]["checkpoint"]["path"]
    check_storage(open_storage(ckpt), done["spec"]["name"], SPEC["training"]["train_iters"])
    print(f"\n[fault matrix] api_kill-before_launch: relaunched once; time to recover {recovered_s:.2f} s "
          "(the crash to the relaunched job's first record, API restart included)")
