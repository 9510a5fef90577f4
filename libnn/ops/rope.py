"""rope: rotary position embedding of q or k, the decoder's position encoding, and `rope_frequencies`, its
frequencies as Hugging Face computes them.

x is (B, S, H, D), the layout of q or k after the QKV projection (heads contiguous), or packed tokens
(T, H, D); positions is (B, S) (or (T,)), int32 or int64, each token's absolute position, so a batch
holds sequences at different offsets (a decode step gives each sequence its own position); inv_freq
is (rotary_dim / 2,) float32. For pair i of a head's first rotary_dim elements:

    angle    = float32(position) * inv_freq[i]       in fp32, one rounding: what Hugging Face computes
    (j0, j1) = (i, i + rotary_dim / 2)    style="half": Hugging Face LLaMA / GPT-NeoX, `rotate_half`
               (2 i, 2 i + 1)             style="interleaved": GPT-J, Meta's original (complex) form
    y[j0] = x[j0] cos(angle) - x[j1] sin(angle),   y[j1] = x[j1] cos(angle) + x[j0] sin(angle)

and y[d] = x[d] for d >= rotary_dim (GPT-NeoX's partial rotary; rotary_dim defaults to D). y has x's
shape, dtype and device; `out=` writes it into a given array instead (x's shape and dtype), and
`out=x` rotates x in place, at no extra cost (every element is read and written by one thread, its
pair read before it is written). `out` must be x itself (same data pointer and strides) or not
overlap it at all; that is checked at every call, from the pointers.

Precision. The angle is an fp32 product of the position's fp32 value and inv_freq, as in Hugging
Face (`inv_freq @ position_ids.float()`): positions up to 2^24 are exact in fp32, larger ones round
to the nearest fp32, and at position p the angle carries an absolute rounding error of up to
p · 2^-24 radians (6e-3 at p = 10^5), which every path shares because it is part of the function:
the reference computes the same fp32 angle, then cos and sin in float64. The custom kernel's sincosf is
accurate to a few ulp at any angle (not the __sincosf intrinsic, whose error grows outside [-pi, pi]);
its rotation is fp32 and rounded once to x's dtype, where Hugging Face rounds cos, sin and each
product to it, so fp16/bf16 results differ from Hugging Face's by their dtype's rounding.

Paths, in `auto` order (there is no library path: neither cuDNN's frontend nor cuBLASLt has a
rotary-embedding op):
- custom:    kernels/rope.cu, one thread per rotation pair (and per pass-through element), fp16,
             bf16, fp32 I/O with fp32 math, positions int32 or int64 read as they are. Strides are
             taken as they come where the last dimension is contiguous: the q and k slices of one
             packed QKV projection, or a window of a KV cache as `out`, run without a copy, and
             positions may be a broadcast view. An x whose last dimension is strided is copied to a
             contiguous one first (one more pass); such an `out` is declined (nothing could be
             written back without another pass), and a non-contiguous inv_freq is copied (it is small).
- reference: NumPy in float64 from the fp32 angle, rounded to x's dtype once at the end (fp64 too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn import dtypes
from libnn.registry import Op, option_key
from libnn.runtime import contracts, launch, memory
from libnn.runtime.arrays import allocator, as_array, data_pointer, device_of, signature, stream_key

GPU_DTYPES = ("fp16", "bf16", "fp32")
STYLES = ("half", "interleaved")
POSITION_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
SCALING_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

op = Op("rope", order=("custom", "reference"))


@dataclass(frozen=True)
class RopeProblem:
    """Everything that decides how a rope call runs."""
    B: int                 # sequences (1 for packed tokens)
    S: int                 # positions per sequence (T for packed tokens)
    H: int                 # heads
    D: int                 # head dimension
    packed: bool           # x is (T, H, D)
    rotary_dim: int        # the first rotary_dim elements of a head rotate, the rest pass through
    style: str             # "half" or "interleaved"
    dtype: str             # x's short dtype name
    position_dtype: str    # "int32" or "int64"
    has_out: bool          # written into a given array (no allocation)
    out_rows_contiguous: bool  # out's last dimension is contiguous (True without out)
    device: str            # "cpu" or "gpu:N"

    @property
    def shape(self) -> tuple[int, ...]:
        """x's shape."""
        return (self.S, self.H, self.D) if self.packed else (self.B, self.S, self.H, self.D)

    def describe(self) -> str:
        dims = f"(T={self.S}, H={self.H}, D={self.D})" if self.packed else \
            f"(B={self.B}, S={self.S}, H={self.H}, D={self.D})"
        partial = f" rotary_dim={self.rotary_dim}" if self.rotary_dim != self.D else ""
        return f"rope {self.style} x {dims}{partial} {self.dtype}, positions {self.position_dtype}"

    @property
    def output_bytes(self) -> int:
        """What a GPU path allocates: y, or nothing when it writes into `out`."""
        return 0 if self.has_out else memory.array_bytes(self.shape, dtypes.parse(self.dtype))

    @property
    def bytes_moved(self) -> int:
        """x read and y written once (positions and inv_freq are small next to them)."""
        return 2 * memory.array_bytes(self.shape, dtypes.parse(self.dtype))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether an array's elements may share bytes: dimensions sorted by |stride|, each must step over
    everything the dimensions inside it span (a sufficient test; a broadcast view fails it)."""
    span = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if stride < span:
            return True
        span += (n - 1) * stride
    return False


def rotary_dim_of(name: str, arg: str, D: int, inv_freq: Any, style: Any, rotary_dim: Any) -> int:
    """The checks of inv_freq, style and rotary_dim that rope and kv_append share, for a head dimension
    D of the array `arg`; the rotary_dim R they give (D by default)."""
    if inv_freq.dtype != np.float32 or inv_freq.ndim != 1:
        raise TypeError(f"{name}: inv_freq must be a 1-D float32 array (rotary_dim / 2 frequencies, e.g. from "
                        f"rope_frequencies), got a {inv_freq.ndim}-D {dtypes.short_name(inv_freq.dtype)} array")
    if not isinstance(style, str) or style not in STYLES:
        raise ValueError(f"{name}: style must be 'half' (Hugging Face LLaMA / GPT-NeoX) or 'interleaved' "
                         f"(GPT-J, Meta's original), got {style!r}")
    if rotary_dim is None:
        if D % 2 or D < 2:
            raise ValueError(f"{name}: rotary_dim defaults to {arg}'s head dimension D = {D}, which is "
                             f"{'odd' if D % 2 else 'below 2'}; pass an even rotary_dim in [2, D] (the elements "
                             "past it pass through)")
        R = D
    elif not _is_int(rotary_dim):
        raise TypeError(f"{name}: rotary_dim must be an int or None, got {type(rotary_dim).__name__} {rotary_dim!r}")
    elif rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"{name}: rotary_dim must be even and in [2, D] for {arg}'s head dimension D = {D}, "
                         f"got {rotary_dim}")
    else:
        R = int(rotary_dim)
    if tuple(inv_freq.shape) != (R // 2,):
        hint = "" if rotary_dim is not None or 2 * inv_freq.shape[0] > D else \
            f" (for partial rotary, pass rotary_dim={2 * inv_freq.shape[0]})"
        raise ValueError(f"{name}: inv_freq must have rotary_dim / 2 = {R // 2} frequencies (rotary_dim {R}), "
                         f"got shape {tuple(inv_freq.shape)}{hint}")
    return R


def rope_problem(x, positions, inv_freq, style, rotary_dim, out) -> RopeProblem:
    if x.ndim not in (3, 4):
        raise ValueError(f"rope: x must be (B, S, H, D) or packed tokens (T, H, D), got shape {tuple(x.shape)}")
    if not dtypes.is_float(x.dtype):
        raise TypeError(f"rope: x must be a floating-point array (fp16, bf16, fp32, fp64), got {x.dtype}")
    packed = x.ndim == 3
    expected = tuple(x.shape[:1] if packed else x.shape[:2])
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"rope: positions must be an int32 or int64 array, got dtype {positions.dtype}")
    if tuple(positions.shape) != expected:
        what = "(T,) for packed tokens x (T, H, D)" if packed else "(B, S) for x (B, S, H, D)"
        raise ValueError(f"rope: positions must have shape {expected}, {what} of shape {tuple(x.shape)}; "
                         f"got {tuple(positions.shape)}")
    R = rotary_dim_of("rope", "x", x.shape[-1], inv_freq, style, rotary_dim)
    if out is not None:
        if tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"rope: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"rope: out has dtype {dtypes.short_name(out.dtype)} but x has "
                            f"{dtypes.short_name(x.dtype)}; the result is written in x's dtype")
        if overlaps_itself(tuple(out.shape), tuple(out.strides), out.itemsize):
            raise ValueError(f"rope: out must not overlap itself (a broadcast view): shape {tuple(out.shape)}, "
                             f"strides {tuple(out.strides)} bytes")
    device = device_of({"x": x, "positions": positions, "inv_freq": inv_freq, "out": out}, "rope")
    B, S = (1, x.shape[0]) if packed else x.shape[:2]
    return RopeProblem(B=B, S=S, H=x.shape[-2], D=x.shape[-1], packed=packed, rotary_dim=R, style=style,
                       dtype=dtypes.short_name(x.dtype), position_dtype=positions.dtype.name,
                       has_out=out is not None,
                       out_rows_contiguous=out is None or _kernel_layout(out, packed) is not None, device=device)


def rope(x: Any, positions: Any, inv_freq: Any, *, style: str = "half", rotary_dim: int | None = None,
         out: Any = None, path: str = "auto") -> Any:
    """Rotary position embedding of x (B, S, H, D) or packed tokens (T, H, D) at `positions` (B, S) or
    (T,), int32/int64, with `inv_freq` (rotary_dim / 2,) float32 (see `rope_frequencies`); style "half"
    (Hugging Face LLaMA, GPT-NeoX) or "interleaved" (GPT-J, Meta); elements past `rotary_dim` (default:
    D) pass through. Returns a new array of x's shape, dtype and device, or writes into `out` and
    returns it (`out=x`: in place). `path` is "auto" or one of `libnn.paths("rope")`."""
    x = as_array(x, "rope", "x")
    positions = as_array(positions, "rope", "positions")
    inv_freq = as_array(inv_freq, "rope", "inv_freq")
    out = None if out is None else as_array(out, "rope", "out")
    key = (signature(x), signature(positions), signature(inv_freq), signature(out), option_key(style),
           option_key(rotary_dim), path, stream_key())
    return op.call(key, lambda: rope_problem(x, positions, inv_freq, style, rotary_dim, out), path,
                   x, positions, inv_freq, out)


# --- frequencies ---------------------------------------------------------------------------------------
def _positive(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not value > 0:
        raise ValueError(f"rope_frequencies: {name} must be a finite number > 0, got {value!r}")
    return float(value)


# Bytes per frequency rope_frequencies holds at once, at most: the int64 exponents, and float32 arrays
# (llama3's wavelengths, scaled, smooth, smoothed, the masks and the result) up to eight of them.
FREQUENCY_BYTES = 8 + 8 * 4


def rope_frequencies(rotary_dim: int, theta: float = 10000.0, scaling: Mapping | None = None) -> np.ndarray:
    """inv_freq, (rotary_dim / 2,) float32: theta^(-2i / rotary_dim), as Hugging Face transformers'
    `_compute_default_rope_parameters` computes it, then rescaled by `scaling`, a config's
    `rope_scaling` dict: None (or type "default") for none, type "linear" (every frequency divided by
    `factor`), or type "llama3" (Llama 3.1's: wavelengths above original_max_position_embeddings /
    low_freq_factor divided by `factor`, those below original_max_position_embeddings /
    high_freq_factor kept, a smooth blend between). The type is read from "rope_type", or "type" as
    older configs name it; any other type is refused by name.

    Every step is the one transformers takes, in float32, in its order, including torch's
    `scalar / tensor` as a reciprocal times the scalar: results agree with transformers' CPU values
    to within torch's float32 pow (1 ulp), bit for bit where that agrees."""
    if not _is_int(rotary_dim) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rope_frequencies: rotary_dim must be an even int >= 2, got {rotary_dim!r}")
    theta = _positive("theta", theta)
    memory.require(FREQUENCY_BYTES * (rotary_dim // 2), "cpu", "rope_frequencies",
                   f"rotary_dim={rotary_dim} ({rotary_dim // 2} frequencies and their temporaries)")
    f32 = np.float32
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(f32) / f32(rotary_dim)
    inv_freq = f32(1) / (f32(theta) ** exponent)  # torch's 1.0 / t is t.reciprocal() * 1.0: the same bits
    if scaling is None:
        return inv_freq
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope_frequencies: scaling must be None or a rope_scaling dict, got "
                        f"{type(scaling).__name__} {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SCALING_TYPES:
        raise ValueError(f"rope_frequencies: rope_scaling type {kind!r} is not supported (supported: "
                         f"{', '.join(map(repr, SCALING_TYPES))}); the scaling dict was {dict(scaling)!r}")
    if kind == "default":
        return inv_freq
    needed = ("factor",) if kind == "linear" else LLAMA3_KEYS
    if missing := [k for k in needed if k not in scaling]:
        raise ValueError(f"rope_frequencies: rope_scaling of type {kind!r} needs {', '.join(needed)}; "
                         f"missing {', '.join(missing)}")
    factor = _positive("rope_scaling's factor", scaling["factor"])
    if kind == "linear":
        return inv_freq / f32(factor)
    low = _positive("rope_scaling's low_freq_factor", scaling["low_freq_factor"])
    high = _positive("rope_scaling's high_freq_factor", scaling["high_freq_factor"])
    old = _positive("rope_scaling's original_max_position_embeddings", scaling["original_max_position_embeddings"])
    if not high > low:
        raise ValueError(f"rope_frequencies: rope_scaling's high_freq_factor ({high:g}) must be greater than its "
                         f"low_freq_factor ({low:g})")
    low_freq_wavelen, high_freq_wavelen = f32(old / low), f32(old / high)
    wavelen = (f32(1) / inv_freq) * f32(2 * math.pi)  # transformers: 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / f32(factor), inv_freq)
    smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
    smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


# --- checks shared by the paths -------------------------------------------------------------------------
def _span(a) -> tuple[int, int] | None:
    """[lo, hi): the bytes a's elements cover, as offsets from its first element (None: no element)."""
    if 0 in a.shape:
        return None
    lo = sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s < 0)
    return lo, sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s > 0) + a.itemsize


def overlap_check(x, out):
    """check(x_pointer, out_pointer) for arrays of these shapes and strides: raises unless out is x
    itself (same pointer and strides: in place) or shares no byte with it. None where nothing can
    overlap (no out, or an empty array)."""
    if out is None or (x_span := _span(x)) is None or (out_span := _span(out)) is None:
        return None
    same_layout = tuple(x.strides) == tuple(out.strides)
    (x_lo, x_hi), (o_lo, o_hi) = x_span, out_span

    def check(x_pointer: int, out_pointer: int) -> None:
        if out_pointer == x_pointer and same_layout:
            return
        if x_pointer + x_lo < out_pointer + o_hi and out_pointer + o_lo < x_pointer + x_hi:
            raise ValueError("rope: out overlaps x without being x itself (the same data pointer and strides); "
                             "pass out=x to rotate in place, or an array that shares no memory with x")
    return check


# --- custom path: kernels/rope.cu ------------------------------------------------------------------------
_ROPE = contracts.params("rope.cu", "ROPE_PARAMS")  # every rope kernel's parameters
ROPE_THREADS = contracts.constant("rope.cu", "ROPE_THREADS")
ROPE_MAX_BX = contracts.constant("rope.cu", "ROPE_MAX_BX")
_POSITION_SUFFIX = {"int32": "i32", "int64": "i64"}


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def custom_launch(problem: RopeProblem) -> tuple[str, tuple[int, int, int], tuple[int, int]]:
    """(kernel name, grid, block) from kernels/rope.cu's LAUNCH table."""
    items = problem.rotary_dim // 2 + problem.D - problem.rotary_dim
    bx = min(ROPE_MAX_BX, max(32, _pow2_at_least(items)))
    by = min(ROPE_THREADS // bx, _pow2_at_least(problem.S))
    cap = launch.GRID_STRIDE_BLOCKS
    grid = (min(-(-problem.S // by), cap), min(problem.H, cap), min(problem.B, cap))
    name = f"rope1_pairs_{dtypes.KERNEL_SUFFIX[problem.dtype]}_{_POSITION_SUFFIX[problem.position_dtype]}"
    return name, grid, (bx, by)


def _element_strides(a, packed: bool) -> tuple[int, ...] | None:
    """a's strides in elements as (B, S, H, D) (packed: B's stride 0), or None where a byte stride is
    not a whole number of elements."""
    strides = tuple(a.strides)
    if any(s % a.itemsize for s in strides):
        return None
    elements = tuple(s // a.itemsize for s in strides)
    return (0, *elements) if packed else elements


def _kernel_layout(a, packed: bool) -> tuple[int, ...] | None:
    """a's (B, S, H) element strides where the kernel can address it as it is (last dimension
    contiguous), else None."""
    strides = _element_strides(a, packed)
    return strides[:3] if strides is not None and strides[3] == 1 else None


def custom_args(problem: RopeProblem, x_strides, y_strides, position_strides) -> tuple:
    """The launch's arguments, arrays as launch.ARRAY: x, positions, inv_freq, y in that order."""
    A = launch.ARRAY
    (xb, xs, xh), (yb, ys, yh), (pb, ps) = x_strides, y_strides, position_strides
    return _ROPE.pack(x=A, positions=A, inv_freq=A, y=A, B=problem.B, S=problem.S, H=problem.H, D=problem.D,
                      R=problem.rotary_dim, xb=xb, xs=xs, xh=xh, yb=yb, ys=ys, yh=yh, pb=pb, ps=ps,
                      interleaved=problem.style == "interleaved")


def _custom_support(problem: RopeProblem) -> str | None:
    if problem.dtype not in GPU_DTYPES:
        return f"dtype {problem.dtype} is not supported (supported: {', '.join(GPU_DTYPES)})"
    if not problem.out_rows_contiguous:
        return "out's last dimension is not contiguous (the kernel writes rows of D elements; pass such an out, " \
               "or none)"
    return None


def _contiguous_strides(shape: tuple[int, ...], packed: bool) -> tuple[int, ...]:
    """The element strides of a C-contiguous array of `shape`, as _element_strides gives them."""
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return (0, *strides) if packed else strides


def bind_custom(problem: RopeProblem, x, positions, inv_freq, out, geometry=None):
    """The runner of kernels/rope.cu for arrays of this signature: y from CuPy's pool (or `out`), one
    packed launch; copies only of what the kernel cannot address (see the module docstring).
    `geometry`, (grid, block), replaces the LAUNCH table's (tests: the kernel strides over tokens,
    heads, sequences and a row's items, so any grid >= 1 and block up to ROPE_THREADS is correct)."""
    import cupy

    shape, dtype = problem.shape, x.dtype
    new = allocator(shape, dtype)
    if problem.B * problem.S * problem.H == 0:  # nothing to rotate
        return lambda x, positions, inv_freq, out: new() if out is None else out
    check = overlap_check(x, out)
    contiguous = _contiguous_strides(shape, problem.packed)[:3]
    x_strides = _kernel_layout(x, problem.packed)
    copy_x = x_strides is None
    y_strides = contiguous if out is None else _kernel_layout(out, problem.packed)
    position_strides = _element_strides(positions, problem.packed)
    copy_positions = position_strides is None
    if copy_positions:
        position_strides = _contiguous_strides(tuple(positions.shape), problem.packed)
    copy_freq = not inv_freq.flags.c_contiguous
    name, grid, block = custom_launch(problem)
    grid, block = geometry or (grid, block)
    kernel = launch.bind("rope.cu", name, grid, block,
                         custom_args(problem, contiguous if copy_x else x_strides, y_strides, position_strides),
                         programmatic=launch.programmatic_supported(problem.device))

    def run(x, positions, inv_freq, out):
        if out is None:
            y = new()
        else:
            if check is not None:
                check(x.data.ptr, out.data.ptr)
            y = out
        kernel(cupy.ascontiguousarray(x) if copy_x else x,
               cupy.ascontiguousarray(positions) if copy_positions else positions,
               cupy.ascontiguousarray(inv_freq) if copy_freq else inv_freq, y)
        return y
    return run


op.path("custom", kind="custom", device="gpu", supports=_custom_support, binds=True)(bind_custom)


# --- reference -----------------------------------------------------------------------------------------
REFERENCE_COPIES = 3  # float64 arrays of x's size alive at once: x's copy and the two rotated halves


def pair_slices(style: str, rotary_dim: int) -> tuple[slice, slice]:
    """The (j0, j1) elements of every rotation pair, in pair order."""
    half = rotary_dim // 2
    return (slice(0, half), slice(half, rotary_dim)) if style == "half" else \
        (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2))


@op.path("reference", kind="reference", device="cpu")
def _reference(problem: RopeProblem, x, positions, inv_freq, out):
    if (check := overlap_check(x, out)) is not None:
        check(data_pointer(x), data_pointer(out))
    memory.require(REFERENCE_COPIES * x.size * 8, "cpu", "rope",
                   f"x of shape {problem.shape} in float64 (a copy and {REFERENCE_COPIES - 1} temporaries of its size)")
    angle = positions.astype(np.float32)[..., None] * inv_freq  # the fp32 product, rounded once
    angle = angle.astype(np.float64)[..., None, :]              # (..., 1, rotary_dim / 2): every head
    cos, sin = np.cos(angle), np.sin(angle)
    y = x.astype(np.float64)
    j0, j1 = pair_slices(problem.style, problem.rotary_dim)
    a, b = y[..., j0], y[..., j1]
    y[..., j0], y[..., j1] = a * cos - b * sin, b * cos + a * sin
    y = y.astype(x.dtype, copy=False)
    if out is None:
        return y
    out[...] = y
    return out
