"""`elastron worker-run` without Ray, for the fault matrix's API row: the real engine on one CPU
rank, reporting to the API as the workers do (workers/telemetry.py's sender: records and events,
at least once). Run as `python -m tests.faults.engine_worker` by the service's ProcessLauncher.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    import torch.distributed as dist

    from engine.jobspec import contract
    from engine.launcher import free_port
    from engine.rank_hooks import RankHooks
    from engine.train_loop import train_rank
    from workers.telemetry import TelemetrySender

    spec = json.loads(os.environ[contract.ENV_JOB_SPEC])
    job_id = os.environ[contract.ENV_JOB_ID]
    sender = TelemetrySender.from_env(job_id, "rank-0", {}, flush_interval_s=0.2).start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        train_rank(spec, quiet=True, hooks=RankHooks(on_record=sender.record, on_event=sender.forward_event))
    finally:
        sender.close(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
