"""Reading a Hugging Face checkpoint directory: config.json, safetensors files, FP8 blocks.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. safetensors' own numpy reader cannot return bfloat16 or float8
arrays, so headers are parsed here (the format is 8 bytes of header length, a JSON header, then
raw little-endian data) and the data is memory-mapped with numpy and `ml_dtypes`. Every header
is validated when the checkpoint is opened, before any data is read.
"""

import json
import math
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from jaxtyping import Float, Float32, Shaped
from tqdm.auto import tqdm

from dropless._files import UnsafeName, inside

SUPPORTED_MODEL_TYPES = (
    "deepseek_v3",
    "deepseek_v2",
    "kimi_k2",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_FP8_BLOCK = (128, 128)
# Show a progress bar by default from this many bytes of tensors on.
PROGRESS_BYTES = 1 << 30

ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# Tensors some checkpoints carry that are no parameters (rotary tables, recomputed here).
IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model its config.json describes."""


class TensorInfo:
    """One tensor's header entry: dtype name, shape, byte offsets in the data section."""

    __slots__ = ("dtype", "shape", "start", "stop")

    def __init__(self, dtype: str, shape: tuple[int, ...], start: int, stop: int):
        self.dtype, self.shape, self.start, self.stop = dtype, shape, start, stop


class SafetensorsFile:
    """The header of one safetensors file, validated; tensor data memory-mapped on demand."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
            n = int.from_bytes(head, "little")
            # the messages never quote the file's bytes: a file that is no safetensors file
            # (one an index names by mistake, or on purpose) keeps its contents
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file, or none at all (its first 8 bytes, "
                    f"read as a header length, exceed the file's {size} bytes)"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise CheckpointError(
                    f"{path}: corrupt safetensors header (not UTF-8 JSON)"
                ) from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        end = 0
        for name, info in header.items():
            try:
                dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
                start, stop = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{path}: corrupt header entry for {name!r}") from err
            if dtype not in ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
            if stop - start != math.prod(shape) * ST_DTYPES[dtype].itemsize or start < 0:
                raise CheckpointError(
                    f"{path}: tensor {name!r} ({dtype} {list(shape)}) has inconsistent offsets "
                    f"[{start}, {stop})"
                )
            self.tensors[name] = TensorInfo(dtype, shape, start, stop)
            end = max(end, stop)
        if self.data_start + end != size:
            kind = "truncated" if self.data_start + end > size else "corrupt"
            raise CheckpointError(
                f"{path}: {kind} safetensors file (its header describes "
                f"{self.data_start + end} bytes, the file has {size})"
            )
        self._map: np.memmap | None = None

    def array(self, name: str) -> np.ndarray:
        """A read-only, memory-mapped view of tensor `name`."""
        info = self.tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self.data_start + info.start : self.data_start + info.stop]
        return raw.view(ST_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._map = None


class Checkpoint:
    """The safetensors files of a checkpoint directory: tensor name -> file."""

    def __init__(self, path: pathlib.Path):
        single, index = path / WEIGHTS_NAME, path / INDEX_NAME
        listed: dict[str, str] = {}
        if single.is_file():
            paths = [single]
        elif index.is_file():
            try:
                with open(index) as f:
                    listed = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: unreadable index ({err!r})") from err
            try:
                paths = [inside(path, name, str(index)) for name in sorted(set(listed.values()))]
            except (UnsafeName, TypeError) as err:
                raise CheckpointError(str(err)) from None
            for p in paths:
                if not p.is_file():
                    raise FileNotFoundError(f"{p}: no such file (listed in {index})")
        else:
            raise FileNotFoundError(
                f"{path}: no {WEIGHTS_NAME} and no {INDEX_NAME} (a Hugging Face safetensors "
                "checkpoint has one of them)"
            )
        self.files = [SafetensorsFile(p) for p in paths]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self.where:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.where[name].path} and {f.path}"
                    )
                self.where[name] = f
        for name, file in listed.items():
            if name not in self.where or self.where[name].path.name != file:
                raise CheckpointError(
                    f"{index} puts tensor {name!r} in {file}, which does not hold it"
                )

    def info(self, name: str) -> TensorInfo:
        return self.where[name].tensors[name]

    def array(self, name: str) -> np.ndarray:
        return self.where[name].array(name)

    def close(self) -> None:
        for f in self.files:
            f.close()


def dequantize_fp8(
    weight: Shaped[np.ndarray, "*lead m n"],
    scale_inv: Float[np.ndarray, "*lead m_blocks n_blocks"],
    block_size: tuple[int, int] = DEFAULT_FP8_BLOCK,
) -> Float32[np.ndarray, "*lead m n"]:
    """float32 `weight * scale_inv`, one scale per `block_size` block of the last two axes.

    `weight` is [*lead, m, n] (float8, as DeepSeek releases it), `scale_inv` [*lead, ceil(m /
    block_m), ceil(n / block_n)]; edge blocks may be partial.
    """
    *lead, m, n = weight.shape
    bm, bn = block_size
    expected = (*lead, -(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {list(scale_inv.shape)} does not match weight {list(weight.shape)} "
            f"in {bm}x{bn} blocks (expected {list(expected)})"
        )
    scale = np.asarray(scale_inv, np.float32)
    out = np.empty(weight.shape, np.float32)
    for i in range(expected[-2]):  # one row of blocks at a time: small temporaries
        rows = slice(i * bm, min(m, (i + 1) * bm))
        row_scale = np.repeat(scale[..., i : i + 1, :], bn, axis=-1)[..., :n]
        out[..., rows, :] = weight[..., rows, :].astype(np.float32) * row_scale
    return out


def fp8_block_size(hf: Mapping[str, Any], where: pathlib.Path) -> tuple[int, int] | None:
    """The FP8 block size a config.json's `quantization_config` gives (None: no FP8)."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: `mxfp4`
        return None
    if method != "fp8":
        raise CheckpointError(
            f"{where}: quantization_config quant_method {method!r} is not supported (only 'fp8' "
            "with block scales, as DeepSeek releases it, and 'mxfp4', as gpt-oss does)"
        )
    block = tuple(q.get("weight_block_size") or DEFAULT_FP8_BLOCK)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{where}: weight_block_size {block} must be two positive ints")
    return block


def read_hf_config(path: pathlib.Path) -> dict[str, Any]:
    """The config.json of checkpoint directory `path`, of a supported `model_type`."""
    file = path / CONFIG_NAME
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file (a checkpoint needs its config.json)")
    try:
        with open(file) as f:
            hf = json.load(f)
    except ValueError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from err
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{file}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return hf


def iter_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """(name, memory-mapped array) for every tensor of a checkpoint directory, as stored
    (bfloat16 and float8 as `ml_dtypes` arrays). For inspecting and comparing checkpoints."""
    ckpt = Checkpoint(pathlib.Path(path))
    try:
        for f in ckpt.files:
            for name in f.tensors:
                yield name, f.array(name)
    finally:
        ckpt.close()


def progress_bar(total_bytes: int, progress: bool | None, **kwargs) -> tqdm:
    """A bar of bytes on stderr: shown if `progress`, or for None from `PROGRESS_BYTES` on."""
    show = total_bytes >= PROGRESS_BYTES if progress is None else progress
    return tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show, **kwargs)
