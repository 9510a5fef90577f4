"""Whole-model CUDA graphs: capture a model's forward pass once per input signature, then replay it.

`model.graphed()` (or `GraphedModule(model)`) returns a callable with the model's signature. The first
call with a new signature (each array argument's shape and dtype, every other argument's value):
1. copies the inputs into static buffers the graph will read;
2. runs the model once as usual, with every check (token ids, sequence lengths), on the caller's stream;
3. runs it `warmup` more times in graph mode on the module's private stream: the code paths the capture
   will take (no host synchronisation; a padding mask as a bias, not lengths), building every plan,
   handle, workspace and kernel they need (cuDNN graphs, cuBLASLt plans, NVRTC modules);
4. captures one more pass into a CUDA graph, its memory drawn from a pool of its own so that nothing
   else ever reuses the addresses the graph has baked in.
Every later call with that signature copies the inputs into the static buffers and launches the graph:
one launch for the whole model instead of one (plus Python) per op. A new signature captures anew;
captures are cached per signature. Replacing a parameter (load_state_dict, to()) drops every capture.

The outputs are the static arrays the graph writes: the next call with the same signature overwrites
them, so copy what you keep (`out.copy()`), as with PyTorch's CUDA graphs. Replays read the inputs
without the checks of step 2: values are not validated again (a token id out of range is not caught).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from libnn.errors import LibnnError
from libnn.nn.module import Module
from libnn.runtime.arrays import is_cupy
from libnn.runtime.stream import graph_mode


@dataclass
class CaptureStats:
    """Where a signature's first call spent its time."""
    warmup_seconds: float      # the checked pass and the graph-mode warm-up passes: plans, kernels
    capture_seconds: float     # recording and instantiating the graph
    replays: int = 0


@dataclass
class _Capture:
    graph: Any
    inputs: list[Any]          # the static input buffers, in argument order
    output: Any
    pool: Any                  # keeps the graph's memory alive and private


class GraphedModule:
    def __init__(self, module: Module, *, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"GraphedModule: warmup must be >= 1 (plans must be built before the capture), got {warmup}")
        self.module, self.warmup = module, warmup
        self._captures: dict[tuple, _Capture] = {}
        self._stats: dict[tuple, CaptureStats] = {}
        # The parameters the captures baked in. Held (not just their ids, which CPython reuses) so that
        # a replaced parameter is noticed and the memory a capture reads is never freed under it.
        self._parameters: tuple[Any, ...] = ()
        self._stream = None    # one private stream for every capture: its handles and workspaces stay valid

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._signature(args, kwargs)  # first: it refuses host arrays before CuPy is needed
        import cupy

        parameters = tuple(v for _, v in self.module.named_parameters())
        if len(parameters) != len(self._parameters) or any(a is not b for a, b in zip(parameters, self._parameters)):
            self._captures.clear()  # a parameter was replaced: every capture reads stale addresses
            self._parameters = parameters
        entry = self._captures.get(key)
        if entry is None:
            entry = self._captures[key] = self._capture(key, args, kwargs)
        for static, value in zip(entry.inputs, _arrays(args, kwargs)):
            cupy.copyto(static, value)
        entry.graph.launch(cupy.cuda.get_current_stream())
        self._stats[key].replays += 1
        return entry.output

    def stats(self) -> dict[tuple, CaptureStats]:
        """Each captured signature's warm-up and capture times and replay count (also of captures dropped
        since, when parameters were replaced)."""
        return dict(self._stats)

    def _signature(self, args: tuple, kwargs: dict) -> tuple:
        def one(name: str, value: Any) -> tuple:
            if is_cupy(value):
                return name, "array", value.shape, value.dtype, value.device.id
            if hasattr(value, "shape") and hasattr(value, "dtype"):
                raise TypeError(f"{type(self.module).__name__}.graphed(): argument {name} is a host array; CUDA "
                                f"graphs replay GPU work only: pass cupy arrays (cupy.asarray(...))")
            try:
                hash(value)
            except TypeError:
                raise TypeError(f"{type(self.module).__name__}.graphed(): argument {name} must be a cupy array or "
                                f"a hashable value (it becomes part of the capture's key), got "
                                f"{type(value).__name__}") from None
            return name, "value", value

        return (tuple(one(f"#{i}", a) for i, a in enumerate(args))
                + tuple(one(k, kwargs[k]) for k in sorted(kwargs)))

    def _capture(self, key: tuple, args: tuple, kwargs: dict) -> _Capture:
        import cupy

        start = time.perf_counter()
        self.module(*args, **kwargs)  # the checked pass: bad input fails here, as it would eagerly
        if self._stream is None:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        stream, pool = self._stream, cupy.cuda.MemoryPool()
        cupy.cuda.get_current_stream().synchronize()  # the inputs are ready before the private stream reads them
        with cupy.cuda.using_allocator(pool.malloc), stream, graph_mode():
            statics = [value.copy() for value in _arrays(args, kwargs)]
            static_args, static_kwargs = _substitute(args, kwargs, statics)
            for _ in range(self.warmup):
                self.module(*static_args, **static_kwargs)
            stream.synchronize()
            warmed = time.perf_counter()
            stream.begin_capture()
            try:
                output = self.module(*static_args, **static_kwargs)
            except Exception as exc:
                stream.end_capture()
                raise LibnnError(f"{type(self.module).__name__}: the forward pass could not be captured in a CUDA "
                                 f"graph ({type(exc).__name__}: {exc}); call the model directly instead") from exc
            graph = stream.end_capture()
            graph.upload(stream)
            stream.synchronize()
        self._stats[key] = CaptureStats(warmup_seconds=warmed - start, capture_seconds=time.perf_counter() - warmed)
        return _Capture(graph, statics, output, pool)


def _arrays(args: tuple, kwargs: dict) -> list[Any]:
    """The array arguments, positional first, then keyword arguments by name."""
    return [a for a in args if is_cupy(a)] + [kwargs[k] for k in sorted(kwargs) if is_cupy(kwargs[k])]


def _substitute(args: tuple, kwargs: dict, statics: list[Any]) -> tuple[tuple, dict]:
    """args and kwargs with each array replaced by its static buffer (same order as _arrays)."""
    it = iter(statics)
    new_args = tuple(next(it) if is_cupy(a) else a for a in args)
    new_kwargs = {k: (next(it) if is_cupy(kwargs[k]) else kwargs[k]) for k in sorted(kwargs)}
    return new_args, new_kwargs

