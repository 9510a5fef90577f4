"""`libnn demo`: a three-layer MLP on random data, on the GPU when there is one, else on the NumPy
reference path; prints where it ran, the path each layer took, the time, and the error against the
float64 reference."""

from __future__ import annotations

import time

import numpy as np

from libnn import nn
from libnn.ops.linear import op as linear_op
from libnn.runtime.device import gpu_missing


class MLP(nn.Module):
    def __init__(self, sizes: list[int], dtype: str, device: str, path: str):
        super().__init__()
        self.layers = []
        for i, (k, n) in enumerate(zip(sizes, sizes[1:])):
            last = i == len(sizes) - 2
            layer = nn.Linear(k, n, activation=None if last else "gelu", dtype=dtype, device=device,
                              path=path, seed=i)
            setattr(self, f"fc{i}", layer)
            self.layers.append(layer)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(batch: int = 64, path: str = "auto") -> int:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch must be a positive int, got {batch!r}")  # batch 0 printed a NaN error
    sizes = [1024, 4096, 4096, 1000]
    reason = gpu_missing()
    device = "cpu" if reason else "gpu"
    dtype = "fp32" if reason else "bf16"
    print(f"libnn demo: {'no GPU (' + reason + '): running the reference path on the CPU' if reason else 'running on the GPU'}")
    x = np.random.default_rng(0).standard_normal((batch, sizes[0])).astype(np.float32)
    model = MLP(sizes, dtype, device, path)
    reference = MLP(sizes, "fp64", "cpu", "reference")
    reference.load_state_dict({k: (v.get() if hasattr(v, "get") else v) for k, v in model.state_dict().items()})
    inputs = x.astype(model.fc0.weight.dtype)
    if device == "gpu":
        import cupy
        inputs = cupy.asarray(inputs)
    model(inputs)  # first call builds plans and compiles kernels
    start = time.perf_counter()
    repeats = 10
    for _ in range(repeats):
        y = model(inputs)
    if device == "gpu":
        import cupy
        cupy.cuda.get_current_stream().synchronize()
        y = cupy.asnumpy(y)
    elapsed = (time.perf_counter() - start) / repeats
    ran_on = linear_op.last_decision.path
    expected = reference(x.astype(np.float64))
    error = np.linalg.norm(y.astype(np.float64) - expected) / np.linalg.norm(expected)
    flops = sum(2 * batch * k * n for k, n in zip(sizes, sizes[1:]))
    print(f"MLP {' -> '.join(map(str, sizes))}, batch {batch}, {dtype}: path '{ran_on}' "
          f"per layer, {elapsed * 1e3:.3f} ms per forward ({flops / elapsed / 1e9:.1f} GFLOP/s)")
    print(f"relative L2 error against the float64 reference: {error:.2e}")
    return 0
