"""`libnn generate` through libnn.cli.main (no subprocess), on the tiny random LLaMA checkpoint of
tests/test_llama.py (2 layers, hidden 64, vocab 97, max_position_embeddings 64): the printed tokens are
CausalLM.generate's for the same arguments on the CPU reference path in fp32 (greedy, seeded sampling with
top_k and top_p, an end token), for a batch of two prompts of different lengths; --stream's step lines
carry the same tokens; the summary's counts add up; the printing's time is not the decode's; bad
arguments exit 2 with the library's message; text prompts through a WordLevel tokenizer.json where the
optional `tokenizers` package is installed, and a clear error where it or the file is missing.

On the GPU (marked gpu): --device gpu --dtype fp16 prints the tokens of the same checkpoint's own GPU
model (generate with the same max_batch and max_len: the same kernels on the same shapes, so equal
tokens, with no tolerance for near-ties to meet), and the default device is the GPU in fp16."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import types

import numpy as np
import pytest

from test_llama import CONFIG, V, random_state, write_checkpoint

from libnn.cli import main
from libnn.models import CausalLM
from libnn.models import run_generate
from libnn.runtime.device import gpu_missing

PROMPTS = ([5, 17, 33, 2, 90, 61, 8], [40, 3, 77])  # two lengths: the batch is right-padded
NEW = 8
CPU = ("--device", "cpu", "--dtype", "fp32")
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}
SEQUENCE = re.compile(r"^\[(\d+)\] (\d+) prompt tokens, (\d+) new:((?: \d+)*)$")
STEP = re.compile(r"^step (\d+): ([-\d ]+?)(?:  (\[.*\]))?$")
SUMMARY = re.compile(r"^batch of (\d+): (\d+) prompt tokens, (\d+) new tokens; prefill ([\d.]+) ms \(time to first "
                     r"token\); decode (\d+) steps, (\d+) tokens in ([\d.]+) ms: ([\d.]+) tokens/s$")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), CONFIG, random_state(np.random.default_rng(11), CONFIG))


def generate(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `libnn generate ARGS`; argparse's own errors exit through SystemExit."""
    try:
        code = main(["generate", *args])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def prompt_args(prompts=PROMPTS) -> list[str]:
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


def option_args(kwargs: dict) -> list[str]:
    """--temperature 0.8 --top-k 20 ... of generate's keyword arguments; eos_token_id a tuple of ids."""
    args = []
    for name, value in kwargs.items():
        values = value if isinstance(value, tuple) else (value,)
        args += [f"--{name.replace('_', '-')}", *map(str, values)]
    return args


def printed_sequences(out: str) -> list[list[int]]:
    """The new tokens of each `[b] ... new: ...` line, in order, checked against the prompts' lengths."""
    found = [SEQUENCE.match(line) for line in out.splitlines()]
    found = [m for m in found if m]
    assert [int(m[1]) for m in found] == list(range(len(found)))
    tokens = [[int(t) for t in m[4].split()] for m in found]
    assert [int(m[3]) for m in found] == [len(t) for t in tokens]
    return tokens


def reference(directory, prompts=PROMPTS, dtype="fp32", device="cpu", **kwargs) -> list[list[int]]:
    model = CausalLM.from_pretrained(directory, dtype=dtype, device=device, max_batch=len(prompts))
    return [t.tolist() for t in model.generate([list(p) for p in prompts], NEW, **kwargs)]


# --- tokens -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_the_printed_tokens_are_generates_for_the_same_arguments(capsys, directory, kwargs):
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), *CPU,
                              *option_args(kwargs))
    assert code == 0, err
    expected = reference(directory, **kwargs)
    assert printed_sequences(out) == expected
    assert [int(m[2]) for m in map(SEQUENCE.match, out.splitlines()) if m] == [len(p) for p in PROMPTS]
    assert "fp32 on the CPU" in out


def test_an_end_token_stops_its_sequence_as_in_generate(capsys, directory):
    free = reference(directory, eos_token_id=())
    eos = free[0][2]  # the first sequence ends at its first such token; the other goes on unless it meets one
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), *CPU,
                              "--eos-token-id", str(eos))
    assert code == 0, err
    tokens = printed_sequences(out)
    assert tokens == reference(directory, eos_token_id=eos)
    assert tokens[0] == free[0][:free[0].index(eos) + 1]


def test_no_end_token_id_means_no_sequence_ends_early(capsys, directory):
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), *CPU,
                              "--eos-token-id")
    assert code == 0, err
    assert printed_sequences(out) == reference(directory, eos_token_id=())


@pytest.mark.parametrize("kwargs", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_stream_prints_each_steps_tokens_as_they_come(capsys, directory, kwargs):
    eos = reference(directory, eos_token_id=(), **kwargs)[1][4]  # the second sequence ends at step 4 at the latest
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), *CPU, "--stream",
                              *option_args({**kwargs, "eos_token_id": (eos,)}))
    assert code == 0, err
    steps = [m for m in map(STEP.match, out.splitlines()) if m]
    assert [int(m[1]) for m in steps] == list(range(len(steps)))
    assert all(m[3] is None for m in steps)  # no text pieces without a tokenizer
    columns = [list(column) for column in zip(*(m[2].split() for m in steps))]
    expected = reference(directory, eos_token_id=eos, **kwargs)
    assert expected == printed_sequences(out)
    # each sequence's tokens, then '-' at the steps after its end
    assert columns == [[str(t) for t in e] + ["-"] * (len(steps) - len(e)) for e in expected]


def test_the_summary_counts_the_prompt_the_new_and_the_decode_tokens(capsys, directory):
    eos = reference(directory, eos_token_id=())[1][1]
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), *CPU,
                              "--eos-token-id", str(eos))
    assert code == 0, err
    tokens = printed_sequences(out)
    summary = SUMMARY.match(out.splitlines()[-1])
    assert summary, out
    batch, prompt, new, prefill_ms, steps, decode_tokens, decode_ms, rate = summary.groups()
    assert (int(batch), int(prompt), int(new)) == (2, sum(map(len, PROMPTS)), sum(map(len, tokens)))
    assert int(steps) == max(map(len, tokens)) - 1
    assert int(decode_tokens) == sum(len(t) - 1 for t in tokens)  # each sequence's first token is the prefill's
    assert float(prefill_ms) > 0
    # the times are printed to 0.1 ms, the rate to 0.1 tokens/s
    slowest, fastest = (int(decode_tokens) / (float(decode_ms) + d) * 1e3 for d in (0.05, -0.05))
    assert slowest - 0.05 <= float(rate) <= fastest + 0.05


def test_one_token_or_none_prints_no_decode_rate(capsys, directory):
    code, out, _ = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", "1", *CPU)
    assert code == 0 and out.splitlines()[-1].endswith("(time to first token); no decode step")
    code, out, _ = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", "0", *CPU)
    assert code == 0 and printed_sequences(out) == [[], []]
    assert out.splitlines()[-1] == "batch of 2: 10 prompt tokens, 0 new tokens; nothing ran (max_new_tokens 0)"


def test_timed_generation_leaves_out_the_time_of_what_each_step_does(directory):
    model = CausalLM.from_pretrained(directory, dtype="fp32", device="cpu", max_batch=2)
    seen = []

    def slow(step, tokens):
        seen.append(tokens.copy())
        time.sleep(0.3)

    result = run_generate.timed_generation(model, PROMPTS, 3, on_step=slow, eos_token_id=())
    assert [t.tolist() for t in result.tokens] == [list(column) for column in zip(*(s.tolist() for s in seen))]
    assert (result.steps, result.decode_tokens) == (3, 4)
    assert result.decode_s < 0.3  # two sleeps of 0.3 s were left out: the two decode steps take milliseconds


def test_the_default_device_without_a_gpu_is_the_cpu_in_fp32(capsys, directory, monkeypatch):
    monkeypatch.setattr(run_generate, "gpu_missing", lambda: "no GPU here (test)")
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", "3")
    assert code == 0, err
    assert out.splitlines()[0] == "libnn generate: no GPU (no GPU here (test)): running the reference path on the CPU"
    assert "vocab 97, fp32 on the CPU" in out.splitlines()[1]


# --- bad arguments: exit 2 and the message -----------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x"], r"argument --prompt-ids: expected token ids separated by commas \(1,15043,29892\), "
                              r"got '1,x'"),
    (["--prompt-ids", "1,97"], rf"CausalLM.stream: input_ids must lie in \[0, {V}\) \(vocab_size\), got values "
                               r"from 1 to 97"),
    (["--prompt-ids=-1"], r"CausalLM.stream: input_ids must lie in \[0, 97\)"),
    ([], r"no prompt: give --prompt-ids \(token ids, comma-separated\) or --prompt \(text\)"),
    (["--prompt-ids", "1", "--max-new-tokens", "-1"], r"argument --max-new-tokens: must be at least 0, got -1"),
    (["--prompt-ids", "1", "--temperature", "hot"], r"argument --temperature: invalid float value: 'hot'"),
    (["--prompt-ids", "1", "--temperature", "-0.5"], r"CausalLM.stream: temperature must be a finite number >= 0"),
    (["--prompt-ids", "1", "--temperature", "1", "--top-p", "1.5"], r"CausalLM.stream: top_p must be in \(0, 1\], "
                                                                    r"got 1.5"),
    (["--prompt-ids", "1", "--top-k", "0"], r"argument --top-k: must be at least 1, got 0"),
    (["--prompt-ids", "1", "--seed", str(2**32)], r"CausalLM.stream: seed must be below 2\*\*32"),
    (["--prompt-ids", "1", "--eos-token-id", "97"], r"CausalLM.stream: eos_token_id \[97\] outside the vocabulary"),
    (["--prompt-ids", "1,2,3,4,5", "--max-len", "4"], r"CausalLM.stream: a prompt of 5 tokens is longer than "
                                                       r"the KV cache's max_len 4"),
    (["--prompt-ids", "1,2,3", "--max-len", "4"], r"CausalLM.stream: max_new_tokens 32 after a prompt of 3 tokens "
                                                  r"needs 34 cache positions, more than max_len 4"),
    (["--prompt-ids", "1", "--max-len", "65"], r"CausalLM.from_pretrained: max_len 65 is beyond the model's "
                                               r"max_position_embeddings 64"),
    (["--prompt-ids", "1", "--dtype", "fp8"], r"argument --dtype: invalid choice: 'fp8'"),
])
def test_bad_arguments_exit_2_with_the_message(capsys, directory, args, message):
    code, _, err = generate(capsys, str(directory), *CPU, *args)
    assert code == 2
    assert re.search(rf"^libnn generate: (error: )?{message}", err, re.M), err


def test_a_missing_or_incomplete_checkpoint_exits_2_naming_it(capsys, directory, tmp_path):
    code, _, err = generate(capsys, str(tmp_path / "absent"), "--prompt-ids", "1", *CPU)
    assert code == 2 and err == f"libnn generate: CausalLM.from_pretrained: {str(tmp_path / 'absent')!r} has no " \
                                "config.json\n"
    shutil.copy(directory / "config.json", tmp_path)
    code, _, err = generate(capsys, str(tmp_path), "--prompt-ids", "1", *CPU)
    assert code == 2 and err.startswith(f"libnn generate: CausalLM.from_pretrained: {str(tmp_path)!r} has no "
                                        "model.safetensors")
    state = random_state(np.random.default_rng(0), CONFIG)
    del state["model.norm.weight"]
    write_checkpoint(tmp_path / "partial", CONFIG, state)
    code, _, err = generate(capsys, str(tmp_path / "partial"), "--prompt-ids", "1", *CPU)
    assert code == 2 and err.startswith("libnn generate: CausalLM.from_pretrained(") and "missing keys" in err


@pytest.mark.skipif(not gpu_missing(), reason="checks the message on machines without a GPU")
def test_device_gpu_without_a_gpu_exits_2_saying_so(capsys, directory):
    code, _, err = generate(capsys, str(directory), "--prompt-ids", "1", "--device", "gpu")
    assert code == 2 and "device='gpu' needs a GPU, and there is none here" in err


# --- text prompts ----------------------------------------------------------------------------------------
WORDS = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}


@pytest.fixture
def with_tokenizer(directory, tmp_path):
    """The checkpoint beside a WordLevel tokenizer.json of the words w3 ... w96 (id i for w{i}), the
    tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(directory / name, tmp_path)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, tokenizer


def test_text_prompts_are_encoded_and_the_new_tokens_decoded(capsys, with_tokenizer):
    path, tokenizer = with_tokenizer
    text = "w5 w17 w33 w2 w90"
    ids = tokenizer.encode(text).ids
    code, out, err = generate(capsys, str(path), "--prompt", text, "--prompt-ids", "40,3,77", "--max-new-tokens",
                              str(NEW), *CPU, "--stream", "--eos-token-id")
    assert code == 0, err
    tokens = printed_sequences(out)
    assert tokens == reference(path, prompts=(ids, [40, 3, 77]), eos_token_id=())
    texts = re.findall(r"^\[\d\] text: (.*)$", out, re.M)
    assert texts == [f'"{tokenizer.decode(t, skip_special_tokens=True)}"' for t in tokens]
    pieces = [m[3] for m in map(STEP.match, out.splitlines()) if m]
    assert ["".join(column) for column in zip(*map(json.loads, pieces))] == [json.loads(t) for t in texts]


def test_text_prompts_without_tokenizers_or_tokenizer_json_exit_2_and_ids_still_work(capsys, directory, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ModuleNotFoundError
    code, _, err = generate(capsys, str(directory), "--prompt", "hello", *CPU)
    assert code == 2 and err == ("libnn generate: --prompt takes text, which needs the optional `tokenizers` package "
                                 "(pip install tokenizers) and the checkpoint's tokenizer.json; without them give "
                                 "token ids with --prompt-ids\n")
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", "2", *CPU)
    assert code == 0 and len(printed_sequences(out)) == 2, err
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=None))  # installed, no file
    code, _, err = generate(capsys, str(directory), "--prompt", "hello", *CPU)
    assert code == 2 and err == (f"libnn generate: --prompt takes text, which needs the checkpoint's tokenizer.json, "
                                 f"and {str(directory / 'tokenizer.json')!r} is not there; give token ids with "
                                 "--prompt-ids\n")


# --- on the GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_on_the_gpu_the_printed_tokens_are_the_gpu_models_own(capsys, directory, kwargs):
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", str(NEW), "--device", "gpu",
                              "--dtype", "fp16", "--warmup", "--stream", *option_args(kwargs))
    assert code == 0, err
    assert "fp16 on the GPU" in out and SUMMARY.match(out.splitlines()[-1]), out
    assert printed_sequences(out) == reference(directory, dtype="fp16", device="gpu", **kwargs)


@pytest.mark.gpu
def test_the_default_device_is_the_gpu_in_fp16(capsys, directory):
    code, out, err = generate(capsys, str(directory), *prompt_args(), "--max-new-tokens", "3")
    assert code == 0, err
    assert "vocab 97, fp16 on the GPU" in out.splitlines()[0]
