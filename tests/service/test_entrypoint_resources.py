"""Issue 61: an export loads the whole model; as a Ray job with no resource request its process
ran on the Ray head, and a head OOM loses every job. Exports (and, where the operator asks, job
drivers) are submitted with Ray Jobs' entrypoint resources, so Ray places them on a node with
room: never on a head started with num-cpus 0, as the Helm chart's is."""

from __future__ import annotations

from service.launcher import EntrypointResources, RayJobsLauncher, export_resources
from tests.service.test_api_exports import job_with_checkpoints
from tests.waiting import wait_for


class RecordingClient:
    """Stands in for Ray's JobSubmissionClient: keeps what each submit_job was given."""

    def __init__(self) -> None:
        self.submitted: list[dict] = []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return kwargs["submission_id"]


def _launcher(**kwargs) -> tuple[RayJobsLauncher, RecordingClient]:
    launcher = RayJobsLauncher("http://ray-head:8265", **kwargs)
    client = RecordingClient()
    launcher._client_obj = client  # no Ray: the client the launcher would build
    return launcher, client


def test_an_export_submission_asks_ray_for_cpus_and_memory():
    launcher, client = _launcher()
    launcher.submit_command(
        "export-1", ["elastron", "export", "x"], {}, resources=export_resources(num_cpus=2, memory_gib=16)
    )
    (sent,) = client.submitted
    assert sent["entrypoint"] == "elastron export x"
    assert sent["entrypoint_num_cpus"] == 2 and sent["entrypoint_memory"] == 16 << 30


def test_a_driver_asks_for_what_the_operator_set_and_nothing_by_default():
    launcher, client = _launcher()
    launcher.submit("job-1", "{}", {}, submission_id="elastron-job-1-1")
    assert not {k for k in client.submitted[0] if k.startswith("entrypoint_")}
    launcher, client = _launcher(driver_resources=EntrypointResources(num_cpus=0.5, custom={"driver": 1}))
    launcher.submit("job-1", "{}", {}, submission_id="elastron-job-1-1")
    assert client.submitted[0]["entrypoint_num_cpus"] == 0.5
    assert client.submitted[0]["entrypoint_resources"] == {"driver": 1}


def test_the_reconciler_submits_exports_with_the_settings_request(start_env):
    env = start_env(export_num_cpus=4, export_memory_gib=8)
    job_id = job_with_checkpoints(env)
    with env.client() as c:
        sid = c.post(f"/v1/jobs/{job_id}/checkpoints/10/export", json={}).json()["submission_id"]
    entry = wait_for(lambda: env.launcher.submissions.get(sid), 10, "the export's submission")
    assert entry["resources"] == EntrypointResources(num_cpus=4, memory_bytes=8 << 30)
    assert entry["resources"].ray_kwargs() == {"entrypoint_num_cpus": 4, "entrypoint_memory": 8 << 30}


def test_by_default_an_export_asks_for_a_cpu():
    from service.settings import Settings

    settings = Settings()
    assert export_resources(settings.export_num_cpus, settings.export_memory_gib).ray_kwargs() == {
        "entrypoint_num_cpus": 1.0
    }
