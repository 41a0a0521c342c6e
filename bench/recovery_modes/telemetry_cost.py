"""What rank 0's per-step telemetry costs the training loop.

telemetry: what one `TelemetrySender.record()` call takes while the sender thread POSTs batches
to a live receiver: no reference run of its own, it is read against the step times the other
modes print (the call is made once per step).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from bench.recovery_modes.harness import Receiver, emit


def telemetry_cost(receiver: Receiver, calls: int = 20000) -> None:
    """What rank 0's per-step telemetry costs the training loop: one `record()` call, measured
    while the sender thread batches and POSTs to a live receiver."""
    from workers.telemetry import TelemetrySender, telemetry_url

    with tempfile.TemporaryDirectory() as spool:
        sender = TelemetrySender(
            telemetry_url(receiver.url, "cost"), "cost", "rank-0", spool_dir=spool, flush_interval_s=0.05
        ).start()
        record = {"iteration": 0, "loss": 1.0, "timers": {"forward-backward": [0.1, 0.2]}, "rerun": {}}
        samples = []
        for i in range(calls):
            t = time.perf_counter_ns()
            sender.record({**record, "iteration": i, "ts": time.time()})
            samples.append(time.perf_counter_ns() - t)
        sender.close(30)
    samples.sort()
    emit(
        figure="telemetry_record_call_us",
        value=round(statistics.median(samples) / 1000, 2),
        p99_us=round(samples[int(0.99 * len(samples))] / 1000, 2),
        calls=calls,
        delivered_batches=sender.delivered_batches,
    )
