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


config = Config()
