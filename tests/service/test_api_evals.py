"""Checkpoint evaluations over REST: POST /v1/jobs/{id}/checkpoints/{iteration}/evals, GET
/v1/jobs/{id}/evals[/{eval_id}]. FakeLauncher for the API's answers, the command submitted and
the status transitions (scores read from the command's log); ProcessLauncher for one real
`elastron eval` of a real checkpoint written by `elastron train`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from service.launcher import LaunchStatus
from tests.service.launchers import ProcessLauncher
from tests.service.test_api_exports import ROOT, checkpoint_events, job_with_checkpoints
from tests.tiny_jobs import TINY_LLAMA
from tests.waiting import wait_for


def wait_eval(env, job_id: str, eval_id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict:
    def get():
        with env.client() as c:
            e = c.get(f"/v1/jobs/{job_id}/evals/{eval_id}").json()
        return e if e["status"] in states else None

    return wait_for(get, timeout_s, f"evaluation {eval_id} in {states}")


def result_line(results: dict) -> str:
    """What `elastron eval --print-json` ends its log with."""
    return "eval-result " + json.dumps({"iteration": 10, "results": results})


def test_an_evaluation_is_accepted_recorded_and_submitted(env):
    job_id = job_with_checkpoints(env)
    body = {"tasks": ["elastron_mc", "elastron_ppl"], "limit": 5, "ranks": 2, "tensor": 2}
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/evals", json=body)
        assert r.status_code == 202, r.text
        row = r.json()
        folder = f"{env.settings.checkpoint_dir}/alice/{job_id}/tiny/iter_0000010"
        assert row["checkpoint"] == folder and row["status"] == "pending" and row["results"] is None
        assert row["tasks"] == ["elastron_mc", "elastron_ppl"]
        assert row["options"] == {"limit": 5, "num_fewshot": None, "ranks": 2, "tensor": 2, "pipeline": 1}
        entry = wait_for(lambda: env.launcher.submissions.get(row["submission_id"]), 10, "the submission")
        assert entry["entrypoint"] == [
            "elastron", "eval", "--tasks", "elastron_mc,elastron_ppl", "--ranks", "2", "--tensor", "2",
            "--pipeline", "1", "--limit", "5", "--run", job_id, "--print-json", "--", folder,
        ]  # fmt: skip
        assert entry["resources"].num_cpus == 2.0  # a CPU per rank
        again = c.post(f"/v1/jobs/{job_id}/checkpoints/10/evals", json=body)
        assert again.status_code == 200 and again.json()["id"] == row["id"]  # the same request: that one
        assert c.get(f"/v1/jobs/{job_id}/evals").json()["evals"] == [c.get(f"/v1/jobs/{job_id}/evals/{row['id']}").json()]
        (event,) = c.get(f"/v1/jobs/{job_id}/events", params={"kind": "eval_requested"}).json()["events"]
    assert event["iteration"] == 10 and event["data"]["eval_id"] == row["id"]


def test_the_scores_come_from_the_commands_log_and_the_end_is_a_job_event(env):
    job_id = job_with_checkpoints(env, saved=(10, 20, 30))
    with env.client() as c:
        good, bare, bad = (
            c.post(f"/v1/jobs/{job_id}/checkpoints/{i}/evals", json={"tasks": ["elastron_mc"]}).json() for i in (10, 20, 30)
        )
    for e in (good, bare, bad):
        wait_for(lambda e=e: e["submission_id"] in env.launcher.submissions, 10, "the submissions")
    env.launcher.logs_of[good["submission_id"]] = "\n".join([
        "elastron_mc  acc  0.5",
        result_line({"elastron_mc": {"alias": "elastron_mc", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25}}),
        "evaluated iteration 10 of ... on 1 rank(s): 900 tokens in 2.0 s",
    ])  # fmt: skip
    env.launcher.logs_of[bad["submission_id"]] = "error: --tasks: 'elastron_mc' reads nothing\n"
    env.launcher.set_status(good["submission_id"], LaunchStatus.RUNNING)
    wait_eval(env, job_id, good["id"], ("running",))
    env.launcher.set_status(good["submission_id"], LaunchStatus.SUCCEEDED)
    env.launcher.set_status(bare["submission_id"], LaunchStatus.SUCCEEDED)  # a log without a result line
    env.launcher.set_status(bad["submission_id"], LaunchStatus.FAILED, "Job entrypoint failed with exit code 2")
    done = wait_eval(env, job_id, good["id"], ("succeeded", "failed"))
    assert done["status"] == "succeeded" and done["results"] == {"elastron_mc": {"acc": 0.5, "acc_norm": 0.25}}
    assert done["message"].startswith("evaluated iteration 10")
    unread = wait_eval(env, job_id, bare["id"], ("succeeded", "failed"))
    assert unread["status"] == "failed" and "without an eval-result line" in unread["message"]
    failed = wait_eval(env, job_id, bad["id"], ("failed",))
    assert "error: --tasks" in failed["message"] and "exit code 2" in failed["message"]
    with env.client() as c:
        events = c.get(f"/v1/jobs/{job_id}/events").json()["events"]
    with env.client("admin") as admin:  # the newest evaluated checkpoint's scores on /metrics
        text = admin.get("/metrics").text
    labels = f'job="{job_id}",tenant="alice"'
    assert f'elastron_job_eval_score{{{labels},task="elastron_mc",metric="acc"}} 0.5' in text
    assert f'elastron_job_eval_score{{{labels},task="elastron_mc",metric="acc_norm"}} 0.25' in text
    assert f"elastron_job_eval_iteration{{{labels}}} 10.0" in text
    ends = [(e["kind"], e["data"]["eval_id"]) for e in events if e["kind"] in ("eval_succeeded", "eval_failed")]
    assert sorted(ends) == sorted([("eval_succeeded", good["id"]), ("eval_failed", bare["id"]), ("eval_failed", bad["id"])])


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tasks": ["hellaswag"]}, "tasks"),
        ({"tasks": []}, "tasks"),
        ({"tasks": ["elastron_mc", "elastron_mc"]}, "tasks"),
        ({"tasks": ["elastron_mc"], "limit": 0}, "limit"),
        ({"tasks": ["elastron_mc"], "ranks": 65}, "ranks"),
        ({"tasks": ["elastron_mc"], "include_path": "/tmp"}, "include_path"),
    ],
)
def test_bad_bodies_are_422_naming_the_field(env, body, field):
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/evals", json=body)
    assert r.status_code == 422, r.text
    assert any(field in d["loc"] for d in r.json()["detail"]), r.json()


def test_a_layout_that_does_not_divide_the_ranks_and_a_missing_checkpoint_are_refused(env):
    job_id = job_with_checkpoints(env, saved=(10,), failed=(20,))
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/evals", json={"tasks": ["elastron_mc"], "ranks": 3, "tensor": 2})
        assert r.status_code == 422 and "not a multiple of tensor x pipeline" in r.text
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/11/evals", json={"tasks": ["elastron_mc"]})
        assert r.status_code == 404 and "iteration 11" in r.json()["detail"]
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/20/evals", json={"tasks": ["elastron_mc"]})
        assert r.status_code == 409 and "nothing to evaluate" in r.json()["detail"]
        assert c.get(f"/v1/jobs/{job_id}/evals/eval-000000000000").status_code == 404
    with env.client("bob") as bob:
        assert bob.post(f"/v1/jobs/{job_id}/checkpoints/10/evals", json={"tasks": ["elastron_mc"]}).status_code == 404
        assert bob.get(f"/v1/jobs/{job_id}/evals").status_code == 404


def test_a_tenant_has_a_bounded_number_of_evaluations_in_flight(start_env):
    from tests.service.launchers import FakeLauncher

    env = start_env(FakeLauncher(), max_exports_per_tenant=2)
    job_id = job_with_checkpoints(env, saved=(10, 20, 30))
    with env.client() as c:
        for i in (10, 20):
            assert c.post(f"/v1/jobs/{job_id}/checkpoints/{i}/evals", json={"tasks": ["elastron_mc"]}).status_code == 202
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/30/evals", json={"tasks": ["elastron_mc"]})
    assert r.status_code == 429 and "ELASTRON_MAX_EXPORTS_PER_TENANT" in r.json()["detail"]


# -- a real evaluation --------------------------------------------------------------------------


@pytest.fixture
def processes(tmp_path):
    launcher = ProcessLauncher(tmp_path / "launches")
    yield launcher
    launcher.kill_all()


def test_a_real_checkpoint_is_evaluated_by_a_real_process(start_env, processes, tmp_path):
    """The job runs on the fake worker (it reports a checkpoint at iteration 2); `elastron train`
    writes that very checkpoint, then `elastron eval` runs as a detached process and its scores
    come back into the evaluation's record."""
    env = start_env(processes, eval_entrypoint=f"{sys.executable} -m elastron.cli eval", checkpoint_dir=str(tmp_path))
    ckpt = tmp_path / "alice"
    spec = {
        "name": "eval-e2e",
        "model": {**TINY_LLAMA, "seq_length": 64},
        "training": {"train_iters": 2, "global_batch_size": 2, "micro_batch_size": 1},
        "checkpoint": {"path": str(ckpt), "interval": 2},
        "resources": {"ranks": 1, "device": "cpu"},
    }
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=spec).json()["id"]
    run_spec = env.wait_state(job_id, "succeeded")["spec"]
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
    checkpoint_events(job_id, env, saved=(2,))
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/2/evals", json={"tasks": ["elastron_mc", "elastron_ppl"], "limit": 4})
        assert r.status_code == 202, r.text
    done = wait_eval(env, job_id, r.json()["id"], ("succeeded", "failed"), timeout_s=240)
    assert done["status"] == "succeeded", done
    assert set(done["results"]) == {"elastron_mc", "elastron_ppl"}
    assert 0.0 <= done["results"]["elastron_mc"]["acc"] <= 1.0 and done["results"]["elastron_ppl"]["bits_per_byte"] > 0


def test_on_checkpoint_evaluates_every_nth_committed_checkpoint_once(env):
    from tests.service.test_api_jobs import TINY

    spec = {**TINY, "evaluation": {"on_checkpoint": {"tasks": ["elastron_mc", "elastron_gen"], "every": 2, "limit": 3}}}
    with env.client() as c:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    checkpoint_events(job_id, env, saved=(10, 20), failed=(25,))
    checkpoint_events(job_id, env, saved=(30, 40))
    checkpoint_events(job_id, env, saved=(40,))  # a save reported twice: still one evaluation
    with env.client() as c:
        rows = c.get(f"/v1/jobs/{job_id}/evals").json()["evals"]
    assert [(e["iteration"], e["tasks"], e["options"]["limit"]) for e in rows] == [
        (20, ["elastron_mc", "elastron_gen"], 3),
        (40, ["elastron_mc", "elastron_gen"], 3),
    ]
    for e in rows:  # submitted by the reconciler as any other evaluation
        wait_for(lambda e=e: e["submission_id"] in env.launcher.submissions, 10, "the submissions")
    with env.client() as c:  # and a bad on_checkpoint is the job spec's 422, naming the field
        r = c.post("/v1/jobs", json={**TINY, "evaluation": {"on_checkpoint": {"tasks": ["mmlu"]}}})
    assert r.status_code == 422 and "evaluation.on_checkpoint.tasks" in r.text, r.text
