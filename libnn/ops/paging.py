"""What the ops that read or write a paged KV cache (attention, kv_append) share: the page table's checks."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_page_table(op: str, table: Any, B: int, of_what: str) -> None:
    """A page table's dtype and shape: int32 (B, max_pages) with max_pages >= 1; `of_what` names where B
    comes from in the message ("k of batch 3")."""
    if table.dtype != np.int32:
        raise TypeError(f"{op}: page_table must be an int32 array (B, max_pages) of page indices, got dtype "
                        f"{table.dtype}")
    if table.ndim != 2 or table.shape[0] != B or table.shape[1] == 0:
        raise ValueError(f"{op}: page_table must have shape (B, max_pages) = ({B}, max_pages >= 1) for {of_what}, "
                         f"got {tuple(table.shape)}")
