"""Process-wide settings, read once from the environment and changeable at run time."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Config:
    # Time every candidate algorithm cuBLASLt's heuristic offers on a plan's first use and keep the
    # fastest, instead of trusting the heuristic's first choice. Costs ~10 runs per candidate, once.
    autotune: bool = _env_flag("LIBNN_AUTOTUNE")
    # Upper bound on cuBLASLt's workspace: more lets the heuristic offer split-K algorithms.
    cublaslt_workspace_bytes: int = int(os.environ.get("LIBNN_CUBLASLT_WORKSPACE", 64 << 20))
    # Let attention's cuDNN plans include those that can give other bits from one run to the next on the
    # same inputs (they split a reduction over thread blocks and add the parts in the order the blocks
    # finish): faster decode attention, but seeded sampling no longer repeats. Off: the same inputs give
    # the same bits. Read when a call's signature is first bound, and part of that signature.
    allow_nondeterministic: bool = _env_flag("LIBNN_ALLOW_NONDETERMINISTIC")


config = Config()
