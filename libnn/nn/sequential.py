"""Sequential: modules in order, with the fusions an inference library should do on its own.

Before running, Sequential fuses what follows each other:
- Conv2d → BatchNorm2d [→ activation]  becomes one Conv2dBNAct (BN folded into the weights by
  default, `fold_bn=False` keeps it as the fused graph's epilogue);
- Conv2d → activation and Linear → activation  put the activation into the conv's or GEMM's epilogue;
- Flatten (layout NHWC) → Linear [→ activation]  becomes one FlattenLinear: the NHWC activation is
  flattened as it lies, with no transpose, and the GEMM uses the Linear's weight with its columns
  permuted once from PyTorch's (C, H, W) order to (H, W, C) (a quantised Linear's E4M3 codes alike: its
  scales are per output row, which the permutation leaves alone).
Each fusion is one rule (`_RULES`, tried in order at each position). The fused plan is made once and
rebuilt whenever the module's version changes: a parameter or layer is replaced (load_state_dict, to(),
`seq[0].weight = w`), or a setting is set to a new value (fold_bn, a layer's stride or activation).
state_dict keys stay those of the original modules ("0.weight", "1.running_mean", ...), as in PyTorch.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from libnn.nn import checks
from libnn.nn.activation import Activation
from libnn.nn.basic import Flatten
from libnn.nn.conv import Conv2d, Conv2dBNAct
from libnn.nn.functional import dense
from libnn.nn.linear import Linear
from libnn.nn.module import Module
from libnn.nn.norm import BatchNorm2d
from libnn.ops.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
from libnn.ops.linear import ACTIVATIONS as LINEAR_ACTIVATIONS
from libnn.ops.linear_fp8 import ACTIVATIONS as LINEAR_FP8_ACTIVATIONS
from libnn.runtime.arrays import array_module, as_array


class _WithActivation(Module):
    """A conv or linear layer run with an activation fused into its epilogue."""

    def __init__(self, layer: Module, activation: str):
        super().__init__()
        self.layer, self.activation = layer, activation

    def describe(self) -> str:
        return f"{type(self.layer).__name__}+{self.activation} fused (activation in the epilogue)"

    def forward(self, x: Any) -> Any:
        return self.layer(x, activation=self.activation)


class FlattenLinear(Module):
    """Flatten(layout="NHWC") → Linear [→ activation] without the transpose Flatten would make: the
    (N, H, W, C) input is reshaped as it lies and multiplied by the Linear's weight (or E4M3 codes, with
    its per-row scales as they are) with its columns permuted from PyTorch's (C, H, W) order to
    (H, W, C), a copy made once per input shape (the parameter itself stays PyTorch's, so state_dict()
    is unchanged). Saving the transpose made SeedCNN measurably faster (benchmarks/RESULTS.md, models).
    Formed by Sequential."""

    def __init__(self, flatten: Flatten, layer: Linear, activation: str | None):
        super().__init__()
        self.flatten, self.layer, self.activation = flatten, layer, activation
        self._permuted: tuple[Any, tuple[int, ...], Any] | None = None  # (weight, (H, W, C), permuted or None)

    def describe(self) -> str:
        act = f"+{self.activation}" if self.activation else ""
        return f"Flatten+Linear{act} fused (weight columns in NHWC order, no transpose)"

    def forward(self, x: Any) -> Any:
        x = as_array(x, "Flatten", "x")
        f, layer, shape = self.flatten, self.layer, x.shape  # shape read once: CuPy makes the tuple at every read
        weight = self._weight(shape) if f.start_dim == 1 and f.end_dim in (-1, 3) else None
        if weight is None:  # another rank or dims, or a shape the Linear will refuse: as the layers would
            return layer(f(x), activation=self.activation)
        return dense(x.reshape(shape[0], weight.shape[1]), weight, layer.bias, self.activation,
                     w_scale=layer.weight_scale, path=layer.path)

    def _weight(self, shape: tuple[int, ...]) -> Any:
        """The Linear's weight with its columns in (H, W, C) order for an input of `shape`, permuted
        once per weight and (H, W, C); None where the input is not 4-D or the weight does not take
        its H·W·C features."""
        weight, hwc = self.layer.weight, shape[1:]
        cached = self._permuted
        if cached is None or cached[0] is not weight or cached[1] != hwc:
            cached = self._permuted = (weight, hwc, _permuted_columns(weight, hwc))
        return cached[2]


def _permuted_columns(weight: Any, hwc: tuple[int, ...]) -> Any:
    """A contiguous copy of `weight` (K, C·H·W) with its columns reordered to (H, W, C); None unless
    `hwc` is (H, W, C) and the weight is a matrix of H·W·C columns."""
    if len(hwc) != 3 or weight.ndim != 2 or weight.shape[1] != hwc[0] * hwc[1] * hwc[2]:
        return None
    (h, w, c), k = hwc, weight.shape[0]
    permuted = weight.reshape(k, c, h, w).transpose(0, 2, 3, 1).reshape(k, h * w * c)
    return array_module(weight).ascontiguousarray(permuted)


class _Plan(NamedTuple):
    """Sequential's fused modules for one `version` of it."""
    version: int
    fused: list[tuple[str, Module]]  # each module that runs, with the names of the layers it covers
    modules: tuple[Module, ...]      # the same modules, in order
    by_forward: bool                 # none overrides Module.__call__, so calling forward is calling it


class Sequential(Module):
    def __init__(self, *modules: Module, fold_bn: bool = True):
        super().__init__()
        for i, module in enumerate(modules):
            if not isinstance(module, Module):  # Module.__setattr__ would keep it as a plain attribute, never run
                raise TypeError(f"Sequential: module {i} must be a libnn.nn.Module, got {type(module).__name__} "
                                f"{module!r}; wrap a function in a Module subclass whose forward() calls it")
            setattr(self, str(i), module)
        self.fold_bn = checks.flag("Sequential", "fold_bn", fold_bn)
        self._plan: _Plan | None = None

    def __getitem__(self, index: int) -> Module:
        """The module at `index` (negative counts from the end, as for a list)."""
        index = checks.size("Sequential", "index", index, minimum=None)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Sequential: index {index} is out of range for {len(self)} modules")
        return list(self._children.values())[index]

    def __len__(self) -> int:
        return len(self._children)

    def fused(self) -> list[tuple[str, Module]]:
        """The modules that run, each with the names of the layers it covers."""
        return self._current_plan().fused

    def _current_plan(self) -> _Plan:
        """The fusion plan, made again only when the version changed (a parameter or layer was replaced)."""
        plan = self._plan
        if plan is None or plan.version != self._version:
            fused = self._fuse()
            modules = tuple(module for _, module in fused)
            plan = self._plan = _Plan(self._version, fused, modules,
                                      all(type(m).__call__ is Module.__call__ for m in modules))
        return plan

    def _fuse(self) -> list[tuple[str, Module]]:
        names, modules = list(self._children), list(self._children.values())
        plan, i = [], 0
        while i < len(modules):
            span, module = next((found for rule in _RULES
                                 if (found := rule(modules[i], modules[i + 1: i + 3], self.fold_bn))), (1, modules[i]))
            plan.append(("+".join(names[i:i + span]), module))
            i += span
        return plan

    def describe(self) -> list[str]:
        """One line per module that runs: the layers it covers and what was fused."""
        return [f"{names}: {m.describe() if hasattr(m, 'describe') else type(m).__name__}" for names, m in self.fused()]

    def forward(self, x: Any) -> Any:
        plan = self._plan  # _current_plan's check inline: this runs at every call
        if plan is None or plan.version != self._version:
            plan = self._current_plan()
        if plan.by_forward:  # without Module.__call__'s frame, which would only call forward
            for module in plan.modules:
                x = module.forward(x)
        else:
            for module in plan.modules:
                x = module(x)
        return x


# --- fusion rules ----------------------------------------------------------------------------------
# Each looks at a module and the (up to) two after it and returns (how many modules it covers, the
# module that runs them in their place), or None; Sequential tries them in _RULES order at each position.
FuseRule = Callable[[Module, list[Module], bool], "tuple[int, Module] | None"]


def _conv_bn_activation(m: Module, following: list[Module], fold_bn: bool) -> tuple[int, Module] | None:
    """Conv2d → BatchNorm2d [→ activation]: one Conv2dBNAct (the Conv2d must have no activation)."""
    if not (isinstance(m, Conv2d) and m.activation is None and following and isinstance(following[0], BatchNorm2d)):
        return None
    act = following[1] if len(following) > 1 and isinstance(following[1], Activation) else None
    return (3 if act else 2), Conv2dBNAct(m, following[0], act.name if act else None, fold=fold_bn)


def _flatten_linear(m: Module, following: list[Module], fold_bn: bool) -> tuple[int, Module] | None:
    """Flatten (layout NHWC) → Linear [→ activation the GEMM's epilogue computes]: one FlattenLinear."""
    if not (isinstance(m, Flatten) and m.layout == "NHWC" and following and isinstance(following[0], Linear)):
        return None
    layer = following[0]
    act = following[1] if (len(following) > 1 and isinstance(following[1], Activation)
                           and layer.activation is None and _fusable(layer, following[1].name)) else None
    return (3 if act else 2), FlattenLinear(m, layer, act.name if act else layer.activation)


def _layer_activation(m: Module, following: list[Module], fold_bn: bool) -> tuple[int, Module] | None:
    """Conv2d or Linear (without an activation) → an activation its epilogue computes."""
    if not (isinstance(m, Conv2d | Linear) and m.activation is None and following
            and isinstance(following[0], Activation) and _fusable(m, following[0].name)):
        return None
    return 2, _WithActivation(m, following[0].name)


_RULES: tuple[FuseRule, ...] = (_conv_bn_activation, _flatten_linear, _layer_activation)


def _fusable(layer: Module, activation: str) -> bool:
    """Whether the epilogue of `layer`'s op (linear, linear_fp8 or conv2d) computes `activation`."""
    if isinstance(layer, Linear):
        return activation in (LINEAR_ACTIVATIONS if layer.quantized is None else LINEAR_FP8_ACTIVATIONS)
    return activation in CONV_ACTIVATIONS
