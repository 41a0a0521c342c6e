"""Model FLOPs per iteration, the peak a device can do, and model FLOPs utilisation (MFU).

MFU = model FLOPs per iteration / (step time x world size x peak per device). Model FLOPs are
what the model needs, not what the hardware did: activation recomputation (selective or full) is
not counted, so MFU stays comparable across recompute settings (counting it gives HFU, hardware
FLOPs utilisation). Only GEMMs are counted; norms, softmax, activations, RoPE, dropout and the
embedding lookup are noise at this scale. The count follows Megatron-Core's
`num_floating_point_operations` (Megatron-LM training.py), which counts the causal half of the
attention score matrix; its published Llama 3 8B figure (744 TFLOP/s at 14,451 tokens/s/GPU,
seq 8192) comes out of this formula to 0.1 %.

The peak comes from a datasheet table for known GPUs, else from timing a large matmul on this
device with this process's torch thread count; a CPU measurement is cached on disk, keyed by CPU
model, thread count, dtype and torch version, so later starts do not pay the second it takes.
Every rank measures its own share of the cores, which is the peak its MFU is relative to.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import device
from engine.transformer.config import TransformerConfig

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def model_flops_per_iteration(
    config: TransformerConfig, global_batch_size: int, *, full_attention_matrix: bool = False
) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one iteration of the GPT decoder.

    With B = global batch, s = seq_length, h = hidden, L = layers, a = attention heads, g = query
    groups (KV heads), d = head dim (model.kv_channels; a*d need not be h, as in Qwen3), f = ffn
    hidden, V = padded vocab, and 2 FLOPs per multiply-add, the forward FLOPs per token are

        L * [ 2h(ad + 2gd)          QKV projections (q: h x ad; k, v: h x gd each)
            + 2 * 2ad * s/2         QK^T and attention x V; causal: half the s x s scores
            + 2ad h                 output projection (ad -> h)
            + 2hf * (3 | 2) ]       MLP: swiglu's gate, up, down | gelu's (or gelu_tanh's) up, down
        + 2hV                       logits (counted whether or not embeddings are tied)

    where an MoE layer's MLP term is 2hE (router) + k * 2hf_e * (3 | 2) (the k experts a token
    goes to) + the shared expert's, if any;

    multi-latent attention (model.attention: mla; q_r, kv_r the latent ranks, n / r / v the
    per-head no-RoPE, RoPE and value sizes) replaces the attention term with

          2h q_r + 2 q_r a(n+r)       query down and up projections (or 2h a(n+r) without q_r)
        + 2h(kv_r + r) + 2 kv_r a(n+v) key/value down projection (+ the shared RoPE key) and up
        + 2 * a(n+r) * s/2 + 2 * av * s/2   QK^T over n+r, attention x V over v; causal half
        + 2av h                       output projection

    and each multi-token prediction depth (model.mtp_num_layers, D of them) adds
    2 * 2h * h (eh_proj) + one more layer (attention + its MLP, MoE when the model is) + 2hV
    (its logits), as Megatron-Core counts them;

    and the iteration is 3 * B * s * that. `full_attention_matrix=True` counts all s^2 scores
    (Megatron-LM's convention before 2025) instead of the causal half; a bidirectional encoder
    (BERT, `config.causal` false) always computes all of them.
    """
    c = config
    if c.t5 is not None:
        return 3.0 * global_batch_size * c.seq_length * _t5_flops_per_token(c, full_attention_matrix)
    qd = c.num_attention_heads * c.head_dim
    kvd = c.num_query_groups * c.head_dim
    attended = c.seq_length if full_attention_matrix or not c.causal else c.seq_length / 2
    mlp_matrices = 3 if c.activation == "swiglu" else 2
    attention = 2 * c.hidden_size * (qd + 2 * kvd) + 2 * 2 * qd * attended + 2 * qd * c.hidden_size
    if c.mla is not None:
        attention = _mla_flops(c, attended)
    dense_mlp = 2 * c.hidden_size * c.ffn_hidden_size * mlp_matrices
    logits = 2 * c.hidden_size * c.padded_vocab_size
    forward_per_token = logits
    for layer in range(c.num_layers):
        forward_per_token += attention + (
            _moe_mlp_flops(c, mlp_matrices) if c.is_moe_layer(layer) else dense_mlp
        )
    mtp_mlp = _moe_mlp_flops(c, mlp_matrices) if c.moe is not None else dense_mlp
    forward_per_token += c.mtp_num_layers * (2 * 2 * c.hidden_size * c.hidden_size + attention + mtp_mlp + logits)
    return 3.0 * global_batch_size * c.seq_length * forward_per_token


def _t5_flops_per_token(c: TransformerConfig, full_attention_matrix: bool) -> float:
    """T5 (model.arch t5), per encoder token and its decoder token (both seq_length long): each
    encoder layer 2h*3ad (QKV) + 2*2ad*s (all scores: bidirectional) + 2adh + 2hf*3 (gated
    GELU); each decoder layer the same with causal scores (s/2 unless `full_attention_matrix`),
    plus cross-attention 2h*ad (q) + 2h*2ad (k, v of the encoder tokens) + 2*2ad*s + 2adh; and
    the logits 2hV."""
    h, s, ad = c.hidden_size, c.seq_length, c.num_attention_heads * c.head_dim
    mlp = 2 * h * c.ffn_hidden_size * 3
    encoder = 2 * h * 3 * ad + 2 * 2 * ad * s + 2 * ad * h + mlp
    causal = s if full_attention_matrix else s / 2
    cross = 2 * h * ad + 2 * h * 2 * ad + 2 * 2 * ad * s + 2 * ad * h
    decoder = 2 * h * 3 * ad + 2 * 2 * ad * causal + 2 * ad * h + cross + mlp
    return c.num_layers * encoder + c.t5.num_decoder_layers * decoder + 2 * h * c.padded_vocab_size


def _mla_flops(c: TransformerConfig, attended: float) -> float:
    m, h, a = c.mla, c.hidden_size, c.num_attention_heads
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    query = 2 * h * a * qk if m.q_lora_rank is None else 2 * h * m.q_lora_rank + 2 * m.q_lora_rank * a * qk
    key_value = 2 * h * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank * a * (m.qk_nope_head_dim + v)
    core = 2 * a * qk * attended + 2 * a * v * attended
    return query + key_value + core + 2 * a * v * h


def _moe_mlp_flops(c: TransformerConfig, mlp_matrices: int) -> float:
    """An MoE block per token: the router (2hE), the k experts it goes to, the shared expert.
    Tokens dropped for capacity are still counted: MFU is about the model, not the routing."""
    moe = c.moe
    flops = (
        2 * c.hidden_size * moe.num_experts
        + moe.top_k * 2 * c.hidden_size * moe.ffn_hidden_size * mlp_matrices
    )
    if moe.shared_expert_ffn_hidden_size:
        flops += 2 * c.hidden_size * moe.shared_expert_ffn_hidden_size * mlp_matrices
    return flops


def mfu(flops_per_iteration: float, step_time_s: float, world_size: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation, a fraction: achieved FLOP/s over the peak of all devices."""
    if step_time_s <= 0 or world_size <= 0 or peak_per_device <= 0:
        raise ValueError(
            f"mfu needs a positive step time, world size and peak, got {step_time_s}, "
            f"{world_size}, {peak_per_device}"
        )
    return flops_per_iteration / (step_time_s * world_size * peak_per_device)


@dataclass(frozen=True)
class PeakFlops:
    flops_per_s: float
    source: str  # "table:<GPU>", "measured", or "measured:cache"


# Dense (no sparsity) datasheet peaks, FLOP/s: bf16/fp16, fp8, tf32, plain fp32.
_GPU_TABLE: dict[str, dict[str, float]] = {
    "GH200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12},  # SXM
    "H100-PCIe": {"bf16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def _gpu_model(name: str) -> str | None:
    """The table row for a CUDA device name; None for parts left out (NVL boards run at lower
    clocks and power, and unknown GPUs are measured rather than guessed)."""
    n = name.upper()
    if "NVL" in n:
        return None
    if "GH200" in n:
        return "GH200"
    if "H200" in n:
        return "H200"
    if "H100" in n and "PCIE" in n:
        return "H100-PCIe"
    if "H100" in n and ("HBM3" in n or "SXM" in n):
        return "H100"
    if "A100" in n:
        return "A100"
    return None


def _dtype_column(dtype: torch.dtype) -> str | None:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype in _FP8:
        return "fp8"
    if dtype == torch.float32:
        # torch runs fp32 matmuls as TF32 when asked to ("high"/"medium" precision).
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


def gpu_peak_from_table(device_name: str, dtype: torch.dtype) -> PeakFlops | None:
    model, column = _gpu_model(device_name), _dtype_column(dtype)
    value = _GPU_TABLE.get(model, {}).get(column) if model and column else None
    return PeakFlops(value, f"table:{model}") if value else None


def gpu_name() -> str | None:
    """This rank's GPU name from NVML (CUDA calls stay in engine.device)."""
    from engine.energy_monitor import cuda_index, load_nvml, nvml_device_handle

    nvml = load_nvml()
    if nvml is None:
        return None
    try:
        name = nvml.nvmlDeviceGetName(nvml_device_handle(nvml, cuda_index()))
    except Exception:  # noqa: BLE001 - no name means "measure it"
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def default_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elastron" / "peak_flops.json"


def _time_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    device.synchronize()
    start = time.perf_counter()
    torch.mm(a, b)
    device.synchronize()
    return time.perf_counter() - start


def measure_matmul_flops(
    device_type: str,
    dtype: torch.dtype,
    max_size: int | None = None,
    repeats: int = 3,
    min_seconds: float = 0.1,
) -> float:
    """FLOP/s of the best of `repeats` timed n^3 matmuls on this rank's device.

    n doubles from 256 until one matmul takes `min_seconds` or n reaches `max_size` (2048 on CPU,
    where that fills two cores for ~0.1 s; 8192 on GPU, which a GPU needs to approach its peak).
    The growth bounds the cost where a dtype has no fast kernel: bf16 on a CPU without
    AVX512-BF16/AMX runs at ~1 GFLOP/s, and a 2048^3 bf16 matmul there takes minutes.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"cannot measure a matmul peak for {dtype}: give the peak explicitly")
    limit = max_size or (8192 if device_type == "cuda" else 2048)
    dev = device.current_device() if device_type == "cuda" else torch.device("cpu")
    n = min(256, limit)
    while True:
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        first = _time_mm(a, b)  # also the warm-up of this size
        if first >= min_seconds or n >= limit:
            break
        n = min(2 * n, limit)
    best = min(_time_mm(a, b) for _ in range(repeats))
    return 2.0 * n**3 / best


def _cache_key(device_type: str, model: str, dtype: torch.dtype) -> str:
    threads = torch.get_num_threads() if device_type == "cpu" else 0
    return f"{device_type}|{model}|threads={threads}|{dtype}|torch={torch.__version__}"


def _load_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(path: Path, key: str, flops: float) -> None:
    """Add one entry; written to a temporary file and renamed, so ranks of one host writing at
    once never leave a torn file (one of two racing entries may be lost and measured again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_cache(path)
        data[key] = {"flops_per_s": flops, "measured_at": time.time()}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a measurement per start


def peak_flops(
    device_type: str,
    dtype: torch.dtype,
    *,
    device_name: str | None = None,
    cache_path: str | Path | None = None,
    measure: Callable[[str, torch.dtype], float] = measure_matmul_flops,
) -> PeakFlops:
    """Peak dense FLOP/s of one of this job's devices for `dtype`.

    CUDA: the datasheet table for the device name (from NVML unless given), else a measurement
    (not cached when NVML cannot name the GPU). CPU and unlisted GPUs: a cached measurement,
    else `measure(device_type, dtype)`, stored in `cache_path` (default: default_cache_path()).
    """
    if device_type == "cuda":
        name = device_name or gpu_name()
        row = gpu_peak_from_table(name, dtype) if name else None
        if row is not None:
            return row
        if name is None:  # a cache entry under no name could belong to any GPU
            return PeakFlops(measure(device_type, dtype), "measured")
    else:
        name = device_name or cpu_model_name()
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = _cache_key(device_type, name, dtype)
    cached = _load_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("flops_per_s"), int | float):
        if cached["flops_per_s"] > 0:
            return PeakFlops(float(cached["flops_per_s"]), "measured:cache")
    flops = measure(device_type, dtype)
    _store(path, key, flops)
    return PeakFlops(flops, "measured")
