"""A small real HTTP server on loopback that receives the workers' telemetry (wire format v1 in
workers/telemetry.py): what the control plane will implement, reduced to what tests check.

It can be stopped and started again on the same port (the control plane going away and coming
back) and told to answer with an error status for a while.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.jobspec.contract import record_epoch
from engine.launcher import free_port

PATH_PREFIX = "/v1/internal/jobs/"
PATH_SUFFIX = "/telemetry"


class TelemetryServer:
    def __init__(self, token: str | None = "test-token", port: int | None = None):
        self.token = token
        self.port = port or free_port()
        self.batches: list[dict] = []  # accepted batches, in arrival order
        self.requests = 0
        self.status = 200  # what to answer (e.g. 503 to simulate an unhealthy control plane)
        self.gate: threading.Event | None = None  # when set: hold every request until it is set
        self.max_body: int | None = None  # answer 413 to larger bodies
        self.refuse_key: str | None = None  # answer 422 to a batch with a record holding this key
        self.ack: dict = {}  # the body of a 200 answer (the API's TelemetryAck, e.g. {"stop": "checkpoint"})
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TelemetryServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                with outer._lock:
                    outer.requests += 1
                if outer.gate is not None:
                    outer.gate.wait()
                if not (self.path.startswith(PATH_PREFIX) and self.path.endswith(PATH_SUFFIX)):
                    return self._answer(404)
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._answer(401)
                if outer.status != 200:
                    return self._answer(outer.status)
                if outer.max_body is not None and length > outer.max_body:
                    return self._answer(413)
                batch = json.loads(body)
                if outer.refuse_key and any(outer.refuse_key in r for r in batch.get("records", [])):
                    return self._answer(422)
                job = self.path[len(PATH_PREFIX) : -len(PATH_SUFFIX)]
                if batch.get("job_id") != job:
                    return self._answer(400)
                with outer._lock:
                    outer.batches.append(batch)
                self._answer(200, json.dumps(outer.ack).encode())

            def _answer(self, status: int, body: bytes = b"{}"):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="telemetry-server", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ what arrived
    def _unique(self, job_id: str | None) -> list[dict]:
        seen, out = set(), []
        with self._lock:
            batches = list(self.batches)
        for b in batches:
            if (job_id is None or b["job_id"] == job_id) and b["batch_id"] not in seen:
                seen.add(b["batch_id"])
                out.append(b)
        return out

    def records(self, job_id: str | None = None) -> list[dict]:
        return [r for b in self._unique(job_id) for r in b["records"]]

    def events(self, job_id: str | None = None, kind: str | None = None) -> list[dict]:
        evs = [e for b in self._unique(job_id) for e in b["events"]]
        return [e for e in evs if kind is None or e.get("kind") == kind]

    def final_records(self, job_id: str) -> dict[int, dict]:
        """iteration -> the record of the latest worker group (what the control plane keeps, by
        the same rule: engine/jobspec/contract.py's `record_epoch`)."""
        out: dict[int, dict] = {}
        for r in self.records(job_id):
            if r["iteration"] not in out or record_epoch(r, 0) >= record_epoch(out[r["iteration"]], 0):
                out[r["iteration"]] = r
        return dict(sorted(out.items()))
