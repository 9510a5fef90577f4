"""Models built from libnn's layers, loading their published checkpoints.

Each model is imported on first use (`from libnn.models import SeedCNN` imports seed_cnn alone), so
one model's dependencies are never needed to run another. The decoder architectures are the exception:
llama and gpt2 register themselves with CausalLM (libnn.models.decoder), which picks one by a
checkpoint's config, so they are imported with the package, as libnn.ops imports every op for the
registry; they need nothing beyond libnn.
"""

from __future__ import annotations

import importlib
from typing import Any

from libnn.models import llama, gpt2  # isort: skip  (llama first: errors list the model types in this order)

_MODULES = {"BertEncoder": "bert", "BertConfig": "bert", "BertOutput": "bert",
            "CausalLM": "decoder", "LlamaConfig": "llama", "GPT2Config": "gpt2", "SeedCNN": "seed_cnn"}

__all__ = [*_MODULES, "llama", "gpt2"]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'libnn.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"libnn.models.{_MODULES[name]}"), name)
