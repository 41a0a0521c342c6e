"""Where a job's ranks go: on its first attempt where the service's scheduler admitted it, and
after a restart back on the node each ran on, if it can.

The scheduler (service/scheduling/placement.py) admits a job only where its ranks fit by its own
count per node and passes the placement in ELASTRON_PLACEMENT; pinning the first attempt's
workers to it keeps Ray from putting them elsewhere, into room the scheduler has counted for
another job (whose gang would then wait in Ray). A fixed-size job gets one selector per worker
(`scheduled_selectors`); an elastic one the set of its nodes, since its group may shrink onto
the nodes that are left. The scheduler also counts where Ray really put the ranks (the
ranks_started event), so what it believes and what Ray holds meet again after any restart.

Sticky placement, after a restart:

In-memory recovery (engine/checkpointing/recovery.py, workers/snapshots.py) reads a rank's
snapshot from the holder on its own node and only falls back to a replica over the network (or to
the persistent checkpoint) when that copy is elsewhere. Ray Train places a restarted group
wherever its placement group fits, so a rank could land on its neighbour's node and read its
snapshot from a replica, or find none. This module turns the previous group's rank -> node map
into one Ray label selector per worker (`ScalingConfig(label_selector=[...])`): a rank whose node
is still alive and usable is pinned to it; the others keep the blocked-node exclusion.

Why this keeps rank numbers as well as nodes: Ray Train numbers workers in the order of their
bundles, grouped by node in order of first appearance (WorkerGroup._sort_workers_by_gpu_id_grouped_by_node),
and the previous group was numbered the same way, so its ranks were contiguous per node; bundle
i pinned to rank i's node therefore gets rank i again.

Only fixed-size jobs, and only right after a group that started: an elastic group changes size
(Ray Train wants one selector per possible worker), and if a pinned attempt never got its group
started (a node's room was taken meanwhile) the next attempt is placed freely again.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.jobspec import contract

NODE_LABEL = "ray.io/node-id"


def exclusion(blocked: set[str]) -> dict[str, str] | None:
    """The selector that keeps workers off `blocked` nodes (None: no constraint)."""
    return {NODE_LABEL: f"!in({','.join(sorted(blocked))})"} if blocked else None


def sticky_selectors(
    previous: dict[str, Any] | None,
    attempt: int,
    world_size: int,
    alive: set[str],
    blocked: set[str],
) -> list[dict[str, str]] | None:
    """One label selector per worker pinning rank i to the node rank i ran on in `previous` (the
    job registry's last group: {"attempt", "ranks": [{"rank", "node_id"}, ...]}), or None to place
    the group freely (no usable previous group, another size, or no node of it left)."""
    if not previous or previous.get("attempt") != attempt - 1:
        return None
    ranks = {r["rank"]: r.get("node_id") for r in previous.get("ranks") or []}
    if sorted(ranks) != list(range(world_size)):
        return None
    usable = {node for node in ranks.values() if node in alive and node not in blocked}
    if not usable:
        return None
    free = exclusion(blocked) or {}
    return [{NODE_LABEL: ranks[i]} if ranks[i] in usable else dict(free) for i in range(world_size)]


def scheduled_selectors(
    placement: dict[str, int] | None,
    world_size: int,
    alive: set[str],
    blocked: set[str],
    elastic: bool,
) -> list[dict[str, str]] | dict[str, str] | None:
    """The scheduler's placement ({node: ranks}) as label selectors: one per worker for a fixed
    job of exactly that size on nodes all alive and usable; for an elastic job the set of its
    usable nodes; None (place freely, off the blocked nodes) when it no longer applies."""
    if not placement:
        return None
    usable = {n: k for n, k in placement.items() if k > 0 and n in alive and n not in blocked}
    if elastic:
        return {NODE_LABEL: f"in({','.join(sorted(usable))})"} if usable else None
    if usable != {n: k for n, k in placement.items() if k > 0} or sum(usable.values()) != world_size:
        return None
    nodes = sorted(usable.items(), key=lambda kv: (-kv[1], kv[0]))
    return [{NODE_LABEL: n} for n, k in nodes for _ in range(k)]


def placement_from_env() -> dict[str, int] | None:
    """ELASTRON_PLACEMENT as the service wrote it (None: unset or not a {node: ranks} map)."""
    try:
        data = json.loads(os.environ.get(contract.ENV_PLACEMENT) or "null")
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in data.items()):
        return None
    return data or None
