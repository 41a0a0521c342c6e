"""Dropout that picks the right RNG stream for where the activation lives."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from engine.tensor_parallel.random import get_rng_tracker


def dropout(x: torch.Tensor, p: float, training: bool, sharded_over_tp: bool) -> torch.Tensor:
    """`sharded_over_tp`: the activation differs per TP rank (sequence chunk), so its mask must
    too; replicated activations use the default stream and get the same mask on every TP rank."""
    if p == 0.0 or not training:
        return x
    with get_rng_tracker().fork() if sharded_over_tp else contextlib.nullcontext():
        return F.dropout(x, p, training=True)
