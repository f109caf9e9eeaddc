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

import jax
import jax.numpy as jnp
import numpy as np

from dropless.backends import Backend
from dropless.models.deepseek_v3._config import DROPLESS_FIELDS, DTYPES, DeepSeekV3Config
from dropless.models.deepseek_v3._layers import moe_strategies
from dropless.models.deepseek_v3._model import DeepSeekV3
from dropless.models.deepseek_v3.hf._files import (
    CONFIG_NAME,
    DEFAULT_FP8_BLOCK,
    Checkpoint,
    CheckpointError,
    dequantize_fp8,
    fp8_block_size,
    progress_bar,
    read_hf_config,
)
from dropless.models.deepseek_v3.hf._match import Source, match_checkpoint
from dropless.models.deepseek_v3.hf._mxfp4 import dequantize_mxfp4
from dropless.models.deepseek_v3.hf._names import (
    HFTensor,
    leaf_name,
)


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
            config, skeleton, leaves, reads = match_checkpoint(
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
