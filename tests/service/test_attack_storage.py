"""Issue 61, storage confinement: every path, bucket and endpoint a tenant's job spec or export
names lies under that tenant's roots (service/storage_policy.py), else 422 naming the field and
the roots; the roots go to the job's workers, where opening storage outside them raises
(engine/jobspec/storage_roots.py). One test per vector of the audit, each seen failing (201/202) before
the fix."""

from __future__ import annotations

import os

import pytest

from engine.checkpointing.backends import open_storage
from engine.jobspec.storage_roots import ENV_STORAGE_ROOTS, StorageOutsideRoots, StorageRoots, is_within
from tests.service.test_api_exports import job_with_checkpoints
from tests.service.test_api_jobs import TINY
from tests.waiting import wait_for


def spec(**sections) -> dict:
    body = {**TINY}
    for name, fields in sections.items():
        body[name] = {**body.get(name, {}), **fields}
    return body


def refused(env, body, field: str, who: str = "alice") -> dict:
    with env.client(who) as c:
        r = c.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    problems = r.json()["detail"]
    mine = [p for p in problems if field in p["msg"]]
    assert mine, problems
    assert "outside the storage" in mine[0]["msg"] or "endpoint" in mine[0]["msg"], mine
    return mine[0]


def tenant_root(env, tenant="alice") -> str:
    return f"{env.settings.checkpoint_dir}/{tenant}"


@pytest.mark.parametrize("path", ["../../etc", "/etc", "/etc/", "file:///etc"])
def test_checkpoint_path_outside_the_tenants_root_is_422(env, path):
    p = refused(env, spec(checkpoint={"path": path}), "checkpoint.path")
    assert tenant_root(env) in p["msg"]  # names the roots allowed
    assert p["loc"] == ["body", "checkpoint", "path"]


def test_checkpoint_path_with_dotdot_out_of_the_root_is_422(env):
    refused(env, spec(checkpoint={"path": f"{tenant_root(env)}/../bob"}), "checkpoint.path")


def test_another_tenants_checkpoint_folder_is_422(env):
    refused(env, spec(checkpoint={"path": tenant_root(env, "bob")}), "checkpoint.path")


def test_a_prefix_sibling_is_not_inside(env):
    refused(env, spec(checkpoint={"path": f"{tenant_root(env)}-other"}), "checkpoint.path")


def test_a_symlink_out_of_the_root_is_422(env, tmp_path):
    os.makedirs(tenant_root(env), exist_ok=True)
    os.makedirs(tmp_path / "elsewhere", exist_ok=True)
    os.symlink(tmp_path / "elsewhere", f"{tenant_root(env)}/link")
    refused(env, spec(checkpoint={"path": f"{tenant_root(env)}/link"}), "checkpoint.path")


def test_another_bucket_is_422(env):
    refused(env, spec(checkpoint={"path": "s3://someone-elses-bucket/ckpt"}), "checkpoint.path")


def test_raw_resume_from_into_another_tenants_folder_is_422(env):
    with env.client("bob") as bob:
        bobs = bob.post("/v1/jobs", json=TINY).json()["id"]
    target = f"{tenant_root(env, 'bob')}/{bobs}/tiny"
    refused(env, spec(checkpoint={"resume_from": target}), "checkpoint.resume_from")


@pytest.mark.parametrize(
    "url",
    ["https://attacker.example.com", "http://169.254.169.254", "http://169.254.169.254/latest/meta-data/"],
)
def test_endpoint_url_not_in_the_operators_list_is_422(env, url):
    p = refused(env, spec(checkpoint={"endpoint_url": url}), "checkpoint.endpoint_url")
    assert "ELASTRON_ALLOWED_ENDPOINTS" in p["msg"]


def test_the_metadata_address_is_refused_even_if_the_operator_lists_it(start_env):
    env = start_env(allowed_endpoints=["http://169.254.169.254", "http://minio:9000"])
    refused(env, spec(checkpoint={"endpoint_url": "http://169.254.169.254"}), "checkpoint.endpoint_url")
    with env.client() as c:
        assert (
            c.post("/v1/jobs", json=spec(checkpoint={"endpoint_url": "http://minio:9000/"})).status_code
            == 201
        )


def test_data_path_etc_passwd_is_422(env):
    refused(env, spec(data={"source": "sft", "path": "/etc/passwd"}), "data.path")


def test_data_blend_member_outside_is_422(env):
    refused(env, spec(data={"blend": [[1.0, "/etc/corpus"]]}), "data.blend[0]")


def test_data_tokenizer_hf_root_is_422(env):
    refused(env, spec(data={"tokenizer": "hf:/root"}), "data.tokenizer")


def test_init_from_outside_is_refused_before_it_is_read(env, tmp_path):
    # A folder the API could read: the 422 must come from confinement, not from reading it.
    folder = tmp_path / "secret-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    refused(env, spec(model={"init_from": str(folder)}), "model.init_from")


def test_lora_init_from_outside_is_422(env):
    refused(env, spec(model={"lora": {"init_from": "/etc/adapters"}}), "model.lora.init_from")


def test_admin_may_name_any_path(env):
    with env.client("admin") as admin:
        assert admin.post("/v1/jobs", json=spec(checkpoint={"path": "/srv/shared-ckpt"})).status_code == 201


def test_a_granted_root_works_and_only_admins_grant(env, tmp_path):
    granted = str(tmp_path / "team-a")
    body = spec(checkpoint={"path": granted}, data={"source": "sft", "path": f"{tmp_path}/sets/x.jsonl"})
    with env.client("alice") as c:
        assert c.post("/v1/jobs", json=body).status_code == 422
        r = c.put("/v1/tenants/alice/storage", json={"roots": [granted]})
        assert r.status_code == 403
    with env.client("admin") as admin:
        r = admin.put(
            "/v1/tenants/alice/storage", json={"roots": [granted], "read_roots": [f"{tmp_path}/sets"]}
        )
        assert r.status_code == 200, r.text
        assert r.json()["roots"] == [granted]
        assert admin.put("/v1/tenants/alice/storage", json={"roots": ["relative/x"]}).status_code == 422
        assert admin.put("/v1/tenants/alice/storage", json={"roots": ["/"]}).status_code == 422
    with env.client("alice") as c:
        assert c.get("/v1/tenants/alice/storage").json()["read_roots"] == [f"{tmp_path}/sets"]
        assert c.get("/v1/tenants/bob/storage").status_code == 404
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        # read-only: not for checkpoints
        refused(env, spec(checkpoint={"path": f"{tmp_path}/sets/ck"}), "checkpoint.path")
    with env.client("bob") as bob:  # a grant is one tenant's
        assert bob.post("/v1/jobs", json=body).status_code == 422
    # The workers get the roots the job was admitted with.
    wait_for(lambda: any(s["job_id"] == job_id for s in env.launcher.submissions.values()), 10, "the launch")
    roots = StorageRoots.from_env(env.launcher.env_of(job_id))
    assert roots is not None and granted in roots.write and f"{tmp_path}/sets" in roots.read


def test_set_storage_cli(env, tmp_path):
    from tests.service.test_cli import cli

    granted = str(tmp_path / "cli-root")
    args = ("tenants", "set-storage", "alice", "--root", granted, "--root", "s3://bkt/alice")
    r = cli(env, *args, token=env.tokens["admin"])
    assert r.exit_code == 0, r.output
    assert granted in r.output and "s3://bkt/alice" in r.output
    assert cli(env, *args).exit_code != 0  # alice is no admin
    with env.client("alice") as c:
        assert c.post("/v1/jobs", json=spec(checkpoint={"path": "s3://bkt/alice/x"})).status_code == 201
        refused(env, spec(checkpoint={"path": "s3://bkt/alice-other"}), "checkpoint.path")


@pytest.mark.parametrize("output", ["s3://another-bucket/x", "s3://bkt/bob/x", "s3://bkt/alice-other"])
def test_export_to_another_bucket_or_tenants_prefix_is_422(env, output):
    with env.client("admin") as admin:
        assert admin.put("/v1/tenants/alice/storage", json={"roots": ["s3://bkt/alice"]}).status_code == 200
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"output": output})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "output"]
        assert "s3://bkt/alice" in r.json()["detail"][0]["msg"]
        r = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={"output": "s3://bkt/alice/hf"})
        assert r.status_code == 202, r.text


# -- where storage is opened ---------------------------------------------------------------------


def test_opening_storage_outside_the_roots_raises(tmp_path, monkeypatch):
    inside, outside = tmp_path / "mine", tmp_path / "theirs"
    inside.mkdir()
    outside.mkdir()
    monkeypatch.setenv(ENV_STORAGE_ROOTS, StorageRoots(write=(str(inside),)).to_env())
    open_storage(str(inside / "ckpt"))
    for where in (str(outside), f"{inside}/../theirs", f"file://{outside}", "s3://bucket/x"):
        with pytest.raises(StorageOutsideRoots):
            open_storage(where)
    monkeypatch.delenv(ENV_STORAGE_ROOTS)
    open_storage(str(outside))  # no roots given (a local run): unconfined


def test_the_driver_refuses_a_spec_outside_its_roots(tmp_path, monkeypatch):
    from engine.jobspec import parse_job
    from workers.driver import JobDriver
    from workers.spec_on_ray import JobInputError

    monkeypatch.setenv(ENV_STORAGE_ROOTS, StorageRoots(write=(str(tmp_path / "mine"),)).to_env())
    job = parse_job({**TINY, "checkpoint": {"path": "/etc"}})
    with pytest.raises(JobInputError, match="checkpoint.path"):
        JobDriver("tiny-00000001", job)


def test_matching_is_by_whole_segments():
    assert is_within("s3://b/p/x", "s3://b/p") and is_within("s3://b/p/", "s3://b/p")
    assert not is_within("s3://b/prefix-other", "s3://b/p") and not is_within("s3://b/p", "s3://b/p/x")
    assert not is_within("s3://b/p/../q", "s3://b/p") and not is_within("s3://c/p", "s3://b/p")
    assert not is_within("/a/bc", "/a/b") and is_within("/a/b/../b/c", "/a/b")


def test_a_tenants_jobs_and_exports_get_its_own_credentials(start_env, monkeypatch):
    monkeypatch.setenv("ACME_SECRET_FOR_TEST", "s3cr3t")
    env = start_env(
        tenant_credentials={
            "alice": {"AWS_ACCESS_KEY_ID": "alice-key", "AWS_SECRET_ACCESS_KEY": "$ACME_SECRET_FOR_TEST"}
        }
    )
    ids = {}
    for who in ("alice", "bob"):
        with env.client(who) as c:
            ids[who] = c.post("/v1/jobs", json=TINY).json()["id"]
    for who in ids:
        wait_for(
            lambda w=who: any(s["job_id"] == ids[w] for s in env.launcher.submissions.values()), 10, "launch"
        )
    alice, bob = env.launcher.env_of(ids["alice"]), env.launcher.env_of(ids["bob"])
    assert alice["AWS_ACCESS_KEY_ID"] == "alice-key" and alice["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert "AWS_ACCESS_KEY_ID" not in bob  # the service's own chain
    assert StorageRoots.from_env(bob).write[0] == f"{env.settings.checkpoint_dir}/bob"
    # An export of alice's job runs with her credentials and roots.
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        sid = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).json()["submission_id"]
    wait_for(lambda: sid in env.launcher.submissions, 10, "the export's submission")
    exported = env.launcher.submissions[sid]["env"]
    assert exported["AWS_ACCESS_KEY_ID"] == "alice-key"
    assert StorageRoots.from_env(exported).allows(f"{env.settings.checkpoint_dir}/alice/x", "write")


@pytest.mark.parametrize("path", ["/tmp/x\x00y", "s3://[bad/x", "gs://bucket/x", "s3://b/a//b"])
def test_unmatchable_locations_are_422_not_500(env, path):
    refused(env, spec(checkpoint={"path": path}), "checkpoint.path")


def test_a_job_without_recorded_roots_is_confined_to_its_tenants_roots(start_env):
    """A job submitted before confinement existed has no `job_storage` row: its launches and
    exports still get its tenant's roots (it was unconfined: every path allowed)."""
    from service.storage_policy import export_env, launch_env
    from service.store.models import JobStorage

    env = start_env(reconcile=False)
    with env.client("bob") as c:
        job_id = c.post("/v1/jobs", json=TINY).json()["id"]
    with env.server.ctx.sessions() as s, s.begin():
        s.delete(s.get(JobStorage, job_id))
    with env.server.ctx.sessions() as s:
        roots = StorageRoots.from_env(launch_env(env.settings, s, job_id))
        exported = StorageRoots.from_env(
            export_env(env.settings, s, job_id, "bob", f"{env.settings.checkpoint_dir}/bob/out")
        )
    assert roots is not None and roots.write[0] == f"{env.settings.checkpoint_dir}/bob"
    assert not roots.allows(f"{env.settings.checkpoint_dir}/alice/x", "read")
    assert exported is not None and exported.allows(f"{env.settings.checkpoint_dir}/bob/out", "write")
