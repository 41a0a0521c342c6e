"""What scripts/gpu_check.sh found on this machine, as one JSON object: the interpreter, torch
and its CUDA, the GPU, the packages `elastron train` needs, and the optional ones (Transformer
Engine, torchao) with why they are missing."""

from __future__ import annotations

import importlib
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def version(name: str) -> str | None:
    try:
        return getattr(importlib.import_module(name), "__version__", "unknown")
    except Exception as err:  # noqa: BLE001 - report, never fail: this is the inventory
        return f"missing ({type(err).__name__})"


def main() -> None:
    import torch

    from engine.transformer.te import load_transformer_engine

    info = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformer_engine": load_transformer_engine()[1],
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
    for name in ("pydantic", "pydantic_core", "typer", "numpy", "transformers", "safetensors", "xxhash", "torchao", "triton", "pynvml"):
        info[name] = version(name)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
