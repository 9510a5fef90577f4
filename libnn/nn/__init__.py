"""Layers for inference, in the PyTorch style: parameters by name, state_dict keys PyTorch uses."""

from libnn.nn.linear import Linear
from libnn.nn.module import Module

__all__ = ["Module", "Linear"]
