"""The service's commands: `up`, `down`, `token`, `submit`, `jobs`, `status`, `logs`, `cancel`,
`demo` (service/cli_jobs.py), `queue` and `tenants` (service/cli_queue.py), `tenants set-storage`
and `tenants storage` (service/cli_storage.py), `sweep submit|status|list|extend|cancel`
(service/cli_sweeps.py), composed into
`elastron` by elastron/cli.py with the engine's and the workers' own commands. Importing this loads no torch and nothing of the engine or workers.
"""

from __future__ import annotations

from service import (
    cli_queue,  # noqa: F401  (registers `queue` and `tenants` on the app)
    cli_storage,  # noqa: F401  (registers `tenants set-storage` / `tenants storage`)
    cli_sweeps,  # noqa: F401  (registers `sweep`)
)
from service.cli_jobs import app

__all__ = ["app"]
