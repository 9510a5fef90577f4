"""Models built from libnn's layers, loading their published checkpoints.

Each model is imported on first use (`from libnn.models import SeedCNN` imports seed_cnn alone), so
one model's dependencies are never needed to run another.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {"BertEncoder": "bert", "BertConfig": "bert", "BertOutput": "bert",
            "CausalLM": "llama", "LlamaConfig": "llama", "SeedCNN": "seed_cnn"}

__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'libnn.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"libnn.models.{_MODULES[name]}"), name)
