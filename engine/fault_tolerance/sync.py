"""What the Trainer and the training loop ask of the job's data-parallel replicas at each step,
and the answer for a job that is one replica.

Under `resilience.on_rank_failure: replace_replica` every replica is a fault domain: it steps
only with a quorum of the others, may heal from a live peer, reduces its gradients over the
quorum and commits a step only when that reduction succeeded (`ReplicaQuorum`,
replica_quorum.py, torchft's). Under `restart_group` the job is one replica and every one of
those questions has its trivial answer: that is this base class, so the Trainer asks the same
questions of every job and holds no branch for "no replicas".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepShares:
    """What one rank trains in a step besides its own share of the global batch: microbatches of
    the shares of replicas missing from the step's quorum (`resilience.lost_replica_share:
    redistribute`), and the weight of its gradients in the quorum's average (the replicas that
    train the step over the job's replicas, so that the average over them is the mean over every
    share of the global batch, as in the uninterrupted run)."""

    # (the data-parallel rank the missing share is read as, the microbatches of it this rank takes)
    extra: tuple[tuple[int, tuple[int, ...]], ...] = ()
    weight: float = 1.0

    @property
    def extra_microbatches(self) -> int:
        return sum(len(picked) for _, picked in self.extra)


class ReplicaSync:
    """One replica, the whole job: always in the quorum, nothing to heal, nothing to reduce over
    replicas, every step committed, its checkpoints and logs written by it."""

    index = 0  # this replica's slot in the job
    count = 1  # the job's replicas

    def __init__(self) -> None:
        self.sits_out = False  # this step: the replica heals and computes nothing
        self.waits_for_peers = False  # this step: alone, waiting for the others; nothing is kept
        self.job_done = False  # a replacement that joined after its peers finished the job
        self._device = torch.device("cpu")

    def attach(self, trainer: Any) -> None:
        """The Trainer, built and resumed: what a peer heals from (a replica's), its device."""
        self._device = trainer.device

    def data_rank(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """(data-parallel size, rank) this rank reads the data as."""
        return dp_size, dp_rank

    @property
    def across_replicas(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How the rerun state machine ORs its flags over the other replicas (None: none)."""
        return None

    def start_step(self, train_iters: int) -> bool:
        """Join this step's quorum (may heal); False: nothing to train (the job is done, or a
        heal brought the state of a peer that has trained `train_iters` steps). One replica
        always trains the step it is asked for."""
        return True

    def reduce(self, ddp_chunks: list, loss: torch.Tensor) -> torch.Tensor:
        """Average the gradients this rank holds in `ddp_chunks`' buffers (in place) and the loss
        over the step's replicas. One replica: nothing to do, and nothing gathered to do it."""
        return loss

    def should_commit(self) -> bool:
        """Whether the step's reduction over replicas succeeded: step the optimizer."""
        return True

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this replica writes the job's persistent checkpoints this step."""
        return True

    @property
    def writes_logs(self) -> bool:
        """Whether this replica's rank 0 writes the job's logger runs (TensorBoard, MLflow, W&B)."""
        return self.index == 0

    def stop_agreed(self, mine: bool) -> bool:
        """Whether any rank was asked to stop: one tiny all-reduce before each step, so every
        rank stops at the same step boundary."""
        flag = torch.tensor([1.0 if mine else 0.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step_shares(self, num_microbatches: int, dp_size: int, dp_rank: int) -> StepShares:
        """What this rank trains this step besides its own microbatches: one replica has no
        missing peer whose share it could take."""
        return StepShares()

    def leave_agreed(self, mine: bool) -> bool:
        """Whether this replica leaves the job at this step boundary (a live shrink). The whole
        job never leaves: it stops (`stop_agreed`), with a checkpoint."""
        return False

    def step_share(self, global_batch_size: int, dp_size: int) -> tuple[int, int, int]:
        """(the record's `replicas`, the samples the step trained, the devices that trained it
        as a multiple of this process group's)."""
        return dp_size, global_batch_size, 1

    def shutdown(self) -> None:
        """Leave the quorum (the training loop's end)."""
