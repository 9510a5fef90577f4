"""`libnn bench overhead`: what a cached call costs on the host, op by op, against PyTorch.

Every case is a problem whose GPU work is tiny (a few microseconds), so the time per call of
back-to-back calls is the host's cost of issuing the work: argument checks, the signature lookup, the
output's allocation and the library call or kernel launch. Three tables:

- **ops and layers**: each op's cached call on each of its GPU paths, the `nn` layers around them, and
  PyTorch's equivalent op or module on the same shapes in the same run (µs per call, and
  libnn's speed relative to PyTorch's);
- **floors**: what the libraries themselves cost per call from Python, measured the same way (CuPy's
  allocation, a kernel launch through CuPy and through cuda-bindings with pre-packed arguments,
  cuBLASLt's matmul, the cuDNN frontend's `execute`, `execute_plan_at_index` and its raw-pointer
  entry point, a CUDA graph launch through CuPy and through cuda-bindings): the least a libnn call can
  cost, and the evidence for which entry point libnn uses;
- **models**: back-to-back per-call time of whole models in eager mode against PyTorch eager.

Per-call time is the median over repeats of (wall time of N back-to-back calls, then one
synchronisation) / N: what a user's loop sees. See `harness.time_per_call`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from libnn import dtypes
from libnn.backends import cublaslt, cudnn
from libnn.bench import harness
from libnn.bench.models import ENCODER, SEQ
from libnn.models.bert import BertConfig, BertEncoder
from libnn.models.seed_cnn import SeedCNN
from libnn.models.train_seed_cnn import torch_model
from libnn.nn import BatchNorm2d, Conv2d, Embedding, Linear, ReLU, Sequential, SiLU
from libnn.ops import attention, conv2d, fft_conv2d, layer_norm, linear, max_pool2d, softmax
from libnn.ops.conv2d import UID_SCALE, UID_SHIFT, UID_W, UID_X, UID_Y, conv2d_graph_builder, conv2d_problem
from libnn.ops.linear import LinearProblem
from libnn.runtime import kernels
from libnn.runtime.handles import cudnn_handle, workspace
from libnn.runtime.stream import current_stream


@dataclass(frozen=True)
class Case:
    """One row: a libnn call and, where PyTorch has one, its equivalent, built by `setup()`."""
    group: str                                    # "op", "layer" or "model"
    name: str
    setup: Callable[[], tuple[Callable[[], Any], Callable[[], Any] | None]]


def _rng():
    import cupy
    return cupy.random.default_rng(7)


def _normal(shape, dtype="fp16"):
    return _rng().standard_normal(shape, dtype="float32").astype(dtypes.parse(dtype))


def _torch(a):
    import torch
    return torch.from_dlpack(a)


def _linear(path: str):
    def setup():
        import torch

        x, w, b = _normal((16, 64)), _normal((64, 64)), _normal((64,))
        tx, tw, tb = _torch(x), _torch(w), _torch(b)
        return (lambda: linear(x, w, b, path=path)), (lambda: torch.nn.functional.linear(tx, tw, tb))
    return setup


def _conv(path: str):
    def setup():
        import torch

        x, w = _normal((1, 8, 8, 16)), _normal((16, 3, 3, 16))
        scale, shift = _normal((16,), "fp32"), _normal((16,), "fp32")
        conv = torch.nn.Conv2d(16, 16, 3, padding=1).cuda().half().to(memory_format=torch.channels_last)
        peer = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(16).cuda().half(), torch.nn.ReLU()).eval()
        tx = _torch(x).permute(0, 3, 1, 2)  # NHWC storage, NCHW view: channels_last

        def torch_call():
            with torch.inference_mode():
                return peer(tx)
        return (lambda: conv2d(x, w, padding=1, bn=(scale, shift), activation="relu", path=path)), torch_call
    return setup


def _attention(path: str):
    def setup():
        import torch

        q, k, v = (_normal((1, 2, 16, 64)) for _ in range(3))
        tq, tk, tv = _torch(q), _torch(k), _torch(v)
        return (lambda: attention(q, k, v, path=path)), \
            (lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))
    return setup


def _layer_norm(path: str):
    def setup():
        import torch

        x, w, b = _normal((16, 64)), _normal((64,)), _normal((64,))
        tx, tw, tb = _torch(x), _torch(w), _torch(b)
        return (lambda: layer_norm(x, w, b, path=path)), \
            (lambda: torch.nn.functional.layer_norm(tx, (64,), tw, tb))
    return setup


def _softmax():
    import torch

    x = _normal((16, 64))
    tx = _torch(x)
    return (lambda: softmax(x)), (lambda: torch.softmax(tx, -1))


def _max_pool():
    import torch

    x = _normal((1, 8, 8, 16))
    tx = _torch(x).permute(0, 3, 1, 2)
    return (lambda: max_pool2d(x, 2)), (lambda: torch.nn.functional.max_pool2d(tx, 2))


def _fft_conv(path: str):
    def setup():
        import cupyx.scipy.signal

        x, w = _normal((1, 1, 32, 32), "fp32"), _normal((1, 1, 7, 7), "fp32")
        x2, w2 = x[0, 0], w[0, 0, ::-1, ::-1]
        # the peer here is CuPy's fftconvolve (PyTorch has no FFT convolution op)
        return (lambda: fft_conv2d(x, w, path=path)), (lambda: cupyx.scipy.signal.fftconvolve(x2, w2, mode="valid"))
    return setup


def _embedding():
    import cupy
    import torch

    layer = Embedding(1000, 64, dtype="fp16", device="gpu", seed=1)
    ids = _rng().integers(0, 1000, (1, 16), dtype=cupy.int64)
    peer = torch.nn.Embedding(1000, 64).cuda().half()
    tids = _torch(ids)
    return (lambda: layer(ids)), (lambda: peer(tids))


def _linear_layer():
    import torch

    layer = Linear(64, 64, dtype="fp16", device="gpu", seed=1)
    peer = torch.nn.Linear(64, 64).cuda().half()
    x = _normal((16, 64))
    tx = _torch(x)

    def torch_call():
        with torch.inference_mode():
            return peer(tx)
    return (lambda: layer(x)), torch_call


def _sequential_conv():
    import torch

    kw = dict(dtype="fp16", device="gpu")
    model = Sequential(Conv2d(16, 16, 3, padding=1, seed=1, **kw), BatchNorm2d(16, **kw), ReLU())
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).cuda().half().to(memory_format=torch.channels_last)
    peer = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(16).cuda().half(), torch.nn.ReLU()).eval()
    x = _normal((1, 8, 8, 16))
    tx = _torch(x).permute(0, 3, 1, 2)

    def torch_call():
        with torch.inference_mode():
            return peer(tx)
    return (lambda: model(x)), torch_call


def _seed_cnn_models(batch: int):
    import torch

    model = SeedCNN.pretrained(dtype="fp16", device="gpu")
    x = _normal((batch, 1, 28, 28))
    peer = torch_model().cuda().eval().half().to(memory_format=torch.channels_last)
    tx = _torch(x).contiguous(memory_format=torch.channels_last)
    return model, x, peer, tx


def _eager(model, args, peer, peer_args):
    import torch

    def torch_call():
        with torch.inference_mode():
            return peer(*peer_args)
    return (lambda: model(*args)), torch_call


def _seed_cnn_eager(batch: int):
    def setup():
        model, x, peer, tx = _seed_cnn_models(batch)
        return _eager(model, (x,), peer, (tx,))
    return setup


def _torch_graph_replay(peer, tx):
    """The replay of PyTorch's CUDA graph of `peer(tx)`, captured after three warm-up calls."""
    import torch

    torch_graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        for _ in range(3):
            peer(tx)
        torch.cuda.synchronize()
        with torch.cuda.graph(torch_graph):
            peer(tx)
    return torch_graph.replay


def _graph_replay():
    """libnn's graph replay with caller-filled buffers against PyTorch's CUDA graph of the same model."""
    model, x, peer, tx = _seed_cnn_models(1)
    graphed = model.graphed()
    buffers = graphed.inputs(x)
    return (lambda: graphed(*buffers)), _torch_graph_replay(peer, tx)


def _tiny_graph_replay():
    """Graph replay's host cost: a captured nn.Linear (16 x 64 x 64, one GEMM: GPU work a few µs), replayed
    with caller-filled buffers by `g.replay()`, against torch.cuda.graph's replay of torch's Linear; the
    floors' CUDA graph launch is the least either can cost."""
    import torch

    layer, peer = Linear(64, 64, dtype="fp16", device="gpu", seed=1), torch.nn.Linear(64, 64).cuda().half()
    graphed = layer.graphed()
    graphed.inputs(_normal((16, 64)))[0][...] = _normal((16, 64))
    return graphed.replay, _torch_graph_replay(peer, _torch(_normal((16, 64))))


def _encoder_eager():
    from transformers import BertConfig as HFConfig, BertModel

    model = BertEncoder(BertConfig.from_dict(ENCODER), pooler=False, dtype="fp16", device="gpu")
    ids = _rng().integers(0, ENCODER["vocab_size"], (1, SEQ), dtype="int64")
    peer = BertModel(HFConfig(**ENCODER), add_pooling_layer=False).cuda().eval().half()
    return _eager(model, (ids,), peer, (_torch(ids),))


def _depthwise_blocks():
    """Four EfficientNet-style blocks (1x1 expand, 3x3 depthwise, 1x1 project, BN and SiLU) at batch 1."""
    import torch

    kw = dict(dtype="fp16", device="gpu")
    layers, peers = [], []
    for cin, cout in ((32, 32), (32, 32), (32, 64), (64, 64)):
        wide = 4 * cin
        layers += [Conv2d(cin, wide, 1, bias=False, seed=1, **kw), BatchNorm2d(wide, **kw), SiLU(),
                   Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False, seed=2, **kw), BatchNorm2d(wide, **kw),
                   SiLU(), Conv2d(wide, cout, 1, bias=False, seed=3, **kw), BatchNorm2d(cout, **kw)]
        peers += [torch.nn.Conv2d(cin, wide, 1, bias=False), torch.nn.BatchNorm2d(wide), torch.nn.SiLU(),
                  torch.nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False), torch.nn.BatchNorm2d(wide),
                  torch.nn.SiLU(), torch.nn.Conv2d(wide, cout, 1, bias=False), torch.nn.BatchNorm2d(cout)]
    model = Sequential(*layers)
    peer = torch.nn.Sequential(*peers).cuda().eval().half().to(memory_format=torch.channels_last)
    x = _normal((1, 28, 28, 32))
    return _eager(model, (x,), peer, (_torch(x).permute(0, 3, 1, 2),))


OPS = [
    Case("op", "linear cublaslt", _linear("cublaslt")),
    Case("op", "linear custom", _linear("custom")),
    Case("op", "conv2d+bn+relu cudnn (fused graph)", _conv("cudnn")),
    Case("op", "conv2d+bn+relu custom", _conv("custom")),
    Case("op", "attention cudnn", _attention("cudnn")),
    Case("op", "attention custom", _attention("custom")),
    Case("op", "layer_norm custom", _layer_norm("custom")),
    Case("op", "layer_norm cudnn", _layer_norm("cudnn")),
    Case("op", "softmax", _softmax),
    Case("op", "max_pool2d", _max_pool),
    Case("op", "fft_conv2d cufft", _fft_conv("cufft")),
    Case("op", "fft_conv2d custom", _fft_conv("custom")),
    Case("layer", "Embedding", _embedding),
    Case("layer", "Linear", _linear_layer),
    Case("layer", "Sequential(Conv2d, BatchNorm2d, ReLU)", _sequential_conv),
    Case("graph", "SeedCNN bs1 graph replay, caller-filled buffers (peer: torch.cuda.graph replay)", _graph_replay),
    Case("graph", "Linear 16x64 graph: g.replay() (peer: torch.cuda.graph replay)", _tiny_graph_replay),
]

MODELS = [
    Case("model", "SeedCNN fp16 bs1 eager", _seed_cnn_eager(1)),
    Case("model", "SeedCNN fp16 bs64 eager", _seed_cnn_eager(64)),
    Case("model", "encoder (MiniLM shape) fp16 bs1 eager (peer: HF transformers)", _encoder_eager),
    Case("model", "depthwise blocks x4 fp16 bs1 eager", _depthwise_blocks),
]


def _op_rows(cases: list[Case], calls: int) -> list[dict[str, Any]]:
    rows = []
    for i, case in enumerate(cases, 1):
        harness.progress(i, len(cases), f"{case.group} {case.name}")
        row: dict[str, Any] = {"group": case.group, "case": case.name}
        try:
            ours, peer = case.setup()
            row["libnn us"] = harness.time_per_call(ours, calls=calls) * 1e3
            if peer is not None:
                row["peer us"] = harness.time_per_call(peer, calls=calls) * 1e3
                row["speed vs peer"] = row["peer us"] / row["libnn us"]
        except Exception as exc:  # a path that cannot run here: say why, keep the table going
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
        rows.append(row)
    return rows


# --- floors: what the libraries cost per call from Python ---------------------------------------------
def _floor_alloc():
    import cupy
    return lambda: cupy.empty((16, 64), cupy.float16)


def _floor_allocator():
    from libnn.runtime.arrays import allocator
    return allocator((16, 64), "float16")


def _floor_stream():
    import cupy
    return lambda: cupy.cuda.get_current_stream().ptr


def _epilogue_kernel_args():
    import cupy

    y = _normal((16, 64))
    f = kernels.function("epilogue.cu", "channel_epilogue_f16")
    null = np.uint64(0)
    args = (y, null, null, np.int64(y.size), np.int32(1), np.int64(1), np.int32(1))
    return f, y, args, cupy


def _floor_rawkernel():
    f, y, args, _ = _epilogue_kernel_args()
    return lambda: f((4,), (256,), args)


def _floor_culaunch():
    from cuda.bindings import driver

    import cupy
    f, y, _, _ = _epilogue_kernel_args()
    slots = np.zeros(7, np.uint64)  # one 8-byte slot per argument, little-endian: ints in the low bytes
    slots.view(np.int64)[3] = y.size
    slots.view(np.int32)[8] = 1   # slot 4, low word
    slots.view(np.int64)[5] = 1
    slots.view(np.int32)[12] = 1  # slot 6, low word
    pointers = np.array([slots.ctypes.data + 8 * i for i in range(7)], np.uint64)
    function = driver.CUfunction(f.kernel.ptr)
    stream = driver.CUstream(cupy.cuda.get_current_stream().ptr)
    address = pointers.ctypes.data

    def launch():
        slots[0] = y.data.ptr
        driver.cuLaunchKernel(function, 4, 1, 1, 256, 1, 1, 0, stream, address, 0)
    return launch


def _floor_launch(programmatic: bool):
    """libnn's Launch of the same kernel: cuLaunchKernelEx (cuda-bindings) with its configuration built once
    where `programmatic`, CuPy's driver binding of cuLaunchKernel otherwise (runtime/launch.py)."""
    from libnn.runtime import launch as launcher

    def setup():
        f, y, args, cupy = _epilogue_kernel_args()
        bound = launcher.Launch(f, "channel_epilogue_f16", (4,), (256,), 0, cupy.cuda.get_current_stream().ptr,
                                [launcher.ARRAY, *args[1:]], programmatic=programmatic)
        return lambda: bound(y)
    return setup


def _floor_cublaslt():
    import cupy

    x, w, b = _normal((16, 64)), _normal((64, 64)), _normal((64,))
    y = cupy.empty((16, 64), cupy.float16)
    problem = LinearProblem(16, 64, 64, "fp16", True, None, False, f"gpu:{x.device.id}")
    stream = current_stream().ptr
    run = cublaslt.plan_for(problem, x, w, b, y, stream).runner(stream)
    return lambda: run(x, w, b, y)


def _cudnn_conv_graph():
    import cupy

    x, w = _normal((1, 8, 8, 16)), _normal((16, 3, 3, 16))
    scale, shift = _normal((16,), "fp32"), _normal((16,), "fp32")
    problem = conv2d_problem(x, w, None, (scale, shift), 1, 1, 1, 1, "relu", "NHWC", False)
    graph = cudnn.graph_for(problem, conv2d_graph_builder(problem), problem.describe)
    y = cupy.empty((1, 8, 8, 16), cupy.float16)
    buffers = {UID_X: x, UID_W: w, UID_SCALE: scale, UID_SHIFT: shift, UID_Y: y}
    return graph, buffers


def _floor_cudnn_execute():
    """The frontend's own generic execute, given the uid -> pointer dict."""
    graph, buffers = _cudnn_conv_graph()
    pack = {uid: a.data.ptr for uid, a in buffers.items()}
    space = workspace(graph.workspace_bytes).data.ptr
    return lambda: graph.graph.execute(pack, space, handle=graph.handle)


def _floor_cudnn_execute_at_index():
    """execute_plan_at_index on a graph of its own whose every heuristic plan is built, so that index 0
    names a built plan whichever plan libnn's graph runs."""
    import cupy

    _, buffers = _cudnn_conv_graph()
    problem = conv2d_problem(buffers[UID_X], buffers[UID_W], None, (buffers[UID_SCALE], buffers[UID_SHIFT]), 1, 1, 1,
                             1, "relu", "NHWC", False)
    handle = cudnn_handle()
    graph = cudnn.planned_graph(conv2d_graph_builder(problem), handle, ("A",))
    graph.build_plan_at_index(0)
    pack = {uid: a.data.ptr for uid, a in buffers.items()}
    space = workspace(graph.get_workspace_size_plan_at_index(0)).data.ptr
    cupy.cuda.get_current_stream().synchronize()
    return lambda: graph.execute_plan_at_index(pack, space, index=0, handle=handle)


def _floor_cudnn_raw():
    """libnn's own executor: the frontend's raw-pointer entry point where it has one (RawExecute)."""
    graph, buffers = _cudnn_conv_graph()
    execute = graph.executor(list(buffers))
    arrays = list(buffers.values())
    print(f"  cuDNN executor in use: {type(execute).__name__}", file=sys.stderr)
    return lambda: execute(*arrays)


def _captured_graph():
    import cupy
    x = _normal((16, 64))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        x *= 1
        graph = stream.end_capture()
        graph.upload(stream)
    stream.synchronize()
    return graph, stream


def _floor_graph_cupy():
    graph, stream = _captured_graph()
    return lambda: graph.launch(stream)


def _floor_graph_raw():
    from cuda.bindings import runtime
    graph, stream = _captured_graph()
    exec_handle = runtime.cudaGraphExec_t(graph.graphExec)
    raw_stream = runtime.cudaStream_t(stream.ptr)

    def launch():  # holds graph and stream: the raw handles die with them (a launch after that crashes)
        return runtime.cudaGraphLaunch(exec_handle, raw_stream), graph, stream
    return launch


def _floor_torch_empty():
    import torch
    return lambda: torch.empty((16, 64), dtype=torch.float16, device="cuda")


FLOORS = [
    ("cupy.empty (16, 64) fp16", _floor_alloc),
    ("cupy.ndarray (16, 64) fp16 given cupy.cuda.alloc's memory (libnn's allocator)", _floor_allocator),
    ("cupy current stream .ptr", _floor_stream),
    ("torch.empty (16, 64) fp16", _floor_torch_empty),
    ("kernel launch: cupy RawKernel (7 args)", _floor_rawkernel),
    ("kernel launch: cuda-bindings cuLaunchKernel, pre-packed", _floor_culaunch),
    ("kernel launch: libnn's plain Launch (CuPy's driver binding of cuLaunchKernel)", _floor_launch(False)),
    ("kernel launch: libnn's programmatic Launch (cuLaunchKernelEx, configuration built once)", _floor_launch(True)),
    ("cuBLASLt matmul (libnn's plan, raw binding)", _floor_cublaslt),
    ("cuDNN frontend execute(dict)", _floor_cudnn_execute),
    ("cuDNN frontend execute_plan_at_index(dict)", _floor_cudnn_execute_at_index),
    ("cuDNN frontend raw-pointer execute (libnn's executor)", _floor_cudnn_raw),
    ("CUDA graph launch: cupy Graph.launch", _floor_graph_cupy),
    ("CUDA graph launch: cuda-bindings cudaGraphLaunch", _floor_graph_raw),
]


def _floor_rows(calls: int) -> list[dict[str, Any]]:
    rows = []
    for i, (name, setup) in enumerate(FLOORS, 1):
        harness.progress(i, len(FLOORS), f"floor {name}")
        row: dict[str, Any] = {"floor": name}
        try:
            row["us per call"] = harness.time_per_call(setup(), calls=calls) * 1e3
        except Exception as exc:
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
    return rows


def run(quick: bool = False, json_path: str | None = None) -> list[dict[str, Any]]:
    calls = 300 if quick else 2000
    print("host cost of a cached call (µs per call, back-to-back calls; GPU work tiny)", file=sys.stderr)
    rows = _op_rows(OPS, calls) + _op_rows(MODELS, max(calls // 10, 50))
    print(harness.format_table(rows, ["group", "case", "libnn us", "peer us", "speed vs peer", "note"]), flush=True)
    if json_path:
        harness.save_json(json_path, {"rows": rows})
    # the floors reach into the libraries' lower-level entry points: last, so that the table above stands
    floors = _floor_rows(calls)
    print()
    print(harness.format_table(floors, ["floor", "us per call", "note"]))
    if json_path:
        harness.save_json(json_path, {"rows": rows, "floors": floors})
    return rows
