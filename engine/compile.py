"""torch.compile of the transformer layers (`training.compile`), TorchTitan's way: each layer is
compiled on its own, in place (`Module.compile`, so parameter names and checkpoints do not
change), rather than the whole model. Every layer has the same code and shapes, so dynamo
compiles one graph and reuses it for the others, and compilation time does not grow with depth;
the embedding, the loss and everything that communicates between layers stay eager.

What it buys: the elementwise work between GEMMs (RMSNorm, RoPE, SwiGLU, residual adds, casts)
fuses into a few Triton kernels instead of one kernel and one HBM round trip each.
"""

from __future__ import annotations

from torch import nn


def compile_layers(chunk: nn.Module) -> None:
    """Compile every transformer layer of one model chunk."""
    for layer in chunk.decoder.layers:
        layer.compile()
