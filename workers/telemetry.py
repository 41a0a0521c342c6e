"""Telemetry from a job's processes to the control plane: batched, sent in the background, and
spooled to a local file while the control plane cannot be reached.

Who sends: rank 0 sends its per-step metrics record (one per iteration, the engine's
`StepMetrics` plus `attempt`, `group`, `world_size`, `data_parallel_size`, `ts`); every rank sends the events
the engine appends to its event record (rerun state machine); the job's driver (`elastron
worker-run`) sends its own events (attempts, failures, restarts, exclusions, the outcome).
Per-step metrics never go through `ray.train.report`, whose controller takes at most one report
per poll (a few seconds) and would cap training at that rate.

What the training loop pays: `record()` appends to an in-memory deque and returns; a daemon
thread wakes every `flush_interval_s`, batches whatever accumulated and POSTs it. The training
thread never waits on the network or the disk.

Wire format (version 1) -- what the control plane implements:

    POST {ELASTRON_API_URL}/v1/internal/jobs/{job_id}/telemetry
    Authorization: Bearer {ELASTRON_API_TOKEN}          (omitted when no token is set)
    Content-Type: application/json

    {"version": 1,
     "job_id": "job-123",
     "source": "rank-0",                  # "driver" or "rank-<world rank>"
     "batch_id": "rank-0-3f9c2a1b7d4e-17",# unique per batch: <source>-<sender incarnation>-<n>
     "sent_at": 1767000000.0,             # unix seconds, when this POST was made
     "records": [{...}, ...],             # rank 0's per-step metrics records, in step order
     "events": [{...}, ...]}              # events, in the order they happened at the source

    Every record has "iteration", "attempt" (the driver's attempt: a restart after a failure
    starts the next) and "group" (the worker group's number in the job: every restart and every
    elastic resize starts a new one, so it only grows); every event has "ts" (unix seconds),
    "kind" and "source" (engine events also "rank", "host", "device", "iteration").

Answers: any 2xx means accepted (the batch is forgotten). 408, 425, 429 and 5xx mean "try again
later": the batch is kept and re-sent, in order, with backoff (0.5 s doubling to 30 s). 413 and
422 split the batch in two halves (batch ids `<id>a`, `<id>b`) and send those, so a refused item
is dropped alone (a batch is at most ~1 MiB to begin with). Any other 4xx (bad token, unknown job, malformed) is permanent: the batch is
dropped with one line on stderr, since re-sending cannot fix it. A connection error or timeout is
"try again later".

Fencing: the sender sends its attempt's fencing token (ELASTRON_FENCING_TOKEN) in the header
X-Elastron-Fencing-Token. A 409 whose detail has the type `attempt_fenced` means the control
plane gave this attempt up and another one runs (service/fencing.py): nothing more is sent or
spooled, `fenced` is set and `on_fenced` is called (workers/fencing.py exits the process without
saving). `still_current()` asks synchronously (an empty batch) before a checkpoint is committed.

Delivery is at least once and in order per source: batches are sent one at a time, oldest
first, and a batch whose answer was lost is sent again with the same batch_id, so the receiver
de-duplicates on batch_id. Records can also repeat (a restart or a resize re-runs the steps
after the last checkpoint): the receiver keeps, per iteration, the record with the highest
"group" (equivalently the highest (attempt, group)).

Spool: while the control plane is unreachable, unsent batches are appended to
`{ELASTRON_SPOOL_DIR or <tmp>/elastron-telemetry}/{job_id}/{source}.jsonl` (one batch per
line) and re-sent from there first when it answers again, including by the next process of the
same source on that machine (a restarted rank or driver). The file is removed once empty.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.jobspec import contract
from engine.jobspec.contract import telemetry_url  # re-exported: the one URL of the wire

WIRE_VERSION = 1
RETRYABLE_STATUS = {408, 425, 429}
# Split and re-send: too large (413), or one item the API refuses (422): halving isolates it,
# so only that item is dropped, not the records batched with it.
SPLIT_STATUS = {413, 422}
MAX_BACKOFF_S = 30.0


def default_spool_dir() -> Path:
    return Path(os.environ.get(contract.ENV_SPOOL_DIR) or Path(tempfile.gettempdir()) / "elastron-telemetry")


TELEMETRY_ENV = (contract.ENV_API_URL, contract.ENV_API_TOKEN, contract.ENV_SPOOL_DIR, contract.ENV_FENCING_TOKEN)


def fenced_answer(code: int, body: bytes) -> str | None:
    """The control plane's message when an answer says this attempt is fenced, else None."""
    if code != 409:
        return None
    try:
        detail = json.loads(body or b"{}").get("detail")
    except (ValueError, AttributeError):
        return None
    for item in detail if isinstance(detail, list) else []:
        if isinstance(item, dict) and item.get("type") == contract.FENCED_CODE:
            return str(item.get("msg") or contract.FENCED_CODE)
    return None


def telemetry_settings() -> dict[str, str]:
    """This process's telemetry environment (what the driver hands its ranks)."""
    return {k: os.environ[k] for k in TELEMETRY_ENV if os.environ.get(k)}


class TelemetrySender:
    """Batches records and events from one source and delivers them in the background.

    `url` is the full telemetry URL (see `telemetry_url`); None disables sending (every call is
    then a no-op). Safe to call `record` and `event` from any thread.
    """

    def __init__(
        self,
        url: str | None,
        job_id: str,
        source: str,
        *,
        token: str | None = None,
        spool_dir: str | Path | None = None,
        flush_interval_s: float = 1.0,
        max_batch: int = 1000,
        max_batch_bytes: int = 1 << 20,
        timeout_s: float = 5.0,
        event_defaults: dict[str, Any] | None = None,
        fencing_token: int | None = None,
        on_fenced: Callable[[str], None] | None = None,
    ):
        self.url, self.job_id, self.source, self.token = url, job_id, source, token
        self.fencing_token, self.on_fenced = fencing_token, on_fenced
        # Set when the control plane says a newer attempt of this job runs (409 attempt_fenced).
        self.fenced = threading.Event()
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.timeout_s = timeout_s
        self.event_defaults = {"source": source, **(event_defaults or {})}
        # Set when the control plane's answer to a batch says "stop": the scheduler preempts
        # this job and wants a checkpoint of the current step first (RankHooks.should_stop).
        self.stop_requested = threading.Event()
        # resilience.resize: live: the replica groups the scheduler wants this job to run, from
        # the control plane's answers (None: no resize asked); the driver reads it.
        self.wanted_replicas: int | None = None
        self.spool_path = Path(spool_dir or default_spool_dir()) / job_id / f"{source}.jsonl"
        self._incarnation = uuid.uuid4().hex[:12]
        self._batches_made = 0
        self._records: collections.deque[dict] = collections.deque()
        self._events: collections.deque[dict] = collections.deque()
        self._pending: collections.deque[dict] = collections.deque()
        self._spooled = 0  # how many of _pending (a prefix) are in the spool file
        self._retry_at = 0.0
        self._backoff = 0.0
        self._lock = threading.Lock()  # one delivery at a time (the thread, or flush/close)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered_batches = 0
        self.dropped_batches = 0
        self.last_error: str | None = None
        if self.enabled:
            self._load_spool()

    @classmethod
    def from_env(
        cls, job_id: str, source: str, fallback: dict[str, str] | None = None, **kwargs: Any
    ) -> TelemetrySender:
        """ELASTRON_API_URL (no URL: disabled), ELASTRON_API_TOKEN, ELASTRON_SPOOL_DIR from the
        environment, else from `fallback` (the same keys)."""
        env = {k: os.environ.get(k) or (fallback or {}).get(k) for k in TELEMETRY_ENV}
        api = env[contract.ENV_API_URL]
        kwargs.setdefault("spool_dir", env[contract.ENV_SPOOL_DIR])
        fence = env[contract.ENV_FENCING_TOKEN]
        kwargs.setdefault("fencing_token", int(fence) if fence and fence.isdigit() else None)
        return cls(
            telemetry_url(api, job_id) if api else None,
            job_id,
            source,
            token=env[contract.ENV_API_TOKEN] or None,
            **kwargs,
        )

    @property
    def enabled(self) -> bool:
        return self.url is not None

    # ------------------------------------------------------------------ the producers' side
    def record(self, record: dict) -> None:
        """Queue one metrics record (never blocks)."""
        if self.enabled and not self.fenced.is_set():
            self._records.append(record)

    def event(self, kind: str, **fields: Any) -> dict:
        """Queue one event; returns it (also when sending is disabled, for logging)."""
        ev = {"ts": time.time(), "kind": kind, **self.event_defaults, **fields}
        if self.enabled and not self.fenced.is_set():
            self._events.append(ev)
        return ev

    def forward_event(self, event: dict) -> None:
        """Queue an event made elsewhere in this process (the engine's, through
        `RankHooks.on_event`), with this sender's defaults (`source`, ...) under its own fields."""
        if self.enabled and not self.fenced.is_set():
            self._events.append({**self.event_defaults, **event})

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TelemetrySender:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"elastron-telemetry-{self.source}", daemon=True
            )
            self._thread.start()
        return self

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver everything queued so far, waiting up to timeout_s; True when nothing is left."""
        if not self.enabled:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            self._cycle(ignore_backoff=True)
            if self._idle():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread after a last delivery; what cannot be delivered stays in the spool."""
        if not self.enabled:
            return True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, self.timeout_s + 1.0))
            self._thread = None
        done = self.flush(timeout_s)
        with self._lock:
            self._persist()
        return done

    def __enter__(self) -> TelemetrySender:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ delivery
    def _idle(self) -> bool:
        return not (self._pending or self._records or self._events)

    def still_current(self, timeout_s: float = 5.0) -> bool:
        """Ask the control plane now (an empty batch) whether this attempt is still the job's
        current one: False only on its `attempt_fenced` answer (an unreachable control plane
        cannot tell, and training goes on)."""
        if self.fenced.is_set():
            return False
        if not self.enabled:
            return True
        self._batches_made += 1
        probe = {
            "version": WIRE_VERSION,
            "job_id": self.job_id,
            "source": self.source,
            "batch_id": f"{self.source}-{self._incarnation}-probe-{self._batches_made}",
            "records": [],
            "events": [],
        }
        with self._lock:
            saved, self.timeout_s = self.timeout_s, min(self.timeout_s, timeout_s)
            try:
                return self._post(probe) != "fenced"
            finally:
                self.timeout_s = saved

    def _fence(self, message: str) -> None:
        """This attempt is fenced: nothing more is sent or kept; the owner decides what stops."""
        first = not self.fenced.is_set()
        self.fenced.set()
        self._records.clear()
        self._events.clear()
        self._pending.clear()
        self._spooled = 0
        self.spool_path.unlink(missing_ok=True)
        self._stop.set()
        if first:
            print(f"[elastron] telemetry: {message}", file=sys.stderr, flush=True)
            if self.on_fenced is not None:
                self.on_fenced(message)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._cycle()
            except Exception as err:  # noqa: BLE001 - telemetry must never take a rank down
                self.last_error = f"{type(err).__name__}: {err}"

    def _take(self, queue: collections.deque, budget: list[int]) -> list[dict]:
        """Items off the queue up to max_batch items and (roughly) max_batch_bytes in all."""
        out = []
        while queue and len(out) < self.max_batch:
            size = len(json.dumps(queue[0], default=str))
            if out and size > budget[0]:
                break
            budget[0] -= size
            out.append(queue.popleft())
        return out

    def _batch(self) -> dict | None:
        budget = [self.max_batch_bytes]
        events = self._take(self._events, budget)
        records = self._take(self._records, budget)
        if not records and not events:
            return None
        self._batches_made += 1
        return {
            "version": WIRE_VERSION,
            "job_id": self.job_id,
            "source": self.source,
            "batch_id": f"{self.source}-{self._incarnation}-{self._batches_made}",
            "records": records,
            "events": events,
        }

    def _cycle(self, ignore_backoff: bool = False) -> None:
        with self._lock:
            while (batch := self._batch()) is not None:
                self._pending.append(batch)
            if not self._pending or (not ignore_backoff and time.monotonic() < self._retry_at):
                self._persist()
                return
            delivered = 0
            while self._pending:
                outcome = self._post(self._pending[0])
                if outcome == "fenced":
                    return  # _fence emptied everything
                if outcome == "retry":
                    break
                if outcome == "too_large" and self._split_first():
                    continue
                self._pending.popleft()
                delivered += 1
                if outcome == "dropped":
                    self.dropped_batches += 1
                else:
                    self.delivered_batches += 1
            if self._pending:
                self._backoff = min(MAX_BACKOFF_S, max(0.5, self._backoff * 2))
                self._retry_at = time.monotonic() + self._backoff
            else:
                self._backoff, self._retry_at = 0.0, 0.0
            on_disk = self._spooled
            self._spooled = max(0, on_disk - delivered)
            if delivered and on_disk:  # drop the delivered lines from the file
                if self._spooled:
                    self._rewrite_spool()
                else:
                    self.spool_path.unlink(missing_ok=True)
            self._persist()

    def _read_ack(self, body: bytes) -> None:
        try:
            ack = json.loads(body or b"{}")
        except ValueError:
            return
        if not isinstance(ack, dict):
            return
        if ack.get("stop") == "checkpoint":
            self.stop_requested.set()
        wanted = ack.get("replicas")
        self.wanted_replicas = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else None

    def _post(self, batch: dict) -> str:
        body = json.dumps({**batch, "sent_at": time.time()}, default=str).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.fencing_token is not None:
            headers[contract.FENCING_HEADER] = str(self.fencing_token)
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                self._read_ack(response.read())
            return "ok"
        except urllib.error.HTTPError as err:
            try:
                answer = err.read() if err.code == 409 else b""
            except OSError:
                answer = b""
            err.close()
            message = fenced_answer(err.code, answer)
            if message is not None:
                self._fence(message)
                return "fenced"
            if err.code in RETRYABLE_STATUS or err.code >= 500:
                self.last_error = f"HTTP {err.code}"
                return "retry"
            if err.code in SPLIT_STATUS and len(batch["records"]) + len(batch["events"]) > 1:
                return "too_large"
            print(
                f"[elastron] telemetry: {self.url} refused batch {batch['batch_id']} with HTTP {err.code}; "
                "dropping it (re-sending cannot fix a 4xx)",
                file=sys.stderr,
                flush=True,
            )
            return "dropped"
        except (OSError, ValueError) as err:  # URLError, connection refused/reset, timeouts
            self.last_error = f"{type(err).__name__}: {err}"
            return "retry"

    def _split_first(self) -> bool:
        """Replace the first pending batch by its two halves (the receiver said 413)."""
        batch = self._pending.popleft()
        items = [("records", r) for r in batch["records"]] + [("events", e) for e in batch["events"]]
        if len(items) < 2:
            self._pending.appendleft(batch)
            return False
        halves = []
        for suffix, part in (("a", items[: len(items) // 2]), ("b", items[len(items) // 2 :])):
            halves.append(
                {
                    **batch,
                    "batch_id": f"{batch['batch_id']}{suffix}",
                    "records": [x for k, x in part if k == "records"],
                    "events": [x for k, x in part if k == "events"],
                }
            )
        self._pending.extendleft(reversed(halves))
        if self._spooled:
            self._spooled += 1
            self._rewrite_spool()
        return True

    # ------------------------------------------------------------------ the spool file
    def _load_spool(self) -> None:
        try:
            lines = self.spool_path.read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash mid-write
                continue
            if isinstance(batch, dict) and "batch_id" in batch:
                self._pending.append(batch)
        self._spooled = len(self._pending)
        if self._spooled != len(lines):
            self._rewrite_spool()

    def _persist(self) -> None:
        """Append the batches not yet on disk; remove the file once nothing is pending."""
        if not self._pending:
            self._spooled = 0
            self.spool_path.unlink(missing_ok=True)
            return
        if self._spooled < len(self._pending):
            self.spool_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.spool_path, "a") as f:
                for batch in list(self._pending)[self._spooled :]:
                    f.write(json.dumps(batch, default=str) + "\n")
            self._spooled = len(self._pending)

    def _rewrite_spool(self) -> None:
        keep = list(self._pending)[: self._spooled]
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.spool_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(b, default=str) + "\n" for b in keep))
        os.replace(tmp, self.spool_path)
