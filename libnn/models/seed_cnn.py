"""SeedCNN: a small digit classifier, the first whole CNN libnn runs, with weights that ship with it.

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    log_probs = model(images)                 # images (N, 1, 28, 28), as PyTorch takes them
    images, labels = load_heldout()           # the held-out split it was not trained on

The network (PyTorch's names; `python -m libnn.models.train_seed_cnn` trains the identical torch model):
    features:   0 Conv2d(1→32, 3×3, pad 1), 1 BatchNorm2d, 2 ReLU, 3 MaxPool2d(2)
                4 Conv2d(32→64, 3×3, pad 1), 5 BatchNorm2d, 6 ReLU, 7 MaxPool2d(2)
    classifier: 0 Flatten, 1 Linear(3136→128), 2 ReLU, 3 Linear(128→10), 4 LogSoftmax(dim=1)
Each Sequential fuses what it can: conv+BN+ReLU run as one conv with BN folded into its weights and
ReLU in its epilogue, Flatten+Linear+ReLU as one GEMM with ReLU in its epilogue (see Layouts).

Input: (N, 1, 28, 28) grayscale digits preprocessed as `preprocess_digits` does (scikit-learn's 8×8
digits, 0..16, resized bilinearly and scaled to [-1, 1]); any floating dtype, cast to the model's.
Output: (N, 10) log-probabilities in the model's dtype.

Layouts. The convolutions run in NHWC, the layout cuDNN's fp16 engines and libnn's kernels are fastest
in, while the checkpoint is PyTorch's, whose Flatten orders fc1's 3136 inputs as (C, H, W). No
parameter is changed for it, so a PyTorch state_dict loads 1:1 and state_dict() gives it back:
- the input: with one channel, an (N, 1, 28, 28) NCHW array holds its values in the same order as
  (N, 28, 28, 1) NHWC, so it is reshaped, not copied;
- Flatten(layout="NHWC") alone would transpose the (N, 7, 7, 64) activation to (C, H, W) order;
  followed by a Linear, Sequential fuses the two (FlattenLinear): the activation is flattened as it
  lies and fc1 multiplies it by a copy of its weight whose columns are permuted once to (H, W, C).
  Without the transpose the model runs faster.
`layout="NCHW"` builds the same model computing in NCHW throughout (the tests check both agree). On
the H100 in fp16, NCHW is much slower than NHWC (cuDNN has no fused engine for NCHW fp16 and falls
back); in fp32 NCHW is a little faster, but fp16 is the dtype to run (benchmarks/RESULTS.md, models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.nn.basic import Flatten, LogSoftmax
from libnn.nn.activation import ReLU
from libnn.nn.conv import Conv2d
from libnn.nn.linear import Linear
from libnn.nn.module import Module
from libnn.nn.norm import BatchNorm2d
from libnn.nn.pool import MaxPool2d
from libnn.nn.sequential import Sequential
from libnn.ops.conv2d import LAYOUTS
from libnn.runtime.arrays import as_array, describe, is_cupy

INPUT_SHAPE = (1, 28, 28)
CLASSES = 10
# The path names every op of the model has; a library path (cudnn, cublaslt) belongs to one op only.
PATHS = ("auto", "custom", "reference")
DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "seed_cnn.safetensors"
HELDOUT = DATA / "digits_heldout.npz"
# PyTorch's BatchNorm saves this training-time counter; inference has no use for it.
TRAINING_ONLY_KEYS = ("num_batches_tracked",)


class SeedCNN(Module):
    def __init__(self, *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto", layout: str = "NHWC"):
        super().__init__()
        if path not in PATHS:
            raise ValueError(f"SeedCNN: path must be one of {PATHS}, got {path!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"SeedCNN: layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._input_weight: tuple[int, Any] | None = None  # (version, features[0].weight): see _first_weight
        kw = dict(layout=layout, dtype=dtype, device=device)
        self.features = Sequential(
            Conv2d(1, 32, 3, padding=1, path=path, **kw), BatchNorm2d(32, **kw), ReLU(),
            MaxPool2d(2, layout=layout, path=path),
            Conv2d(32, 64, 3, padding=1, path=path, **kw), BatchNorm2d(64, **kw), ReLU(),
            MaxPool2d(2, layout=layout, path=path))
        self.classifier = Sequential(
            Flatten(layout=layout),
            Linear(64 * 7 * 7, 128, dtype=dtype, device=device, path=path), ReLU(),
            Linear(128, CLASSES, dtype=dtype, device=device, path=path),
            LogSoftmax(dim=1, path=path))

    @classmethod
    def pretrained(cls, *, dtype: Any = "fp32", device: str = "cpu", path: str = "auto",
                   layout: str = "NHWC") -> "SeedCNN":
        """The model with the weights shipped in libnn/models/data (trained by train_seed_cnn.py)."""
        return cls(dtype=dtype, device=device, path=path, layout=layout).load(WEIGHTS)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A PyTorch state_dict as it is; BatchNorm's num_batches_tracked counters are set aside."""
        super().load_state_dict({k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in TRAINING_ONLY_KEYS})

    def describe(self) -> list[str]:
        """One line per module that runs, with what was fused."""
        return [f"{name}.{line}" for name in ("features", "classifier") for line in self._children[name].describe()]

    def forward(self, x: Any) -> Any:
        x = as_array(x, "SeedCNN", "x")
        shape = x.shape  # read once: CuPy makes the tuple at every read
        if len(shape) != 4 or shape[1:] != INPUT_SHAPE or shape[0] < 1:
            raise ValueError(f"SeedCNN: expected input (N, 1, 28, 28) with N >= 1, got {tuple(shape)}")
        if not dtypes.is_float(x.dtype):
            raise TypeError(f"SeedCNN: expected a floating-point input, got dtype {x.dtype}")
        weight = self._first_weight()
        if is_cupy(x) != is_cupy(weight):
            raise TypeError(f"SeedCNN: x is {describe(x)} but the model's weights are {describe(weight)}; "
                            "move x with cupy.asarray(x) / cupy.asnumpy(x), or the model with .to('gpu' / 'cpu')")
        if x.dtype != weight.dtype:  # astype(copy=False) would return x itself, at a call's cost
            x = x.astype(weight.dtype)
        if self.layout == "NHWC":
            x = x.reshape(shape[0], 28, 28, 1)  # one channel: NCHW and NHWC order the values alike
        return self.classifier(self.features(x))

    def _first_weight(self) -> Any:
        """features[0].weight, whose device and dtype the input takes; looked up again only when the
        model's version changed (a parameter or layer was replaced), not through Sequential's
        indexing at every call."""
        cached = self._input_weight
        if cached is None or cached[0] != self._version:
            cached = self._input_weight = (self._version, self.features[0].weight)
        return cached[1]


def preprocess_digits(images: Any) -> np.ndarray:
    """scikit-learn's 8×8 digits (values 0..16; shape (N, 8, 8) or (N, 64)) as the model's input:
    (N, 1, 28, 28) float32, resized bilinearly (torch.nn.functional.interpolate's bilinear with
    align_corners=False) and scaled from [0, 16] to [-1, 1]."""
    images = np.asarray(images, dtype=np.float64)
    if images.ndim == 2 and images.shape[1] == 64:
        images = images.reshape(-1, 8, 8)
    if images.ndim != 3 or images.shape[1:] != (8, 8):
        raise ValueError(f"preprocess_digits: expected images (N, 8, 8) or (N, 64), got {images.shape}")
    resize = _bilinear_matrix(8, 28)
    resized = np.einsum("ij,njk,lk->nil", resize, images, resize)  # rows, then columns
    return ((resized / 16 - 0.5) / 0.5).astype(np.float32)[:, None]


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) weights of 1-D linear interpolation with half-pixel centres (align_corners=False):
    source position (i + 0.5)·n_in/n_out − 0.5, clamped at 0 as PyTorch does."""
    source = np.maximum((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0)
    low = np.floor(source).astype(int)
    high = np.minimum(low + 1, n_in - 1)
    frac = source - low
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), low), 1 - frac)
    np.add.at(m, (np.arange(n_out), high), frac)
    return m


def load_heldout() -> tuple[np.ndarray, np.ndarray]:
    """The held-out split SeedCNN was not trained on: images (N, 1, 28, 28) float32, already
    preprocessed, and labels (N,) int64."""
    with np.load(HELDOUT, allow_pickle=False) as data:
        return data["images"], data["labels"]
