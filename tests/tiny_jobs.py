"""The small model most tests train: one definition, so the suites (engine, workers, e2e) train
the same thing and a change of size reaches all of them. Tests that need another shape say so
with `{**TINY_LLAMA, "seq_length": 64}`."""

from __future__ import annotations

# 2 layers, hidden 64, 4 heads, 32 tokens: a step takes tens of milliseconds on one CPU core.
TINY_LLAMA = {
    "arch": "llama",
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
}
