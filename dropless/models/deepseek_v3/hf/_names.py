"""Which Hugging Face checkpoint tensor fills which part of which dropless parameter.

`hf_names` and `dropless_names` are the public mapping: a dropless parameter path (a leaf's
`jax.tree_util.keystr(path, simple=True, separator=".")`, then `[i]` per stacked index: layer,
then expert) to a Hugging Face tensor name, and back, e.g.

    moe_layers.mlp.experts.w_gate[2][5]  <->  model.layers.3.mlp.experts.5.gate_proj.weight

Underneath is one table, used in both directions by loading and export: `tensor_table` lists
every tensor of a DeepSeek-V2/V3 checkpoint (the names of DeepSeek's release:
`model.layers.{L}.*`, per-expert `mlp.experts.{e}.*`, MTP modules as layers
`num_hidden_layers + d`) with its shape and the slots of dropless leaves it fills. A slot is a
leaf path (`moe_layers.mlp.experts.w_gate`), leading indices into it (layer, expert) and whether
Hugging Face stores it transposed ([out in] where dropless stores [in out]). A tensor with
several slots is their concatenation along axis -2: the fused `mlp.experts.gate_up_proj`
[experts 2*hidden dim] that recent `transformers` writes; or, marked `interleave`, their
columns interleaved along the last axis: gpt-oss's `gate_up_proj` [experts dim 2*hidden]
(gate, up, gate, ...) and its bias.
"""

import dataclasses
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._model import DeepSeekV3

# Hugging Face nn.Linear names whose [out in] weight dropless stores as [in out] (MLA, dense MLP).
_ATTN_PROJ = (
    *("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    *("k_proj", "v_proj"),  # grouped-query attention
)
_ATTN_NORMS = ("q_a_layernorm", "kv_a_layernorm", "q_norm", "k_norm")
_SWIGLU = (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))
# Mixtral's release: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
_MIXTRAL_SWIGLU = (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down"))

# "model.layers.{L}.mlp.experts.gate_up_proj" and ".down_proj": the fused layout of a layer.
FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Slot:
    """`leaf[index]` (a dropless parameter, indexed on its leading stacked axes); `transpose`:
    the checkpoint holds it with the last two axes swapped."""

    leaf: str
    index: tuple[int, ...]
    transpose: bool


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One checkpoint tensor: its name, shape and the slots it fills (concatenated along -2).

    `duplicate`: a copy of a tensor listed elsewhere (an MTP module's `embed_tokens` and
    `shared_head.head`, a tied `lm_head`); import checks its shape but does not read it, and it
    is optional. `write`: export writes it. `interleave`: the slots' columns alternate along
    the last axis instead.
    """

    name: str
    shape: tuple[int, ...]
    slots: tuple[Slot, ...]
    duplicate: bool = False
    write: bool = True
    interleave: bool = False

    def split(self, a: Any) -> list[Any]:
        """The parts of the tensor `a` that fill the slots, in slot order (still in the
        checkpoint's layout: transposed where a slot says)."""
        n = len(self.slots)
        if n == 1:
            return [a]
        if self.interleave:
            return [a[..., i::n] for i in range(n)]
        return np.split(a, n, axis=-2)

    def join(self, parts: list[Any]) -> Any:
        """The tensor from its parts, the inverse of `split` (numpy arrays)."""
        if len(parts) == 1:
            return parts[0]
        if self.interleave:
            stacked = np.stack(parts, axis=-1)
            return stacked.reshape(*stacked.shape[:-2], -1)
        return np.concatenate(parts, axis=-2)


def _shape(
    slots: tuple[Slot, ...], leaves: Mapping[str, tuple[int, ...]], interleave: bool = False
) -> tuple[int, ...]:
    parts = []
    for s in slots:
        part = leaves[s.leaf][len(s.index) :]
        if s.transpose:
            part = (*part[:-2], part[-1], part[-2])
        parts.append(part)
    if len(parts) == 1:
        return tuple(parts[0])
    first = parts[0]
    if interleave:
        return (*first[:-1], sum(p[-1] for p in parts))
    return (*first[:-2], sum(p[-2] for p in parts), first[-1])


def tensor_table(
    leaves: Mapping[str, tuple[int, ...]],
    config: DeepSeekV3Config,
    *,
    fused_layers: Collection[int] = (),
) -> dict[str, HFTensor]:
    """Every checkpoint tensor of the model whose parameter shapes are `leaves` ({leaf path:
    shape}, as `jax.tree_util.keystr(path, simple=True, separator=".")` spells the path).

    Layers in `fused_layers` (Hugging Face layer numbers) hold their routed experts in the fused
    layout (`gate_up_proj`, `down_proj`), the others one tensor per expert and projection.
    Parameters absent from `leaves` (no q LoRA, no shared experts, no expert bias, a tied head,
    no MTP) have no tensors.
    """
    table: dict[str, HFTensor] = {}

    def add(
        name: str, *slots: Slot, duplicate: bool = False, write: bool = True, interleave=False
    ) -> None:
        shape = _shape(slots, leaves, interleave)
        table[name] = HFTensor(name, shape, slots, duplicate, write, interleave)

    def block(hf: str, stack: str, index: tuple[int, ...], layer: int) -> None:
        _attention(add, leaves, hf, stack, index)
        mlp = f"{stack}.mlp"
        if config.model_type == "gpt_oss" and f"{mlp}.experts.w_gate" in leaves:
            _gpt_oss_moe(add, hf, mlp, index)
            return
        if f"{mlp}.w_gate" in leaves:  # dense SwiGLU
            for name, w in _SWIGLU:
                add(f"{hf}.mlp.{name}.weight", Slot(f"{mlp}.{w}", index, True))
            return
        add(f"{hf}.mlp.gate.weight", Slot(f"{mlp}.router.w_router", index, False))
        if f"{mlp}.router.expert_bias" in leaves:
            bias = Slot(f"{mlp}.router.expert_bias", index, False)
            add(f"{hf}.mlp.gate.e_score_correction_bias", bias)
        if f"{mlp}.shared.w_gate" in leaves:
            for name, w in _SWIGLU:
                shared = Slot(f"{mlp}.shared.{w}", index, True)
                add(f"{hf}.mlp.shared_experts.{name}.weight", shared)
        _routed_experts(add, table, leaves, config, hf, mlp, index, layer in fused_layers)

    add("model.embed_tokens.weight", Slot("embed_tokens", (), False))
    first_k, n_layers = config.first_k_dense_replace, config.num_hidden_layers
    for layer in range(n_layers):
        if layer < first_k:
            block(f"model.layers.{layer}", "dense_layers", (layer,), layer)
        else:
            block(f"model.layers.{layer}", "moe_layers", (layer - first_k,), layer)
    add("model.norm.weight", Slot("norm.weight", (), False))
    tied = "lm_head" not in leaves
    head = Slot("embed_tokens", (), False) if tied else Slot("lm_head", (), True)
    # transformers leaves a tied head out of the files; accept (and ignore) it on import.
    add("lm_head.weight", head, duplicate=tied, write=not tied)
    if "mtp.layers.eh_proj" in leaves:
        for d in range(leaves["mtp.layers.eh_proj"][0]):
            _mtp_module(add, block, head, n_layers, d)
    return table


def _routed_experts(add, table, leaves, config, hf, mlp, index, fused: bool) -> None:
    """The routed experts' tensors: fused (`gate_up_proj`, `down_proj`) or one per expert and
    projection (Mixtral's names, its router renamed to match, for `config.model_type` mixtral)."""
    experts = f"{mlp}.experts"
    if fused:
        gate, up = Slot(f"{experts}.w_gate", index, True), Slot(f"{experts}.w_up", index, True)
        add(f"{hf}.mlp.experts.gate_up_proj", gate, up)
        add(f"{hf}.mlp.experts.down_proj", Slot(f"{experts}.w_down", index, True))
        return
    mlp_name, names = "mlp", _SWIGLU
    if config.model_type == "mixtral":
        mlp_name, names = "block_sparse_moe", _MIXTRAL_SWIGLU
        router = f"{hf}.{mlp_name}.gate.weight"
        table[router] = dataclasses.replace(table.pop(f"{hf}.mlp.gate.weight"), name=router)
    for e in range(leaves[f"{experts}.w_gate"][len(index)]):
        for name, w in names:
            expert = Slot(f"{experts}.{w}", (*index, e), True)
            add(f"{hf}.{mlp_name}.experts.{e}.{name}.weight", expert)


def _attention(add, leaves, hf: str, stack: str, index: tuple[int, ...]) -> None:
    """The tensors of a decoder block's norms and attention, those its leaves have."""
    for norm in ("input_layernorm", "post_attention_layernorm"):
        add(f"{hf}.{norm}.weight", Slot(f"{stack}.{norm}.weight", index, False))
    for proj in _ATTN_PROJ:
        if f"{stack}.self_attn.{proj}" in leaves:
            add(f"{hf}.self_attn.{proj}.weight", Slot(f"{stack}.self_attn.{proj}", index, True))
    for norm in _ATTN_NORMS:
        if f"{stack}.self_attn.{norm}.weight" in leaves:
            leaf = f"{stack}.self_attn.{norm}.weight"
            add(f"{hf}.self_attn.{norm}.weight", Slot(leaf, index, False))
    for proj in ("q", "k", "v", "o"):
        if f"{stack}.self_attn.{proj}_bias" in leaves:
            bias = Slot(f"{stack}.self_attn.{proj}_bias", index, False)
            add(f"{hf}.self_attn.{proj}_proj.bias", bias)
    if f"{stack}.self_attn.sinks" in leaves:
        add(f"{hf}.self_attn.sinks", Slot(f"{stack}.self_attn.sinks", index, False))


def _mtp_module(add, block, head: Slot, n_layers: int, d: int) -> None:
    """The tensors of MTP depth `d`, stored as layer `n_layers + d`."""
    hf, index = f"model.layers.{n_layers + d}", (d,)
    for norm in ("enorm", "hnorm"):
        add(f"{hf}.{norm}.weight", Slot(f"mtp.layers.{norm}.weight", index, False))
    add(f"{hf}.eh_proj.weight", Slot("mtp.layers.eh_proj", index, True))
    norm = Slot("mtp.layers.shared_head.norm.weight", index, False)
    add(f"{hf}.shared_head.norm.weight", norm)
    block(hf, "mtp.layers.block", index, n_layers + d)
    # DeepSeek's release stores each MTP module with its own copy of embedding and head.
    add(f"{hf}.embed_tokens.weight", Slot("embed_tokens", (), False), duplicate=True)
    add(f"{hf}.shared_head.head.weight", head, duplicate=True)


def _gpt_oss_moe(add, hf: str, mlp: str, index: tuple[int, ...]) -> None:
    """gpt-oss's MoE tensors: a router with a bias, and the experts fused, [in out], gate and up
    interleaved, with biases."""
    add(f"{hf}.mlp.router.weight", Slot(f"{mlp}.router.w_router", index, False))
    add(f"{hf}.mlp.router.bias", Slot(f"{mlp}.router.logit_bias", index, False))
    experts = f"{mlp}.experts"

    def pair(a: str, b: str) -> tuple[Slot, Slot]:
        return Slot(f"{experts}.{a}", index, False), Slot(f"{experts}.{b}", index, False)

    add(f"{hf}.mlp.experts.gate_up_proj", *pair("w_gate", "w_up"), interleave=True)
    add(f"{hf}.mlp.experts.gate_up_proj_bias", *pair("gate_bias", "up_bias"), interleave=True)
    add(f"{hf}.mlp.experts.down_proj", Slot(f"{experts}.w_down", index, False))
    add(f"{hf}.mlp.experts.down_proj_bias", Slot(f"{experts}.down_bias", index, False))


def check_coverage(table: Mapping[str, HFTensor], leaves: Mapping[str, tuple[int, ...]]) -> None:
    """Raises AssertionError unless the non-duplicate tensors fill every leaf exactly once
    (a property of `tensor_table`, checked on every import)."""
    filled = dict.fromkeys(leaves, 0)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for t in table.values():
        if t.duplicate:
            continue
        for s in t.slots:
            if (s.leaf, s.index) in seen:
                raise AssertionError(f"{s.leaf}{list(s.index)} is filled twice (by {t.name})")
            seen.add((s.leaf, s.index))
            filled[s.leaf] += math.prod(leaves[s.leaf][len(s.index) :])
    for leaf, shape in leaves.items():
        if filled[leaf] != math.prod(shape):
            raise AssertionError(f"{leaf}: {filled[leaf]} of {math.prod(shape)} values mapped")


def leaf_name(path: tuple) -> str:
    """A leaf's dropless path (`moe_layers.mlp.experts.w_gate`) from its key path."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def leaves_by_name(tree: Any) -> dict[str, Any]:
    """{leaf path: leaf} for the array (or ShapeDtypeStruct) leaves of a model-shaped tree."""
    return {leaf_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def is_tensor(x: Any) -> bool:
    """An array, or the shape and dtype of one (`eqx.filter_eval_shape`'s leaves)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def model_table(model_or_config: DeepSeekV3 | DeepSeekV3Config) -> dict[str, HFTensor]:
    """`tensor_table` of a model (or of any tree shaped like one, such as its gradients) or of
    the model a config builds (no arrays are allocated), experts one tensor each."""
    if isinstance(model_or_config, DeepSeekV3Config):
        config = model_or_config
        model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    else:
        config, model = model_or_config.config, model_or_config
    leaves = leaves_by_name(eqx.filter(model, is_tensor))
    table = tensor_table({k: tuple(v.shape) for k, v in leaves.items()}, config)
    return {name: t for name, t in table.items() if t.write}


def slot_path(slot: Slot) -> str:
    """The dropless path of a slot: its leaf, then `[i]` per index."""
    return slot.leaf + "".join(f"[{i}]" for i in slot.index)


def hf_names(model_or_config: DeepSeekV3 | DeepSeekV3Config) -> dict[str, str]:
    """{dropless path: Hugging Face tensor name} for every parameter of a model (or its config).

    A path is a leaf's `keystr` with `.` separators followed by one `[i]` per stacked index
    (`moe_layers.mlp.experts.w_gate[2][5]`: MoE layer 2, expert 5); each names one tensor of
    `save_pretrained`'s files (experts one tensor each). One-to-one: the copies that the files
    also hold (an MTP module's `embed_tokens` and `shared_head.head`) are only in
    `dropless_names`. Hugging Face stores linear weights [out in] where dropless stores
    [in out]: `to_hf` gives the tensors in its layout."""
    return {
        slot_path(t.slots[0]): name
        for name, t in model_table(model_or_config).items()
        if not t.duplicate
    }


def dropless_names(model_or_config: DeepSeekV3 | DeepSeekV3Config) -> dict[str, str]:
    """{Hugging Face tensor name: dropless path}, the inverse of `hf_names`, for every tensor
    `save_pretrained` writes, copies included (an MTP module's `embed_tokens.weight` maps to
    `embed_tokens`)."""
    return {name: slot_path(t.slots[0]) for name, t in model_table(model_or_config).items()}
