"""What `elastron demo` and `elastron logs -f` print: progress, the summary and our own lines; not
Ray's machinery nor the raw `[elastron] event {` lines (those go to the log file, and --verbose
prints them). The page's log view shows no ANSI codes.

The real `make demo` takes about two minutes here (a Ray head, then 60 steps on 2 CPU ranks), too
slow for CI. So: tests/service/data/demo_output.txt is the real demo's output, captured before
this filtering existed (Ray 2.x, 2 CPU ranks); its driver-log part is replayed as the log of a
job run by the fake worker, and `elastron demo` itself (its `up` aside) runs against it, through
the same follow / summary code that prints the real one.
"""

from __future__ import annotations

import random
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elastron.cli import app
from service.log_lines import LineFilter
from tests.service.launchers import FAKE_WORKER, ProcessLauncher
from tests.service.test_ui import browser, ready_after, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for

CAPTURE = Path(__file__).parent / "data" / "demo_output.txt"
# Ray's machinery as it appears in the capture (and what a newcomer takes for failures).
RAY_INTERNALS = re.compile(
    r"core_worker\.cc|PreemptionWatcher|TrainController|RayTrainWorker|INFO worker\.py|job_manager\.py|"
    r"Running entrypoint|Setting up process group|Requesting resources|world_rank=|\x1b\["
)


def driver_log() -> str:
    """The capture's driver-log part: after `submitted ...`, before the progress bar's last line."""
    lines = CAPTURE.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("submitted ")) + 1
    end = next(i for i, line in enumerate(lines) if "━" in line)
    return "".join(lines[start:end])


def assert_clean(text: str) -> None:
    bad = [line for line in text.splitlines() if line.startswith("[elastron] event {") or RAY_INTERNALS.search(line)]
    assert not bad, bad


def test_the_capture_holds_what_is_filtered():  # the fixture still shows the problem
    raw = driver_log()
    assert "[elastron] event {" in raw and "core_worker.cc" in raw and "\x1b[36m" in raw
    with pytest.raises(AssertionError):
        assert_clean(raw)


def test_the_filter_keeps_our_lines_and_drops_rays_in_any_chunking():
    raw = driver_log()
    whole = LineFilter()
    kept = whole.feed(raw) + whole.flush()
    assert_clean("\n".join(kept))
    assert sum(line.startswith("iter ") for line in kept) == 12  # every engine progress line (5..60)
    assert any(line.startswith("committed checkpoint iteration 60") for line in kept)
    assert "[elastron] job_started: ranks=2" in "\n".join(kept)
    assert any("training finished after 1 attempt(s)" in line for line in kept)
    rng = random.Random(0)
    for _ in range(20):  # a stream cut anywhere gives the same lines
        f, out, at = LineFilter(), [], 0
        while at < len(raw):
            n = rng.randint(1, 200)
            out += f.feed(raw[at : at + n])
            at += n
        assert out + f.flush() == kept


@pytest.fixture
def replay(start_env, tmp_path):
    """An API whose jobs print the real demo's driver log, then post records like the workers."""
    (tmp_path / "driver.log").write_text(driver_log())
    worker = " ".join(shlex.quote(a) for a in FAKE_WORKER)
    command = ["/bin/sh", "-c", f"cat {shlex.quote(str(tmp_path / 'driver.log'))}; exec {worker}"]
    launcher = ProcessLauncher(tmp_path / "launches", command=command)
    yield start_env(launcher)
    launcher.kill_all()


def demo(env, tmp_path, monkeypatch, *args: str):
    import service.cli_jobs

    monkeypatch.setattr(service.cli_jobs, "up", lambda: None)  # the API is the test's
    job = tmp_path / "job.yaml"
    job.write_text("name: demo\ntraining:\n  train_iters: 5\n  global_batch_size: 2\n")
    environ = {
        "ELASTRON_API_URL": env.server.url,
        "ELASTRON_API_TOKEN": env.tokens["alice"],
        "ELASTRON_HOME": str(env.settings.home),
        "COLUMNS": "200",
    }
    return CliRunner().invoke(app, ["demo", "--job", str(job), *args], env=environ)


def test_demo_prints_progress_summary_and_our_lines_only(replay, tmp_path, monkeypatch):
    r = demo(replay, tmp_path, monkeypatch)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert_clean(out)
    assert "iteration 5 loss" in out and "iter    60/60 | loss 2.8227" in out  # the workers' lines
    assert "[elastron] job_started: ranks=2" in out  # an event, in short
    assert re.search(r"job demo-\w+: succeeded after 5/5 iterations", out) and "final loss" in out
    job_id = re.search(r"job (demo-\w+): succeeded", out).group(1)
    full = (replay.settings.home / "logs" / f"{job_id}.log").read_text()
    assert "[elastron] event {" in full and "core_worker.cc" in full  # nothing lost: in the file
    assert f"the full log (Ray's lines and events too): {replay.settings.home / 'logs' / job_id}.log" in out


def test_verbose_prints_everything(replay, tmp_path, monkeypatch):
    r = demo(replay, tmp_path, monkeypatch, "--verbose")
    assert r.exit_code == 0, r.output
    assert "[elastron] event {" in r.stdout and "core_worker.cc" in r.stdout


def test_the_page_log_view_shows_no_ansi_codes(replay, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    with replay.client() as c:
        job_id = c.post("/v1/jobs", json={"name": "ansi", "training": {"train_iters": 3, "global_batch_size": 2}}).json()["id"]
    replay.wait_state(job_id, "succeeded", timeout_s=60)
    with replay.client() as c:
        assert "\x1b[36m" in c.get(f"/v1/jobs/{job_id}/logs").text
    sign_in(browser, replay.server.url, replay.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 20, "the jobs list")
    ready_after(browser, f"#/jobs/{job_id}")
    wait_for(lambda: "iteration 3 loss" in browser.find_element(By.ID, "log").text, 20, "the log")
    text = browser.execute_script("return document.getElementById('log').textContent")
    assert "\x1b" not in text and "[36m" not in text and "(TrainController pid=23957) Requesting" in text


