"""Transformer Engine, behind the one guard DESIGN.md asks for.

TE is the `gpu` extra and is not importable on most machines: its PyPI package is a meta wheel
whose torch extension builds from source against CUDA, and a broken install raises RuntimeError
(not ImportError) on import while importlib still finds it. So every caller asks here, and any
exception means "not available", with the reason kept for the logs and scripts/gpu_check.sh.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load_transformer_engine() -> tuple[ModuleType | None, str]:
    """(transformer_engine.pytorch, its version) when TE imports, else (None, why not)."""
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except ModuleNotFoundError:
        return None, "TE not installed"
    except Exception as err:  # noqa: BLE001 - a broken TE raises anything (RuntimeError, OSError)
        return None, f"TE installed but does not import: {type(err).__name__}: {err}"
    version = getattr(importlib.import_module("transformer_engine"), "__version__", "unknown")
    return te, f"TE {version}"
