"""Mixture of Experts: top-k router, all-to-all token dispatch over the expert-parallel group, local experts."""

from engine.transformer.moe.moe_layer import MoELayer
from engine.transformer.moe.router import MoEConfig, TopKRouter

__all__ = ["MoEConfig", "MoELayer", "TopKRouter"]
