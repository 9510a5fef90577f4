"""Hugging Face checkpoint directories, read without PyTorch or transformers: what every model's
from_pretrained shares.

    directory, config_file, fields = checkpoint.read_config(directory, where)   # config.json, parsed
    parsed = checkpoint.check_model_arguments(where, config, BertConfig, dtype, device)
    tensors, files = checkpoint.read_tensors(directory, where)   # model.safetensors, or its shards
    checkpoint.load_state(model, state, f"{where}(...): the checkpoint does not match its config")

A directory holds config.json and either model.safetensors or model.safetensors.index.json, whose
weight_map names each tensor's shard file in the same directory. Each model checks its config's fields
itself (its own config class) and maps the tensors onto its module tree; every error here names the
caller (`where`, e.g. "CausalLM.from_pretrained") and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from libnn.nn import checks, weights
from libnn.nn.module import Module

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_json(path: Path, where: str) -> Any:
    """The JSON value of the file at `path`; a file that is not JSON (or not UTF-8, or nested deeper than
    Python's parser recurses) is a ValueError naming it."""
    try:
        return json.loads(path.read_text())
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: {str(path)!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{where}: {str(path)!r} nests its JSON too deeply to be read (Python's json recurses "
                         "once per level)") from None


def read_config(directory: Any, where: str) -> tuple[Path, Path, Any]:
    """(the directory as a Path, its config.json, that file's JSON value, unchecked: the model's config
    class checks its fields). `directory` must be a str or Path holding a config.json."""
    if not isinstance(directory, (str, Path)):
        raise TypeError(f"{where}: directory must be a str or pathlib.Path, got {type(directory).__name__} "
                        f"{directory!r}")
    directory = Path(directory)
    config_file = directory / CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{where}: {str(directory)!r} has no config.json")
    return directory, config_file, read_json(config_file, where)


def check_model_arguments(where: str, config: Any, config_type: type, dtype: Any, device: str) -> np.dtype:
    """A model constructor's config (an instance of `config_type`, its fields checked again: one built by
    hand has not been through from_dict), dtype and device; the parsed float dtype."""
    if not isinstance(config, config_type):
        name = config_type.__name__
        raise TypeError(f"{where}: config must be a {name} ({name}.from_dict(...)), got {type(config).__name__}")
    parsed = checks.float_dtype(where, dtype)
    checks.device(where, device)
    config.check(where)
    return parsed


def shard_files(index: Path, where: str) -> tuple[dict, list[str]]:
    """(weight_map, the shard files it names, sorted) of model.safetensors.index.json at `index`: each a
    file name in the index's own directory, never a path elsewhere."""
    loaded = read_json(index, where)
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{where}: {str(index)!r} must be a JSON object whose 'weight_map' "
                         "maps each tensor's name to its shard file")
    shards = sorted(set(weight_map.values()), key=str)
    for shard in shards:
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise ValueError(f"{where}: {str(index)!r} names the shard {shard!r}; expected a "
                             "file name in the checkpoint's directory")
    return weight_map, shards


def read_tensors(directory: Path, where: str, *, others: tuple[str, ...] = ("*.bin",),
                 check_placement: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
    """(every tensor of model.safetensors, or of the shards model.safetensors.index.json lists, by key;
    the files read). With `check_placement`, a tensor found in another shard than the one weight_map
    names is an error. A directory with neither file is a FileNotFoundError that lists the files of the
    glob patterns `others` it holds (pickled formats libnn does not read)."""
    single, index = directory / SINGLE, directory / INDEX
    if single.is_file():
        return _read_weights(single, where), [str(single)]
    if index.is_file():
        weight_map, shards = shard_files(index, where)
        state: dict[str, np.ndarray] = {}
        for shard in shards:
            for key, value in _read_weights(directory / shard, where, index).items():
                if check_placement and weight_map.get(key, shard) != shard:
                    raise ValueError(f"{where}: {str(directory / shard)!r} holds {key!r}, which "
                                     f"{str(index)!r} places in {weight_map[key]!r}")
                state[key] = value
        return state, [str(directory / s) for s in shards]
    found = [name for pattern in others for name in sorted(p.name for p in directory.glob(pattern))]
    raise FileNotFoundError(f"{where}: {str(directory)!r} has no model.safetensors (nor "
                            f"model.safetensors.index.json)" + (f"; found {found}: convert them to safetensors "
                                                                "(libnn reads no pickles)" if found else ""))


def _read_weights(path: Path, where: str, index: Path | None = None) -> dict[str, np.ndarray]:
    """weights.read(path), its errors (an empty, truncated or foreign file) naming the caller too; a shard
    the `index` names that is not there is named as the index's."""
    try:
        return weights.read(path)
    except FileNotFoundError:
        if index is None:
            raise
        raise FileNotFoundError(f"{where}: {str(index)!r} names the shard {path.name!r}, which "
                                f"{str(path.parent)!r} does not hold") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def load_state(model: Module, state: dict[str, Any], context: str) -> None:
    """model.load_state_dict(state, assign=True): the arrays just read, no copy of the checkpoint. A key,
    shape or dtype that does not match is raised again as the same type with `context` (which names the
    checkpoint and its config) before the layer's message."""
    try:
        model.load_state_dict(state, assign=True)
    except (KeyError, ValueError, TypeError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        raise type(exc)(f"{context}: {message}") from exc
