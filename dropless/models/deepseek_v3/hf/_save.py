"""Writing a `DeepSeekV3` as Hugging Face tensors: `to_hf` (in memory) and `save_pretrained`
(a checkpoint directory that transformers, vLLM and `from_pretrained` read).

Files are written with `safetensors.numpy`, tensor names and layouts those of DeepSeek's release
(`dropless.models.deepseek_v3.hf._names`).
"""

import json
import math
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import numpy as np
from safetensors.numpy import save_file

from dropless.models.deepseek_v3._config import MLA_TYPES, DeepSeekV3Config
from dropless.models.deepseek_v3._model import DeepSeekV3
from dropless.models.deepseek_v3.hf._files import (
    CONFIG_NAME,
    INDEX_NAME,
    SHARD_NAME,
    WEIGHTS_NAME,
    progress_bar,
)
from dropless.models.deepseek_v3.hf._names import (
    HFTensor,
    check_coverage,
    is_tensor,
    leaves_by_name,
    model_table,
    tensor_table,
)

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or e.g. '5GB', '500MiB'")
    return int(float(m[1]) * _UNITS[m[2] or "B"])


def _host(leaf: Any, index: tuple[int, ...]) -> np.ndarray:
    if isinstance(leaf, np.ndarray):
        return leaf[index]
    devices = leaf.devices()
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        return np.asarray(leaf)[index]  # a view of the buffer: no copy of the whole stack
    return np.asarray(leaf[index])  # slice where the array lives, copy only the slice


def _export(t: HFTensor, leaves: Mapping[str, Any]) -> np.ndarray:
    parts = []
    for s in t.slots:
        a = _host(leaves[s.leaf], s.index)
        parts.append(np.swapaxes(a, -1, -2) if s.transpose else a)
    return np.ascontiguousarray(t.join(parts))


def _shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_pretrained(
    model: DeepSeekV3,
    config: DeepSeekV3Config,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    fused_experts: bool = False,
    progress: bool | None = None,
) -> None:
    """Writes `model` as a Hugging Face checkpoint directory that `from_pretrained` (and
    transformers, vLLM, ...) reads: config.json and model.safetensors, or shards of at most
    `max_shard_size` (bytes, or "5GB" / "500MiB"; a larger tensor gets a shard of its own) with
    model.safetensors.index.json.

    Tensors keep the model's dtypes (no FP8 re-quantisation). Names are DeepSeek's release
    names, routed experts one tensor each, or with `fused_experts` the fused
    `mlp.experts.gate_up_proj` / `down_proj` of recent transformers; each MTP module gets copies
    of the embedding and head, as released. Weight files already in `path` (model*.safetensors,
    the index) are replaced.
    """
    if config.to_hf_dict() != model.config.to_hf_dict():
        raise ValueError("config does not describe model (their Hugging Face fields differ)")
    path = pathlib.Path(path)
    leaves = leaves_by_name(eqx.filter(model, eqx.is_array))
    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    n = config.num_hidden_layers
    fused = range(config.first_k_dense_replace, n + config.num_nextn_predict_layers)
    table = tensor_table(shapes, config, fused_layers=fused if fused_experts else ())
    check_coverage(table, shapes)
    tensors = [t for t in table.values() if t.write]

    def nbytes(t: HFTensor) -> int:
        return math.prod(t.shape) * np.dtype(leaves[t.slots[0].leaf].dtype).itemsize

    sizes = [(t.name, nbytes(t)) for t in tensors]
    _write_weights(path, table, leaves, sizes, max_shard_size, progress)
    hf = config.to_hf_dict()
    if config.model_type in MLA_TYPES and config.topk_method != "noaux_tc":
        # transformers' DeepseekV3 always routes the V3 way (sigmoid, bias, top-2 group sums):
        # V2 routing must say deepseek_v2 to be read back as what it is.
        hf["model_type"], hf["architectures"] = "deepseek_v2", ["DeepseekV2ForCausalLM"]
    hf["dtype"] = hf["torch_dtype"] = np.dtype(leaves["embed_tokens"].dtype).name
    with open(path / CONFIG_NAME, "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


def _write_weights(
    path: pathlib.Path,
    table: Mapping[str, HFTensor],
    leaves: Mapping[str, Any],
    sizes: list[tuple[str, int]],
    max_shard_size: int | str,
    progress: bool | None,
) -> None:
    """The weight files of the tensors `sizes` names ((name, bytes), in order): one file, or
    shards of at most `max_shard_size` and their index, replacing those already in `path`."""
    shards = _shards(sizes, _parse_size(max_shard_size))
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (WEIGHTS_NAME, INDEX_NAME) or SHARD_NAME.match(old.name):
            old.unlink()
    total = sum(s for _, s in sizes)
    with progress_bar(total, progress, desc=f"saving {path.name}") as bar:
        for shard, file in zip(shards, names, strict=True):
            data = {name: _export(table[name], leaves) for name in shard}
            save_file(data, str(path / file), metadata={"format": "pt"})
            bar.update(sum(a.nbytes for a in data.values()))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {
                name: file for shard, file in zip(shards, names, strict=True) for name in shard
            },
        }
        with open(path / INDEX_NAME, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def to_hf(tree: DeepSeekV3) -> dict[str, np.ndarray]:
    """{Hugging Face tensor name: host array} of a model, or of any tree shaped like one (its
    gradients, an optimiser's moments: `eqx.filter_grad`'s output keeps the model's `config`):
    every tensor `save_pretrained` writes, experts one tensor each, in Hugging Face's layout
    ([out in] linear weights) and the tree's dtypes. `hf_names` says which dropless path each
    comes from."""
    leaves = leaves_by_name(eqx.filter(tree, is_tensor))
    return {name: _export(t, leaves) for name, t in model_table(tree).items()}
