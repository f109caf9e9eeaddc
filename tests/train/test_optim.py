"""Learning-rate schedule, weight-decay mask, trainable filter, optimiser numbers as data."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

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


def _random_tree(seed: int):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (4, 3)), "norm": jax.random.normal(k2, (3,))}


def _run(config: TrainConfig, steps: int = 4):
    """`steps` updates of random gradients through the library's optimiser: the updates and the
    final state."""
    params = _random_tree(0)
    state = optim.with_learning_rate(optim.optimizer_state(config, params), jnp.float32(0.01))
    step = jax.jit(optim.optimizer().update)
    updates = []
    for t in range(steps):
        u, state = step(_random_tree(t + 1), state, params)
        updates.append(u)
    return updates, state


def test_float32_moments_give_optax_adamw():
    """`optim.adamw` rewrites optax's chain to keep the moments' dtype; in float32 it is the
    same formula as optax.adamw behind the same clipping. Not bit for bit: XLA fuses the two
    programs differently (1 float32 ulp seen), hence a tolerance of a few ulps."""
    config = TrainConfig(grad_clip=1.0, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8)
    got, _ = _run(config)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))  # betas as f32 arrays
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=optim.weight_decay_mask),
    )
    params = _random_tree(0)
    state = reference.init(params)
    for t, update in enumerate(got):
        want, state = jax.jit(reference.update)(_random_tree(t + 1), state, params)
        for a, b in zip(jax.tree.leaves(update), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=4 * 2**-24, atol=0)


def _moments(opt_state):
    adam = opt_state[1].inner_state[0]
    return jax.tree.leaves((adam.mu, adam.nu))


def test_bfloat16_moments_stay_bfloat16_and_track_the_float32_run():
    steps = 4
    f32_updates, f32_state = _run(TrainConfig(), steps)
    bf16_updates, bf16_state = _run(TrainConfig(moments_dtype="bfloat16"), steps)
    assert all(m.dtype == jnp.bfloat16 for m in _moments(bf16_state))
    assert all(m.dtype == jnp.float32 for m in _moments(f32_state))
    for got, want in zip(_moments(bf16_state), _moments(f32_state), strict=True):
        # Each step rounds a moment by at most half an ulp, 2**-9 of its size, and earlier
        # roundings only shrink (by beta): `steps` roundings of the largest moment bound it.
        bound = steps * 2**-9 * float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0, atol=bound)
    # An update is lr * m / sqrt(v), |m / sqrt(v)| <= 1 here, so the moments' relative errors
    # (each at most `steps` half-ulps) move it by at most about lr * steps * 2**-8.
    last = zip(jax.tree.leaves(bf16_updates[-1]), jax.tree.leaves(f32_updates[-1]), strict=True)
    for got, want in last:
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * steps * 2**-8)
        assert not np.array_equal(got, want)  # rounded moments do change the update a little


def test_with_config_converts_the_moments_of_a_resumed_state():
    _, state = _run(TrainConfig())
    converted = optim.with_config(state, TrainConfig(moments_dtype="bfloat16"))
    for got, want in zip(_moments(converted), _moments(state), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))


@pytest.mark.parametrize(("b2", "decays"), [(0.99, True), (0.999, False)])
def test_a_bfloat16_second_moment_decays_only_for_beta_up_to_the_bound(b2, decays):
    """Why `moments_dtype="bfloat16"` needs b2 <= MAX_BF16_BETA: with zero gradients, nu
    should shrink by b2 each step; at 0.999 the decay is below half a bf16 ulp and nu stays."""
    grads = {"x": jnp.zeros((64,))}
    nu = jax.random.uniform(jax.random.key(0), (64,), minval=0.5, maxval=2.0).astype(jnp.bfloat16)
    adam = optim.scale_by_adam(0.9, b2, 1e-8)
    state = adam.init(grads)._replace(nu={"x": nu}, mu={"x": jnp.zeros((64,), jnp.bfloat16)})
    _, state = adam.update(grads, state)
    shrank = state.nu["x"].astype(jnp.float32) < nu.astype(jnp.float32)
    assert shrank.all() if decays else not shrank.any()
    assert (b2 <= optim.MAX_BF16_BETA) == decays


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moments_dtype": "float16"}, "moments_dtype"),  # the type check may come first
        ({"moments_dtype": "bfloat16", "b2": 0.999}, r"TrainConfig.b2=0.999 must be <= 0.99"),
        ({"moments_dtype": "bfloat16", "b1": 0.995}, r"TrainConfig.b1=0.995 must be <= 0.99"),
    ],
)
def test_bad_moments_settings_are_clear_errors(changes, message):
    with pytest.raises((ValueError, TypeCheckError), match=message):
        TrainConfig(**changes)
