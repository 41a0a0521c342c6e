"""AdamW's per-tensor state read and written outside a step: what checkpoints save and put back.

torch's AdamW keeps `state[tensor] = {"step", "exp_avg", "exp_avg_sq"}` and creates it lazily at
the first step. Reading it (zeros before that step, which is exactly what a fresh Adam starts
from, so a checkpoint of iteration 0 loads right) and setting it as a checkpoint gives it (the
step count where the fused kernel wants it) are details of torch's optimizer: they live here,
beside `TrainingOptimizer`, whose state accessors are the only callers.
"""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def moment(adam: torch.optim.Optimizer, main: torch.Tensor, name: str) -> torch.Tensor:
    """Adam's moment `name` for the tensor `main`; zeros before the first step."""
    state = adam.state.get(main)
    return state[name] if state and name in state else torch.zeros_like(main)


def step_count(adam: torch.optim.Optimizer) -> int:
    """The optimizer's step count (0 before the first step)."""
    return max((int(s["step"]) for s in adam.state.values() if "step" in s), default=0)


def set_state(adam: torch.optim.Optimizer, main: torch.Tensor, step: int, moments: dict) -> None:
    """Adam's state for `main` as a loaded checkpoint gives it (step count and both moments)."""
    # The fused (GPU) AdamW keeps its step count on the parameter's device; foreach on the host.
    where = main.device if adam.defaults.get("fused") else None
    adam.state[main] = {
        "step": torch.tensor(float(step), device=where),
        **{name: moments[name] for name in MOMENTS},
    }


def moment_bytes(adam: torch.optim.Optimizer) -> int:
    """Bytes the moments take (0 before the first step)."""
    return sum(t.numel() * t.element_size() for state in adam.state.values() for k, t in state.items() if k in MOMENTS)
