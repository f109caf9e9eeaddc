"""The optimiser: global-norm clipping then AdamW, on a linear-warmup + cosine-decay schedule,
with a weight-decay mask; plus the filter that keeps non-trainable arrays (the routers' expert
bias) out of the optimiser altogether.

Every number of the optimiser (learning rate, betas, eps, weight decay, clip norm) is *data*,
held in the optimiser state (`optax.inject_hyperparams`), not a constant compiled into the step:
one optimiser object, and one compiled train step, serve every `TrainConfig`, and a run resumed
with another learning rate recompiles nothing.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Float, PyTree

from dropless.nn._rmsnorm import RMSNorm
from dropless.train._config import TrainConfig

# Arrays under an attribute of this name are updated by the aux-loss-free balancing rule
# (dropless.update_expert_bias), never by gradients or weight decay.
EXPERT_BIAS = "expert_bias"

# Attribute names whose arrays get no weight decay, whatever their rank (stacked layers make a
# norm's weight 2-D, so the rank alone cannot tell).
_NO_DECAY_NAMES = ("norm", "bias", "sinks")


def attribute_names(path) -> list[str]:
    """The attribute (and dict key) names along a pytree key path."""
    names = []
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            names.append(entry.name)
        elif isinstance(entry, jax.tree_util.DictKey):
            names.append(str(entry.key))
    return names


def trainable_filter(model: PyTree) -> PyTree[bool]:
    """True for arrays the optimiser trains: every floating array except an `expert_bias`.

    Use with `eqx.partition(model, trainable_filter(model))`.
    """

    def is_trainable(path, leaf):
        return _is_inexact(leaf) and EXPERT_BIAS not in attribute_names(path)

    return jax.tree_util.tree_map_with_path(is_trainable, model)


def _is_inexact(leaf) -> bool:
    # a jax.ShapeDtypeStruct stands for an array under jax.eval_shape
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.issubdtype(leaf.dtype, jnp.inexact)
    return eqx.is_inexact_array(leaf)


def expert_bias_filter(model: PyTree) -> PyTree[bool]:
    """True for the `expert_bias` arrays (updated outside the gradient), False elsewhere."""

    def is_bias(path, leaf):
        return eqx.is_inexact_array(leaf) and EXPERT_BIAS in attribute_names(path)

    return jax.tree_util.tree_map_with_path(is_bias, model)


def weight_decay_mask(params: PyTree) -> PyTree[bool]:
    """True where weight decay applies: arrays of rank >= 2 that are not norms or biases.

    Rank alone is not enough, since a stacked (scanned) norm weight is [layers dim]: arrays
    inside an `RMSNorm`, or whose attribute path names a norm or a bias, are excluded too.
    """

    def decays(path, node):
        if isinstance(node, RMSNorm):
            return jax.tree.map(lambda _: False, node)
        if not eqx.is_inexact_array(node) or node.ndim < 2:
            return False
        names = attribute_names(path)
        return not any(tag in name.lower() for name in names for tag in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(
        decays, params, is_leaf=lambda node: isinstance(node, RMSNorm)
    )


def warmup_cosine(
    step: ArrayLike,
    *,
    lr: ArrayLike,
    warmup_steps: ArrayLike,
    steps: ArrayLike,
    min_lr_ratio: ArrayLike,
) -> Float[Array, ""]:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `lr * min_lr_ratio`
    at `steps` (and constant after):

        lr(t) = lr * t / warmup                                                  t < warmup
        lr(t) = lr * (r + (1 - r) * (1 + cos(pi * (t - warmup) / (steps - warmup))) / 2)   after

    Every argument may be traced, so the schedule is data inside a compiled step.
    """
    t = jnp.asarray(step, jnp.float32)
    warmup = jnp.asarray(warmup_steps, jnp.float32)
    decay = jnp.maximum(jnp.asarray(steps, jnp.float32) - warmup, 1.0)
    progress = jnp.clip((t - warmup) / decay, 0.0, 1.0)
    cosine = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    warm = t / jnp.maximum(warmup, 1.0)
    return jnp.asarray(lr, jnp.float32) * jnp.where(t < warmup, warm, cosine)


def learning_rate(config: TrainConfig, step: ArrayLike) -> Float[Array, ""]:
    """The learning rate of step `step` (0-based) under `config`'s schedule."""
    return warmup_cosine(
        step,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
        steps=config.steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def scale_by_adam(
    b1: ArrayLike, b2: ArrayLike, eps: ArrayLike, eps_root: ArrayLike = 0.0
) -> optax.GradientTransformation:
    """`optax.scale_by_adam` (same state, same float32 arithmetic) whose moments keep the dtype
    they have in the state: `optimizer_state` stores them in `TrainConfig.moments_dtype`, and
    each update rounds the new moments to it."""

    def init(params):
        return optax.scale_by_adam(b1, b2, eps, eps_root).init(params)

    def update(grads, state, params=None):
        del params
        f32 = lambda m: m.astype(jnp.float32)  # noqa: E731
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * f32(m), grads, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g**2 + b2 * f32(v), grads, state.nu)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        like = lambda new, old: new.astype(old.dtype)  # noqa: E731
        return updates, optax.ScaleByAdamState(
            count, jax.tree.map(like, mu, state.mu), jax.tree.map(like, nu, state.nu)
        )

    return optax.GradientTransformation(init, update)


def adamw(
    learning_rate, b1, b2, eps, weight_decay, mask, eps_root=0.0
) -> optax.GradientTransformation:
    """`optax.adamw` on `scale_by_adam` above: the same chain, and under
    `optax.inject_hyperparams` the same state (`eps_root` included), so checkpoints written
    with `optax.adamw` restore into it."""
    return optax.chain(
        scale_by_adam(b1, b2, eps, eps_root),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


@functools.cache
def optimizer() -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW decaying only `weight_decay_mask`, every number injected.

    One object for the whole process (so compiled steps are shared); `optimizer_state` sets the
    numbers from a config, `with_learning_rate` the learning rate of a step.
    """
    return optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
        optax.inject_hyperparams(adamw, static_args=("mask",))(
            learning_rate=0.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0, mask=weight_decay_mask
        ),
    )


def _hyperparams(config: TrainConfig) -> tuple[dict, dict]:
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    adamw = dict(b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay)
    return {"max_norm": max_norm}, adamw


@eqx.filter_jit
def optimizer_state(config: TrainConfig, params: PyTree) -> PyTree:
    """A fresh optimiser state for `params`, with `config`'s numbers."""
    # Compiled, so that the moments are made in their own dtype: bf16 ones never exist in
    # float32 first. (Initialised from params, whose float32 also sets the injected numbers'.)
    return with_config(optimizer().init(params), config)


def with_config(opt_state: PyTree, config: TrainConfig) -> PyTree:
    """`opt_state` with clip norm, betas, eps and weight decay taken from `config`, and the
    moments stored in its `moments_dtype` (their values and the counts are kept: this is how a
    resumed run adopts a changed config)."""
    clip, adamw = _hyperparams(config)
    clip_state, adamw_state = opt_state

    def update(state, values):
        merged = {**state.hyperparams}
        for name, value in values.items():
            merged[name] = jnp.asarray(value, merged[name].dtype)
        return state._replace(hyperparams=merged)

    adam, *rest = adamw_state.inner_state
    store = lambda m: m.astype(config.moments_dtype)  # noqa: E731
    adam = adam._replace(mu=jax.tree.map(store, adam.mu), nu=jax.tree.map(store, adam.nu))
    adamw_state = adamw_state._replace(inner_state=(adam, *rest))
    return (update(clip_state, clip), update(adamw_state, adamw))


def with_learning_rate(opt_state: PyTree, lr: Float[Array, ""]) -> PyTree:
    """`opt_state` whose next update uses learning rate `lr`."""
    clip_state, adamw_state = opt_state
    hyper = {**adamw_state.hyperparams, "learning_rate": lr.astype(jnp.float32)}
    return (clip_state, adamw_state._replace(hyperparams=hyper))
