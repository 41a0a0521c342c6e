"""REST exports of a LoRA job take the CLI's formats: `peft` (its adapters) and `hf-merged-lora`
(`elastron export --format hf --merge-lora`); a format that does not fit the job is a 422
naming `format`."""

from __future__ import annotations

import pytest

from tests.service.test_api_exports import checkpoint_events
from tests.service.test_api_jobs import TINY
from tests.waiting import wait_for

LORA_JOB = {**TINY, "model": {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}}


def submitted(env, body: dict) -> str:
    with env.client() as c:
        job_id = c.post("/v1/jobs", json=body).json()["id"]
    checkpoint_events(job_id, env)
    return job_id


@pytest.mark.parametrize(
    ("format", "flags"),
    [("peft", ["--format", "peft"]), ("hf-merged-lora", ["--format", "hf", "--merge-lora"])],
)
def test_lora_formats_run_the_cli_with_its_flags(env, format, flags):
    job_id = submitted(env, LORA_JOB)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"format": format, "dtype": "fp32"})
        assert r.status_code == 202, r.text
    export = r.json()
    folder = f"{env.settings.checkpoint_dir}/alice/{job_id}/tiny/iter_0000010"
    assert export["format"] == format and export["output"] == f"{folder}-{format}"
    entry = wait_for(lambda: env.launcher.submissions.get(export["submission_id"]), 10, "the export's submission")
    assert entry["entrypoint"] == [
        "elastron", "export", *flags, "--output", f"{folder}-{format}", "--dtype", "fp32", "--", folder
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "format", "says"),
    [
        (LORA_JOB, "hf", "this job trained LoRA adapters"),
        (TINY, "peft", "this job has none"),
        (TINY, "hf-merged-lora", "this job has none"),
    ],
)
def test_a_format_that_does_not_fit_the_job_is_422(env, body, format, says):
    job_id = submitted(env, body)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"format": format})
    assert r.status_code == 422, r.text
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "format"] and says in detail["msg"]


def test_cli_jobs_export_takes_the_format(env):
    from tests.service.test_cli import cli

    job_id = submitted(env, LORA_JOB)
    r = cli(env, "jobs", "export", job_id, "10", "--format", "peft")
    assert r.exit_code == 0, r.output
    assert r.stdout.split()[1] == "pending" and r.stdout.rstrip().endswith("iter_0000010-peft")
    r = cli(env, "jobs", "export", job_id, "10")  # hf: not for a LoRA job
    assert r.exit_code == 2 and "this job trained LoRA adapters" in r.stderr  # a 422: bad input
