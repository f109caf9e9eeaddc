"""Which tensors of a Hugging Face checkpoint fill which leaves of a `DeepSeekV3`, checked
before any data is read (`dropless.models.deepseek_v3.hf.from_pretrained` reads them):
MTP layers kept or ignored, a config.json too large for its files refused at once, and every
missing, unexpected, misshapen or mistyped tensor named in one error."""

import pathlib
from collections.abc import Mapping

import equinox as eqx
import jax

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._model import DeepSeekV3
from dropless.models.deepseek_v3.hf._files import (
    CONFIG_NAME,
    DEFAULT_FP8_BLOCK,
    FLOAT_DTYPES,
    FP8_DTYPES,
    IGNORED,
    Checkpoint,
    CheckpointError,
)
from dropless.models.deepseek_v3.hf._mxfp4 import packed_tensors
from dropless.models.deepseek_v3.hf._names import (
    FUSED_EXPERTS,
    LAYER,
    HFTensor,
    check_coverage,
    leaves_by_name,
    tensor_table,
)

# Where a tensor's values come from: None, stored as they are; a name, the `scale_inv` of FP8
# values; a pair, the MXFP4 `_blocks` and `_scales` that replace the tensor.
Source = str | tuple[str, str] | None


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
    scales, bad_dtype = _fp8_scales(table, ckpt, fp8_block, bad_shape)
    scales = {**packed, **scales}
    unexpected = _unexpected(table, ckpt, scales, ignore_from_layer)
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


def _fp8_scales(
    table: Mapping[str, HFTensor],
    ckpt: Checkpoint,
    fp8_block: tuple[int, int] | None,
    bad_shape: list[str],
) -> tuple[dict[str, Source], list[str]]:
    """(the scale tensor of each fp8 tensor of `table` in `ckpt`, the dtype problems); shape
    problems are appended to `bad_shape`."""
    scales: dict[str, Source] = {}
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
    return scales, bad_dtype


def _unexpected(
    table: Mapping[str, HFTensor],
    ckpt: Checkpoint,
    scales: Mapping[str, Source],
    ignore_from_layer: int | None,
) -> list[str]:
    """The tensors of `ckpt` that neither the table nor a scale reads, less those ignored
    (`IGNORED`, layers from `ignore_from_layer`) and empty ones."""

    def ignored(name: str) -> bool:
        if IGNORED.search(name):
            return True
        m = LAYER.match(name)
        return ignore_from_layer is not None and m is not None and int(m[1]) >= ignore_from_layer

    def empty(name: str) -> bool:  # what transformers writes for an absent part (width 0)
        return 0 in ckpt.info(name).shape

    consumed = {n for s in scales.values() for n in ((s,) if isinstance(s, str) else s)}
    return [
        n
        for n in ckpt.where
        if n not in table and n not in consumed and not ignored(n) and not empty(n)
    ]


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


def match_checkpoint(config, ckpt, mtp, backend, fp8_block, mxfp4, path):
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
