"""torchft's reconfigurable gloo group with a rendezvous timeout of its own.

Every new quorum rebuilds the managed group over the replicas in it (torchft's
`ProcessGroupGloo.configure`): the ranks meet through the quorum's store and gloo connects every
pair. torchft builds the group with one timeout for both the rendezvous and the collectives
(the replica's step timeout, up to 60 s). A peer that dies in the middle of the rendezvous (a
replacement killed while it joins) leaves the others in gloo's connect for five times that
timeout, not once: measured with torch 2.13's gloo, 25 s for a 5 s timeout and 5 s for 1 s,
each time the peer was killed 30-100 ms into it. The survivors' quorum thread is inside gloo's
C++ constructor then, where nothing can interrupt it, and their step waits for it: up to five
minutes of a job's survivors standing still for a replica that will never arrive (a flaky
tests/engine/test_replica_quorum.py ten-kill test found it: 25 s, in one kill of ~300 aimed at
the join).

Peers reach the rendezvous within milliseconds of each other (each configures on its quorum
thread as soon as the Lighthouse answers them all), so this group gives the rendezvous a short
timeout (`RENDEZVOUS_TIMEOUT_S`) and its collectives the full one. A rendezvous that times out
fails that step's quorum (torchft reports the error, the step is not committed) and the next
step asks the Lighthouse again, without the dead peer. NCCL's group (GPU) is torchft's own: its
communicator is set up nonblocking and aborted by torchft's timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torchft import ProcessGroupGloo

# 5 x this is what a peer dying during the rendezvous costs the others (see above).
RENDEZVOUS_TIMEOUT_S = 2.0


class QuorumGloo(ProcessGroupGloo):
    """`timeout`: the collectives' (and torchft's waits on them); `rendezvous_timeout`: the store
    reads and gloo's connects while the group is rebuilt for a new quorum."""

    def __init__(self, timeout: timedelta, rendezvous_timeout: timedelta | None = None) -> None:
        super().__init__(timeout=timeout)
        self._rendezvous_timeout = min(timeout, rendezvous_timeout or timedelta(seconds=RENDEZVOUS_TIMEOUT_S))

    def configure(self, *args, **kwargs) -> None:
        # torchft's configure reads `_timeout` for its store client and the gloo backend it builds.
        full, self._timeout = self._timeout, self._rendezvous_timeout
        try:
            super().configure(*args, **kwargs)
        finally:
            self._timeout = full
        self._pg._get_backend(torch.device("cpu"))._set_default_timeout(full)
