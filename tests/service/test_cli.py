"""The job commands of the `elastron` CLI against a running API: output, and a clear message with a
non-zero exit for every failure (1: the API refused or is unreachable, 2: bad input)."""

from __future__ import annotations

import httpx
from typer.testing import CliRunner

from elastron.cli import app

runner = CliRunner()


def cli(env, *args: str, token: str | None = None, url: str | None = None):
    environ = {
        "ELASTRON_API_URL": url or env.server.url,
        "ELASTRON_API_TOKEN": token or env.tokens["alice"],
        "ELASTRON_HOME": str(env.settings.home),
        "ELASTRON_DATABASE_URL": env.settings.resolved_database_url,
    }
    return runner.invoke(app, list(args), env=environ)


def test_submit_jobs_status_cancel(env, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("# a comment\nname: cli-job\ntraining:\n  train_iters: 3\n  global_batch_size: 2\n")
    env.launcher.up = False  # stays queued
    r = cli(env, "submit", str(job), "--idempotency-key", "k1")
    assert r.exit_code == 0, r.output
    job_id = r.stdout.strip()
    assert cli(env, "submit", str(job), "--idempotency-key", "k1").stdout.strip() == job_id
    listing = cli(env, "jobs").stdout
    assert job_id in listing and "queued" in listing and "0/3" in listing
    status = cli(env, "status", job_id).stdout
    assert "state        queued" in status and "0/3 iterations" in status and "submitted" in status
    r = cli(env, "cancel", job_id)
    assert r.exit_code == 0 and f"{job_id}: cancelled" in r.stdout
    assert cli(env, "jobs", "--state", "cancelled").stdout.count(job_id) == 1
    assert cli(env, "logs", job_id).stdout == ""


def test_errors_are_clear_and_non_zero(env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  hidden_size: 65\n")
    r = cli(env, "submit", str(bad))
    assert r.exit_code == 2 and "model.hidden_size (65) must be divisible" in r.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    r = cli(env, "submit", str(broken))
    assert r.exit_code == 2 and "not valid YAML" in r.stderr
    r = cli(env, "submit", str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2 and "cannot read job file" in r.stderr
    r = cli(env, "status", "nope-00000000")
    assert r.exit_code == 1 and "no job 'nope-00000000'" in r.stderr and "HTTP 404" in r.stderr
    r = cli(env, "jobs", token="elt_not-a-token")
    assert r.exit_code == 1 and "invalid or revoked token" in r.stderr
    r = cli(env, "jobs", "--state", "asleep")
    assert r.exit_code == 2 and "state" in r.stderr
    r = cli(env, "jobs", url="http://127.0.0.1:9")
    assert r.exit_code == 1 and "cannot reach the API at http://127.0.0.1:9" in r.stderr


def test_no_configuration_says_how_to_get_one(tmp_path):
    r = runner.invoke(
        app, ["jobs"], env={"ELASTRON_HOME": str(tmp_path), "ELASTRON_API_URL": "", "ELASTRON_API_TOKEN": ""}
    )
    assert r.exit_code == 1 and "elastron up" in r.stderr and "ELASTRON_API_URL" in r.stderr


def test_token_create(env):
    r = cli(env, "token", "create", "--tenant", "carol")
    assert r.exit_code == 0, r.output
    token = r.stdout.strip()
    assert token.startswith("elt_") and "tenant 'carol'" in r.stderr
    with httpx.Client(base_url=env.server.url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/v1/jobs").json() == {"jobs": [], "next_cursor": None}
    r = cli(env, "token", "create", "--tenant", "Not Valid!")
    assert r.exit_code == 2 and "--tenant" in r.stderr
    r_id = cli(env, "token", "list").stdout.split("carol")[0].split()[-1]
    assert r_id.startswith("tok_")
    assert cli(env, "token", "revoke", r_id).exit_code == 0
    assert "revoked" in cli(env, "token", "list").stdout.split("carol")[1].splitlines()[0]
    env.server.ctx.tokens._cache.clear()  # the API honours a revocation within its cache TTL
    with httpx.Client(base_url=env.server.url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert c.get("/v1/jobs").status_code == 401
    r = cli(env, "token", "revoke", r_id)
    assert r.exit_code == 2 and "no active token" in r.stderr
