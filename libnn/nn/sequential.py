"""Sequential: modules in order, with the fusions an inference library should do on its own.

Before running, Sequential fuses what follows each other:
- Conv2d → BatchNorm2d [→ activation]  becomes one Conv2dBNAct (BN folded into the weights by
  default, `fold_bn=False` keeps it as the fused graph's epilogue);
- Conv2d → activation and Linear → activation  put the activation into the conv's or GEMM's epilogue.
The fused plan is rebuilt whenever a parameter is replaced (load_state_dict, to()). state_dict keys
stay those of the original modules ("0.weight", "1.running_mean", ...), as in PyTorch.
"""

from __future__ import annotations

from typing import Any

from libnn.nn.conv import Activation, BatchNorm2d, Conv2d, Conv2dBNAct
from libnn.nn.linear import Linear
from libnn.nn.module import Module


class _WithActivation(Module):
    """A conv or linear layer run with an activation fused into its epilogue."""

    def __init__(self, layer: Module, activation: str):
        super().__init__()
        self.layer, self.activation = layer, activation

    def describe(self) -> str:
        return f"{type(self.layer).__name__}+{self.activation} fused (activation in the epilogue)"

    def forward(self, x: Any) -> Any:
        if isinstance(self.layer, Linear):
            from libnn.ops.linear import linear
            return linear(x, self.layer.weight, self.layer.bias, self.activation, path=self.layer.path)
        return self.layer(x, activation=self.activation)


class Sequential(Module):
    def __init__(self, *modules: Module, fold_bn: bool = True):
        super().__init__()
        for i, module in enumerate(modules):
            setattr(self, str(i), module)
        self.fold_bn = fold_bn
        self._plan: tuple[tuple[int, ...], list[tuple[str, Module]]] | None = None

    def __getitem__(self, index: int) -> Module:
        return self._children[str(index)]

    def __len__(self) -> int:
        return len(self._children)

    def fused(self) -> list[tuple[str, Module]]:
        """The modules that run, each with the names of the layers it covers."""
        fingerprint = tuple(id(v) for _, v in self.named_parameters())
        if self._plan is None or self._plan[0] != fingerprint:
            self._plan = (fingerprint, self._fuse())
        return self._plan[1]

    def _fuse(self) -> list[tuple[str, Module]]:
        names, modules = list(self._children), list(self._children.values())
        plan, i = [], 0
        while i < len(modules):
            m = modules[i]
            following = modules[i + 1: i + 3]
            if isinstance(m, Conv2d) and following and isinstance(following[0], BatchNorm2d) and m.activation is None:
                act = following[1] if len(following) > 1 and isinstance(following[1], Activation) else None
                span = 3 if act else 2
                plan.append(("+".join(names[i:i + span]), Conv2dBNAct(m, following[0], act.name if act else None,
                                                                     fold=self.fold_bn)))
                i += span
            elif (isinstance(m, Conv2d | Linear) and following and isinstance(following[0], Activation)
                  and m.activation is None and _fusable(m, following[0].name)):
                plan.append((f"{names[i]}+{names[i + 1]}", _WithActivation(m, following[0].name)))
                i += 2
            else:
                plan.append((names[i], m))
                i += 1
        return plan

    def describe(self) -> list[str]:
        """One line per module that runs: the layers it covers and what was fused."""
        return [f"{names}: {m.describe() if hasattr(m, 'describe') else type(m).__name__}" for names, m in self.fused()]

    def forward(self, x: Any) -> Any:
        for _, module in self.fused():
            x = module(x)
        return x


def _fusable(layer: Module, activation: str) -> bool:
    from libnn.ops.conv2d import ACTIVATIONS as CONV_ACTIVATIONS
    from libnn.ops.linear import ACTIVATIONS as LINEAR_ACTIVATIONS

    return activation in (LINEAR_ACTIVATIONS if isinstance(layer, Linear) else CONV_ACTIVATIONS)
