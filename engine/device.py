"""Device choice, in one place: the rest of the engine asks here and never calls torch.cuda.

A rank runs on CPU with gloo (tests, laptops) or on one CUDA device with NCCL. Which one is
decided once per process from the job's `resources.device` and the local rank; the RNG state
helpers exist so the TP RNG tracker works the same on both.
"""

from __future__ import annotations

import os

import torch


def resolve_device_type(requested: str = "auto") -> str:
    """'cpu' or 'cuda' for a job's resources.device ('auto', 'cpu' or 'cuda')."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("resources.device is 'cuda' but no CUDA device is visible: use 'cpu' or 'auto'")
    return requested


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


_DEVICE: torch.device | None = None


def set_device(device_type: str, local_rank: int = 0) -> torch.device:
    """Bind this process to its device; on CUDA one GPU per local rank."""
    global _DEVICE
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        _DEVICE = torch.device("cuda", local_rank)
    else:
        _DEVICE = torch.device("cpu")
    return _DEVICE


def current_device() -> torch.device:
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def get_rng_state() -> torch.Tensor:
    if current_device().type == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if current_device().type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if current_device().type == "cuda":
        torch.cuda.manual_seed(seed)


def synchronize() -> None:
    if current_device().type == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    """Start a new peak for `memory_bytes` (called at the start of each step)."""
    if current_device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def memory_bytes() -> tuple[int, int] | None:
    """(allocated now, peak allocated since the last reset) by torch's caching allocator on this
    rank's GPU: what the step really held, without the allocator's cached-but-free blocks. None on
    CPU, where a process's memory is not the model's alone (RSS counts the interpreter and torch)."""
    if current_device().type != "cuda":
        return None
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def cuda_capability(index: int | None = None) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of a CUDA device (default: the current one)."""
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def cpu_cores() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_per_rank(local_world_size: int) -> int:
    """Split the machine's cores between local ranks so gloo ranks do not oversubscribe them."""
    return max(1, cpu_cores() // max(1, local_world_size))
