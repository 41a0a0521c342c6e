"""Checkpoint exports over REST: POST /v1/jobs/{id}/checkpoints/{iteration}/export, GET
/v1/jobs/{id}/exports[/{export_id}], `elastron jobs export`. FakeLauncher for the API's
answers and the status transitions; ProcessLauncher for one real `elastron export` of a real
checkpoint written by `elastron train`."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from service.launcher import LaunchStatus, SubmissionRejected
from tests.service.launchers import ProcessLauncher
from tests.service.test_api_jobs import TINY
from tests.service.test_cli import cli
from tests.tiny_jobs import TINY_LLAMA
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def checkpoint_events(job_id: str, env, saved=(10,), failed=()) -> None:
    """What the workers report after checkpoint saves (posted with a token the route accepts)."""
    events = [
        {"kind": "checkpoint_saved", "iteration": i, "ts": time.time(), "uri": f"/elsewhere/iter_{i:07d}"}
        for i in saved
    ] + [
        {"kind": "checkpoint_failed", "iteration": i, "ts": time.time(), "error": "disk full"} for i in failed
    ]
    with env.client("admin") as admin:
        r = admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"events": events})
        assert r.status_code == 200, r.text


def grant(env, *roots: str, tenant: str = "alice") -> None:
    """An admin grants `tenant` storage roots (s3:// outputs must lie under them)."""
    with env.client("admin") as admin:
        r = admin.put(f"/v1/tenants/{tenant}/storage", json={"roots": list(roots)})
        assert r.status_code == 200, r.text


def job_with_checkpoints(env, **kwargs) -> str:
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    checkpoint_events(job_id, env, **kwargs)
    return job_id


def wait_export(env, job_id: str, export_id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict:
    def get():
        with env.client() as c:
            e = c.get(f"/v1/jobs/{job_id}/exports/{export_id}").json()
        return e if e["status"] in states else None

    return wait_for(get, timeout_s, f"export {export_id} in {states}")


def test_export_is_accepted_recorded_and_submitted(env):
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"dtype": "fp16"})
        assert r.status_code == 202, r.text
        export = r.json()
        # The checkpoint read is where the job's spec as run writes, not the reported uri.
        folder = f"{env.settings.checkpoint_dir}/alice/{job_id}/tiny/iter_0000010"
        assert export["checkpoint"] == folder and export["output"] == f"{folder}-hf"
        assert (export["job_id"], export["iteration"], export["format"], export["dtype"]) == (
            job_id,
            10,
            "hf",
            "fp16",
        )
        assert export["status"] == "pending" and export["message"] is None and export["finished_at"] is None
        sid = export["submission_id"]
        entry = wait_for(lambda: env.launcher.submissions.get(sid), 10, "the export's submission")
        assert entry["entrypoint"] == [
            "elastron", "export", "--format", "hf", "--output", f"{folder}-hf", "--dtype", "fp16", "--", folder
        ]  # fmt: skip
        assert c.get(f"/v1/jobs/{job_id}/exports").json()["exports"] == [export]
        assert c.get(f"/v1/jobs/{job_id}/exports/{export['id']}").json() == export
        (event,) = c.get(f"/v1/jobs/{job_id}/events", params={"kind": "export_requested"}).json()["events"]
    assert event["iteration"] == 10 and event["data"]["export_id"] == export["id"]
    assert event["data"]["output"] == f"{folder}-hf" and folder in event["message"]


def test_status_follows_the_launcher_and_the_end_is_a_job_event(env):
    job_id = job_with_checkpoints(env, saved=(10, 20))
    grant(env, "s3://bucket")
    with env.client() as c:
        good = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).json()
        bad = c.post(f"/v1/jobs/{job_id}/checkpoints/20/export", json={"output": "s3://bucket/x"}).json()
    for e in (good, bad):
        wait_for(lambda e=e: e["submission_id"] in env.launcher.submissions, 10, "the submissions")
    env.launcher.set_status(good["submission_id"], LaunchStatus.RUNNING)
    wait_export(env, job_id, good["id"], ("running",))
    env.launcher.set_status(good["submission_id"], LaunchStatus.SUCCEEDED)
    env.launcher.set_status(
        bad["submission_id"], LaunchStatus.FAILED, "Job entrypoint failed with exit code 2"
    )
    done = wait_export(env, job_id, good["id"], ("succeeded",))
    failed = wait_export(env, job_id, bad["id"], ("failed",))
    assert done["finished_at"] is not None and failed["finished_at"] is not None
    assert "exit code 2" in failed["message"]
    with env.client() as c:
        listed = c.get(f"/v1/jobs/{job_id}/exports").json()["exports"]
        events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
    assert [(e["id"], e["status"]) for e in listed] == [(good["id"], "succeeded"), (bad["id"], "failed")]
    kinds = [(e["kind"], e["data"].get("export_id")) for e in events if e["kind"].startswith("export_")]
    assert (
        kinds.count(("export_succeeded", good["id"])) == 1 and kinds.count(("export_failed", bad["id"])) == 1
    )
    (end,) = [e for e in events if e["kind"] == "export_failed"]
    assert end["data"]["output"] == "s3://bucket/x" and "exit code 2" in end["data"]["message"]


def test_a_refused_submission_fails_the_export(env):
    job_id = job_with_checkpoints(env)
    env.wait_state(job_id, "starting")
    env.launcher.reject_with = SubmissionRejected("no such runtime env")
    with env.client() as c:
        export = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).json()
    failed = wait_export(env, job_id, export["id"], ("failed",))
    assert "no such runtime env" in failed["message"]


def test_unknown_iteration_is_404_and_a_failed_save_409(env):
    job_id = job_with_checkpoints(env, saved=(10,), failed=(20,))
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/11/export", json={})
        assert r.status_code == 404 and "iteration 11" in r.json()["detail"]
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/20/export", json={})
        assert r.status_code == 409 and "iteration 20 failed" in r.json()["detail"]
        assert c.post("/v1/jobs/nope-00000000/checkpoints/10/export", json={}).status_code == 404
        r = c.get(f"/v1/jobs/{job_id}/exports/exp-000000000000")
        assert r.status_code == 404 and "no export" in r.json()["detail"]
        assert c.get(f"/v1/jobs/{job_id}/exports").json() == {"exports": []}


def test_another_tenants_job_and_exports_are_404(env):
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        export_id = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).json()["id"]
    with env.client("bob") as bob:
        r = bob.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={})
        assert r.status_code == 404 and r.json()["detail"] == f"no job {job_id!r}"
        assert bob.get(f"/v1/jobs/{job_id}/exports").status_code == 404
        assert bob.get(f"/v1/jobs/{job_id}/exports/{export_id}").status_code == 404
    with env.client(None) as anonymous:
        assert anonymous.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).status_code == 401
    with env.client("admin") as admin:  # an admin sees every tenant's jobs
        assert admin.get(f"/v1/jobs/{job_id}/exports/{export_id}").status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"format": "onnx"}, "format"),
        ({"output": ""}, "output"),
        ({"output": "x" * 1025}, "output"),
        ({"output": "/tmp/a\nb"}, "output"),
        ({"output": "relative/folder"}, "output"),
        ({"output": "/etc/elastron"}, "output"),
        ({"output": "file:///tmp/x"}, "output"),
        ({"output": "s3://"}, "output"),
        ({"overwrite": True}, "overwrite"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(env, body, field):
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json=body)
    assert r.status_code == 422, r.text
    assert any(field in d["loc"] for d in r.json()["detail"]), r.json()


def test_local_outputs_only_under_the_tenants_folders(env):
    job_id = job_with_checkpoints(env)
    home, ckpt = env.settings.home, env.settings.checkpoint_dir
    grant(env, "s3://models/alice")
    ok = [f"{home}/exports/alice/llama", f"{ckpt}/alice/hf/llama", "s3://models/alice/llama"]
    refused = [
        "s3://models/bob/llama",  # another tenant's prefix (issue 61)
        f"{ckpt}/bob/llama",  # another tenant's folder
        f"{home}/exports/alice/../bob/llama",  # climbs out
        f"{home}/exports/alice",  # the root itself
        f"{ckpt}/alice/{job_id}/tiny/iter_0000010/hf",  # into a checkpoint
        f"{home}/elastron.db",
    ]
    with env.client() as c:
        for output in ok:
            r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"output": output})
            assert r.status_code == 202 and r.json()["output"] == output, r.text
        for output in refused:
            r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"output": output})
            assert r.status_code == 422, (output, r.text)
            (problem,) = r.json()["detail"]
            assert problem["loc"] == ["body", "output"] and output in problem["msg"]


def test_cli_jobs_export(env):
    job_id = job_with_checkpoints(env)
    r = cli(env, "jobs", "export", job_id, "10", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    export_id, status = r.stdout.split()[:2]
    assert export_id.startswith("exp-") and status == "pending" and "iteration 10 ->" in r.stdout
    r = cli(env, "jobs", "export", job_id, "11")
    assert r.exit_code == 1 and "iteration 11" in r.stderr and "HTTP 404" in r.stderr
    r = cli(env, "jobs", "export", job_id, "10", "--dtype", "int4")
    assert r.exit_code == 2 and "dtype" in r.stderr
    assert job_id in cli(env, "jobs").stdout  # the listing is unchanged

    wait_for(lambda: f"elastron-{job_id}-{export_id}" in env.launcher.submissions, 10, "the first export")
    known = set(env.launcher.submissions)

    def finish_the_next_export():
        sid = wait_for(lambda: next((s for s in env.launcher.submissions if s not in known), None), 30)
        env.launcher.set_status(sid, LaunchStatus.FAILED, "exit code 2")

    finisher = threading.Thread(target=finish_the_next_export)
    finisher.start()
    r = cli(env, "jobs", "export", job_id, "10", "--wait")
    finisher.join()
    assert r.exit_code == 1 and "failed: " in r.stdout and "exit code 2" in r.stdout, r.output


# -- a real export -----------------------------------------------------------------------------


@pytest.fixture
def processes(tmp_path):
    launcher = ProcessLauncher(tmp_path / "launches")
    yield launcher
    launcher.kill_all()


def test_a_real_checkpoint_is_exported_by_a_real_process(start_env, processes, tmp_path):
    """The job runs on the fake worker (it reports a checkpoint at iteration 2); `elastron train`
    writes that very checkpoint where the job's spec as run says, then the export runs as a
    detached `elastron export` process and the folder has what transformers loads."""
    # alice's checkpoints under <ELASTRON_CHECKPOINT_DIR>/alice, her storage root (issue 61)
    env = start_env(
        processes, export_entrypoint=f"{sys.executable} -m elastron.cli export", checkpoint_dir=str(tmp_path)
    )
    ckpt = tmp_path / "alice"
    spec = {
        "name": "exp-e2e",
        "model": TINY_LLAMA,
        "training": {"train_iters": 2, "global_batch_size": 2, "micro_batch_size": 1},
        "checkpoint": {"path": str(ckpt), "interval": 2},
        "resources": {"ranks": 1, "device": "cpu"},
    }
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=spec).json()["id"]
    run_spec = env.wait_state(job_id, "succeeded")["spec"]
    with env.client() as c:  # nothing written there yet: the command's own error comes back
        early = c.post(f"/v1/jobs/{job_id}/checkpoints/2/export", json={}).json()
    failed = wait_export(env, job_id, early["id"], ("succeeded", "failed"), timeout_s=180)
    assert failed["status"] == "failed" and "error:" in failed["message"], failed
    assert "exit code 2" in failed["message"], failed
    run_spec["checkpoint"]["path"] = str(ckpt / job_id)  # what the workers do
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(run_spec))
    train = subprocess.run(
        [sys.executable, "-m", "elastron.cli", "train", str(job_file), "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert train.returncode == 0, train.stderr
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/2/export", json={"dtype": "fp32"})
        assert r.status_code == 202, r.text
    export = r.json()
    assert export["checkpoint"] == str(ckpt / job_id / "exp-e2e" / "iter_0000002")
    done = wait_export(env, job_id, export["id"], ("succeeded", "failed"), timeout_s=180)
    assert done["status"] == "succeeded", (done, processes.logs(export["submission_id"]))
    assert done["message"].startswith("exported iteration 2 of ")
    out = Path(done["output"])
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
