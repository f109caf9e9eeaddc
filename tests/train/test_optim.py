"""Learning-rate schedule, weight-decay mask, trainable filter, optimiser numbers as data."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import optim
from dropless.train.config import TrainConfig


def reference_lr(t: int, lr: float, warmup: int, steps: int, ratio: float) -> float:
    if t < warmup:
        return lr * t / warmup
    progress = min((t - warmup) / (steps - warmup), 1.0)
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("warmup", [0, 10])
def test_lr_schedule_matches_the_formula(warmup):
    config = TrainConfig(lr=2e-3, warmup_steps=warmup, steps=100, min_lr_ratio=0.1)
    for t in [0, 1, 5, 9, 10, 11, 37, 55, 99, 100, 150]:
        expected = reference_lr(t, 2e-3, warmup, 100, 0.1)
        assert float(optim.learning_rate(config, t)) == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert float(optim.learning_rate(config, warmup)) == pytest.approx(2e-3, rel=1e-6)
    assert float(optim.learning_rate(config, 100)) == pytest.approx(2e-4, rel=1e-5)


def test_lr_schedule_works_traced():
    f = jax.jit(
        lambda t, lr: optim.warmup_cosine(t, lr=lr, warmup_steps=4, steps=20, min_lr_ratio=0.0)
    )
    assert float(f(2, 1.0)) == pytest.approx(0.5)
    assert float(f(12, 1.0)) == pytest.approx(0.5, abs=1e-6)  # half-way through the cosine


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(get_preset("tiny"), key=jax.random.key(0))


def _by_path(tree) -> dict[str, object]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_weight_decay_mask(model):
    mask = _by_path(optim.weight_decay_mask(model))
    shapes = {k: v.shape for k, v in _by_path(model).items()}
    # norms (stacked: 2-D) and 1-D arrays are never decayed
    norm_keys = [k for k in mask if "norm" in k]
    assert norm_keys and not any(mask[k] for k in norm_keys)
    assert any(len(shapes[k]) == 2 for k in norm_keys)  # the stacked case is covered
    assert not any(mask[k] for k in mask if len(shapes[k]) <= 1)
    assert not any(mask[k] for k in mask if "expert_bias" in k)
    # matrices are
    for key in (".embed_tokens", ".lm_head", ".moe_layers.mlp.experts.w_gate"):
        assert mask[key]
    assert mask[".moe_layers.self_attn.q_a_proj"]


def test_expert_bias_is_not_trainable(model):
    trainable = _by_path(optim.trainable_filter(model))
    bias = _by_path(optim.expert_bias_filter(model))
    bias_keys = [k for k, v in bias.items() if v]
    assert bias_keys == [
        ".moe_layers.mlp.router.expert_bias",
        ".mtp.layers.block.mlp.router.expert_bias",
    ]
    assert not any(trainable[k] for k in bias_keys)
    assert sum(trainable.values()) == len(trainable) - len(bias_keys)


def test_optimizer_numbers_come_from_the_config(model):
    params = eqx.filter(model, optim.trainable_filter(model))
    config = TrainConfig(b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.05, grad_clip=0.5)
    clip_state, adamw_state = optim.optimizer_state(config, params)
    assert float(clip_state.hyperparams["max_norm"]) == 0.5
    hyper = {k: float(v) for k, v in adamw_state.hyperparams.items()}
    assert hyper["b1"] == pytest.approx(0.8) and hyper["b2"] == pytest.approx(0.9)
    assert hyper["eps"] == pytest.approx(1e-6) and hyper["weight_decay"] == pytest.approx(0.05)
    off = optim.with_config((clip_state, adamw_state), TrainConfig(grad_clip=0.0))
    assert math.isinf(float(off[0].hyperparams["max_norm"]))


def test_one_update_is_adamw_with_clipping():
    params = {"w": jnp.ones((2, 3)), "norm": jnp.ones((3,))}
    grads = {"w": jnp.full((2, 3), 10.0), "norm": jnp.full((3,), 10.0)}
    config = TrainConfig(grad_clip=1.0, weight_decay=0.5, b1=0.9, b2=0.95, eps=1e-8)
    state = optim.with_learning_rate(optim.optimizer_state(config, params), jnp.float32(0.1))
    updates, _ = optim.optimizer().update(grads, state, params)
    # After clipping every gradient element is equal, so Adam's first step is sign * 1;
    # decay 0.5 * w applies to the matrix only.
    np.testing.assert_allclose(updates["w"], -0.1 * (1.0 + 0.5), rtol=1e-5)
    np.testing.assert_allclose(updates["norm"], -0.1 * 1.0, rtol=1e-5)
