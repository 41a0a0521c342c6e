"""FP8 linear layers: Y = X W^T with float8 matmuls and dynamic per-tensor ("tensorwise") scaling.

The recipe torchao / TorchTitan call "tensorwise", written here on `torch._scaled_mm`:

* forward: X and W are each cast to float8_e4m3fn with their own scale s = finfo(e4m3).max / amax
  (amax of |t| over the whole tensor, in fp32, clamped to >= 1e-12 so a zero tensor does not
  divide by zero), then Y = scaled_mm(X8, W8^T, scale_a=1/s_x, scale_b=1/s_w) in X's dtype;
* backward: grad_Y is cast to float8_e5m2 (more range, less precision: gradients span more
  orders of magnitude) with its own dynamic scale, and grad_X = scaled_mm(G8, W8),
  grad_W = scaled_mm(G8^T, X8), reusing the fp8 copies of X and W saved by the forward (half the
  memory of saving bf16 ones, a quarter of fp32).

The scales are recomputed every call from the tensor itself (no amax history) and are local to
the rank: under tensor parallelism each rank scales its own shard, which changes nothing in the
maths (each rank's matmul is dequantised by its own scales).

`torch._scaled_mm` wants its first operand row-major and its second column-major, and every
dimension (rows, inner, columns; the token count appears as the inner one in grad_W) a multiple
of 16. Where the flattened input X [M, K] or the weight W [N, K] has M, K or N not a multiple of
16 this falls back to plain `F.linear` in the input's precision. The bias is added after the fp8
matmul, in the output's precision.

On GPU, fp8 matmuls need compute capability 8.9 or above (Ada, Hopper and newer); an older GPU
is refused with a message rather than a cuBLAS error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import device

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_AMAX_EPS = 1e-12
_ALIGN = 16


def _to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * scale as `dtype`, 1 / scale) with scale = finfo(dtype).max / amax(|t|), in fp32: the
    inverse is what _scaled_mm takes to dequantise, so it is the one kept.

    The cast goes through fp32 (one rounding, to fp8) and saturates: the float8 formats have no
    inf (e4m3fn) or overflow to it (e5m2), and amax * scale may round a hair above the maximum."""
    fmax = torch.finfo(dtype).max
    t = t.detach()
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32).clamp(min=_AMAX_EPS)
    return t.to(torch.float32, copy=True).mul_(fmax / amax).clamp_(-fmax, fmax).to(dtype), amax / fmax


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix, laid out column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


# float8 tensor cores: Ada (8.9) and Hopper (9.0) on.
MIN_CAPABILITY = (8, 9)
_CHECKED_DEVICES: set[int] = set()


def unsupported(device_type: str, index: int | None = None) -> str | None:
    """Why float8 matmuls cannot run on this device, or None when they can (CPU: torch's kernel,
    a correctness path)."""
    if device_type != "cuda":
        return None
    name, capability = device.cuda_capability(index)
    if capability < MIN_CAPABILITY:
        return (
            f"training.fp8 needs a GPU of compute capability {'.'.join(map(str, MIN_CAPABILITY))} or above "
            f"(Ada, Hopper); {name} is {'.'.join(map(str, capability))}: set training.fp8: false"
        )
    return None


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" or t.device.index in _CHECKED_DEVICES:
        return
    reason = unsupported("cuda", t.device.index)
    if reason:
        raise RuntimeError(reason)
    _CHECKED_DEVICES.add(t.device.index)


class _FP8Matmul(torch.autograd.Function):
    """X [M, K] @ W [N, K]^T -> [M, N] in X's dtype, every matmul in float8 (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x8, inv_x = _to_fp8(x, E4M3)
        w8, inv_w = _to_fp8(weight, E4M3)
        # w8 [N, K] row-major: its transpose [K, N] is column-major, as _scaled_mm wants.
        out = torch._scaled_mm(x8, w8.t(), scale_a=inv_x, scale_b=inv_w, out_dtype=x.dtype)
        ctx.save_for_backward(x8, inv_x, w8, inv_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8, inv_x, w8, inv_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, inv_g = _to_fp8(grad_out.contiguous(), E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # [M, N] @ [N, K]: W8 as the column-major second operand.
            grad_x = torch._scaled_mm(
                g8, _column_major(w8), scale_a=inv_g, scale_b=inv_w, out_dtype=x_dtype
            )
        if ctx.needs_input_grad[1]:
            # [N, M] @ [M, K]: G8^T row-major, X8 column-major.
            grad_w = torch._scaled_mm(
                g8.t().contiguous(),
                _column_major(x8),
                scale_a=inv_g,
                scale_b=inv_x,
                out_dtype=w_dtype,
            )
        return grad_x, grad_w


def fp8_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(..., fp8=True) runs in float8 for these shapes (else it falls back to F.linear)."""
    if weight.dim() != 2 or x.dim() < 1:
        return False
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    n, k = weight.shape
    return tokens > 0 and all(d % _ALIGN == 0 for d in (tokens, k, n))


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fp8: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias), its matmul in float8 with tensorwise dynamic scaling when `fp8`.

    x is [..., K] (e.g. [s, b, K]; flattened to [M, K] for the matmul), weight [N, K]. Falls back to
    F.linear when a flattened dimension (M, K or N) is not a multiple of 16."""
    if not fp8 or not fp8_applies(x, weight):
        return F.linear(x, weight, bias)
    _check_device(x)
    lead = x.shape[:-1]
    y = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])
    return y if bias is None else y + bias
