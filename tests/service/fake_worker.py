"""A stand-in for `elastron worker-run` in control-plane tests: no torch, no Ray Train.

It does what the real workers do towards the API: read ELASTRON_JOB_SPEC, post metrics records
(and a checkpoint event at the end) to ELASTRON_API_URL with ELASTRON_API_TOKEN, retrying while
the API is away, and exit 0. Knobs (env): FAKE_WORKER_GATE=path: after FAKE_WORKER_PAUSE_AT
iterations, wait until that file exists ("{job_id}" in it is replaced by the job id);
FAKE_WORKER_EXIT=code: exit with it at the end; FAKE_WORKER_STEP_S=seconds: each step takes
that long (and reports it as step_time_s).
SIGINT (a graceful stop) exits 130 at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request


def post(url: str, token: str, body: dict, deadline_s: float = 120.0) -> None:
    data = json.dumps(body).encode()
    deadline = time.monotonic() + deadline_s
    while True:
        request = urllib.request.Request(
            url,
            data=data,
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                response.read()
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            if isinstance(err, urllib.error.HTTPError) and err.code < 500:
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the API is away (restarting): at-least-once, so resend


def main() -> int:
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    spec = json.loads(os.environ["ELASTRON_JOB_SPEC"])
    job_id = os.environ["ELASTRON_JOB_ID"]
    url = f"{os.environ['ELASTRON_API_URL']}/v1/internal/jobs/{job_id}/telemetry"
    token = os.environ["ELASTRON_API_TOKEN"]
    iters = spec["training"]["train_iters"]
    gate = os.environ.get("FAKE_WORKER_GATE", "").replace("{job_id}", job_id)
    pause_at = int(os.environ.get("FAKE_WORKER_PAUSE_AT", "0"))
    step_s = float(os.environ.get("FAKE_WORKER_STEP_S", "0"))
    print(f"fake worker for {job_id}: {iters} iterations", flush=True)
    for it in range(1, iters + 1):
        if gate and it == pause_at + 1:
            while not os.path.exists(gate):
                time.sleep(0.05)
        time.sleep(step_s)
        record = {
            "iteration": it,
            "loss": 4.0 / it,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens": 1024,
            "step_time_s": step_s or 0.01,
            "tokens_per_s": 102400.0,
            "energy_j": None,
            "skipped": False,
        }
        post(url, token, {"records": [record]})
        print(f"iteration {it} loss {record['loss']:.3f}", flush=True)
    path = (spec.get("checkpoint") or {}).get("path") or "/nowhere"
    post(
        url,
        token,
        {
            "events": [
                {
                    "kind": "checkpoint_saved",
                    "iteration": iters,
                    "rank": 0,
                    "ts": time.time(),
                    "uri": f"{path}/{job_id}/{spec['name']}/iter_{iters:07d}",
                    "bytes": 4096,
                    "seconds": 0.02,
                }
            ]
        },
    )
    return int(os.environ.get("FAKE_WORKER_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
