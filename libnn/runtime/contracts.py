"""Kernel contracts read from the kernel files: each kernel's parameter list and the constants its launch
depends on are written once, in kernels/*.cu, and Python reads them from there.

- `params(file, key)`: the parameter list of a kernel, by the name of the macro that declares it
  (`#define CONV_PARAMS(T) const T* __restrict__ x, ..., int N, ...`) or of the kernel itself
  (`fft_cmul`, `channel_epilogue_##SUFFIX`). `Params.pack(name=value, ...)` builds the launch's
  argument tuple by name, in the kernel's order, each scalar as the kernel's type: a missing or
  unknown name is an error, so no argument can shift or change its width.
- `constants(file)`: every `#define NAME <int>` and `constexpr int NAME = <int>;` of the file (tile
  sizes, warps per block, activation codes). Derived values (threads, shared memory) are computed from
  these by the launch code, with the formula the .cu's LAUNCH comment states.

tests/test_kernel_contracts.py compiles every kernel file to PTX and checks each launched kernel's
parameters (count, sizes, order) against these declarations.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from libnn.runtime.kernels import kernel_dir

# C parameter type -> (kind, NumPy scalar type). Pointers are "ptr": passed as given (an array, the
# ARRAY placeholder of runtime/launch.py), None as a null pointer.
_SCALARS = {
    "int": ("i32", np.int32), "i32": ("i32", np.int32),
    "unsigned": ("u32", np.uint32), "unsigned int": ("u32", np.uint32), "u32": ("u32", np.uint32),
    "long long": ("i64", np.int64), "i64": ("i64", np.int64),
    "unsigned long long": ("u64", np.uint64), "u64": ("u64", np.uint64),
    "float": ("f32", np.float32),
}
SIZES = {"ptr": 8, "i32": 4, "u32": 4, "i64": 8, "u64": 8, "f32": 4}
NULL = np.uint64(0)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str   # "ptr", "i32", "u32", "i64", "u64", "f32"
    ctype: str  # as written in the .cu, e.g. "const T* __restrict__"

    @property
    def size(self) -> int:
        return SIZES[self.kind]


@dataclass(frozen=True)
class Params:
    """A kernel's parameter list, in order, as kernels/<file> declares it under `key`."""
    file: str
    key: str
    params: tuple[Param, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def pack(self, **values: Any) -> tuple:
        """The argument tuple for a launch: every parameter by name, scalars as the kernel's types."""
        missing = [n for n in self.names if n not in values]
        unknown = [n for n in values if n not in self.names]
        if missing or unknown:
            raise TypeError(f"kernels/{self.file} {self.key}: " + "; ".join(
                part for part in (f"missing {', '.join(missing)}" if missing else "",
                                  f"no parameter named {', '.join(unknown)}" if unknown else "") if part))
        return tuple(_convert(p, values[p.name]) for p in self.params)


def _convert(p: Param, value: Any) -> Any:
    if p.kind == "ptr":
        return NULL if value is None else value
    return _SCALARS_BY_KIND[p.kind](value)


_SCALARS_BY_KIND = {kind: t for kind, t in _SCALARS.values()}


@functools.cache
def _source(file: str) -> str:
    """The file without comments, its macros' line continuations joined."""
    text = (kernel_dir() / file).read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"\\\n", " ", text)


def _parse_param(decl: str, file: str, key: str) -> Param:
    decl = " ".join(decl.split())
    m = re.fullmatch(r"(.*?)\s*\b([A-Za-z_]\w*)", decl)
    if not m or not m.group(1):
        raise ValueError(f"kernels/{file} {key}: cannot read the parameter {decl!r}")
    ctype, name = m.group(1), m.group(2)
    if "*" in ctype:
        return Param(name, "ptr", ctype)
    base = " ".join(re.sub(r"^\w+::", "", w) for w in ctype.split() if w not in ("const", "__restrict__"))
    if base not in _SCALARS:
        raise ValueError(f"kernels/{file} {key}: parameter {name} has type {ctype!r}, which libnn does not pass")
    return Param(name, _SCALARS[base][0], ctype)


def _balanced(text: str, start: int) -> str:
    """The text between the parenthesis at `start` and the one that closes it."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError("unbalanced parentheses")


@functools.cache
def params(file: str, key: str) -> Params:
    """The parameter list kernels/<file> declares under `key`: a macro `#define KEY(T) <list>` (or
    without arguments), else the kernel defined as `void KEY(<list>)` (KEY may hold `##`)."""
    source = _source(file)
    if m := re.search(rf"^[ \t]*#define[ \t]+{re.escape(key)}\b(\([^)]*\))?[ \t]*(.*)$", source, re.M):
        body = m.group(2)
    elif m := re.search(rf"\bvoid\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?{re.escape(key)}\s*\(", source):
        body = _balanced(source, m.end() - 1)
    else:
        raise KeyError(f"kernels/{file} declares no parameter list {key}")
    return Params(file, key, tuple(_parse_param(d, file, key) for d in body.split(",")))


_DEFINE = re.compile(r"^[ \t]*#define[ \t]+([A-Za-z_]\w*)[ \t]+\(?(-?\d+)\)?[ \t]*$", re.M)
_CONSTEXPR = re.compile(r"\bconstexpr\s+(?:int|unsigned)\s+([A-Za-z_]\w*)\s*=\s*(-?\d+)u?\s*;")


@functools.cache
def constants(file: str) -> dict[str, int]:
    """Every integer constant kernels/<file> defines as `#define NAME <int>` or `constexpr int NAME = <int>;`.
    A name given two different values (say, under #if) is an error: the launch code could not know which."""
    found: dict[str, int] = {}
    for pattern in (_DEFINE, _CONSTEXPR):
        for name, value in pattern.findall(_source(file)):
            if found.setdefault(name, int(value)) != int(value):
                raise ValueError(f"kernels/{file} gives {name} two values, {found[name]} and {value}")
    return found


def constant(file: str, name: str) -> int:
    try:
        return constants(file)[name]
    except KeyError:
        raise KeyError(f"kernels/{file} defines no integer constant {name}") from None
