"""The layer base class: named parameters, state_dict with PyTorch's key names, and device/dtype
moves. Inference only: there are no gradients and no training mode.

Every module has a `version` that changes whenever a parameter of it or of any module below it is
registered or replaced (register_parameter, load_state_dict, to(), `layer.weight = new`), a child
module is added, replaced or removed, or a setting (a public attribute that is neither: a conv's
stride, a norm's eps, a layer's path or activation) is set to a new value after the module was built.
Modules know their parents (weakly), so a change is pushed up to every ancestor at the time it
happens, through every parent of a module shared by several; reading a model's version is then one
attribute read, which is what CUDA graphs (libnn.nn.graphs) and Sequential's fusion plan check on each
call instead of walking the parameters. Changes made in place (`layer.weight[...] = v`) keep the
version: they keep the arrays, and so the addresses.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import numpy as np

from libnn import dtypes, registry
from libnn.nn import checks, weights
from libnn.nn.graphs import GraphedModule
from libnn.ops.quantize_fp8 import check_quantize
from libnn.runtime.arrays import as_array, is_cupy


def _same_setting(old: Any, new: Any) -> bool:
    """Whether a setting keeps its value: the same object, or equal values (arrays count as changed
    unless the same object: their == is elementwise)."""
    if old is new:
        return True
    if hasattr(old, "shape") or hasattr(new, "shape"):
        return False
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - a value whose == cannot be read as one bool is a new setting
        return False


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_parents", weakref.WeakSet())  # weak: a parent's life is its own business
        object.__setattr__(self, "_version", 0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._parameters:  # `layer.weight = new` replaces the parameter, as in PyTorch
            self.register_parameter(name, value)
            return
        # A setting set again to a new value: what was made from the old one (a Sequential's fusion and
        # folded weights, a CUDA graph's capture, which bakes eps and strides into its kernels) must
        # be made again. Private attributes are caches; a first assignment is the constructor's.
        resets = (not name.startswith("_") and name in self.__dict__ and name not in self._children
                  and not isinstance(value, Module) and not _same_setting(self.__dict__[name], value))
        old = self._children.get(name)
        if isinstance(value, Module):
            self._children[name] = value
            value._parents.add(self)
        elif old is not None:  # `model.pooler = None` removes the child
            del self._children[name]
        object.__setattr__(self, name, value)
        if old is not value and (old is not None or isinstance(value, Module)):
            if old is not None and not any(c is old for c in self._children.values()):
                old._parents.discard(self)
            self._bump()
        elif resets:
            self._bump()

    @property
    def version(self) -> int:
        """Changes whenever a parameter of this module or of a module below it is registered or
        replaced, or a child module is added, replaced or removed (see the module docstring)."""
        return self._version

    def _bump(self) -> None:
        """A new version for this module and every module above it, each once (a module shared by two
        parents reaches a common ancestor twice)."""
        seen: set[int] = set()
        pending = [self]
        while pending:
            module = pending.pop()
            if id(module) not in seen:
                seen.add(id(module))
                object.__setattr__(module, "_version", module._version + 1)
                pending.extend(module._parents)

    def register_parameter(self, name: str, value: Any) -> None:
        if name in self._parameters and self._parameters[name] is value:
            return  # the same array again (to("gpu") of a GPU array): nothing a capture baked in changed
        self._parameters[name] = value
        object.__setattr__(self, name, value)
        self._bump()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for name, value in self._parameters.items():
            if value is not None:
                yield prefix + name, value
        for child_name, child in self._children.items():
            yield from child.named_parameters(f"{prefix}{child_name}.")

    def state_dict(self) -> dict[str, Any]:
        return dict(self.named_parameters())

    def load_state_dict(self, state: dict[str, Any], *, assign: bool = False) -> None:
        """Replace every parameter with a copy of the array `state` holds under its key (the caller may
        change theirs later), or with `assign=True` (PyTorch's name) with the array itself where its
        device and dtype are the layer's: for a caller that hands its arrays over, as a loader reading a
        file does. Checks all keys, dtypes and shapes first, so a failed load changes nothing."""
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: state must be a dict of arrays by key, got {type(state).__name__}")
        copy = not checks.flag(where, "assign", assign)
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
        converted = {}
        for key, value in state.items():
            value = as_array(value, where, key)
            if not _is_real(value.dtype):  # complex would lose its imaginary part, strings and objects fail in astype
                raise TypeError(f"{where}: {key} has dtype {value.dtype}; parameters take real numbers (bool, int, "
                                "float)")
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(f"{where}: {key} has shape {tuple(value.shape)}, the layer expects "
                                 f"{tuple(own[key].shape)}")
            if own[key].dtype.kind in "iu" and value.dtype.kind not in "iu":
                # a quantised layer's codes (FP8 in uint8): floats cast to them would be rounded to integers
                raise TypeError(f"{where}: {key} holds {own[key].dtype} codes (a quantised layer) but the state "
                                f"has {value.dtype} values; load float weights before quantize(), or the state of "
                                "a model quantised the same way")
            # the layer's own array again (a state_dict() round trip) is kept: nothing to copy, and the
            # version (what CUDA graphs check) stays
            converted[key] = value if value is own[key] else _like(value, own[key], copy)
        for key, value in converted.items():
            owner, name = self._owner_of(key)
            owner.register_parameter(name, value)

    def load(self, path: Any) -> "Module":
        """Load a .safetensors or .npz file (see libnn.nn.weights); on any error the model is unchanged."""
        self.load_state_dict(weights.read(path))
        return self

    def save(self, path: Any) -> None:
        weights.write(path, self.state_dict())

    def _owner_of(self, key: str) -> tuple["Module", str]:
        *path, name = key.split(".")
        module = self
        for part in path:
            module = module._children[part]
        return module, name

    def to(self, target: Any) -> "Module":
        """Move every parameter to "cpu" / "gpu" ("cuda"), or cast it to a floating-point dtype
        ("fp16", np.float32...)."""
        where = f"{type(self).__name__}.to"
        if isinstance(target, str) and target in checks.DEVICES:
            checks.device(where, target)
        else:
            target = _target_dtype(where, target)
        for key, value in list(self.named_parameters()):
            owner, name = self._owner_of(key)
            if isinstance(target, str) or not owner.keeps_dtype(name):
                owner.register_parameter(name, _moved(value, target))
        return self

    def keeps_dtype(self, name: str) -> bool:
        """Whether parameter `name` keeps its dtype when the module is cast (`to(dtype)`): a quantised
        layer's codes and scales do (nn.Linear after quantize()); every other parameter is cast."""
        return False

    def quantize(self, dtype: str = "fp8", *, per_channel: bool = True) -> "Module":
        """Quantise in place the weights of every layer below this module that can hold them in `dtype`,
        and return the module. "fp8": E4M3 codes with float32 scales, one per output channel
        (`per_channel`, the default: the more accurate, and layers whose weights are stacked along their
        outputs stay exact) or one per weight (libnn.ops.quantize_fp8); those layers' GEMMs then run
        linear_fp8, which needs a GPU of compute capability 8.9 or newer (or the CPU's reference path).
        A GPU below that is refused here, before anything changes. Layers already quantised are left as
        they are; biases, norms and embeddings keep their dtype. nn.Linear is the layer that quantises:
        a module that stacks its Linear children's weights into one GEMM does it with
        nn.linear.stack_linear, which stacks their codes and scales (BERT's query, key and value); a
        weight a module holds as its own parameter, not in an nn.Linear, keeps its dtype and its float
        GEMM (nn.MultiheadAttention's in_proj_weight)."""
        check_quantize(f"{type(self).__name__}.quantize", dtype, per_channel,
                       [a for _, a in self.named_parameters()])
        for child in list(self._children.values()):
            child.quantize(dtype, per_channel=per_channel)
        return self

    def use_path(self, path: str) -> "Module":
        """Force `path` ("auto", "cudnn", "custom", "reference", ...) on every layer that takes one."""
        checks.path(f"{type(self).__name__}.use_path", path, registry.ops())
        for module in self.modules():
            if hasattr(module, "path"):
                module.path = path
        return self

    def modules(self) -> Iterator["Module"]:
        """This module and every module below it."""
        yield self
        for child in self._children.values():
            yield from child.modules()

    def graphed(self, *, warmup: int = 2, buckets: Sequence[int] | None = None,
                seq_buckets: Sequence[int] | None = None, max_captures: int = 32):
        """This model as one CUDA graph per input signature, or per batch (and sequence) bucket with
        `buckets` (and `seq_buckets`); see libnn.nn.graphs."""
        return GraphedModule(self, warmup=warmup, buckets=buckets, seq_buckets=seq_buckets,
                             max_captures=max_captures)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")


def _moved(value: Any, target: Any) -> Any:
    if target in ("gpu", "cuda"):
        import cupy
        return cupy.asarray(value)
    if target == "cpu":
        return value.get() if is_cupy(value) else value
    return value.astype(dtypes.parse(target))


def _target_dtype(where: str, target: Any) -> np.dtype:
    """The floating-point dtype `target` names; an error naming the devices too, for a typo of one."""
    try:
        return checks.float_dtype(where, target)
    except (TypeError, ValueError):
        error = ValueError if isinstance(target, str) else TypeError
        raise error(f"{where}: target must be a device {checks.DEVICES} or a floating-point dtype "
                    f"({checks.FLOAT_DTYPES}), got {type(target).__name__} {target!r}") from None


def _is_real(dtype: np.dtype) -> bool:
    return dtype.kind in "biuf" or dtypes.short_name(dtype) == "bf16"


def _like(value: Any, like: Any, copy: bool) -> Any:
    """`value` on the device and with the dtype of `like`: a new array if `copy` (one: a move or a
    cast makes it), else `value` itself where it is already that."""
    moved = _moved(value, "gpu" if is_cupy(like) else "cpu")
    return moved.astype(like.dtype, copy=copy and moved is value)


def full(shape: tuple[int, ...], value: float, dtype: Any, device: str) -> Any:
    values = np.full(shape, value, dtypes.parse(dtype))
    return _moved(values, device) if device != "cpu" else values


# Set by `uninitialised()`: layers built under it draw no random initial values.
_UNINITIALISED: ContextVar[bool] = ContextVar("libnn_uninitialised", default=False)


@contextmanager
def uninitialised() -> Iterator[None]:
    """Layers built inside leave their random-initialised parameters as they are allocated (np.empty):
    for a loader that replaces every parameter at once (load_state_dict refuses a missing key), and
    so need not draw values it would throw away (they are drawn in float64 first: for a BERT-base a
    cost in seconds on the host, benchmarks/RESULTS.md)."""
    token = _UNINITIALISED.set(True)
    try:
        yield
    finally:
        _UNINITIALISED.reset(token)


def _drawn(draw: Any, shape: tuple[int, ...], dtype: Any, device: str) -> Any:
    """draw(shape) (float64) in `dtype` on `device`, or an uninitialised array under `uninitialised()`."""
    values = np.empty(shape, dtypes.parse(dtype)) if _UNINITIALISED.get() else draw(shape).astype(dtypes.parse(dtype))
    return _moved(values, device) if device != "cpu" else values


def init_uniform(shape: tuple[int, ...], bound: float, dtype: Any, device: str, seed: int | None) -> Any:
    """PyTorch's default init for linear and conv layers: U(-bound, bound)."""
    return _drawn(lambda n: np.random.default_rng(seed).uniform(-bound, bound, n), shape, dtype, device)


def init_normal(shape: tuple[int, ...], dtype: Any, device: str, seed: int | None) -> Any:
    """PyTorch's init for embeddings: N(0, 1)."""
    return _drawn(lambda n: np.random.default_rng(seed).standard_normal(n), shape, dtype, device)
