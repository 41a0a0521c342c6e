"""A sweep on a real Ray cluster, through the service (issue 56's proof): eight trials of a small
job, two at a time on the shared two-node test cluster, ASHA stopping those that fall behind.
A pruned trial hears it in its telemetry answers, saves the step it is at and stops (its last
record is its last checkpoint's iteration) and ends cancelled, not requeued; the API is restarted
mid-sweep and nothing is launched twice; the best trial is the one Optuna's study reports."""

from __future__ import annotations

from service.sweeps.spec import SweepSpec
from service.sweeps.study import SweepStudy, study_storage
from tests.waiting import wait_for
from tests.workers.conftest import job
from tests.workers.service_on_ray import JobView, service_on_ray

ITERS = 24
TRIALS = 8


def test_an_asha_sweep_runs_prunes_at_a_checkpoint_and_survives_an_api_restart(ray_cluster, tmp_path):
    """Over 30 s: eight Ray job launches (two at a time on 2 CPUs) and an API restart."""
    base = job(
        name="swp",
        training={"train_iters": ITERS, "log_interval": 1, "global_batch_size": 2, "micro_batch_size": 2},
        checkpoint={"interval": 12},
        resources={"ranks": 1, "device": "cpu"},
    )
    body = {
        "name": "lr",
        "base": base,
        "search_space": {"optimizer.lr": {"type": "float", "low": 1e-5, "high": 3e-2, "log": True}},
        "metric": {"name": "loss"},
        "budget": {"max_trials": TRIALS, "max_parallel": 2},
        "sampler": {"name": "random", "seed": 1},
        "pruner": {"name": "asha", "min_resource": 4, "reduction_factor": 3},
    }
    with service_on_ray(ray_cluster, tmp_path) as service:
        with service.client() as api:
            r = api.post("/v1/sweeps", json=body)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]

            def trials() -> list[dict]:
                return api.get(f"/v1/sweeps/{sid}").json()["trials"]

            wait_for(lambda: sum(t["state"] in ("complete", "pruned", "failed") for t in trials()) >= 3, 300, "3 trials done")
        service.restart()  # mid-sweep: trials running, the study and the rows in the store
        with service.client() as api:
            jobs = JobView(api)
            done = wait_for(
                lambda: (s := api.get(f"/v1/sweeps/{sid}").json())["state"] != "running" and s, 480, "the sweep ended"
            )
            assert done["state"] == "completed", done
            states = [t["state"] for t in done["trials"]]
            assert len(states) == TRIALS and "failed" not in states, done["trials"]
            pruned = [t for t in done["trials"] if t["state"] == "pruned"]
            assert pruned and "complete" in states
            for t in pruned:
                trial_job = jobs.get(t["job_id"])
                assert trial_job["state"] == "cancelled" and trial_job["attempt"] == 1
                (stopped,) = jobs.events(t["job_id"], "pruned")
                last = jobs.get(t["job_id"], f"/metrics?limit={ITERS + 5}")["records"][-1]["iteration"]
                assert stopped["data"]["checkpoint_iteration"] == last == stopped["data"]["stopped_at_iteration"] < ITERS
                assert not jobs.events(t["job_id"], "preempted")
            trial_jobs = [t["job_id"] for t in done["trials"]]
            assert len(set(trial_jobs)) == TRIALS
            mine = [j["id"] for j in api.get("/v1/jobs?limit=100").json()["jobs"] if j["name"].startswith("lr-t")]
            assert sorted(mine) == sorted(trial_jobs)  # one job per trial, across the restart
            assert [jobs.get(j)["attempt"] for j in trial_jobs] == [1] * TRIALS  # each launched once
        spec = SweepSpec.model_validate(done["spec"])
        url = service.server.settings.resolved_database_url
        assert SweepStudy.open(spec, sid, study_storage(url), ITERS).best().params == done["best"]["params"]
