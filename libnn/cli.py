"""The `libnn` command: `libnn --help` lists the subcommands, each with its own --help."""

# Each command imports the module that does its work (bench.*, inspect, demo, models.run_cnn,
# runtime.kernels) when it runs, not here: `libnn --help` and `libnn info` would otherwise load them
# all, a sizeable part of the start-up (python -X importtime -m libnn --help; benchmarks/RESULTS.md). What
# every command shares is imported below; it costs nothing, since `import libnn` has loaded it already.

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from libnn.errors import LibnnError
from libnn.registry import ops, paths
from libnn.runtime import device


def _int_at_least(minimum: int):
    """An argparse type: an int >= minimum; argparse names the option in its error and exits 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


positive_int, non_negative_int = _int_at_least(1), _int_at_least(0)


def token_ids(text: str) -> list[int]:
    """An argparse type: token ids separated by commas ("1,15043,29892"); CausalLM checks their range."""
    try:
        return [int(piece) for piece in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids separated by commas (1,15043,29892), "
                                         f"got {text!r}") from None


def _info(args: argparse.Namespace) -> int:
    found = device.info()
    print(json.dumps(found.as_dict(), indent=2) if args.json else found.table())
    return 0


def _paths(args: argparse.Namespace) -> int:
    from libnn.bench.harness import format_table

    for op in [args.op] if args.op else ops():
        print(f"{op}:")
        print(format_table(paths(op), ["path", "kind", "device", "available", "reason"]))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from libnn.demo import run

    return run(batch=args.batch, path=args.path)


def _run(args: argparse.Namespace) -> int:
    from libnn.models.run_cnn import run

    return run(batch=args.batch, path=args.path, dtype=args.dtype)


def _generate(args: argparse.Namespace) -> int:
    from libnn.models.run_generate import run

    return run(args.directory, args.prompts or [], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
               top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=args.eos_token_id, dtype=args.dtype,
               device=args.device, max_len=args.max_len, stream=args.stream, warmup=args.warmup)


def _bench(args: argparse.Namespace) -> int:
    if args.only is not None:
        from libnn.bench.models import PARTS

        parts = [p.strip() for p in args.only.split(",")]
        if args.op != "models" or not all(p in PARTS for p in parts):
            print(f"libnn bench: --only takes parts of `bench models` among {', '.join(PARTS)}, comma-separated; "
                  f"got {args.only!r} for `bench {args.op}`", file=sys.stderr)
            return 2
    if reason := device.gpu_missing():
        print(f"libnn bench needs a GPU: {reason}", file=sys.stderr)
        return 2
    options = {} if args.only is None else {"only": args.only}
    importlib.import_module(f"libnn.bench.{args.op}").run(quick=args.quick, json_path=args.json, **options)
    return 0


def _plans(args: argparse.Namespace) -> int:
    needed = {"linear": ["m", "n", "k"], "conv2d": ["n", "c", "h", "w", "k", "r"], "attention": ["b", "h", "s", "d"]}[args.op]
    if missing := [f"--{a}" for a in needed if getattr(args, a) is None]:
        print(f"libnn plans {args.op}: missing {' '.join(missing)}", file=sys.stderr)
        return 2

    if reason := device.gpu_missing():
        print(f"libnn plans needs a GPU: {reason}", file=sys.stderr)
        return 2
    from libnn.inspect import attention_plans, conv_plans, linear_plans

    if args.op == "linear":
        report = linear_plans(m=args.m, n=args.n, k=args.k, dtype=args.dtype or "bf16", bias=not args.no_bias,
                              activation=args.activation, allow_tf32=args.tf32, time=args.time)
    elif args.op == "attention":
        report = attention_plans(b=args.b, h=args.h, s=args.s, d=args.d, s_kv=args.s_kv, h_kv=args.h_kv,
                                 dtype=args.dtype or "bf16", causal=args.causal, time=args.time,
                                 progress=not args.json)
    else:
        report = conv_plans(n=args.n, c=args.c, h=args.h, w=args.w, k=args.k, r=args.r, s=args.s or args.r,
                            stride=args.stride, padding=args.padding, dilation=args.dilation, groups=args.groups,
                            dtype=args.dtype or "fp16", layout=args.layout, activation=args.activation,
                            bn=not args.no_bias, time=args.time, progress=not args.json)
    print(json.dumps(report.as_dict(), indent=2, default=str) if args.json else report.table())
    return 0


def _check_kernels(args: argparse.Namespace) -> int:
    from libnn.bench.harness import format_table
    from libnn.runtime.kernels import compile_report

    rows = compile_report(args.arch, progress=lambda line: print(f"libnn check-kernels: {line}", file=sys.stderr,
                                                                flush=True))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows, ["file", "arch", "kernel", "registers", "smem_bytes", "stack_bytes", "spill_bytes"]))
    return 1 if any(r["spill_bytes"] for r in rows) and args.fail_on_spill else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libnn", description="GPU inference layers on cuBLASLt, cuDNN and cuFFT, "
                                "each op raced against custom CUDA kernels and a float64 NumPy reference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="the GPU and the NVIDIA library versions libnn sees")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_info)

    s = sub.add_parser("paths", help="each op's paths and whether they can run here")
    s.add_argument("op", nargs="?", help="one op (default: all)")
    s.set_defaults(func=_paths)

    s = sub.add_parser("demo", help="a small MLP on the GPU if there is one, else on the NumPy reference path")
    s.add_argument("--batch", type=positive_int, default=64, help="rows of input (default 64)")
    s.add_argument("--path", default="auto", help="force a path for every layer (default auto)")
    s.set_defaults(func=_demo)

    s = sub.add_parser("run", help="a shipped model on its held-out data: accuracy and latency, on the GPU "
                       "if there is one, else on the NumPy reference path")
    s.add_argument("model", choices=["cnn"], help="cnn: SeedCNN, a small digit classifier (libnn.models.seed_cnn)")
    s.add_argument("--batch", type=int, default=64, help="images per batch (default 64)")  # run() checks it
    s.add_argument("--path", default="auto", choices=["auto", "custom", "reference"],
                   help="force a path for every op (default auto)")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="default fp32")
    s.set_defaults(func=_run)

    s = sub.add_parser("generate", help="continue prompts with a LLaMA or GPT-2 checkpoint: the new tokens, the "
                       "time to the first token and tokens/s, on the GPU if there is one, else on the reference "
                       "path on the CPU",
                       description="Several prompts (--prompt-ids and --prompt, in the order given) make one batch. "
                       "Greedy unless --temperature is above 0. Times are wall clock: prefill is the time to the "
                       "first token, decode tokens/s counts the tokens of the steps after it.")
    s.add_argument("directory", metavar="DIR", help="a Hugging Face LlamaForCausalLM checkpoint: config.json and "
                   "model.safetensors (or its sharded index); tokenizer.json for --prompt")
    s.add_argument("--prompt-ids", dest="prompts", action="append", type=token_ids, metavar="IDS",
                   help="a prompt as token ids separated by commas, e.g. 1,15043,29892 (repeat for a batch)")
    s.add_argument("--prompt", dest="prompts", action="append", metavar="TEXT",
                   help="a prompt as text, encoded and the new tokens decoded with DIR/tokenizer.json "
                   "(needs the optional `tokenizers` package; repeat for a batch)")
    s.add_argument("--max-new-tokens", type=non_negative_int, default=32, metavar="N",
                   help="tokens to generate per sequence, the end token included (default 32)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 for greedy (the default), "
                   "else sample from softmax(logits / T)")
    s.add_argument("--top-k", type=positive_int, metavar="K", help="sample among the K most likely tokens only")
    s.add_argument("--top-p", type=float, metavar="P", help="sample among the fewest most likely tokens "
                   "whose probabilities add up to P, in (0, 1]")
    s.add_argument("--seed", type=non_negative_int, metavar="S", help="the sampler's seed, below 2**32 "
                   "(default: fresh entropy)")
    s.add_argument("--eos-token-id", type=non_negative_int, nargs="*", metavar="ID", help="end tokens "
                   "(default: the config's eos_token_id); with no ID, no sequence ends early")
    s.add_argument("--dtype", choices=["fp16", "bf16", "fp32"],
                   help="the weights' and cache's dtype (default fp16 on the GPU, fp32 on the CPU)")
    s.add_argument("--device", choices=["gpu", "cpu"], help="default: the GPU if there is one, else the CPU "
                   "(every op's reference path)")
    s.add_argument("--max-len", type=positive_int, metavar="L", help="the KV cache's tokens per sequence, prompt "
                   "and new tokens (default min(2048, max_position_embeddings))")
    s.add_argument("--stream", action="store_true", help="print each step's tokens as they come (and their "
                   "text with --prompt), one line per step")
    s.add_argument("--warmup", action="store_true", help="run the prefill and one decode step of the same prompts "
                   "untimed first, so that kernel compiles, plan builds and the decode graph's capture are not timed")
    s.set_defaults(func=_generate)

    s = sub.add_parser("bench", help="time an op's paths against each other and PyTorch (GPU only)")
    s.add_argument("op", choices=["linear", "conv2d", "pool2d", "fft_conv", "attention", "argmax", "models",
                                  "overhead", "generate"],
                   help="the op (or, for models, the whole seed CNN and encoder; for overhead, the host "
                   "cost of a cached call of every op against PyTorch's; for generate, LLaMA and GPT-2 "
                   "prefill and decode against Hugging Face's) to benchmark")
    s.add_argument("--quick", action="store_true", help="small shapes only, for a smoke test")
    s.add_argument("--json", metavar="FILE", help="also write every result to FILE (fft_conv: and a heat map PNG beside it)")
    s.add_argument("--only", metavar="PARTS", help="models only: the parts to run, comma-separated, among "
                   "cnn, block, encoder, server, cold (default all)")
    s.set_defaults(func=_bench)

    s = sub.add_parser("plans", help="the plans a library's heuristics offer for one problem (GPU only)",
                       description="linear: --m --n --k (cuBLASLt). conv2d: --n --c --h --w --k --r [--s] "
                       "[--stride --padding --dilation --groups --layout] (cuDNN, heuristics modes A, B, FALLBACK). "
                       "attention: --b --h --s --d [--s-kv --h-kv --causal] (cuDNN SDPA, BHSD).")
    s.add_argument("op", choices=["linear", "conv2d", "attention"], help="the op whose plans to list")
    s.add_argument("--m", type=positive_int, help="linear: rows of x")
    s.add_argument("--n", type=positive_int, help="linear: output features; conv2d: batch size")
    s.add_argument("--k", type=positive_int, help="linear: input features; conv2d: output channels")
    s.add_argument("--b", type=positive_int, help="attention: batch size")
    s.add_argument("--s", type=positive_int, help="attention: query sequence length; conv2d: filter width (default: --r)")
    s.add_argument("--d", type=positive_int, help="attention: head dimension")
    s.add_argument("--s-kv", type=positive_int, help="attention: key/value sequence length (default: --s)")
    s.add_argument("--h-kv", type=positive_int, help="attention: key/value heads (default: --h; fewer for GQA/MQA)")
    s.add_argument("--causal", action="store_true", help="attention: causal mask (top-left)")
    s.add_argument("--c", type=positive_int, help="conv2d: input channels")
    s.add_argument("--h", type=positive_int, help="conv2d: input height; attention: query heads")
    s.add_argument("--w", type=positive_int, help="conv2d: input width")
    s.add_argument("--r", type=positive_int, help="conv2d: filter height")
    s.add_argument("--stride", type=positive_int, default=1, help="conv2d: stride (default 1)")
    s.add_argument("--padding", type=non_negative_int, default=0, help="conv2d: padding (default 0)")
    s.add_argument("--dilation", type=positive_int, default=1, help="conv2d: dilation (default 1)")
    s.add_argument("--groups", type=positive_int, default=1, help="conv2d: groups (default 1)")
    s.add_argument("--layout", default="NHWC", choices=["NHWC", "NCHW"], help="conv2d: layout (default NHWC)")
    s.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="default bf16 (linear, attention), fp16 (conv2d)")
    s.add_argument("--activation", choices=["relu", "relu6", "gelu", "silu"], help="fused activation (default none)")
    s.add_argument("--no-bias", action="store_true", help="without the bias (linear) or batch-norm (conv2d) epilogue")
    s.add_argument("--tf32", action="store_true", help="allow TF32 for fp32")
    s.add_argument("--time", action="store_true", help="time every candidate (CUDA events, median)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_plans)

    s = sub.add_parser("check-kernels", help="compile every kernels/*.cu with NVRTC (no GPU needed) and "
                       "report registers, shared memory and spills")
    s.add_argument("--arch", nargs="+", default=["sm_80", "sm_90"], help="targets (default sm_80 sm_90)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills registers")
    s.set_defaults(func=_check_kernels)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # a user-facing command: the message, not a traceback
        # ModuleNotFoundError: an optional package this command needs is not installed (the message
        # says which); the environment's problem, not a bug to show a traceback for. FileNotFoundError
        # and KeyError: a checkpoint directory without its files, or with keys its config does not
        # name (the loaders' messages say which)
        if not isinstance(exc, LibnnError | ValueError | TypeError | MemoryError | ModuleNotFoundError
                          | FileNotFoundError | KeyError):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # str() of a KeyError quotes it
        print(f"libnn {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
