"""Hugging Face DeepSeek-V2/V3 checkpoints: `from_pretrained` and `save_pretrained`.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensor names are those of DeepSeek's release (see `hf_names`);
routed experts may also be in the fused layout recent `transformers` writes. FP8 weights
(float8 with a `weight_scale_inv` per 128x128 block, as released) are dequantised on load.

Loading checks every file header against the config before reading any data (missing, unexpected
or misshapen tensors, truncated files: one error naming them), then streams tensor by tensor from
memory-mapped files into arrays preallocated at their final (stacked) shape, so peak host memory
stays near the size of the result. The model skeleton comes from `eqx.filter_eval_shape`: no
random initialisation is ever allocated. Either a complete model is returned or an error raised.

safetensors' own numpy reader cannot return bfloat16 or float8 arrays, so headers are parsed here
(the format is 8 bytes of header length, a JSON header, then raw little-endian data) and the data
is memory-mapped with numpy and `ml_dtypes`; files are written with `safetensors.numpy`.
"""

import json
import math
import os
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Float, Float32, Shaped
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from dropless.backends import Backend
from dropless.models.deepseek_v3.config import DROPLESS_FIELDS, DTYPES, DeepSeekV3Config
from dropless.models.deepseek_v3.hf_names import (
    FUSED_EXPERTS,
    LAYER,
    HFTensor,
    check_coverage,
    tensor_table,
)
from dropless.models.deepseek_v3.model import DeepSeekV3

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_FP8_BLOCK = (128, 128)
# Show a progress bar by default from this many bytes of tensors on.
PROGRESS_BYTES = 1 << 30

_ST_DTYPES: dict[str, np.dtype] = {
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
_FLOAT = ("F64", "F32", "F16", "BF16")
_FP8 = ("F8_E4M3", "F8_E5M2")
# Tensors some checkpoints carry that are no parameters (rotary tables, recomputed here).
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model its config.json describes."""


# --- safetensors files ---------------------------------------------------------------------------


class _TensorInfo:
    __slots__ = ("dtype", "shape", "start", "stop")

    def __init__(self, dtype: str, shape: tuple[int, ...], start: int, stop: int):
        self.dtype, self.shape, self.start, self.stop = dtype, shape, start, stop


class _SafetensorsFile:
    """The header of one safetensors file, validated; tensor data memory-mapped on demand."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file (its header alone claims {n} bytes, "
                    f"the file has {size})"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from err
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors: dict[str, _TensorInfo] = {}
        end = 0
        for name, info in header.items():
            try:
                dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
                start, stop = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{path}: corrupt header entry for {name!r}") from err
            if dtype not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
            if stop - start != math.prod(shape) * _ST_DTYPES[dtype].itemsize or start < 0:
                raise CheckpointError(
                    f"{path}: tensor {name!r} ({dtype} {list(shape)}) has inconsistent offsets "
                    f"[{start}, {stop})"
                )
            self.tensors[name] = _TensorInfo(dtype, shape, start, stop)
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
        return raw.view(_ST_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._map = None


class _Checkpoint:
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
            paths = [path / name for name in sorted(set(listed.values()))]
            for p in paths:
                if not p.is_file():
                    raise FileNotFoundError(f"{p}: no such file (listed in {index})")
        else:
            raise FileNotFoundError(
                f"{path}: no {WEIGHTS_NAME} and no {INDEX_NAME} (a Hugging Face safetensors "
                "checkpoint has one of them)"
            )
        self.files = [_SafetensorsFile(p) for p in paths]
        self.where: dict[str, _SafetensorsFile] = {}
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

    def info(self, name: str) -> _TensorInfo:
        return self.where[name].tensors[name]

    def array(self, name: str) -> np.ndarray:
        return self.where[name].array(name)

    def close(self) -> None:
        for f in self.files:
            f.close()


# --- FP8 -----------------------------------------------------------------------------------------


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


def _fp8_block(hf: Mapping[str, Any], where: pathlib.Path) -> tuple[int, int] | None:
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(
            f"{where}: quantization_config quant_method {method!r} is not supported (only 'fp8' "
            "with block scales, as DeepSeek releases it)"
        )
    block = tuple(q.get("weight_block_size") or DEFAULT_FP8_BLOCK)
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise CheckpointError(f"{where}: weight_block_size {block} must be two positive ints")
    return block


# --- config --------------------------------------------------------------------------------------


def _read_hf_config(path: pathlib.Path) -> dict[str, Any]:
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


def _param_dtype(dtype: Any, hf: Mapping[str, Any], fp8: bool) -> str:
    if dtype is None:  # the checkpoint's own, where dropless has it (exact); float16 -> float32
        stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return "bfloat16" if stored == "bfloat16" or fp8 else "float32"
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} must be one of {tuple(DTYPES)}")
    return name


def _config(
    path: pathlib.Path, dtype: Any, overrides: Mapping[str, Any]
) -> tuple[DeepSeekV3Config, tuple[int, int] | None]:
    if "param_dtype" in overrides:
        raise ValueError("param_dtype: pass dtype= (the loaded parameters' dtype) instead")
    hf = _read_hf_config(path)
    fp8_block = _fp8_block(hf, path / CONFIG_NAME)
    param_dtype = _param_dtype(dtype, hf, fp8_block is not None)
    try:
        config = DeepSeekV3Config.from_hf_config(hf, param_dtype=param_dtype, **overrides)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path / CONFIG_NAME}: {err}") from err
    return config, fp8_block


def config_from_pretrained(
    path: str | os.PathLike, *, dtype: Any = None, **overrides: Any
) -> DeepSeekV3Config:
    """The `DeepSeekV3Config` of a checkpoint directory (its config.json), as `from_pretrained`
    builds it (MTP depth as written there; `from_pretrained` may drop it, see there)."""
    return _config(pathlib.Path(path), dtype, overrides)[0]


# --- import --------------------------------------------------------------------------------------


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _shapes(tree) -> dict[str, Any]:
    """{leaf path: leaf} for the array (or ShapeDtypeStruct) leaves of a model."""
    return {_leaf_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _load_dtype(leaf: str, skeleton_dtype) -> np.dtype:
    # Routers stay float32 whatever the parameter dtype: they compute in float32, transformers
    # keeps `gate.weight` in float32 too, and a bf16-rounded router would route differently.
    if leaf.endswith(".router.w_router"):
        return np.dtype(np.float32)
    return np.dtype(skeleton_dtype)


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _resolve_mtp(
    config: DeepSeekV3Config, ckpt: _Checkpoint, mtp: bool | None, where: pathlib.Path
) -> tuple[DeepSeekV3Config, bool]:
    """The config to build (MTP kept or dropped), and whether MTP layers in the files are
    to be ignored."""
    n = config.num_hidden_layers
    has_mtp = any((m := LAYER.match(name)) and int(m.group(1)) >= n for name in ckpt.where)
    if mtp is True and config.num_nextn_predict_layers == 0:
        raise CheckpointError(f"{where}: mtp=True, but config.json has num_nextn_predict_layers 0")
    if mtp is None and has_mtp and config.num_nextn_predict_layers == 0:
        raise CheckpointError(
            f"{where}: the files hold layers from {n} = num_hidden_layers on (MTP modules?), but "
            "config.json has num_nextn_predict_layers 0; pass mtp=False to ignore them"
        )
    if mtp is False or (mtp is None and not has_mtp):
        # transformers' DeepseekV3ForCausalLM writes no MTP weights (its config still says 1).
        return config.replace(num_nextn_predict_layers=0), mtp is False
    return config, False


def _plan(
    table: Mapping[str, HFTensor],
    ckpt: _Checkpoint,
    fp8_block: tuple[int, int] | None,
    ignore_from_layer: int | None,
    where: pathlib.Path,
) -> list[tuple[HFTensor, str | None]]:
    """Checks the files against the table; returns (tensor, its scale_inv name or None) to read,
    in file order. Raises CheckpointError listing every problem, before any data is read."""
    problems: list[str] = []
    missing = [n for n, t in table.items() if not t.duplicate and n not in ckpt.where]
    scales: dict[str, str] = {}
    bad_shape, bad_dtype = [], []
    for name, t in table.items():
        if name not in ckpt.where:
            continue
        info = ckpt.info(name)
        if info.shape != t.shape:
            bad_shape.append(f"{name} is {list(info.shape)}, config.json implies {list(t.shape)}")
        if info.dtype in _FP8:
            scale = name + "_scale_inv"
            if scale not in ckpt.where:
                bad_dtype.append(f"{name} is {info.dtype} without {scale}")
                continue
            block = fp8_block or DEFAULT_FP8_BLOCK
            s = ckpt.info(scale)
            want = (*t.shape[:-2], *(-(-d // b) for d, b in zip(t.shape[-2:], block, strict=True)))
            if s.dtype not in _FLOAT or s.shape != want:
                bad_shape.append(
                    f"{scale} is {s.dtype} {list(s.shape)}, {block[0]}x{block[1]} blocks of "
                    f"{name} need a float {list(want)}"
                )
            scales[name] = scale
        elif info.dtype not in _FLOAT:
            bad_dtype.append(f"{name} has dtype {info.dtype}, not a float type")

    def ignored(name: str) -> bool:
        if _IGNORED.search(name):
            return True
        m = LAYER.match(name)
        return ignore_from_layer is not None and m is not None and int(m[1]) >= ignore_from_layer

    consumed = set(scales.values())
    unexpected = [n for n in ckpt.where if n not in table and n not in consumed and not ignored(n)]
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(sorted(unexpected))}")
    if bad_shape:
        problems.append(f"wrong shapes: {_listing(bad_shape, 6)}")
    if bad_dtype:
        problems.append(f"wrong dtypes: {_listing(bad_dtype, 6)}")
    if problems:
        raise CheckpointError(
            f"{where}: the checkpoint does not match its config.json: " + "; ".join(problems)
        )
    reads = [(t, scales.get(t.name)) for t in table.values() if not t.duplicate]
    order = {id(f): i for i, f in enumerate(ckpt.files)}
    reads.sort(key=lambda r: (order[id(ckpt.where[r[0].name])], ckpt.info(r[0].name).start))
    return reads


def _progress(total_bytes: int, progress: bool | None, **kwargs) -> tqdm:
    show = total_bytes >= PROGRESS_BYTES if progress is None else progress
    return tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show, **kwargs)


def _match(config, ckpt, mtp, backend, fp8_block, path):
    """The model skeleton for `config` (MTP resolved against the files), its array leaves, and
    the reads that fill them; CheckpointError where the files do not match."""
    config, ignore_mtp = _resolve_mtp(config, ckpt, mtp, path)
    skeleton = eqx.filter_eval_shape(
        lambda: DeepSeekV3(config, backend=backend, key=jax.random.key(0))
    )
    leaves = {k: v for k, v in _shapes(skeleton).items() if isinstance(v, jax.ShapeDtypeStruct)}
    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    fused = {int(m[1]) for name in ckpt.where if (m := FUSED_EXPERTS.match(name))}
    table = tensor_table(shapes, config, fused_layers=fused)
    check_coverage(table, shapes)
    ignore_from = config.num_hidden_layers if ignore_mtp else None
    return config, skeleton, leaves, _plan(table, ckpt, fp8_block, ignore_from, path)


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    backend: str | Backend = "jnp",
    mtp: bool | None = None,
    progress: bool | None = None,
    **overrides: Any,
) -> tuple[DeepSeekV3, DeepSeekV3Config]:
    """A `DeepSeekV3` model and its config from a Hugging Face checkpoint directory.

    - `dtype`: parameter dtype ("float32" | "bfloat16"); None takes the checkpoint's
      (bfloat16 for bf16 and FP8 checkpoints, float32 otherwise). Router weights stay float32.
    - `backend`: the MoE backend, as in `DeepSeekV3(..., backend=...)`.
    - `mtp`: load the multi-token-prediction layers (True: required; False: ignore them;
      None: load them if the files have them, else build the model without MTP).
    - `progress`: a progress bar on stderr (None: only for checkpoints over 1 GiB).
    - `overrides`: other `DeepSeekV3Config` fields (`compute_dtype`, `remat`, ...).

    Raises FileNotFoundError for missing files and CheckpointError (a ValueError) for an
    unsupported `model_type`, corrupt or truncated files, and tensors missing, unexpected or
    misshapen for config.json, naming each; no model is returned then.
    """
    path = pathlib.Path(path)
    config, fp8_block = _config(path, dtype, overrides)
    ckpt = _Checkpoint(path)
    try:
        try:
            config, skeleton, leaves, reads = _match(config, ckpt, mtp, backend, fp8_block, path)
        except CheckpointError as err:
            changed = {k: v for k, v in overrides.items() if k not in DROPLESS_FIELDS}
            if not changed:
                raise
            given = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise CheckpointError(f"{err} (config.json with the overrides {given})") from None
        arrays = _read(reads, leaves, ckpt, fp8_block or DEFAULT_FP8_BLOCK, progress, path)
    finally:
        ckpt.close()

    def fill(p, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jnp.asarray(arrays.pop(_leaf_name(p)))  # frees each host copy as it goes

    model = jax.tree_util.tree_map_with_path(
        fill, skeleton, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )
    return model, config


def _read(
    reads: list[tuple[HFTensor, str | None]],
    leaves: Mapping[str, jax.ShapeDtypeStruct],
    ckpt: _Checkpoint,
    fp8_block: tuple[int, int],
    progress: bool | None,
    where: pathlib.Path,
) -> dict[str, np.ndarray]:
    arrays = {k: np.empty(v.shape, _load_dtype(k, v.dtype)) for k, v in leaves.items()}
    total = sum(ckpt.info(t.name).stop - ckpt.info(t.name).start for t, _ in reads)
    with _progress(total, progress, desc=f"loading {where.name}") as bar:
        for t, scale in reads:
            try:
                a = ckpt.array(t.name)
                if scale is not None:
                    a = dequantize_fp8(a, ckpt.array(scale), fp8_block)
                parts = np.split(a, len(t.slots), axis=-2) if len(t.slots) > 1 else [a]
                for slot, part in zip(t.slots, parts, strict=True):
                    arrays[slot.leaf][slot.index] = (
                        np.swapaxes(part, -1, -2) if slot.transpose else part
                    )
            except OSError as err:
                file = ckpt.where[t.name].path
                raise CheckpointError(f"{file}: reading {t.name}: {err}") from err
            info = ckpt.info(t.name)
            bar.update(info.stop - info.start)
    return arrays


# --- export --------------------------------------------------------------------------------------


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
    out = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-2)
    return np.ascontiguousarray(out)


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
    leaves = _shapes(eqx.filter(model, eqx.is_array))
    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    n = config.num_hidden_layers
    fused = range(config.first_k_dense_replace, n + config.num_nextn_predict_layers)
    table = tensor_table(shapes, config, fused_layers=fused if fused_experts else ())
    check_coverage(table, shapes)
    tensors = [t for t in table.values() if t.write]

    def nbytes(t: HFTensor) -> int:
        return math.prod(t.shape) * np.dtype(leaves[t.slots[0].leaf].dtype).itemsize

    sizes = [(t.name, nbytes(t)) for t in tensors]
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
    with _progress(total, progress, desc=f"saving {path.name}") as bar:
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
    hf = config.to_hf_dict()
    if config.topk_method != "noaux_tc":
        # transformers' DeepseekV3 always routes the V3 way (sigmoid, bias, top-2 group sums):
        # V2 routing must say deepseek_v2 to be read back as what it is.
        hf["model_type"], hf["architectures"] = "deepseek_v2", ["DeepseekV2ForCausalLM"]
    hf["dtype"] = hf["torch_dtype"] = np.dtype(leaves["embed_tokens"].dtype).name
    with open(path / CONFIG_NAME, "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)


def iter_checkpoint(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """(name, memory-mapped array) for every tensor of a checkpoint directory, as stored
    (bfloat16 and float8 as `ml_dtypes` arrays). For inspecting and comparing checkpoints."""
    ckpt = _Checkpoint(pathlib.Path(path))
    try:
        for f in ckpt.files:
            for name in f.tensors:
                yield name, f.array(name)
    finally:
        ckpt.close()
