"""Benchmarks: one harness (timing, ceilings, tables, JSON) shared by every op's suite.

PyTorch, the outside baseline, is imported here, before CuPy and the NVIDIA libraries are loaded: on
the H100 image torch 2.11 failed to import (in its own custom-op registration, "annotate(strtag)")
when imported after them in a long-running process, and imported fine first.
"""

try:
    import torch  # noqa: F401
except ImportError:
    torch = None
