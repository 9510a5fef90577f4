"""Weights from files: safetensors and NumPy .npz, read without PyTorch, into a state dict of NumPy
arrays with the file's own key names (PyTorch's, for checkpoints saved from PyTorch).

`Module.load(path)` loads a file into a model through `load_state_dict`, which checks every key and
shape before it changes anything. bf16 tensors come back as ml_dtypes.bfloat16 arrays.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from libnn import dtypes

FORMATS = (".safetensors", ".npz")
NUMERIC_KINDS = "biufc"  # bool, integers, floats, complex; bf16 (ml_dtypes) counts as a float


def _path(function: str, path: Any) -> Path:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{function}: path must be a str or pathlib.Path, got {type(path).__name__} {path!r}")
    return Path(path)


def _numeric(dtype: np.dtype) -> bool:
    return dtype.kind in NUMERIC_KINDS or dtypes.short_name(dtype) == "bf16"


def read(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor in a .safetensors or .npz file, by name. A file that is missing, a directory,
    empty, truncated, not in its suffix's format, or holds a non-numeric array is refused with a
    ValueError (FileNotFoundError if missing) that names the file."""
    path = _path("weights.read", path)
    if path.is_dir():
        raise ValueError(f"weights file {str(path)!r} is a directory; expected a {' or '.join(FORMATS)} file in it")
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.suffix not in FORMATS:
        raise ValueError(f"weights file {str(path)!r}: expected one of {FORMATS}, got {path.suffix!r}")
    if path.stat().st_size == 0:
        raise ValueError(f"weights file {str(path)!r} is empty")
    tensors = _read_npz(path) if path.suffix == ".npz" else _read_safetensors(path)
    for name, array in tensors.items():
        if not _numeric(array.dtype):
            raise ValueError(f"weights file {str(path)!r}: tensor {name!r} has dtype {array.dtype}; weights must "
                             "be numbers")
    return tensors


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    # np.load reports a truncated or foreign archive as BadZipFile, EOFError, OSError or ValueError,
    # and an object array as ValueError (pickles are never loaded: they can run code)
    tensors, name = {}, None
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a plain .npy saved under an .npz name
            raise ValueError("it holds a single array, not an archive of named arrays")
        with loaded as archive:
            for name in archive.files:
                tensors[name] = archive[name]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        which = f" (at array {name!r})" if name is not None else ""
        raise ValueError(f"weights file {str(path)!r} is not a readable .npz archive{which}: "
                         f"{type(exc).__name__}: {exc}") from exc
    return tensors


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file
    except ImportError as exc:
        raise ModuleNotFoundError(f"reading {path.name} needs the safetensors package: pip install safetensors "
                                  "(or libnn[io])", name="safetensors") from exc
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"weights file {str(path)!r} is not a readable .safetensors file (empty, truncated or "
                         f"another format): {exc}") from exc


def write(path: str | Path, state: dict[str, Any]) -> None:
    """Save a state dict (NumPy or CuPy arrays of numbers) as .safetensors or .npz; what `read` would
    refuse is refused before anything is written."""
    path = _path("weights.write", path)
    if path.suffix not in FORMATS:
        raise ValueError(f"weights file {str(path)!r}: expected one of {FORMATS}, got {path.suffix!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"weights file {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    if not isinstance(state, Mapping):
        raise TypeError(f"weights.write: state must be a dict of arrays by name, got {type(state).__name__}")
    arrays = {name: (value.get() if hasattr(value, "get") else np.asarray(value)) for name, value in state.items()}
    for name, array in arrays.items():
        if not _numeric(array.dtype):
            raise ValueError(f"weights file {str(path)!r}: tensor {name!r} has dtype {array.dtype}; weights must be "
                             "numbers")
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))
