"""Weights from files: safetensors and NumPy .npz, read without PyTorch, into a state dict of NumPy
arrays with the file's own key names (PyTorch's, for checkpoints saved from PyTorch).

`Module.load(path)` loads a file into a model through `load_state_dict`, which checks every key and
shape before it changes anything. bf16 tensors come back as ml_dtypes.bfloat16 arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FORMATS = (".safetensors", ".npz")


def read(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor in a .safetensors or .npz file, by name."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    if path.suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError as exc:
            raise ImportError("reading .safetensors needs the safetensors package: pip install safetensors") from exc
        return load_file(str(path))
    raise ValueError(f"weights file {str(path)!r}: expected one of {FORMATS}, got {path.suffix!r}")


def write(path: str | Path, state: dict[str, Any]) -> None:
    """Save a state dict (NumPy or CuPy arrays) as .safetensors or .npz."""
    path = Path(path)
    arrays = {name: (value.get() if hasattr(value, "get") else np.asarray(value)) for name, value in state.items()}
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    elif path.suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))
    else:
        raise ValueError(f"weights file {str(path)!r}: expected one of {FORMATS}, got {path.suffix!r}")
