"""The floating-point dtypes libnn knows, by short name.

bfloat16 is not a NumPy dtype of its own: it comes from ml_dtypes, the package CuPy (>=14), JAX and
TensorFlow share, so a bf16 array moves between them without a copy. Without ml_dtypes installed,
bf16 is simply unavailable.
"""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    bfloat16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the base install: NumPy only
    bfloat16 = None

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

_BY_NAME = {"fp16": float16, "float16": float16, "half": float16,
            "fp32": float32, "float32": float32, "float": float32,
            "fp64": float64, "float64": float64, "double": float64}
if bfloat16 is not None:
    _BY_NAME.update({"bf16": bfloat16, "bfloat16": bfloat16})


_SHORT_NAMES = {_BY_NAME[n]: n for n in ("fp16", "bf16", "fp32", "fp64") if n in _BY_NAME}


def short_name(dtype) -> str:
    """'fp16', 'bf16', 'fp32', 'fp64', or NumPy's own name for anything else."""
    name = _SHORT_NAMES.get(dtype)  # hot path: a dtype object hashes fast
    if name is None:
        dtype = np.dtype(dtype)
        name = _SHORT_NAMES.get(dtype, dtype.name)
    return name


def is_float(dtype) -> bool:
    """A floating-point dtype: NumPy's float kinds, or bfloat16 (ml_dtypes' kind is 'V', not 'f')."""
    return dtype.kind == "f" or short_name(dtype) == "bf16"


def parse(name) -> np.dtype:
    """A dtype from a short name ('bf16', 'fp32', ...) or anything NumPy understands."""
    if isinstance(name, str):
        key = name.lower()
        if key in _BY_NAME:
            return _BY_NAME[key]
        if key in ("bf16", "bfloat16"):
            raise ValueError("dtype bf16 needs the ml_dtypes package (pip install ml_dtypes)")
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(set(_BY_NAME))}")
    return np.dtype(name)


def bf16_as_float32(a):
    """A bf16 array (NumPy's or CuPy's: the same methods) as float32 from its bits, widened: the same values,
    exactly, for a library whose arithmetic takes no bf16 (CuPy's)."""
    return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# Relative L2 error that each dtype's results are held to against the float64 reference.
TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5, "tf32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}

# The suffix of a kernel's name in kernels/*.cu for each dtype it is generated for.
KERNEL_SUFFIX = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
# The same for the kernel files that also build fp64 kernels (softmax.cu, masked_mean.cu).
KERNEL_SUFFIX_WITH_F64 = {**KERNEL_SUFFIX, "fp64": "f64"}
