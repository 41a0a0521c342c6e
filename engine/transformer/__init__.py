"""Transformer building blocks: config, attention, MLP, layer, block."""
