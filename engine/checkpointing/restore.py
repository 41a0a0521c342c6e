"""Putting saved state back into checkpoint parts: the one routine a persistent resume
(checkpointer.py) and an in-memory snapshot restore (memory.py) share.

Both go the same way; only where the values come from differs:

1. every part says what it loads into: `load_target(saved)` where it plans its load
   (stateful.PlansItsLoad: which optimizer states, whether RNG streams apply on this layout),
   else its own `state_dict()` (views of its tensors, loaded in place);
2. the source checks those targets against what it holds and fills every tensor in place
   (`load_tensors`: DCP from storage, or copies out of the snapshot's host block); a source that
   refuses raises before any part was changed;
3. only then, once every part's tensors are in, each part gets its state: its tensors, and every
   other value from the saved meta (a key an older checkpoint lacks keeps the target's value).
   Whatever a part must fix up after a load (the optimizer's masters, data parallelism's gathered
   parameters, the rerun machine's iteration) it does in its own `load_state_dict`, so it happens
   on both paths alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.checkpointing.stateful import PlansItsLoad, SavedCheckpoint, Stateful

# {part name: {key: value}}: what each part loads into.
Targets = dict[str, dict[str, Any]]


def is_tensor(value: Any) -> bool:
    """A value that is a shard entry (a torch.Tensor or a DTensor), not meta."""
    return isinstance(value, torch.Tensor)


def restore_parts(
    parts: Mapping[str, Stateful],
    saved: SavedCheckpoint,
    load_tensors: Callable[[Targets], None],
    meta: Mapping[str, Mapping[str, Any]],
) -> None:
    """Load into `parts` what `saved` describes: targets planned, `load_tensors(targets)` checks
    them and fills their tensors in place, then every part's `load_state_dict`, in `parts`' order
    (the order every rank calls them in), with its meta values from `meta[part name]`."""
    targets: Targets = {
        name: part.load_target(saved) if isinstance(part, PlansItsLoad) else part.state_dict()
        for name, part in parts.items()
    }
    load_tensors(targets)
    for name, part in parts.items():
        values = meta[name]
        part.load_state_dict({k: v if is_tensor(v) else values.get(k, v) for k, v in targets[name].items()})
