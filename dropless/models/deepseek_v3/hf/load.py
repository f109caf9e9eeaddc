"""Loading a Hugging Face DeepSeek-V2/V3 checkpoint into a `DeepSeekV3`: `from_pretrained`.

Loading checks every file header against the config before reading any data (missing,
unexpected or misshapen tensors, truncated files: one error naming them), then streams tensor by
tensor from memory-mapped files into arrays preallocated at their final (stacked) shape, so peak
host memory stays near the size of the result. The model skeleton comes from
`eqx.filter_eval_shape`: no random initialisation is ever allocated. Either a complete model is
returned or an error raised. Routed experts may be in DeepSeek's per-expert layout or the fused
one recent `transformers` writes; FP8 weights (float8 with a `weight_scale_inv` per 128x128
block, as DeepSeek releases them) and MXFP4 ones (`_blocks` and `_scales`, gpt-oss's experts)
are dequantised on load, tensor by tensor.
"""

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from dropless.backends import Backend
from dropless.models.deepseek_v3.config import DROPLESS_FIELDS, DTYPES, DeepSeekV3Config
from dropless.models.deepseek_v3.hf.files import (
    CONFIG_NAME,
    DEFAULT_FP8_BLOCK,
    FLOAT_DTYPES,
    FP8_DTYPES,
    IGNORED,
    Checkpoint,
    CheckpointError,
    dequantize_fp8,
    fp8_block_size,
    progress_bar,
    read_hf_config,
)
from dropless.models.deepseek_v3.hf.mxfp4 import dequantize_mxfp4, packed_tensors
from dropless.models.deepseek_v3.hf.names import (
    FUSED_EXPERTS,
    LAYER,
    HFTensor,
    check_coverage,
    leaf_name,
    leaves_by_name,
    tensor_table,
)
from dropless.models.deepseek_v3.layers import moe_strategies
from dropless.models.deepseek_v3.model import DeepSeekV3

# Where a tensor's values come from: None, stored as they are; a name, the `scale_inv` of FP8
# values; a pair, the MXFP4 `_blocks` and `_scales` that replace the tensor.
Source = str | tuple[str, str] | None


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
) -> tuple[DeepSeekV3Config, tuple[int, int] | None, bool]:
    if "param_dtype" in overrides:
        raise ValueError("param_dtype: pass dtype= (the loaded parameters' dtype) instead")
    hf = read_hf_config(path)
    fp8_block = fp8_block_size(hf, path / CONFIG_NAME)
    param_dtype = _param_dtype(dtype, hf, fp8_block is not None)
    try:
        config = DeepSeekV3Config.from_hf_config(hf, param_dtype=param_dtype, **overrides)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path / CONFIG_NAME}: {err}") from err
    mxfp4 = (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    return config, fp8_block, mxfp4


def config_from_pretrained(
    path: str | os.PathLike, *, dtype: Any = None, **overrides: Any
) -> DeepSeekV3Config:
    """The `DeepSeekV3Config` of a checkpoint directory (its config.json), as `from_pretrained`
    builds it (MTP depth as written there; `from_pretrained` may drop it, see there)."""
    return _config(pathlib.Path(path), dtype, overrides)[0]


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
    config: DeepSeekV3Config, ckpt: Checkpoint, mtp: bool | None, where: pathlib.Path
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
    ckpt: Checkpoint,
    fp8_block: tuple[int, int] | None,
    mxfp4: bool,
    ignore_from_layer: int | None,
    where: pathlib.Path,
) -> list[tuple[HFTensor, Source]]:
    """Checks the files against the table; returns (tensor, where its values come from) to
    read, in file order. Raises CheckpointError listing every problem, before any data is
    read."""
    problems: list[str] = []
    shapes = {n: t.shape for n, t in table.items() if not t.duplicate}
    packed, bad_shape = packed_tensors(shapes, ckpt) if mxfp4 else ({}, [])
    missing = [n for n in shapes if n not in ckpt.where and n not in packed]
    scales: dict[str, Source] = dict(packed)
    bad_dtype = []
    for name, t in table.items():
        if name not in ckpt.where:
            continue
        info = ckpt.info(name)
        if info.shape != t.shape:
            bad_shape.append(f"{name} is {list(info.shape)}, config.json implies {list(t.shape)}")
        if info.dtype in FP8_DTYPES:
            scale = name + "_scale_inv"
            if scale not in ckpt.where:
                bad_dtype.append(f"{name} is {info.dtype} without {scale}")
                continue
            block = fp8_block or DEFAULT_FP8_BLOCK
            s = ckpt.info(scale)
            want = (*t.shape[:-2], *(-(-d // b) for d, b in zip(t.shape[-2:], block, strict=True)))
            if s.dtype not in FLOAT_DTYPES or s.shape != want:
                bad_shape.append(
                    f"{scale} is {s.dtype} {list(s.shape)}, {block[0]}x{block[1]} blocks of "
                    f"{name} need a float {list(want)}"
                )
            scales[name] = scale
        elif info.dtype not in FLOAT_DTYPES:
            bad_dtype.append(f"{name} has dtype {info.dtype}, not a float type")

    def ignored(name: str) -> bool:
        if IGNORED.search(name):
            return True
        m = LAYER.match(name)
        return ignore_from_layer is not None and m is not None and int(m[1]) >= ignore_from_layer

    def empty(name: str) -> bool:  # what transformers writes for an absent part (width 0)
        return 0 in ckpt.info(name).shape

    consumed = {n for s in scales.values() for n in ((s,) if isinstance(s, str) else s)}
    unexpected = [
        n
        for n in ckpt.where
        if n not in table and n not in consumed and not ignored(n) and not empty(n)
    ]
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

    def first(read):  # a packed tensor's blocks stand for it
        name = read[1][0] if isinstance(read[1], tuple) else read[0].name
        return order[id(ckpt.where[name])], ckpt.info(name).start

    return sorted(reads, key=first)


def _check_size(config: DeepSeekV3Config, ckpt: Checkpoint, fused: set[int], where) -> None:
    """CheckpointError, in microseconds, when config.json calls for more tensors than the files
    hold: a table of them is built only for a config the files can fill (a config.json with
    10**8 experts or 200,000 layers would otherwise take minutes and gigabytes to refuse)."""
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    per_expert = max(config.n_moe_layers - len(fused), 0)  # layers with a tensor per expert
    least = 2 * layers + 3 * config.n_routed_experts * per_expert  # two norms per layer
    if least > len(ckpt.where):
        raise CheckpointError(
            f"{where / CONFIG_NAME}: num_hidden_layers ({config.num_hidden_layers}), "
            f"first_k_dense_replace ({config.first_k_dense_replace}) and n_routed_experts "
            f"({config.n_routed_experts}) call for at least {least:,} tensors; the files hold "
            f"{len(ckpt.where):,}"
        )


def _match(config, ckpt, mtp, backend, fp8_block, mxfp4, path):
    """The model skeleton for `config` (MTP resolved against the files), its array leaves, and
    the reads that fill them; CheckpointError where the files do not match."""
    config, ignore_mtp = _resolve_mtp(config, ckpt, mtp, path)
    fused = {int(m[1]) for name in ckpt.where if (m := FUSED_EXPERTS.match(name))}
    _check_size(config, ckpt, fused, path)
    skeleton = eqx.filter_eval_shape(
        lambda: DeepSeekV3(config, backend=backend, key=jax.random.key(0))
    )
    leaves = {
        k: v for k, v in leaves_by_name(skeleton).items() if isinstance(v, jax.ShapeDtypeStruct)
    }
    shapes = {k: tuple(v.shape) for k, v in leaves.items()}
    table = tensor_table(shapes, config, fused_layers=fused)
    check_coverage(table, shapes)
    ignore_from = config.num_hidden_layers if ignore_mtp else None
    return config, skeleton, leaves, _plan(table, ckpt, fp8_block, mxfp4, ignore_from, path)


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    backend: Backend | None = None,
    mtp: bool | None = None,
    progress: bool | None = None,
    **overrides: Any,
) -> tuple[DeepSeekV3, DeepSeekV3Config]:
    """A `DeepSeekV3` model and its config from a Hugging Face checkpoint directory.

    - `dtype`: parameter dtype ("float32" | "bfloat16"); None takes the checkpoint's
      (bfloat16 for bf16 and FP8 checkpoints, float32 otherwise). Router weights stay float32.
    - `backend`: the MoE layers' strategies, as in `DeepSeekV3(..., backend=...)` (a
      `dropless.Backend`; None: `MoE`'s defaults).
    - `mtp`: load the multi-token-prediction layers (True: required; False: ignore them;
      None: load them if the files have them, else build the model without MTP).
    - `progress`: a progress bar on stderr (None: only for checkpoints over 1 GiB).
    - `overrides`: other `DeepSeekV3Config` fields (`compute_dtype`, `remat`, ...).

    Raises FileNotFoundError for missing files and CheckpointError (a ValueError) for an
    unsupported `model_type`, corrupt or truncated files, and tensors missing, unexpected or
    misshapen for config.json, naming each; no model is returned then.
    """
    moe_strategies(backend)  # a wrong backend fails before any file is read
    path = pathlib.Path(path)
    config, fp8_block, mxfp4 = _config(path, dtype, overrides)
    ckpt = Checkpoint(path)
    try:
        try:
            config, skeleton, leaves, reads = _match(
                config, ckpt, mtp, backend, fp8_block, mxfp4, path
            )
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
        return jnp.asarray(arrays.pop(leaf_name(p)))  # frees each host copy as it goes

    model = jax.tree_util.tree_map_with_path(
        fill, skeleton, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )
    return model, config


def _stored(t: HFTensor, source: Source) -> tuple[str, ...]:
    """The checkpoint tensors that hold `t`'s values (less FP8 scales)."""
    return source if isinstance(source, tuple) else (t.name,)


def _values(
    t: HFTensor, source: Source, ckpt: Checkpoint, fp8_block: tuple[int, int], dtype: np.dtype
) -> np.ndarray:
    """`t` in its checkpoint layout: as stored, dequantised from FP8 (float32), or from MXFP4
    (in `dtype`; the blocks run along the tensor's axis -2)."""
    if isinstance(source, tuple):
        blocks, scales = (ckpt.array(name) for name in source)
        return np.swapaxes(dequantize_mxfp4(blocks, scales, dtype), -1, -2)
    a = ckpt.array(t.name)
    return a if source is None else dequantize_fp8(a, ckpt.array(source), fp8_block)


def _read(
    reads: list[tuple[HFTensor, Source]],
    leaves: Mapping[str, jax.ShapeDtypeStruct],
    ckpt: Checkpoint,
    fp8_block: tuple[int, int],
    progress: bool | None,
    where: pathlib.Path,
) -> dict[str, np.ndarray]:
    arrays = {k: np.empty(v.shape, _load_dtype(k, v.dtype)) for k, v in leaves.items()}

    def size(t: HFTensor, source: Source) -> int:
        return sum(ckpt.info(n).stop - ckpt.info(n).start for n in _stored(t, source))

    total = sum(size(t, source) for t, source in reads)
    with progress_bar(total, progress, desc=f"loading {where.name}") as bar:
        for t, source in reads:
            try:
                a = _values(t, source, ckpt, fp8_block, arrays[t.slots[0].leaf].dtype)
                for slot, part in zip(t.slots, t.split(a), strict=True):
                    arrays[slot.leaf][slot.index] = (
                        np.swapaxes(part, -1, -2) if slot.transpose else part
                    )
            except OSError as err:
                name = _stored(t, source)[0]
                raise CheckpointError(f"{ckpt.where[name].path}: reading {name}: {err}") from err
            bar.update(size(t, source))
    return arrays
