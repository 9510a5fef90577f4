"""Ops and their paths, and the one front end every op's calls go through.

An op (``linear``, ``conv2d``, ...) has several paths that compute the same function: library paths
(``cublaslt``, ``cudnn``, ``cufft``), ``custom`` (our kernels) and ``reference`` (NumPy, float64).
Each path declares where it runs, what it needs installed, and which problems it supports; the op
dispatches a call to the forced path or, under ``path="auto"``, by this policy:

1. only paths on the device the arrays are on (host arrays go to ``reference``);
2. only paths whose libraries are present and that support the problem (dtype, options, shape);
3. of those, the first in the op's declared ``order`` (fastest first, as measured by
   ``libnn bench <op>`` on the H100), except that a path whose ``slower(problem)`` gives a reason
   (a measured case where a later path wins) goes after the others, still available as a fallback;
4. if that path's library fails, a ``FallbackWarning`` says why and the next one runs.

The reason every path was passed over is kept in ``op.last_decision`` for inspection.

Bound calls. The first call with a new *signature* (every array's type, shape, strides, dtype, device
and pointer alignment, every option, the path and the stream) does everything once: the op's checks
build its problem, the paths are resolved, and the chosen path *binds*: it finds its plan, kernel,
launch geometry and workspace, and returns a runner that takes the arrays. The result, a `Bound`,
is kept in ``op.calls`` under the signature; a later call with the same signature is one dict lookup,
then the runner: allocate the output, one library call or kernel launch. A runner never keeps the
arrays it was bound with: pointers are read at every call. Everything an op's checks read is in its
signature, so an input the checks would refuse can never find a bound call and is refused as before.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from libnn.errors import FallbackWarning, LibraryError, NoPathError, PathUnavailableError
from libnn.runtime import device as _device
from libnn.runtime import memory
from libnn.runtime.cache import register_stats

_OPS: dict[str, "Op"] = {}


@dataclass(frozen=True)
class Path:
    name: str
    kind: str                      # "library", "custom" or "reference"
    device: str                    # "gpu" or "cpu"
    run: Callable[..., Any]        # run(problem, *args), or with `binds`, bind(problem, *args) -> runner
    requires: tuple[str, ...] = ()  # Python modules the path imports
    supports: Callable[[Any], str | None] = lambda problem: None  # None, or why not
    slower: Callable[[Any], str | None] = lambda problem: None    # None, or why auto tries it last
    binds: bool = False

    def bind(self, problem: Any, args: tuple) -> Callable[..., Any]:
        """The runner of `problem`: runner(*args) computes it for arrays of the bound signature."""
        return self.run(problem, *args) if self.binds else functools.partial(self.run, problem)

    def missing(self) -> str | None:
        """None if this path can run on this machine, else what is missing."""
        if self.device == "gpu" and (reason := _device.gpu_missing()):
            return reason
        for module in self.requires:
            if reason := _device.module_missing(module):
                return reason
        return None


@dataclass
class Decision:
    path: str
    passed_over: dict[str, str] = field(default_factory=dict)  # path name -> why it was not run


class Op:
    def __init__(self, name: str, order: tuple[str, ...], max_calls: int = 4096):
        """`order` is the `auto` preference, fastest first; every path registered must be in it."""
        self.name = name
        self.order = tuple(order)
        self.paths: dict[str, Path] = {}
        self.last_decision: Decision | None = None
        self.calls = BoundCalls(f"{name} calls", max_calls)
        self._lookup = self.calls.get  # read once: `call` runs it on every call
        _OPS[name] = self

    def path(self, name: str, *, kind: str, device: str, requires: tuple[str, ...] = (),
             supports: Callable[[Any], str | None] | None = None, slower: Callable[[Any], str | None] | None = None,
             binds: bool = False):
        """Decorator registering a path named in the op's `order`. The function is run(problem, *args),
        or with `binds=True`, bind(problem, *args) returning runner(*args): what the path finds once per
        signature (a plan, a kernel and its launch geometry) it finds there, not in the runner."""
        if name not in self.order:
            raise ValueError(f"{self.name}: path {name!r} is not in the op's declared order {self.order}")

        def register(run):
            self.paths[name] = Path(name, kind, device, run, requires, supports or (lambda problem: None),
                                    slower or (lambda problem: None), binds)
            return run
        return register

    def ordered(self) -> list[Path]:
        """The registered paths in the declared `auto` order."""
        return [self.paths[n] for n in self.order if n in self.paths]

    def _why_not(self, p: Path, problem: Any, where: str) -> str | None:
        if p.device != where:
            return f"runs on the {p.device.upper()}, the arrays are on the {where.upper()}"
        return p.missing() or p.supports(problem)

    def call(self, key: Hashable, prepare: Callable[..., Any], path: str, *args: Any, checks: tuple = ()) -> Any:
        """Run the bound call of signature `key` on `args`. The first call with a signature binds it:
        `prepare(*checks)` checks the arguments and returns the problem, the paths are resolved and
        bound, and the bound call is kept under `key`. The cached case runs `Bound.__call__`'s body here,
        without its frame: this is every op's per-call path. `checks` carries prepare's arguments, so
        that an op need not make a closure over them at every call (measured on a CPU: a lambda closing
        over six names about 0.18 µs a call, their tuple about 0.04 µs)."""
        try:
            try:
                bound = self._lookup(key)
            except TypeError:  # an unhashable option: the checks name it, or the call runs unbound
                return self.bind(prepare(*checks), path, args)(*args)
            if bound is None:
                bound = self.bind(prepare(*checks), path, args)
                self.calls.add(key, bound)
            self.last_decision = bound.decision
            try:
                return bound.run(*args)
            except LibraryError as exc:
                return bound.fall_back(exc, args)
        except MemoryError as exc:
            if type(exc) is MemoryError:  # libnn's own (memory.require): names the op and the bytes already
                raise
            # CuPy's OutOfMemoryError or NumPy's: memory taken since the bind's check, or a temporary
            raise MemoryError(f"{self.name}: out of memory: {exc}") from exc

    def dispatch(self, problem: Any, path: str, *args: Any) -> Any:
        """Run `problem` on `path` (a path name or "auto") without keeping the bound call;
        `problem.device` is 'cpu' or 'gpu:N'."""
        return self.bind(problem, path, args)(*args)

    def bind(self, problem: Any, path: str, args: tuple) -> "Bound":
        """A bound call for `problem` on `path`, bound with the first call's `args`."""
        candidates, passed_over = self.resolve(problem, path)
        if candidates[0].device == "gpu":
            _require_gpu_memory(self.name, problem)
        return Bound(self, problem, candidates, passed_over, args)

    def resolve(self, problem: Any, path: str) -> tuple[tuple[Path, ...], dict[str, str]]:
        """The paths to try for `problem`, in order, and why each other path was passed over. A
        forced path comes alone, or raises if it cannot run here."""
        where = problem.device.split(":")[0]
        if not isinstance(path, str):  # a list would fail as an unhashable key with no libnn message
            raise TypeError(f"{self.name}: path must be a string, 'auto' or one of {list(self.paths)}; got "
                            f"{type(path).__name__} {path!r}")
        if path != "auto":
            return (self._forced(problem, path, where),), {}
        candidates, deferred, passed_over = [], [], {}
        for p in self.ordered():
            if reason := self._why_not(p, problem, where):
                passed_over[p.name] = reason
            elif reason := p.slower(problem):
                deferred.append(p)
                passed_over[p.name] = f"tried last: {reason}"
            else:
                candidates.append(p)
        candidates += deferred
        if not candidates:
            reasons = "; ".join(f"{n}: {r}" for n, r in passed_over.items())
            raise NoPathError(f"{self.name}: no path can compute {problem.describe()} ({reasons})")
        return tuple(candidates), passed_over

    def _forced(self, problem: Any, path: str, where: str) -> Path:
        if path not in self.paths:
            raise ValueError(f"{self.name}: unknown path {path!r}; expected 'auto' or one of {list(self.paths)}")
        p = self.paths[path]
        if p.device != where:
            raise TypeError(f"{self.name}: path '{path}' runs on the {p.device.upper()}, but the arrays are "
                            f"{'host (NumPy) arrays' if where == 'cpu' else 'on the GPU'}; "
                            + ("move them with cupy.asarray(...)" if p.device == "gpu"
                               else "move them to the host with cupy.asnumpy(...) or use a GPU path"))
        if reason := p.missing() or p.supports(problem):
            raise PathUnavailableError(f"{self.name}: path '{path}' cannot run {problem.describe()}: {reason}")
        return p

    def availability(self) -> list[dict[str, str]]:
        return [{"path": p.name, "kind": p.kind, "device": p.device,
                 "available": "yes" if not p.missing() else "no", "reason": p.missing() or ""}
                for p in self.ordered()]


class Bound:
    """One signature's call: the problem, the runner of the path it runs on, and the paths `auto` can
    still fall back to. Calling it runs the runner. Under `auto`, a LibraryError while binding or
    running warns and binds the next path for good (so a library that declines a signature is asked
    once); the last path's errors are the caller's."""

    __slots__ = ("op", "problem", "run", "decision", "_pending", "_failures")

    def __init__(self, op: Op, problem: Any, candidates: tuple[Path, ...], passed_over: dict[str, str],
                 args: tuple):
        self.op, self.problem = op, problem
        self._pending, self._failures = list(candidates), dict(passed_over)
        self._bind_next(args)

    def __call__(self, *args: Any) -> Any:
        self.op.last_decision = self.decision
        try:
            return self.run(*args)
        except LibraryError as exc:
            return self.fall_back(exc, args)

    def fall_back(self, exc: LibraryError, args: tuple) -> Any:
        """After the runner raised `exc` on `args`: re-raise it if no path is left, else warn, bind the
        next path for good and run it."""
        if not self._pending:
            raise exc
        self._failed(self.decision.path, exc)
        self._bind_next(args)
        return self(*args)

    def _bind_next(self, args: tuple) -> None:
        while True:
            path = self._pending.pop(0)
            try:
                self.run = path.bind(self.problem, args)
            except LibraryError as exc:
                if not self._pending:
                    raise
                self._failed(path.name, exc)
                continue
            self.decision = Decision(path.name, _others(self._failures, path.name))
            return

    def _failed(self, name: str, exc: LibraryError) -> None:
        self._failures[name] = f"failed: {exc}"
        warnings.warn(f"{self.op.name}: path '{name}' failed, trying the next path: {exc}", FallbackWarning,
                      stacklevel=4)


class BoundCalls:
    """An op's bound calls by signature: a plain dict, read without a lock on the hot path (a dict
    lookup is atomic), with the oldest entry dropped past `maxsize` and the builds counted."""

    def __init__(self, name: str, maxsize: int):
        self._items: dict[Hashable, Bound] = {}
        self.get = self._items.get
        self.maxsize = maxsize
        self.stats = register_stats(name)

    def add(self, key: Hashable, bound: Bound) -> None:
        if len(self._items) >= self.maxsize:
            self._items.pop(next(iter(self._items)), None)
        self._items[key] = bound
        self.stats.builds += 1
        self.stats.size = len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self.stats.size = 0


_BOOL_KEYS = {False: (bool, False), True: (bool, True)}


def option_key(value: Any) -> Any:
    """An option as part of a bound call's key, with the type of each value: 1.0 and True equal 1 as
    keys, so stride=1.0 would otherwise find the bound call of stride=1 and skip the checks that
    refuse it. A list (stride=[2, 2]) keys as the tuple it means, marked as a sequence so that
    (2.0,) and 2.0 differ. The common cases cost one or two
    type tests on the per-call path: an exact int, an exact str and None are their own keys (no
    value of another type equals one of them, while every other type's key is a tuple), and a bool's
    key is made once."""
    kind = type(value)
    if kind is int or kind is str or value is None:
        return value
    if kind is bool:
        return _BOOL_KEYS[value]
    if kind is tuple or kind is list:
        return (tuple, *map(type, value), *value)
    return (kind, value)


def _require_gpu_memory(op: str, problem: Any) -> None:
    """Refuse, before any allocation, a problem whose output (`problem.output_bytes`, which every GPU
    path allocates; ops without it are not checked here) would not fit in free GPU memory. Checked
    once per signature, at the bind: a later call that runs out raises CuPy's error, named by `call`."""
    needed = getattr(problem, "output_bytes", None)
    if needed:
        memory.require(needed, "gpu", op, f"the output of {problem.describe()}")


def _others(reasons: dict[str, str], ran: str) -> dict[str, str]:
    """Why each path other than the one that ran was not run."""
    return {name: why for name, why in reasons.items() if name != ran}


def get_op(name: str) -> Op:
    """The op registered under `name`. Ops register themselves when their module is imported, and
    `import libnn` (which importing any libnn module runs first) imports every op module through
    libnn.ops: the registry, below the ops, never imports them."""
    if name not in _OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {sorted(_OPS)}")
    return _OPS[name]


def paths(op: str) -> list[dict[str, str]]:
    """The paths of `op` and whether each can run here (and if not, why)."""
    return get_op(op).availability()


def ops() -> list[str]:
    """The names of every registered op (every op, once `libnn` is imported: see `get_op`)."""
    return sorted(_OPS)
