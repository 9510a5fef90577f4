"""Hypothesis strategies for every op, shared by the property tests (test_properties_gpu.py and
test_properties_reference.py); not a test module itself.

A strategy draws a `Spec`: the op, its shapes and options (sizes of 1, primes and non-multiples of 8
among them), the dtype, how each input lies in device memory (contiguous, every other element, one
element past an aligned start, rows padded) and a seed for the values. `build(spec, base_seed)`
turns it into a `Case`: host inputs drawn from N(0, 1) (never all zeros) and a `call(arrays, path)`
that runs the op on NumPy or CuPy arrays, with everything else fixed. A failing example prints its
Spec, which rebuilds the same inputs under the same LIBNN_TEST_SEED.

Tolerances (relative L2 error against the float64 reference, `conftest.rel_error`):
- fp32 1e-5; TF32 (allow_tf32=True) 1e-3; fp16 and bf16 1e-2 (libnn.dtypes.TOLERANCE);
- FFT convolutions in fp32 1e-5 · log2(2·F), F the largest padded length (the FFT's error grows
  with log F);
- max pooling exact (a max of the same values);
- layer_norm on cuDNN in fp32 2e-5 (its sums keep ~2 ulps less, 1.004e-5 seen on the H100);
- ops that sum (linear, conv2d, fft_conv, attention's P·V, average pooling) also pass when the error
  relative to the size of the summed terms (the op on |inputs|, no activation) is within the
  tolerance: random signs can cancel an output down to far below its terms, where no fp32
  accumulation is 1e-5-accurate;
- fp32 GELU/SiLU epilogues also pass at a maximum absolute error of 2e-5: cuBLASLt's and cuDNN's
  evaluate tanh/exp approximately (5e-6 measured), which a tiny output turns into a large relative error.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

from libnn import dtypes
from libnn.ops import (attention, avg_pool2d, conv2d, fft_conv1d, fft_conv2d, layer_norm, linear, max_pool2d,
                       softmax)

GPU_DTYPES = ("fp16", "bf16", "fp32")
# small sizes, with 1, primes and non-multiples of 8 over-represented
SMALL = st.one_of(st.sampled_from([1, 2, 3, 5, 7, 8, 11, 13, 16, 17]), st.integers(1, 24))
TINY = st.one_of(st.sampled_from([1, 2, 3, 5, 7]), st.integers(1, 8))
VIEWS = ("contiguous", "strided", "offset")          # any strides (the op copies what it must)
ALIGNED_VIEWS = ("contiguous", "strided")            # what 16-byte loads take (a strided view is copied)
ROW_VIEWS = ("contiguous", "padded_rows", "offset")  # last dimension contiguous (attention)
FP32_APPROXIMATE_ACTIVATIONS = ("gelu", "silu", "gelu_erf")
APPROXIMATE_ACTIVATION_ABS_ERROR = 2e-5


@dataclass(frozen=True)
class Spec:
    """What a strategy drew: the op's name and every choice, printed by hypothesis on a failure."""
    op: str
    params: dict = field(hash=False)

    def __repr__(self) -> str:
        return f"Spec({self.op!r}, {self.params!r})"


@dataclass
class Case:
    op: str                                      # the registry's op name
    call: Callable[[dict, str], Any]             # call(arrays, path) -> output
    arrays: dict[str, Any]                       # host inputs (None: not passed)
    dtype: str
    tolerance: float
    views: dict[str, str] = field(default_factory=dict)  # how each input lies on the device
    magnitude: Callable[[dict], Any] | None = None       # the op on |inputs| (the summed terms' size)
    approximate_activation: bool = False
    exact: bool = False
    path_tolerance: dict[str, float] = field(default_factory=dict)  # a path's own, where measured looser

    def tolerance_for(self, path: str) -> float:
        return self.path_tolerance.get(path, self.tolerance)


def accepts(function: Callable, name: str) -> bool:
    """Whether a public function takes keyword `name` (options other helpers are adding, e.g.
    residual=): drawn only where the signature has it."""
    return name in inspect.signature(function).parameters


def tolerance(dtype: str, allow_tf32: bool = False) -> float:
    return dtypes.TOLERANCE["tf32" if allow_tf32 and dtype == "fp32" else dtype]


def normal(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """N(0, scale²) in `dtype`; zeros (rare after rounding) are replaced so no input is all zeros."""
    a = rng.standard_normal(shape) * scale
    a[a == 0] = scale
    return a.astype(dtypes.parse(dtype))


def _host_abs(a):
    if a is None:
        return None
    return np.abs(a.astype(np.float64)).astype(a.dtype)


# --- linear -------------------------------------------------------------------------------------------
@st.composite
def linear_specs(draw, dtypes_=GPU_DTYPES, activations=None, aligned=False, one_row=False, views=VIEWS):
    """linear's problems; `activations` (default: all), `aligned` (N and K multiples of 8), `one_row`
    (M = 1) and `views` narrow them to what one path takes, so that its examples are not nearly all
    rejected."""
    from libnn.ops.linear import ACTIVATIONS

    dtype = draw(st.sampled_from(dtypes_))
    features = TINY.map(lambda n: 8 * n) if aligned else SMALL
    p = dict(lead=draw(st.lists(st.just(1) if one_row else SMALL, min_size=0, max_size=2)), N=draw(features), K=draw(features), dtype=dtype,
             bias=draw(st.booleans()), activation=draw(st.sampled_from(activations or ACTIVATIONS)),
             allow_tf32=dtype == "fp32" and draw(st.booleans()),
             x_view=draw(st.sampled_from(views)), w_view=draw(st.sampled_from(views)),
             residual=accepts(linear, "residual") and draw(st.booleans()),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("linear", p)


def _build_linear(p, rng) -> Case:
    lead, N, K, dtype = tuple(p["lead"]), p["N"], p["K"], p["dtype"]
    arrays = {"x": normal(rng, (*lead, K), dtype), "w": normal(rng, (N, K), dtype, 1 / math.sqrt(K)),
              "b": normal(rng, (N,), dtype) if p["bias"] else None,
              "residual": normal(rng, (*lead, N), dtype) if p["residual"] else None}

    def call(a, path, activation=p["activation"]):
        extra = {} if a["residual"] is None else {"residual": a["residual"]}
        return linear(a["x"], a["w"], a["b"], activation, allow_tf32=p["allow_tf32"], path=path, **extra)

    def magnitude(a):
        return call({k: _host_abs(v) for k, v in a.items()}, "reference", activation=None)

    return Case("linear", call, arrays, dtype, tolerance(dtype, p["allow_tf32"]),
                views={"x": p["x_view"], "w": p["w_view"]}, magnitude=magnitude,
                approximate_activation=p["activation"] in FP32_APPROXIMATE_ACTIVATIONS)


# --- conv2d -------------------------------------------------------------------------------------------
@st.composite
def conv2d_specs(draw, dtypes_=GPU_DTYPES):
    from libnn.ops.conv2d import ACTIVATIONS

    dtype = draw(st.sampled_from(dtypes_))
    kind = draw(st.sampled_from(["dense", "dense", "grouped", "depthwise"]))
    if kind == "depthwise":
        groups = draw(TINY)
        cg, kg = 1, 1
    else:
        groups = 1 if kind == "dense" else draw(st.integers(2, 4))
        cg, kg = draw(TINY), draw(TINY)
    R, S = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    # the input at least as large as the dilated kernel after padding
    H = draw(st.integers(max(1, dilation[0] * (R - 1) + 1 - 2 * padding[0]), 13))
    W = draw(st.integers(max(1, dilation[1] * (S - 1) + 1 - 2 * padding[1]), 13))
    p = dict(N=draw(st.integers(1, 3)), H=H, W=W, C=groups * cg, K=groups * kg, R=R, S=S, groups=groups,
             stride=stride, padding=padding, dilation=dilation, dtype=dtype,
             layout=draw(st.sampled_from(["NHWC", "NCHW"])), bias=draw(st.booleans()),
             bn=draw(st.sampled_from([None, "scale_shift", "batchnorm"])),
             activation=draw(st.sampled_from(ACTIVATIONS)), allow_tf32=dtype == "fp32" and draw(st.booleans()),
             x_view=draw(st.sampled_from(VIEWS)), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("conv2d", p)


def _build_conv2d(p, rng) -> Case:
    N, H, W, C, K, R, S, groups, dtype = (p[k] for k in ("N", "H", "W", "C", "K", "R", "S", "groups", "dtype"))
    x_shape = (N, H, W, C) if p["layout"] == "NHWC" else (N, C, H, W)
    w_shape = (K, R, S, C // groups) if p["layout"] == "NHWC" else (K, C // groups, R, S)
    fan_in = R * S * C // groups
    arrays = {"x": normal(rng, x_shape, dtype), "w": normal(rng, w_shape, dtype, 1 / math.sqrt(fan_in)),
              "b": normal(rng, (K,), dtype) if p["bias"] else None}
    if p["bn"] == "scale_shift":
        arrays.update(bn0=normal(rng, (K,), "fp32"), bn1=normal(rng, (K,), "fp32"))
    elif p["bn"] == "batchnorm":
        arrays.update(bn0=normal(rng, (K,), "fp32"), bn1=normal(rng, (K,), "fp32"), bn2=normal(rng, (K,), "fp32"),
                      bn3=(0.5 + rng.random(K)).astype(np.float32))

    def bn_of(a):
        if p["bn"] == "scale_shift":
            return (a["bn0"], a["bn1"])
        if p["bn"] == "batchnorm":
            return (a["bn0"], a["bn1"], a["bn2"], a["bn3"], 1e-5)
        return None

    def call(a, path):
        return conv2d(a["x"], a["w"], a["b"], stride=p["stride"], padding=p["padding"], dilation=p["dilation"],
                      groups=groups, bn=bn_of(a), activation=p["activation"], layout=p["layout"],
                      allow_tf32=p["allow_tf32"], path=path)

    def magnitude(a):
        """conv(|x|, |w|)·|scale| + |shift| (the batch norm folded to (scale, shift) first)."""
        from libnn.ops.conv2d import _epilogue_vectors

        scale, shift = _epilogue_vectors(bn_of(a), a["b"], K, a["x"])
        terms = conv2d(_host_abs(a["x"]), _host_abs(a["w"]), stride=p["stride"], padding=p["padding"],
                       dilation=p["dilation"], groups=groups, layout=p["layout"], path="reference")
        terms = terms.astype(np.float64)
        axis = (1, 1, 1, K) if p["layout"] == "NHWC" else (1, K, 1, 1)
        if scale is not None:
            terms = terms * np.abs(scale).reshape(axis)
        if shift is not None:
            terms = terms + np.abs(shift).reshape(axis)
        return terms

    return Case("conv2d", call, arrays, dtype, tolerance(dtype, p["allow_tf32"]), views={"x": p["x_view"]},
                magnitude=magnitude, approximate_activation=p["activation"] in FP32_APPROXIMATE_ACTIVATIONS)


# --- attention ----------------------------------------------------------------------------------------
@st.composite
def attention_specs(draw, dtypes_=GPU_DTYPES):
    dtype = draw(st.sampled_from(dtypes_))
    B, Hkv, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    Sq, Skv = draw(SMALL), draw(SMALL)
    D = draw(st.one_of(st.sampled_from([8, 16, 32, 40, 64, 72, 128]), st.integers(1, 40)))
    lens = draw(st.sampled_from([None, "q", "kv", "both"]))
    bias = draw(st.sampled_from([None, "key_padding", "relative", "full"]))
    p = dict(B=B, Hq=Hkv * group, Hkv=Hkv, Sq=Sq, Skv=Skv, D=D, dtype=dtype,
             layout=draw(st.sampled_from(["BHSD", "BSHD"])),
             causal=draw(st.sampled_from([False, True, "bottom_right"])), lens=lens, bias=bias,
             scale=draw(st.sampled_from([None, None, 0.5, 0.125])),
             view=draw(st.sampled_from(ROW_VIEWS)), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("attention", p)


def _build_attention(p, rng) -> Case:
    B, Hq, Hkv, Sq, Skv, D, dtype = (p[k] for k in ("B", "Hq", "Hkv", "Sq", "Skv", "D", "dtype"))

    def shape(H, S):
        return (B, H, S, D) if p["layout"] == "BHSD" else (B, S, H, D)

    arrays = {"q": normal(rng, shape(Hq, Sq), dtype), "k": normal(rng, shape(Hkv, Skv), dtype),
              "v": normal(rng, shape(Hkv, Skv), dtype), "seq_lens_q": None, "seq_lens_kv": None, "attn_bias": None}
    if p["lens"] in ("q", "both"):
        arrays["seq_lens_q"] = rng.integers(0, Sq + 1, B).astype(np.int32)
    if p["lens"] in ("kv", "both"):
        arrays["seq_lens_kv"] = rng.integers(0, Skv + 1, B).astype(np.int32)
    bias_shapes = {"key_padding": (B, 1, 1, Skv), "relative": (1, Hq, Sq, Skv), "full": (B, Hq, Sq, Skv)}
    if p["bias"]:
        arrays["attn_bias"] = normal(rng, bias_shapes[p["bias"]], dtype)

    def call(a, path):
        return attention(a["q"], a["k"], a["v"], scale=p["scale"], causal=p["causal"], seq_lens_q=a["seq_lens_q"],
                         seq_lens_kv=a["seq_lens_kv"], attn_bias=a["attn_bias"], layout=p["layout"], path=path)

    def magnitude(a):
        """Σ p_j |v_j|: the weighted values before their signs cancel."""
        return call(dict(a, v=_host_abs(a["v"])), "reference")

    return Case("attention", call, arrays, dtype, tolerance(dtype),
                views={"q": p["view"], "k": p["view"], "v": p["view"]}, magnitude=magnitude)


# --- layer_norm ---------------------------------------------------------------------------------------
@st.composite
def layer_norm_specs(draw, dtypes_=GPU_DTYPES):
    N = draw(st.one_of(SMALL, st.sampled_from([63, 64, 129, 384, 768, 1000, 1024, 1025, 1031, 2048, 4104, 5003])))
    p = dict(lead=draw(st.lists(TINY, min_size=0, max_size=2)), N=N, dtype=draw(st.sampled_from(dtypes_)),
             weight=draw(st.booleans()), bias=draw(st.booleans()), eps=draw(st.sampled_from([1e-5, 1e-12, 0.1])),
             shift=draw(st.sampled_from([0.0, 3.0])), x_view=draw(st.sampled_from(VIEWS)),
             residual=accepts(layer_norm, "residual") and draw(st.booleans()),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("layer_norm", p)


def _build_layer_norm(p, rng) -> Case:
    lead, N, dtype = tuple(p["lead"]), p["N"], p["dtype"]
    x = (rng.standard_normal((*lead, N)) + p["shift"]).astype(dtypes.parse(dtype))  # a mean far from 0 too
    arrays = {"x": x, "weight": normal(rng, (N,), dtype) if p["weight"] else None,
              "bias": normal(rng, (N,), dtype) if p["bias"] else None,
              "residual": normal(rng, (*lead, N), dtype) if p["residual"] else None}

    def call(a, path):
        extra = {} if a["residual"] is None else {"residual": a["residual"]}
        return layer_norm(a["x"], a["weight"], a["bias"], eps=p["eps"], path=path, **extra)

    # cuDNN's fp32 sums keep ~2 ulps less than ours (1.004e-5 seen at 5x1023 on the H100, see
    # test_layer_norm_gpu.py): it gets 2e-5, plus what its statistics lose on a row whose mean is far
    # beyond its spread: its variance is off by up to about fp32's unit roundoff times mean², the
    # one-pass E[h²] - E[h]² bound (our kernels take two passes about a pivot and keep it). On the
    # H100 a 2-element row of mean 4.29 and std 0.0057 (eps 1e-5) came out of cuDNN 4.2e-5 off.
    return Case("layer_norm", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"]},
                path_tolerance={"cudnn": 2e-5 + 2.0**-24 * _mean_over_spread(arrays, p["eps"])}
                if dtype == "fp32" else {})


def _mean_over_spread(arrays, eps: float) -> float:
    """The largest mean² / (var + eps) of a row of h = x (+ residual): how much a variance taken as
    E[h²] - E[h]² in finite precision can lose, relative to what normalizes the row."""
    h = arrays["x"].astype(np.float64) + (0 if arrays["residual"] is None else arrays["residual"].astype(np.float64))
    if h.size == 0:
        return 0.0
    rows = h.reshape(-1, h.shape[-1])
    return float(np.max(rows.mean(axis=1) ** 2 / (rows.var(axis=1) + eps)))


# --- softmax ------------------------------------------------------------------------------------------
@st.composite
def softmax_specs(draw, dtypes_=GPU_DTYPES):
    shape = draw(st.lists(st.one_of(SMALL, st.sampled_from([127, 1000, 1025])), min_size=1, max_size=3)
                 .filter(lambda s: math.prod(s) <= 40000))
    p = dict(shape=shape, dim=draw(st.integers(-len(shape), len(shape) - 1)), log=draw(st.booleans()),
             dtype=draw(st.sampled_from(dtypes_)), scale=draw(st.sampled_from([1.0, 8.0])),
             x_view=draw(st.sampled_from(VIEWS)), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("softmax", p)


def _build_softmax(p, rng) -> Case:
    arrays = {"x": normal(rng, tuple(p["shape"]), p["dtype"], p["scale"])}

    def call(a, path):
        return softmax(a["x"], p["dim"], log=p["log"], path=path)

    return Case("softmax", call, arrays, p["dtype"], tolerance(p["dtype"]), views={"x": p["x_view"]})


# --- pooling ------------------------------------------------------------------------------------------
@st.composite
def pool2d_specs(draw, dtypes_=GPU_DTYPES):
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    p = dict(mode=draw(st.sampled_from(["max", "avg"])), N=draw(st.integers(1, 3)),
             H=draw(st.integers(max(1, kernel[0] - 2 * padding[0]), 13)),
             W=draw(st.integers(max(1, kernel[1] - 2 * padding[1]), 13)), C=draw(SMALL), kernel=kernel,
             stride=draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3)))), padding=padding,
             count_include_pad=draw(st.booleans()), layout=draw(st.sampled_from(["NHWC", "NCHW"])),
             dtype=draw(st.sampled_from(dtypes_)), x_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("pool2d", p)


def _build_pool2d(p, rng) -> Case:
    shape = (p["N"], p["H"], p["W"], p["C"]) if p["layout"] == "NHWC" else (p["N"], p["C"], p["H"], p["W"])
    arrays = {"x": normal(rng, shape, p["dtype"])}

    def call(a, path):
        if p["mode"] == "max":
            return max_pool2d(a["x"], p["kernel"], p["stride"], p["padding"], layout=p["layout"], path=path)
        return avg_pool2d(a["x"], p["kernel"], p["stride"], p["padding"], count_include_pad=p["count_include_pad"],
                          layout=p["layout"], path=path)

    def magnitude(a):
        return call({"x": _host_abs(a["x"])}, "reference")

    return Case("pool2d", call, arrays, p["dtype"], tolerance(p["dtype"]), views={"x": p["x_view"]},
                magnitude=magnitude, exact=p["mode"] == "max")


# --- fft_conv -----------------------------------------------------------------------------------------
@st.composite
def fft_conv_specs(draw, dtypes_=GPU_DTYPES):
    dims = draw(st.sampled_from([1, 2]))
    kernel = tuple(draw(st.integers(1, 7)) for _ in range(dims))
    causal = dims == 1 and draw(st.booleans())
    # causal pads kl-1 on the left itself: mode and padding stay at their defaults
    mode = "valid" if causal else draw(st.sampled_from(["valid", "same", "full"]))
    padding = tuple(draw(st.integers(0, 3)) for _ in range(dims)) if mode == "valid" and not causal else 0
    pad = padding if isinstance(padding, tuple) else (0,) * dims
    least = [1 if mode != "valid" or causal else max(1, k - 2 * q) for k, q in zip(kernel, pad)]
    spatial = tuple(draw(st.integers(lo, 29)) for lo in least)
    p = dict(dims=dims, N=draw(st.integers(1, 2)), C=draw(st.integers(1, 4)), K=draw(st.integers(1, 5)),
             spatial=spatial, kernel=kernel, mode=mode, causal=causal,
             padding=list(padding) if isinstance(padding, tuple) else padding, bias=draw(st.booleans()),
             dtype=draw(st.sampled_from(dtypes_)), x_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("fft_conv", p)


def _build_fft_conv(p, rng) -> Case:
    N, C, K, dtype = p["N"], p["C"], p["K"], p["dtype"]
    fan_in = C * math.prod(p["kernel"])
    arrays = {"x": normal(rng, (N, C, *p["spatial"]), dtype),
              "w": normal(rng, (K, C, *p["kernel"]), dtype, 1 / math.sqrt(fan_in)),
              "b": normal(rng, (K,), dtype) if p["bias"] else None}

    def call(a, path):
        if p["dims"] == 2:
            return fft_conv2d(a["x"], a["w"], a["b"], padding=p["padding"], mode=p["mode"], path=path)
        return fft_conv1d(a["x"], a["w"], a["b"], padding=p["padding"], mode=p["mode"], causal=p["causal"],
                          path=path)

    def magnitude(a):
        return call({k: _host_abs(v) for k, v in a.items()}, "reference")

    longest = max(n + 2 * k for n, k in zip(p["spatial"], p["kernel"]))
    tol = 1e-5 * math.log2(2 * longest) if dtype == "fp32" else tolerance(dtype)
    return Case("fft_conv", call, arrays, dtype, tol, views={"x": p["x_view"]}, magnitude=magnitude)


# --- embedding ----------------------------------------------------------------------------------------
@st.composite
def embedding_specs(draw, dtypes_=GPU_DTYPES):
    lead = draw(st.lists(TINY, min_size=0, max_size=2))
    S = draw(SMALL)
    positions = draw(st.booleans())
    offset = draw(st.integers(0, 3)) if positions else 0
    types = draw(st.sampled_from([None, "table", "ids"]))
    normalize = draw(st.booleans())
    p = dict(shape=[*lead, S], rows=draw(st.one_of(st.just(1), st.integers(2, 50))),
             H=draw(st.one_of(SMALL, st.sampled_from([64, 384, 768, 1000, 1031, 2048]))), dtype=draw(st.sampled_from(dtypes_)),
             ids_dtype=draw(st.sampled_from(["int32", "int64", "int16"])), positions=positions,
             position_rows=offset + S + draw(st.integers(0, 3)) if positions else 0, position_offset=offset,
             types=types, normalize=normalize, norm_weight=normalize and draw(st.booleans()),
             norm_bias=normalize and draw(st.booleans()), eps=draw(st.sampled_from([1e-5, 1e-12])),
             weight_view=draw(st.sampled_from(["contiguous", "offset"])),
             ids_view=draw(st.sampled_from(["contiguous", "strided"])), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("embedding", p)


def _build_embedding(p, rng) -> Case:
    from libnn.ops import embedding

    shape, H, dtype = tuple(p["shape"]), p["H"], p["dtype"]
    arrays = {"ids": rng.integers(0, p["rows"], shape).astype(p["ids_dtype"]), "weight": normal(rng, (p["rows"], H), dtype),
              "position_weight": normal(rng, (p["position_rows"], H), dtype) if p["positions"] else None,
              "type_ids": rng.integers(0, 2, shape).astype(p["ids_dtype"]) if p["types"] == "ids" else None,
              "type_weight": normal(rng, (2, H), dtype) if p["types"] else None,
              "norm_weight": normal(rng, (H,), dtype) if p["norm_weight"] else None,
              "norm_bias": normal(rng, (H,), dtype) if p["norm_bias"] else None}

    def call(a, path):
        return embedding(a["ids"], a["weight"], position_weight=a["position_weight"],
                         position_offset=p["position_offset"], type_ids=a["type_ids"], type_weight=a["type_weight"],
                         norm_weight=a["norm_weight"], norm_bias=a["norm_bias"], eps=p["eps"],
                         normalize=p["normalize"], path=path)

    def magnitude(a):
        """|row| + |position| + |type|: the size of the terms the sum adds (without the norm)."""
        return call({k: v if k in ("ids", "type_ids") else _host_abs(v) for k, v in a.items()}, "reference")

    return Case("embedding", call, arrays, dtype, tolerance(dtype),
                views={"ids": p["ids_view"], "weight": p["weight_view"]},
                magnitude=None if p["normalize"] else magnitude)


# --- rope ---------------------------------------------------------------------------------------------
@st.composite
def rope_specs(draw, dtypes_=GPU_DTYPES):
    D = draw(st.sampled_from([2, 8, 32, 64, 80, 96, 128, 256]))
    packed = draw(st.booleans())
    p = dict(B=1 if packed else draw(TINY), S=draw(SMALL), H=draw(TINY), D=D, packed=packed,
             rotary_dim=draw(st.one_of(st.none(), st.integers(1, D // 2).map(lambda half: 2 * half))),
             style=draw(st.sampled_from(["half", "interleaved"])), dtype=draw(st.sampled_from(dtypes_)),
             position_dtype=draw(st.sampled_from(["int32", "int64"])),
             max_position=draw(st.sampled_from([16, 5000, 100000])), x_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("rope", p)


def _build_rope(p, rng) -> Case:
    from libnn.ops import rope, rope_frequencies

    shape = (p["S"], p["H"], p["D"]) if p["packed"] else (p["B"], p["S"], p["H"], p["D"])
    positions = rng.integers(0, p["max_position"], shape[:1] if p["packed"] else shape[:2]).astype(p["position_dtype"])
    arrays = {"x": normal(rng, shape, p["dtype"]), "positions": positions,
              "inv_freq": rope_frequencies(p["rotary_dim"] or p["D"])}

    def call(a, path):
        return rope(a["x"], a["positions"], a["inv_freq"], style=p["style"], rotary_dim=p["rotary_dim"], path=path)

    return Case("rope", call, arrays, p["dtype"], tolerance(p["dtype"]), views={"x": p["x_view"]})


# --- rms_norm -----------------------------------------------------------------------------------------
@st.composite
def rms_norm_specs(draw, dtypes_=GPU_DTYPES):
    N = draw(st.one_of(SMALL, st.sampled_from([63, 64, 127, 768, 1000, 1024, 1025, 2048, 4096, 5003])))
    p = dict(lead=draw(st.lists(TINY, min_size=0, max_size=2)), N=N, dtype=draw(st.sampled_from(dtypes_)),
             weight=draw(st.booleans()), eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
             shift=draw(st.sampled_from([0.0, 3.0])), x_view=draw(st.sampled_from(VIEWS)),
             residual=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("rms_norm", p)


def _build_rms_norm(p, rng) -> Case:
    from libnn.ops import rms_norm

    lead, N, dtype = tuple(p["lead"]), p["N"], p["dtype"]
    arrays = {"x": (rng.standard_normal((*lead, N)) + p["shift"]).astype(dtypes.parse(dtype)),
              "weight": normal(rng, (N,), dtype) if p["weight"] else None,
              "residual": normal(rng, (*lead, N), dtype) if p["residual"] else None}

    def call(a, path):
        return rms_norm(a["x"], a["weight"], residual=a["residual"], eps=p["eps"], path=path)

    return Case("rms_norm", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"]})


# --- swiglu -------------------------------------------------------------------------------------------
@st.composite
def swiglu_specs(draw, dtypes_=GPU_DTYPES):
    F = draw(st.one_of(SMALL, st.sampled_from([1, 7, 64, 1000, 1031, 2048, 11008])))
    p = dict(lead=draw(st.lists(TINY, min_size=0, max_size=2)), F=F, dtype=draw(st.sampled_from(dtypes_)),
             scale=draw(st.sampled_from([1.0, 4.0, 30.0])), x_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("swiglu", p)


def _build_swiglu(p, rng) -> Case:
    from libnn.ops import swiglu

    lead, F, dtype = tuple(p["lead"]), p["F"], p["dtype"]
    arrays = {"x": normal(rng, (*lead, 2 * F), dtype, p["scale"])}  # scale 30: gates deep in silu's tails

    def call(a, path):
        return swiglu(a["x"], path=path)

    return Case("swiglu", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"]})


# --- argmax -------------------------------------------------------------------------------------------
@st.composite
def argmax_specs(draw, dtypes_=GPU_DTYPES):
    """Rows of odd and vocabulary lengths; values from N(0, 1), or rounded to a few levels (ties: the first
    index wins), with NaNs sprinkled in where `nans` (the first NaN wins); exact on every path."""
    N = draw(st.one_of(SMALL, st.sampled_from([1, 7, 64, 1000, 1031, 32000, 50257])))
    p = dict(lead=draw(st.lists(TINY, min_size=0, max_size=2)), N=N, dtype=draw(st.sampled_from(dtypes_)),
             levels=draw(st.sampled_from([None, 2, 5])), nans=draw(st.booleans()),
             x_view=draw(st.sampled_from(VIEWS)), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("argmax", p)


def _build_argmax(p, rng) -> Case:
    from libnn.ops import argmax

    lead, N, dtype = tuple(p["lead"]), p["N"], p["dtype"]
    x = rng.standard_normal((*lead, N))
    if p["levels"]:
        x = np.round(x * p["levels"]) / p["levels"]
    if p["nans"]:
        x[rng.random(x.shape) < 0.01] = np.nan
    arrays = {"x": x.astype(dtypes.parse(dtype))}

    def call(a, path):
        return argmax(a["x"], path=path)

    return Case("argmax", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"]}, exact=True)


# --- rms_norm_linear ------------------------------------------------------------------------------------
@st.composite
def rms_norm_linear_specs(draw, dtypes_=GPU_DTYPES, one_row=False):
    """rms_norm_linear's problems, with weights in x's dtype or E4M3 codes (x fp16/bf16); `one_row` (M = 1,
    K a multiple of 8, fp16/bf16, no view one element off alignment) narrows them to what the gemv path
    takes."""
    views = ALIGNED_VIEWS if one_row else VIEWS
    K = draw(TINY.map(lambda n: 8 * n) | st.sampled_from([1000, 2048]) if one_row else SMALL)
    dtype = draw(st.sampled_from(("fp16", "bf16") if one_row else dtypes_))
    p = dict(lead=draw(st.lists(st.just(1) if one_row else TINY, min_size=0, max_size=2)), K=K,
             N=draw(SMALL), glu=draw(st.sampled_from([None, "swiglu"])), bias=draw(st.booleans()), dtype=dtype,
             e4m3=dtype in ("fp16", "bf16") and draw(st.booleans()),
             eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])), x_view=draw(st.sampled_from(views)),
             w_view=draw(st.sampled_from(views)), seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("rms_norm_linear", p)


def _build_rms_norm_linear(p, rng) -> Case:
    from libnn.ops import rms_norm_linear

    lead, K, dtype = tuple(p["lead"]), p["K"], p["dtype"]
    N = 2 * p["N"] if p["glu"] else p["N"]
    arrays = {"x": normal(rng, (*lead, K), dtype, 3.0), "norm_weight": normal(rng, (K,), dtype),
              "w": normal(rng, (N, K), dtype, 1 / math.sqrt(K)), "w_scale": None,
              "b": normal(rng, (N,), dtype) if p["bias"] else None}
    if p["e4m3"]:
        from libnn.ops.quantize_fp8 import quantize_weight

        arrays["w"], arrays["w_scale"] = quantize_weight(normal(rng, (N, K), "fp32", 1 / math.sqrt(K)))

    def call(a, path):
        return rms_norm_linear(a["x"], a["norm_weight"], a["w"], a["b"], w_scale=a["w_scale"], eps=p["eps"],
                               glu=p["glu"], path=path)

    return Case("rms_norm_linear", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"], "w": p["w_view"]})


# --- linear_fp8 -------------------------------------------------------------------------------------------
FP8_SIZES = st.one_of(SMALL, st.sampled_from([16, 32, 48, 64]))  # cuBLASLt's FP8 GEMMs take N, K multiples of 16


@st.composite
def linear_fp8_specs(draw):
    from libnn.ops.linear_fp8 import ACTIVATIONS, GPU_DTYPES as FP8_DTYPES

    p = dict(lead=draw(st.lists(SMALL, min_size=0, max_size=2)), N=draw(FP8_SIZES), K=draw(FP8_SIZES),
             dtype=draw(st.sampled_from(FP8_DTYPES)), per_channel=draw(st.booleans()), bias=draw(st.booleans()),
             activation=draw(st.sampled_from(ACTIVATIONS)), residual=draw(st.booleans()),
             x_view=draw(st.sampled_from(VIEWS)), w_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("linear_fp8", p)


def _build_linear_fp8(p, rng) -> Case:
    """x in fp16/bf16, the weight drawn in fp32 and quantised (per channel or per tensor): the op takes its
    E4M3 codes (uint8) and scales (float32), which the reference dequantises as the GPU paths do."""
    from libnn.ops.linear_fp8 import linear_fp8
    from libnn.ops.quantize_fp8 import quantize_weight

    lead, N, K, dtype = tuple(p["lead"]), p["N"], p["K"], p["dtype"]
    weight = quantize_weight(normal(rng, (N, K), "fp32", 1 / math.sqrt(K)), per_channel=p["per_channel"])
    arrays = {"x": normal(rng, (*lead, K), dtype), "w": weight.data, "w_scale": weight.scale,
              "b": normal(rng, (N,), dtype) if p["bias"] else None,
              "residual": normal(rng, (*lead, N), dtype) if p["residual"] else None}

    def call(a, path, activation=p["activation"]):
        return linear_fp8(a["x"], a["w"], a["w_scale"], a["b"], activation, residual=a["residual"], path=path)

    def magnitude(a):  # |x| quantises to x's codes with the sign bit cleared, under the same scale
        absolute = {k: _host_abs(v) for k, v in a.items()} | {"w": a["w"] & 0x7F, "w_scale": a["w_scale"]}
        return call(absolute, "reference", activation=None)

    return Case("linear_fp8", call, arrays, dtype, tolerance(dtype), views={"x": p["x_view"], "w": p["w_view"]},
                magnitude=magnitude)


# --- kv_append ----------------------------------------------------------------------------------------
@st.composite
def kv_append_specs(draw, dtypes_=GPU_DTYPES):
    D = draw(st.sampled_from([2, 8, 32, 64, 80, 128]))
    S = draw(SMALL)
    p = dict(B=draw(TINY), S=S, H=draw(TINY), D=D, L=S + draw(st.integers(0, 40)),
             rotary_dim=draw(st.one_of(st.none(), st.integers(1, D // 2).map(lambda half: 2 * half))),
             style=draw(st.sampled_from(["half", "interleaved"])), dtype=draw(st.sampled_from(dtypes_)),
             position_dtype=draw(st.sampled_from(["int32", "int64"])), k_view=draw(st.sampled_from(VIEWS)),
             seed=draw(st.integers(0, 2**32 - 1)))
    return Spec("kv_append", p)


def _build_kv_append(p, rng) -> Case:
    """The output is both caches after the append, side by side (their bits, so that CuPy, which has no
    bf16 kernels, can join them): written positions and untouched ones are compared alike."""
    from libnn.ops import kv_append, rope_frequencies

    B, S, H, D, L, dtype = p["B"], p["S"], p["H"], p["D"], p["L"], p["dtype"]
    positions = (rng.integers(0, L - S + 1, (B, 1)) + np.arange(S)).astype(p["position_dtype"])
    arrays = {"k": normal(rng, (B, S, H, D), dtype), "v": normal(rng, (B, S, H, D), dtype), "positions": positions,
              "inv_freq": rope_frequencies(p["rotary_dim"] or D), "k_cache": normal(rng, (B, L, H, D), dtype),
              "v_cache": normal(rng, (B, L, H, D), dtype)}

    def call(a, path):
        k_cache, v_cache = a["k_cache"].copy(), a["v_cache"].copy()
        kv_append(a["k"], a["v"], a["positions"], a["inv_freq"], k_cache, v_cache, style=p["style"],
                  rotary_dim=p["rotary_dim"], path=path)
        bits = f"u{k_cache.itemsize}"
        xp = np if isinstance(k_cache, np.ndarray) else __import__("cupy")
        return xp.concatenate([k_cache.view(bits), v_cache.view(bits)]).view(k_cache.dtype)

    return Case("kv_append", call, arrays, dtype, tolerance(dtype), views={"k": p["k_view"]})


STRATEGIES = {"linear": linear_specs, "conv2d": conv2d_specs, "attention": attention_specs,
              "layer_norm": layer_norm_specs, "softmax": softmax_specs, "pool2d": pool2d_specs,
              "fft_conv": fft_conv_specs, "embedding": embedding_specs, "rope": rope_specs,
              "rms_norm": rms_norm_specs, "swiglu": swiglu_specs, "linear_fp8": linear_fp8_specs,
              "kv_append": kv_append_specs, "rms_norm_linear": rms_norm_linear_specs, "argmax": argmax_specs}
# Paths that take a narrow slice of their op's problems draw from that slice: linear's cutlass path runs
# gelu_erf alone, fp16/bf16, N and K multiples of 8 (about 1 in 250 of linear_specs' draws); the gemv
# paths one row, fp16/bf16, K a multiple of 8, arrays 16-byte aligned (the misaligned fallback has its tests
# in test_rms_norm_linear_gpu.py).
PATH_STRATEGIES = {("linear", "cutlass"): lambda: linear_specs(dtypes_=("fp16", "bf16"), activations=("gelu_erf",),
                                                               aligned=True),
                   ("linear", "gemv"): lambda: linear_specs(dtypes_=("fp16", "bf16"), aligned=True, one_row=True,
                                                            views=ALIGNED_VIEWS),
                   ("rms_norm_linear", "gemv"): lambda: rms_norm_linear_specs(one_row=True)}


def strategy_for(op: str, path: str):
    """The strategy drawing `op`'s problems for `path`."""
    return PATH_STRATEGIES.get((op, path), STRATEGIES[op])()


_BUILDERS = {"linear": _build_linear, "conv2d": _build_conv2d, "attention": _build_attention,
             "layer_norm": _build_layer_norm, "softmax": _build_softmax, "pool2d": _build_pool2d,
             "fft_conv": _build_fft_conv, "embedding": _build_embedding, "rope": _build_rope,
             "rms_norm": _build_rms_norm, "swiglu": _build_swiglu, "linear_fp8": _build_linear_fp8,
             "kv_append": _build_kv_append, "rms_norm_linear": _build_rms_norm_linear, "argmax": _build_argmax}


def build(spec: Spec, base_seed: int) -> Case:
    """The inputs of `spec`, drawn from the run's base seed and the spec's own seed."""
    return _BUILDERS[spec.op](spec.params, np.random.default_rng([base_seed, spec.params["seed"]]))


# --- device placement ---------------------------------------------------------------------------------
def _same_bits(a):
    """A view of `a` as unsigned integers of its itemsize: copies move bits, whatever the dtype (bf16)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" else a


def to_device(a, view: str = "contiguous"):
    """`a` (host) on the GPU laid out as `view` says: "contiguous"; "strided" (every other element of a
    twice-as-wide buffer along the last axis); "offset" (one element past a 256-byte aligned start:
    misaligned for 16-byte loads); "padded_rows" (the last axis contiguous, rows 8 elements apart
    more than its length, as in a packed QKV projection)."""
    import cupy

    if a is None:
        return None
    if view == "contiguous" or a.ndim == 0 or a.size == 0:
        return cupy.asarray(a)
    if view == "strided":
        base = cupy.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
        out = base[..., ::2]
    elif view == "offset":
        out = cupy.zeros(a.size + 1, a.dtype)[1:].reshape(a.shape)
    elif view == "padded_rows":
        out = cupy.zeros((*a.shape[:-1], a.shape[-1] + 8), a.dtype)[..., :a.shape[-1]]
    else:
        raise ValueError(f"to_device: unknown view {view!r}")
    _same_bits(out)[...] = cupy.asarray(_same_bits(np.ascontiguousarray(a)))
    return out


def on_device(case: Case) -> dict:
    return {name: to_device(a, case.views.get(name, "contiguous")) for name, a in case.arrays.items()}
