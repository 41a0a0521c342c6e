"""The seam between the Trainer and the job's replicas (engine/fault_tolerance/sync.py): a job of
one replica answers every question trivially, so the Trainer asks them of every job; a quorum
of replicas answers them from torchft's agreement (tests/engine/test_replica_quorum.py runs it)."""

from __future__ import annotations

import pytest
import torch

from engine.fault_tolerance.replica_quorum import ReplicaQuorum
from engine.fault_tolerance.sync import ReplicaSync


def test_one_replica_trains_every_step_it_is_asked_for_and_writes_everything():
    one = ReplicaSync()
    # Past train_iters too: the parallel harness trains a saved job on (tests/engine/test_deepseek.py).
    assert one.start_step(train_iters=4) is True and one.should_commit() is True
    assert (one.sits_out, one.waits_for_peers, one.job_done) == (False, False, False)
    assert one.writes_checkpoint and one.writes_logs and one.across_replicas is None
    assert one.data_rank(4, 3) == (4, 3)
    assert one.step_share(16, 4) == (4, 16, 1)  # every DP rank, the whole batch, this group's devices
    loss = torch.tensor(2.5)
    assert one.reduce([object()], loss) is loss  # the DP chunks are not even looked at


class _Quorum(ReplicaQuorum):
    """A quorum's answers without torchft: replica `index` of `count`, `replicas` in this step."""

    def __init__(self, index: int, count: int, replicas: int, participating_rank: int) -> None:
        ReplicaSync.__init__(self)
        self.index, self.count, self.replicas, self._at = index, count, replicas, participating_rank
        self._slots = None  # lost_replica_share: skip, or every replica in the step

    @property
    def participating_rank(self) -> int:
        return self._at


def test_a_replica_reads_its_share_and_a_step_with_fewer_replicas_trains_fewer_samples():
    q = _Quorum(index=1, count=3, replicas=2, participating_rank=1)
    assert q.data_rank(2, 1) == (6, 3)  # DP rank 1 of replica 1's two ranks: rank 3 of 6
    assert q.step_share(12, 2) == (2, 8, 2)  # two of three replicas trained 8 of the 12 samples
    q._slots = [0, 1]  # redistribute: the two took the third's share
    assert q.step_share(12, 2) == (2, 12, 2)
    q._slots = None
    assert not q.writes_checkpoint and not q.writes_logs
    assert _Quorum(0, 3, 3, participating_rank=0).writes_checkpoint


def test_each_share_a_step_takes_is_weighted_by_its_own_label_tokens_tagged_or_not():
    """A replica that takes a missing share (lost_replica_share: redistribute) weights every share
    by its own count of label tokens; under pipeline parallelism one schedule runs them all and
    its loss picks the weight from the share index each target carries (engine/objective.py)."""
    from torch import nn

    from engine.data.sft import IGNORE_INDEX
    from engine.objective import ShareLosses, TrainingObjective, summed_token_loss

    chunk = nn.Linear(2, 2)
    chunk.mtp = None  # a model chunk without multi-token prediction
    objective = TrainingObjective(
        [chunk], 0, 0.0, replicas=1, reads_labels=True, pipelined=True, device=torch.device("cpu")
    )
    g = torch.Generator().manual_seed(0)
    own, taken = torch.randint(0, 11, (2, 6), generator=g), torch.randint(0, 11, (2, 6), generator=g)
    taken[:, 3:] = IGNORE_INDEX  # the taken share has half the label tokens
    losses = objective.begin_shares([[own], [taken]], scale=0.5, num_microbatches=1)
    assert losses.weights.tolist() == pytest.approx([0.5 / 12, 0.5 / 6], rel=1e-7)
    logits = torch.randn(2, 6, 11, generator=g)
    for share, labels in enumerate((own, taken)):
        want = summed_token_loss(logits, labels) * losses.weights[share]
        assert torch.equal(losses.of(share)(logits, labels), want)
        assert torch.equal(losses.tagged(logits, ShareLosses.tag(labels, share)), want)
    # begin_step is the one-share case
    assert torch.equal(objective.begin_step([own], 0.5, 1)(logits, own), losses.of(0)(logits, own))
