"""Sweeps through the real API and reconciler (service/routers/sweeps.py, service/reconcile/sweeps.py)
with a fake launcher: trials drawn by the Optuna study and queued as ordinary jobs, their metrics
reported to the study from their telemetry, a trial the ASHA pruner stops asked to save its step
and stop and then cancelled (not requeued), the best trial the study's, a drawn job spec the job
spec refuses a failed trial (not a failed sweep), an API restart mid-sweep (nothing launched twice,
a trial drawn but not recorded before the crash adopted), cancel, and bad input as 422s naming
their field."""

from __future__ import annotations

import pytest

from service.launcher import LaunchStatus
from service.sweeps.spec import SweepSpec
from service.sweeps.study import SweepStudy, study_storage
from tests.service.launchers import FakeLauncher
from tests.service.test_attack_surfaces import scrape
from tests.waiting import wait_for

ITERS = 9
BASE = {"name": "base", "training": {"train_iters": ITERS, "global_batch_size": 2}}


def sweep_body(**over) -> dict:
    return {
        "name": "lr",
        "base": BASE,
        "search_space": {"optimizer.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "metric": {"name": "loss"},
        "budget": {"max_trials": 4, "max_parallel": 2},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "asha", "min_resource": 1, "reduction_factor": 3},
        **over,
    }


def submit(env, body: dict, who: str = "alice") -> dict:
    with env.client(who) as c:
        r = c.post("/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def get(env, sweep_id: str, who: str = "alice") -> dict:
    with env.client(who) as c:
        r = c.get(f"/v1/sweeps/{sweep_id}")
    assert r.status_code == 200, r.text
    return r.json()


def launched_trials(env, sweep_id: str, count: int) -> list[dict]:
    """The sweep's trials once `count` of them have a launched job (in trial order)."""

    def ready():
        trials = [t for t in get(env, sweep_id)["trials"] if t["job_id"]]
        started = [t for t in trials if env.job(t["job_id"], "admin")["submission_id"]]
        return len(started) >= count and started

    return wait_for(ready, 30, f"{count} trials launched")


def report(env, job_id: str, losses: list[float], first: int = 1) -> dict:
    """Post the job's records (loss per iteration from `first`); returns the API's answer."""
    records = [{"iteration": first + i, "loss": v, "tokens": 8, "step_time_s": 0.1} for i, v in enumerate(losses)]
    with env.client("admin") as admin:
        r = admin.post(f"/v1/internal/jobs/{job_id}/telemetry", json={"records": records})
    assert r.status_code == 200, r.text
    return r.json()


def finish(env, job_id: str, status: LaunchStatus = LaunchStatus.SUCCEEDED) -> None:
    env.launcher.set_status(env.job(job_id, "admin")["submission_id"], status)


def trial_state(env, sweep_id: str, number: int) -> str:
    return next(t for t in get(env, sweep_id)["trials"] if t["number"] == number)["state"]


def run_to_end(env, job_id: str, scale: float) -> None:
    report(env, job_id, [scale / i for i in range(1, ITERS + 1)])
    finish(env, job_id)


def test_a_sweep_prunes_a_trial_that_falls_behind_and_ends_on_the_studys_best(start_env):
    # A pruned trial is asked in its telemetry answers first; the stop signal only after the grace.
    env = start_env(preempt_grace_s=3600.0)
    sweep = submit(env, sweep_body())
    sid = sweep["id"]
    assert sweep["state"] == "running" and sweep["spec"]["pruner"]["max_resource"] == ITERS
    first, second = launched_trials(env, sid, 2)
    assert {first["number"], second["number"]} == {0, 1}
    job = env.job(first["job_id"], "admin")
    assert job["spec"]["optimizer"]["lr"] == first["params"]["optimizer.lr"]  # the drawn value runs
    assert job["name"] == "lr-t0" and job["tenant"] == "alice"
    with env.client() as c:  # the job's record links it to its sweep
        (link,) = [e for e in c.get(f"/v1/jobs/{job['id']}/events").json()["events"] if e["kind"] == "sweep_trial"]
    assert link["data"] == {"sweep_id": sid, "number": 0, "params": first["params"]}

    run_to_end(env, first["job_id"], 1.0)
    wait_for(lambda: trial_state(env, sid, 0) == "complete", 30, "trial 0 complete")
    ack = report(env, second["job_id"], [10.0])  # far behind trial 0 at the first rung
    wait_for(lambda: trial_state(env, sid, 1) == "pruning", 30, "trial 1 pruned")
    ack = report(env, second["job_id"], [9.0], first=2)
    assert ack["stop"] == "checkpoint"  # asked to save its step and stop, as a preemption is
    finish(env, second["job_id"])  # it stopped by itself short of train_iters
    pruned = env.wait_state(second["job_id"], "cancelled")
    assert pruned["state"] == "cancelled"
    with env.client("admin") as admin:
        kinds = [e["kind"] for e in admin.get(f"/v1/jobs/{second['job_id']}/events").json()["events"]]
    assert "pruning" in kinds and "pruned" in kinds and "preempted" not in kinds
    wait_for(lambda: trial_state(env, sid, 1) == "pruned", 30, "trial 1 told pruned")

    third, fourth = [t for t in launched_trials(env, sid, 4) if t["number"] >= 2]
    run_to_end(env, third["job_id"], 0.5)  # the best
    wait_for(lambda: trial_state(env, sid, third["number"]) == "complete", 30, "the third trial complete")
    run_to_end(env, fourth["job_id"], 2.0)
    done = wait_for(lambda: (s := get(env, sid))["state"] == "completed" and s, 30, "the sweep completed")

    states = {t["number"]: t["state"] for t in done["trials"]}
    assert states[1] == "pruned" and states[third["number"]] == "complete" and len(states) == 4
    assert done["best"]["number"] == third["number"] and done["best"]["job_id"] == third["job_id"]
    assert done["best"]["value"] == pytest.approx(0.5 / ITERS)
    assert done["trials_started"] == 4 and len(env.launcher.submissions) == 4
    spec = SweepSpec.model_validate(done["spec"])
    study = SweepStudy.open(spec, sid, study_storage(env.settings.resolved_database_url), ITERS)
    assert study.best().params == done["best"]["params"]  # the best is the study's
    history = next(t for t in done["trials"] if t["number"] == 0)["history"]
    assert [p[0] for p in history] == list(range(1, ITERS + 1))

    exposition = scrape(env)
    assert 'elastron_sweeps{state="completed"} 1' in exposition
    assert 'elastron_sweep_trials{state="pruned"} 1' in exposition
    assert 'elastron_sweep_trials{state="complete"} 3' in exposition

    with env.client("bob") as c:  # another tenant sees none of it
        assert c.get(f"/v1/sweeps/{sid}").status_code == 404
        assert c.get("/v1/sweeps").json()["sweeps"] == []
    with env.client() as c:
        assert [s["id"] for s in c.get("/v1/sweeps").json()["sweeps"]] == [sid]


def test_a_drawn_job_spec_the_job_spec_refuses_is_a_failed_trial_not_a_failed_sweep(env):
    body = sweep_body(
        base={**BASE, "training": {"train_iters": ITERS, "global_batch_size": 4}},
        search_space={  # each value is fine alone; 6 with micro batch 4 is not
            "training.global_batch_size": {"type": "choice", "values": [4, 6]},
            "training.micro_batch_size": {"type": "choice", "values": [2, 4]},
        },
        sampler={"name": "grid", "seed": 0},
        pruner={"name": "none"},
        budget={"max_trials": 10, "max_parallel": 4},
    )
    sid = submit(env, body)["id"]
    good = launched_trials(env, sid, 3)
    for t in good:
        run_to_end(env, t["job_id"], 1.0)
    done = wait_for(lambda: (s := get(env, sid))["state"] == "completed" and s, 30, "the sweep completed")
    by_state = {}
    for t in done["trials"]:
        by_state.setdefault(t["state"], []).append(t)
    (refused,) = by_state["failed"]
    assert refused["params"] == {"training.global_batch_size": 6, "training.micro_batch_size": 4}
    assert refused["job_id"] is None and "refused" in refused["message"] and "global_batch_size" in refused["message"]
    assert len(by_state["complete"]) == 3 and len(done["trials"]) == 4  # the grid, once


def test_an_api_restart_mid_sweep_launches_nothing_twice_and_adopts_a_drawn_trial(start_env, tmp_path):
    url = f"sqlite:///{tmp_path}/store.db"
    fake = FakeLauncher()
    first = start_env(fake, database_url=url)
    sid = submit(first, sweep_body(pruner={"name": "none"}))["id"]
    a, b = launched_trials(first, sid, 2)
    run_to_end(first, a["job_id"], 1.0)
    wait_for(lambda: trial_state(first, sid, 0) == "complete", 30, "trial 0 complete")
    launched_trials(first, sid, 3)
    first.server.stop()
    # A crash between drawing a trial and recording it: the study has a trial the store does not.
    spec = SweepSpec.model_validate(get_spec(url, sid))
    orphan, _ = SweepStudy.open(spec, sid, study_storage(url), ITERS).ask()

    second = start_env(fake, database_url=url)  # the same store and the same (fake) Ray
    trials = wait_for(lambda: len(t := get(second, sid)["trials"]) == 4 and t, 30, "the drawn trial adopted")
    adopted = next(t for t in trials if t["number"] == orphan)
    assert adopted["state"] in ("waiting", "running")
    for t in launched_trials(second, sid, 4):
        if t["number"] != 0:
            run_to_end(second, t["job_id"], 2.0)
    done = wait_for(lambda: (s := get(second, sid))["state"] == "completed" and s, 30, "the sweep completed")
    jobs = [t["job_id"] for t in done["trials"]]
    assert len(done["trials"]) == 4 and len(set(jobs)) == 4
    assert len(fake.submissions) == 4  # one launch per trial, across the restart


def get_spec(url: str, sweep_id: str) -> dict:
    from service.store.db import make_engine, make_sessionmaker
    from service.store.sweeps import get_sweep

    engine = make_engine(url)
    try:
        with make_sessionmaker(engine)() as s:
            return dict(get_sweep(s, sweep_id).spec)
    finally:
        engine.dispose()


def test_cancelling_a_sweep_cancels_its_running_trials(env):
    sid = submit(env, sweep_body())["id"]
    trials = launched_trials(env, sid, 2)
    with env.client() as c:
        r = c.post(f"/v1/sweeps/{sid}/cancel")
    assert r.status_code == 202, r.text
    for t in trials:
        env.wait_state(t["job_id"], "cancelled")
    done = wait_for(lambda: (s := get(env, sid))["state"] == "cancelled" and s, 30, "the sweep cancelled")
    assert {t["state"] for t in done["trials"]} == {"failed"} and len(done["trials"]) == 2
    with env.client() as c:
        assert c.post(f"/v1/sweeps/{sid}/cancel").status_code == 409


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"search_space": {"optimizer.lrr": {"type": "float", "low": 1, "high": 2}}}, "search_space.optimizer.lrr"),
        ({"base": {**BASE, "training": {"train_iters": 0}}}, "base.training.train_iters"),
        ({"budget": {"max_trials": 0}}, "budget.max_trials"),
        ({"metric": {"name": "valid_loss"}}, "metric.name"),
        (
            {"search_space": {"training.global_batch_size": {"type": "choice", "values": [2, 0]}}},
            "search_space.training.global_batch_size.values.1",
        ),
        ({"base": {**BASE, "checkpoint": {"path": "/etc/elsewhere"}}}, "base.checkpoint.path"),
    ],
)
def test_a_sweep_that_cannot_run_is_a_422_naming_the_field(env, over, field):
    with env.client() as c:
        r = c.post("/v1/sweeps", json=sweep_body(**over))
    assert r.status_code == 422, r.text
    locs = [".".join(str(p) for p in d["loc"][1:]) for d in r.json()["detail"]]
    assert field in locs, r.json()
    with env.client() as c:
        assert c.get("/v1/sweeps").json()["sweeps"] == []  # nothing recorded


def test_the_sweep_commands_submit_show_and_cancel(env, tmp_path):
    import yaml

    from tests.service.test_cli import cli

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_body(pruner={"name": "none"})))
    r = cli(env, "sweep", "submit", str(path))
    assert r.exit_code == 0, r.output
    sid = r.stdout.split()[1]
    first, _ = launched_trials(env, sid, 2)
    run_to_end(env, first["job_id"], 1.0)
    wait_for(lambda: "best: #0" in cli(env, "sweep", "status", sid).stdout, 30, "the best trial shown")
    status = cli(env, "sweep", "status", sid).stdout
    assert f"{sid}  running  loss (min)" in status and "#0   complete" in status and first["job_id"] in status
    assert sid in cli(env, "sweep", "list").stdout
    r = cli(env, "sweep", "cancel", sid)
    assert r.exit_code == 0 and "cancel requested" in r.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep_body(search_space={"optimizer.lrr": {"type": "float", "low": 1, "high": 2}})))
    r = cli(env, "sweep", "submit", str(bad))
    assert r.exit_code == 2 and "search_space.optimizer.lrr" in r.stderr and "no field 'lrr'" in r.stderr


def test_an_extended_sweep_continues_its_pruned_trial_from_its_checkpoint(start_env):
    env = start_env(preempt_grace_s=3600.0)
    sid = submit(env, sweep_body(budget={"max_trials": 2, "max_parallel": 2}))["id"]
    first, second = launched_trials(env, sid, 2)
    run_to_end(env, first["job_id"], 1.0)
    wait_for(lambda: trial_state(env, sid, 0) == "complete", 30, "trial 0 complete")
    report(env, second["job_id"], [10.0])
    wait_for(lambda: trial_state(env, sid, 1) == "pruning", 30, "trial 1 pruned")
    finish(env, second["job_id"])
    wait_for(lambda: get(env, sid)["state"] == "completed", 30, "the sweep completed")

    with env.client() as c:
        assert c.post(f"/v1/sweeps/{sid}/extend", json={"max_trials": 2}).status_code == 422  # not above 2
        r = c.post(f"/v1/sweeps/{sid}/extend", json={"max_trials": 3, "resume_pruned": True})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "running" and r.json()["spec"]["budget"]["max_trials"] == 3
    resumed = next(t for t in launched_trials(env, sid, 3) if t["number"] == 2)
    assert resumed["params"] == second["params"] and resumed["resumes_job"] == second["job_id"]
    spec = env.job(resumed["job_id"], "admin")["spec"]
    assert second["job_id"] in spec["checkpoint"]["resume_from"]  # job:<id> resolved to where it saved
    run_to_end(env, resumed["job_id"], 0.5)
    done = wait_for(lambda: (s := get(env, sid))["state"] == "completed" and s, 30, "the extended sweep completed")
    assert [t["state"] for t in done["trials"]] == ["complete", "pruned", "complete"]
    assert done["best"]["number"] == 2
    with env.client() as c:
        assert c.post(f"/v1/sweeps/{sid}/cancel").status_code == 409  # completed
        assert c.post("/v1/sweeps/nope/extend", json={"max_trials": 9}).status_code == 404
