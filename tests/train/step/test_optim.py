"""Learning-rate schedule, weight-decay mask, trainable filter, optimiser numbers as data."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train._config import MAX_BF16_BETA
from dropless.train.step import _optim as optim


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
    state after each."""
    params = _random_tree(0)
    state = optim.with_learning_rate(optim.optimizer_state(config, params), jnp.float32(0.01))
    step = jax.jit(optim.optimizer().update)
    updates, states = [], []
    for t in range(steps):
        u, state = step(_random_tree(t + 1), state, params)
        updates.append(u)
        states.append(state)
    return updates, states


def _optax_adamw(eps: float):
    """optax.adamw behind the same clipping, its numbers injected (float32 arrays) like ours."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
    return optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
        adamw(0.01, b1=0.9, b2=0.95, eps=eps, weight_decay=0.1, mask=optim.weight_decay_mask),
    )


def test_the_state_is_optax_adamws():
    """Same tree as optax.adamw's injected state (`eps_root` included): checkpoints written
    before `optim.adamw` replaced it restore into it."""
    params = _random_tree(0)
    ours = optim.optimizer_state(TrainConfig(), params)
    assert jax.tree.structure(ours) == jax.tree.structure(_optax_adamw(1e-8).init(params))


@pytest.mark.parametrize("eps", [1e-8, 0.1])  # a large eps shows where it is added
def test_float32_moments_give_optax_adamw(eps):
    """In float32, `optim.adamw` is optax.adamw's formula. Not bit for bit: XLA fuses the two
    programs differently (1 float32 ulp seen), hence a tolerance of a few ulps."""
    config = TrainConfig(grad_clip=1.0, weight_decay=0.1, b1=0.9, b2=0.95, eps=eps)
    got, _ = _run(config)
    reference = _optax_adamw(eps)
    params = _random_tree(0)
    state = optim.with_learning_rate(reference.init(params), jnp.float32(0.01))
    for t, update in enumerate(got):
        want, state = jax.jit(reference.update)(_random_tree(t + 1), state, params)
        for a, b in zip(jax.tree.leaves(update), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=4 * 2**-24, atol=0)


def _moments(opt_state):
    adam = opt_state[1].inner_state[0]
    return jax.tree.leaves((adam.mu, adam.nu))


def test_one_bfloat16_step_is_the_float32_formula_rounded():
    """From a bf16 state, one step computes in float32 on the upcast moments and stores the
    new moments rounded to bf16."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    g = jax.random.normal(jax.random.key(0), (32,))
    k_mu, k_nu = jax.random.split(jax.random.key(1))
    mu = jax.random.normal(k_mu, (32,)).astype(jnp.bfloat16)
    nu = jax.random.uniform(k_nu, (32,)).astype(jnp.bfloat16)
    adam = optim.scale_by_adam(b1, b2, eps)
    state = adam.init(g)._replace(count=jnp.asarray(3, jnp.int32), mu=mu, nu=nu)
    update, new = adam.update(g, state)
    m = (1 - b1) * g + b1 * mu.astype(jnp.float32)
    v = (1 - b2) * g**2 + b2 * nu.astype(jnp.float32)
    want = (m / (1 - jnp.float32(b1) ** 4)) / (jnp.sqrt(v / (1 - jnp.float32(b2) ** 4)) + eps)
    np.testing.assert_allclose(update, want, rtol=2**-21)  # a few ulps: pow, fused divisions
    np.testing.assert_array_equal(new.mu, m.astype(jnp.bfloat16))
    np.testing.assert_array_equal(new.nu, v.astype(jnp.bfloat16))


def test_bfloat16_moments_stay_bfloat16_and_track_the_float32_run():
    steps = 4
    _, f32_states = _run(TrainConfig(), steps)
    _, bf16_states = _run(TrainConfig(moments_dtype="bfloat16"), steps)
    assert all(m.dtype == jnp.bfloat16 for m in _moments(bf16_states[-1]))
    assert all(m.dtype == jnp.float32 for m in _moments(f32_states[-1]))
    for i, (got, want) in enumerate(
        zip(_moments(bf16_states[-1]), _moments(f32_states[-1]), strict=True)
    ):
        # Each step rounds a moment by at most half an ulp, at most 2**-8 of its size, and
        # earlier roundings only shrink (by beta): `steps` times the largest size it had bound
        # the difference.
        largest = max(float(jnp.max(jnp.abs(_moments(s)[i]))) for s in f32_states)
        np.testing.assert_allclose(
            got.astype(jnp.float32), want, rtol=0, atol=steps * 2**-8 * largest
        )
        assert not np.array_equal(got.astype(jnp.float32), want)  # rounding did happen


def test_with_config_converts_the_moments_of_a_resumed_state():
    _, states = _run(TrainConfig())
    converted = optim.with_config(states[-1], TrainConfig(moments_dtype="bfloat16"))
    for got, want in zip(_moments(converted), _moments(states[-1]), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))


@pytest.mark.parametrize(("b2", "decays"), [(0.98, True), (0.999, False)])
def test_a_bfloat16_second_moment_decays_only_for_beta_up_to_the_bound(b2, decays):
    """With zero gradients nu should shrink by b2 each step; at 0.999 the decay is below half a
    bf16 ulp and nu stays where it is."""
    grads = {"x": jnp.zeros((64,))}
    nu = jax.random.uniform(jax.random.key(0), (64,), minval=0.5, maxval=2.0).astype(jnp.bfloat16)
    adam = optim.scale_by_adam(0.9, b2, 1e-8)
    state = adam.init(grads)._replace(nu={"x": nu}, mu={"x": jnp.zeros((64,), jnp.bfloat16)})
    _, state = adam.update(grads, state)
    shrank = state.nu["x"].astype(jnp.float32) < nu.astype(jnp.float32)
    assert shrank.all() if decays else not shrank.any()


@pytest.mark.parametrize("b2", [MAX_BF16_BETA, 0.99])
def test_bfloat16_second_moment_bias_sets_the_bound(b2):
    """Why bf16 moments need b2 <= MAX_BF16_BETA: under unit Gaussian gradients for 3000 steps
    the bf16 second moment's mean stays within 1% of the float32 one's at the bound, and ends
    more than 2% high at 0.99 (moves that round away are not symmetric)."""
    adam = optim.scale_by_adam(0.9, b2, 1e-8)
    ones = jnp.ones((4096,))

    @functools.partial(jax.jit, static_argnums=0)  # one program: the 3000 steps and the mean
    def run(dtype):
        state = adam.init(ones)._replace(
            mu=jnp.zeros_like(ones, dtype), nu=jnp.ones_like(ones, dtype)
        )

        def step(state, key):
            return adam.update(jax.random.normal(key, ones.shape), state)[1], None

        final, _ = jax.lax.scan(step, state, jax.random.split(jax.random.key(0), 3000))
        return jnp.mean(final.nu.astype(jnp.float32))

    bias = float(run(jnp.bfloat16) / run(jnp.float32)) - 1
    assert abs(bias) < 0.01 if b2 <= MAX_BF16_BETA else bias > 0.02


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"moments_dtype": "float16"}, "moments_dtype"),  # the type check may come first
        ({"moments_dtype": "bfloat16", "b2": 0.99}, r"TrainConfig.b2=0.99 must be <= 0.98"),
        ({"moments_dtype": "bfloat16", "b1": 0.995}, r"TrainConfig.b1=0.995 must be <= 0.98"),
    ],
)
def test_bad_moments_settings_are_clear_errors(changes, message):
    with pytest.raises((ValueError, TypeCheckError), match=message):
        TrainConfig(**changes)
