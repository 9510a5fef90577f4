"""The layer base class: named parameters, state_dict with PyTorch's key names, and device/dtype
moves. Inference only: there are no gradients and no training mode."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from libnn import dtypes
from libnn.runtime.arrays import as_array, is_cupy


class Module:
    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_children", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Module):
            self._children[name] = value
        object.__setattr__(self, name, value)

    def register_parameter(self, name: str, value: Any) -> None:
        self._parameters[name] = value
        object.__setattr__(self, name, value)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for name, value in self._parameters.items():
            if value is not None:
                yield prefix + name, value
        for child_name, child in self._children.items():
            yield from child.named_parameters(f"{prefix}{child_name}.")

    def state_dict(self) -> dict[str, Any]:
        return dict(self.named_parameters())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every parameter; checks all keys and shapes first, so a failed load changes nothing."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        converted = {}
        for key, value in state.items():
            value = as_array(value, "load_state_dict", key)
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(f"{type(self).__name__}.load_state_dict: {key} has shape {tuple(value.shape)}, "
                                 f"the layer expects {tuple(own[key].shape)}")
            converted[key] = _like(value, own[key])
        for key, value in converted.items():
            owner, name = self._owner_of(key)
            owner.register_parameter(name, value)

    def load(self, path: Any) -> "Module":
        """Load a .safetensors or .npz file (see libnn.nn.weights); on any error the model is unchanged."""
        from libnn.nn import weights

        self.load_state_dict(weights.read(path))
        return self

    def save(self, path: Any) -> None:
        from libnn.nn import weights

        weights.write(path, self.state_dict())

    def _owner_of(self, key: str) -> tuple["Module", str]:
        *path, name = key.split(".")
        module = self
        for part in path:
            module = module._children[part]
        return module, name

    def to(self, target: Any) -> "Module":
        """Move every parameter to "cpu" / "gpu", or cast it to a dtype ("fp16", np.float32...)."""
        for key, value in list(self.named_parameters()):
            owner, name = self._owner_of(key)
            owner.register_parameter(name, _moved(value, target))
        return self

    def use_path(self, path: str) -> "Module":
        """Force `path` ("auto", "cudnn", "custom", "reference", ...) on every layer that takes one."""
        for module in self.modules():
            if hasattr(module, "path"):
                module.path = path
        return self

    def modules(self) -> Iterator["Module"]:
        """This module and every module below it."""
        yield self
        for child in self._children.values():
            yield from child.modules()

    def graphed(self, *, warmup: int = 2):
        """This model as one CUDA graph per input signature (see libnn.nn.graphs)."""
        from libnn.nn.graphs import GraphedModule

        return GraphedModule(self, warmup=warmup)

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


def _like(value: Any, like: Any) -> Any:
    """`value` on the device and with the dtype of `like`."""
    value = _moved(value, "gpu" if is_cupy(like) else "cpu")
    return value.astype(like.dtype, copy=False)


def full(shape: tuple[int, ...], value: float, dtype: Any, device: str) -> Any:
    values = np.full(shape, value, dtypes.parse(dtype))
    return _moved(values, device) if device != "cpu" else values


def init_uniform(shape: tuple[int, ...], bound: float, dtype: Any, device: str, seed: int | None) -> Any:
    """PyTorch's default init for linear and conv layers: U(-bound, bound)."""
    values = np.random.default_rng(seed).uniform(-bound, bound, shape).astype(dtypes.parse(dtype))
    return _moved(values, device) if device != "cpu" else values
