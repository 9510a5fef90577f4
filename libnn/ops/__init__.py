"""Ops: one module per op, each holding its signature, shape checks and paths side by side."""

from libnn.ops.linear import linear

__all__ = ["linear"]
