"""Aux-loss-free balancing on a whole `DeepSeekV3`: every router's `expert_bias` moved by its rule
(`TopKRouter.bias_update`) from a step's loads, and the rules' states."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from dropless._moe import MoE
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.models.deepseek_v3._model import DeepSeekV3, ModelOutput

ExpertBiasState = tuple[PyTree, PyTree]
"""The bias rules' states (`AbstractBiasUpdate.init`) of the main MoE layers' routers and of the
MTP blocks' (None where a rule keeps none, or there is no expert bias)."""


def _bias_stacks(model: DeepSeekV3) -> list:
    """(where the main stack's and the MTP blocks' `expert_bias` is, their MoE or None)."""

    def moe_of(block):
        is_moe = isinstance(block, DecoderBlock) and isinstance(block.mlp, MoE)
        moe = block.mlp if is_moe else None
        return moe if moe is not None and moe.router.expert_bias is not None else None

    pairs = [(lambda m: m.moe_layers.mlp.router.expert_bias, moe_of(model.moe_layers))]
    where_mtp = lambda m: m.mtp.layers.block.mlp.router.expert_bias  # noqa: E731
    pairs.append((where_mtp, None if model.mtp is None else moe_of(model.mtp.layers.block)))
    return pairs


def expert_bias_state(model: DeepSeekV3) -> ExpertBiasState:
    """The state every router's bias rule starts from (`AbstractBiasUpdate.init`)."""
    return tuple(
        None if moe is None else moe.router.bias_update.init(moe.router.expert_bias)
        for _, moe in _bias_stacks(model)
    )


def step_expert_bias(
    model: DeepSeekV3,
    out: ModelOutput,
    rate: float | Float[Array, ""],
    state: ExpertBiasState | None = None,
) -> tuple[DeepSeekV3, ExpertBiasState]:
    """Aux-loss-free balancing step: every router's `expert_bias` moved by its rule
    (`TopKRouter.bias_update`) at `rate` towards balance, from the loads in `out` (main MoE
    layers and MTP blocks), and the rules' new states. `state`: the last step's
    (`expert_bias_state(model)` before the first; None: that). A no-op without biases."""
    state = expert_bias_state(model) if state is None else state
    new_state = []
    for (where, moe), stats, rule_state in zip(
        _bias_stacks(model), (out.moe_stats, out.mtp_moe_stats), state, strict=True
    ):
        if moe is None:
            new_state.append(rule_state)
            continue
        loads = jnp.concatenate([stats.tokens_per_expert, stats.zero_tokens], -1)
        bias = moe.router.expert_bias
        target = moe.bias_target(loads)
        new, rule_state = moe.router.bias_update.update(bias, loads, rate, target, rule_state)
        model = eqx.tree_at(where, model, new)
        new_state.append(rule_state)
    return model, tuple(new_state)


def with_updated_expert_bias(
    model: DeepSeekV3, out: ModelOutput, rate: float | Float[Array, ""]
) -> DeepSeekV3:
    """`step_expert_bias` from the rules' first state: all that a rule without memory (the
    sign and proportional rules) needs."""
    return step_expert_bias(model, out, rate)[0]
