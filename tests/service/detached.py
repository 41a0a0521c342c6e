"""Run a command detached from the test process, recording its pid, log and exit code in a folder.

Used by ProcessLauncher (tests/service/launchers.py): the job outlives whichever API instance
launched it, as a Ray job does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    with open(folder / "log", "ab") as log:
        proc = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        (folder / "pid").write_text(str(proc.pid))
        rc = proc.wait()
    (folder / "rc.tmp").write_text(str(rc))
    os.replace(folder / "rc.tmp", folder / "rc")


if __name__ == "__main__":
    main()
