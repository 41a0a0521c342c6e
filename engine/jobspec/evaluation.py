"""What the service may ask `elastron eval` to run: the lm-eval tasks shipped with elastron.

Over REST a tenant names tasks only from this list: their data ship in the package
(engine/harness/tasks/, local JSON lines), so an evaluation reads no hub and no tenant's files,
and a task YAML from storage, whose `!function` would run code, is never loaded. The service
checks names here (it imports nothing of the engine but the job spec); `elastron eval` on the
command line takes any task over local files (engine/harness/tasks.py).
tests/engine/test_harness.py keeps this list equal to the shipped YAMLs.
"""

from __future__ import annotations

SHIPPED_TASKS = ("elastron_gen", "elastron_mc", "elastron_ppl")
