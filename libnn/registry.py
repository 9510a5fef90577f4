"""Ops and their paths.

An op (``linear``, ``conv2d``, ...) has several paths that compute the same function: library paths
(``cublaslt``, ``cudnn``, ``cufft``), ``custom`` (our kernels) and ``reference`` (NumPy, float64).
Each path declares where it runs, what it needs installed, and which problems it supports; the op
dispatches a call to the forced path or, under ``path="auto"``, by this policy:

1. only paths on the device the arrays are on (host arrays go to ``reference``);
2. only paths whose libraries are present and that support the problem (dtype, options, shape);
3. of those, the first in the op's registration order, which lists paths fastest first as measured
   by ``libnn bench <op>`` on the H100, except that a path whose ``slower(problem)`` gives a reason
   (a measured case where a later path wins) goes after the others, still available as a fallback;
4. if that path's library fails at run time, a ``FallbackWarning`` says why and the next one runs.

The reason every path was passed over is kept in ``op.last_decision`` for inspection.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from libnn.errors import FallbackWarning, LibraryError, NoPathError, PathUnavailableError
from libnn.runtime import device as _device

_OPS: dict[str, "Op"] = {}


@dataclass(frozen=True)
class Path:
    name: str
    kind: str                      # "library", "custom" or "reference"
    device: str                    # "gpu" or "cpu"
    run: Callable[..., Any]
    requires: tuple[str, ...] = ()  # Python modules the path imports
    supports: Callable[[Any], str | None] = lambda problem: None  # None, or why not
    slower: Callable[[Any], str | None] = lambda problem: None    # None, or why auto tries it last

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
    def __init__(self, name: str):
        self.name = name
        self.paths: dict[str, Path] = {}
        self.last_decision: Decision | None = None
        _OPS[name] = self

    def path(self, name: str, *, kind: str, device: str, requires: tuple[str, ...] = (),
             supports: Callable[[Any], str | None] | None = None, slower: Callable[[Any], str | None] | None = None):
        """Decorator registering a path; registration order is the `auto` preference order, except for
        the problems `slower` names a reason for (auto then tries the path after the others)."""
        def register(run):
            self.paths[name] = Path(name, kind, device, run, requires, supports or (lambda problem: None),
                                    slower or (lambda problem: None))
            return run
        return register

    def _why_not(self, p: Path, problem: Any, where: str) -> str | None:
        if p.device != where:
            return f"runs on the {p.device.upper()}, the arrays are on the {where.upper()}"
        return p.missing() or p.supports(problem)

    def dispatch(self, problem: Any, path: str, *args: Any) -> Any:
        """Run `problem` on `path` (a path name or "auto"); `problem.device` is 'cpu' or 'gpu:N'."""
        return self.run(self.resolve(problem, path), problem, *args)

    def resolve(self, problem: Any, path: str) -> tuple[tuple[Path, ...], dict[str, str]]:
        """The paths to try for `problem`, in order, and why each other path was passed over. A
        forced path comes alone, or raises if it cannot run here. The result depends only on the
        problem and the machine, so an op may cache it per problem."""
        where = problem.device.split(":")[0]
        if path != "auto":
            return (self._forced(problem, path, where),), {}
        candidates, deferred, passed_over = [], [], {}
        for p in self.paths.values():
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

    def run(self, resolved: tuple[tuple[Path, ...], dict[str, str]], problem: Any, *args: Any) -> Any:
        """Run the first of the resolved paths whose library does not fail; a failure under `auto`
        warns and moves on to the next path."""
        candidates, passed_over = resolved
        if len(candidates) == 1:  # a forced path, or the only one: its errors are the caller's
            result = candidates[0].run(problem, *args)
            self.last_decision = Decision(candidates[0].name, _others(passed_over, candidates[0].name))
            return result
        failures = dict(passed_over)
        for p in candidates:
            try:
                result = p.run(problem, *args)
            except LibraryError as exc:
                failures[p.name] = f"failed: {exc}"
                warnings.warn(f"{self.name}: path '{p.name}' failed, trying the next path: {exc}",
                              FallbackWarning, stacklevel=3)
                continue
            self.last_decision = Decision(p.name, _others(failures, p.name))
            return result
        reasons = "; ".join(f"{n}: {r}" for n, r in failures.items())
        raise NoPathError(f"{self.name}: no path could compute {problem.describe()} ({reasons})")

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
                for p in self.paths.values()]


def _others(reasons: dict[str, str], ran: str) -> dict[str, str]:
    """Why each path other than the one that ran was not run."""
    return {name: why for name, why in reasons.items() if name != ran}


def get_op(name: str) -> Op:
    import libnn.ops  # noqa: F401  (registers every op)

    if name not in _OPS:
        raise ValueError(f"unknown op {name!r}; known ops: {sorted(_OPS)}")
    return _OPS[name]


def paths(op: str) -> list[dict[str, str]]:
    """The paths of `op` and whether each can run here (and if not, why)."""
    return get_op(op).availability()


def ops() -> list[str]:
    import libnn.ops  # noqa: F401
    return sorted(_OPS)
