"""Plan caches: everything expensive (library plans, handles, compiled modules) is built once per key
and reused. A key must name everything the object depends on (shapes, strides, dtypes, options,
device); `cache_info()` reports hits and build time per cache, which is how tests check that a second
call built nothing, and `cache_keys(name)` lists what a plan cache holds. What outlives the process (compiled kernels, serialized cuDNN plans) goes under
`cache_dir()`."""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Hashable, Iterator, TypeVar

T = TypeVar("T")

_STATS: dict[str, "CacheStats"] = {}
_CACHES: dict[str, "PlanCache"] = {}


@dataclass
class CacheStats:
    hits: int = 0
    builds: int = 0
    build_seconds: float = 0.0
    size: int = 0


class PlanCache(Generic[T]):
    """A thread-safe LRU map from key to built object, with build statistics."""

    def __init__(self, name: str, maxsize: int = 512):
        self.name = name
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, T] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = register_stats(name)
        _CACHES[name] = self

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.stats.hits += 1
                return self._items[key]
        start = time.perf_counter()
        value = build()  # outside the lock: builds can take seconds and may use other caches
        with self._lock:
            self.stats.builds += 1
            self.stats.build_seconds += time.perf_counter() - start
            self._items[key] = value
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
            self.stats.size = len(self._items)
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def keys(self) -> list[Hashable]:
        """The keys held now, least recently used first (a copy: safe while other threads build)."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.stats.size = 0


def register_stats(name: str) -> CacheStats:
    """The statistics object `cache_info()` reports under `name`, for a cache of any kind."""
    _STATS[name] = stats = CacheStats()
    return stats


def cache_info() -> dict[str, CacheStats]:
    """Statistics of every plan cache libnn has created in this process."""
    return dict(_STATS)


def cache_keys(name: str) -> list[Hashable]:
    """The keys the plan cache `name` (as `cache_info()` names it) holds now, least recently used first."""
    if name not in _CACHES:
        raise KeyError(f"cache_keys: no plan cache named {name!r}; plan caches: {sorted(_CACHES)}")
    return _CACHES[name].keys()


def cache_dir() -> Path:
    """Where compiled kernels and plans are kept on disk (kernels/ and cudnn/ below it):
    $LIBNN_CACHE_DIR, else the user's cache dir."""
    root = os.environ.get("LIBNN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "libnn")
    return Path(root)


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` so that a reader, in this process or another, finds the old contents or the new,
    never part of them: the data goes to a temporary file of a unique name in the same directory (so
    on the same file system), which then replaces `path` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def entry_lock(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (created if missing) against every other holder, in
    other processes or other threads, so that one of them builds a disk-cache entry while the rest wait
    and then read it. Not reentrant: a holder that takes the same lock again waits forever."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "ab") as f:  # each open is its own flock: threads of one process exclude each other too
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
