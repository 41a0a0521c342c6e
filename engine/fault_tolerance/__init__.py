"""Replicas as fault domains (`resilience.on_rank_failure: replace_replica`), apart from the rest of
the engine's process groups: what the Trainer asks of the job's replicas each step (`sync.py`:
`ReplicaSync`, whose base is a job of one replica), torchft's quorum over them
(`replica_quorum.py`), a replica of several ranks' own process group (`replica_group.py`), the
job's Lighthouse with its liveness relay (`lighthouse.py`) and the quorum's gloo group
(`quorum_gloo.py`). The launcher (workers/) builds a replica's `ReplicaQuorum` and hands it to
the engine through `RankHooks.quorum`."""
