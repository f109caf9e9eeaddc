"""Aux-loss-free balancing: rules that move each router's selection-only `expert_bias` after an
optimiser step, from the step's tokens per expert, towards a target load.

A rule is a parameter-free value on the router (`TopKRouter(..., bias_update=...)`, the model's
`DeepSeekV3Config.bias_update`); the step size comes from the trainer
(`TrainConfig.bias_update_rate`), as data, so changing it recompiles nothing.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class AbstractBiasUpdate(eqx.Module):
    """`rule(bias, load, rate, target=None) -> new bias`.

    - `bias`, `load`: `[*layers experts]`: the biases and the tokens each expert received.
    - `rate`: the step size (a float or a float32 scalar array); 0 leaves the bias unchanged.
    - `target`: the load each expert should receive, broadcastable to `load`; None: the mean
      load of the layer (perfect balance).

    The new bias never carries a gradient. Rules fill in `_step(error, target)`: the change per
    unit rate, given `error = target - load`.
    """

    def __call__(
        self,
        bias: Float[Array, "*layers experts"],
        load: Float[Array, "*layers experts"],
        rate: float | Float[Array, ""],
        target: Float[Array, "*layers experts"] | None = None,
    ) -> Float[Array, "*layers experts"]:
        if bias.shape != load.shape:
            raise ValueError(f"bias {bias.shape} and load {load.shape} must have one shape")
        load = jax.lax.stop_gradient(load).astype(jnp.float32)
        if target is None:
            target = load.mean(-1, keepdims=True)
        target = jnp.broadcast_to(jax.lax.stop_gradient(target), load.shape).astype(jnp.float32)
        step = self._step(target - load, target)
        return jax.lax.stop_gradient(bias + (rate * step).astype(bias.dtype))

    @abc.abstractmethod
    def _step(
        self, error: Float[Array, "*layers experts"], target: Float[Array, "*layers experts"]
    ) -> Float[Array, "*layers experts"]: ...


class SignBiasUpdate(AbstractBiasUpdate):
    """DeepSeek-V3's rule: every bias moves by exactly `rate`, up for experts below their
    target, down for those above (an expert exactly at its target stays). The default."""

    def _step(self, error, target):
        return jnp.sign(error)


class ProportionalBiasUpdate(AbstractBiasUpdate):
    """A proportional controller (as LongCat-Flash's): each bias moves by `rate` times its
    relative error `(target - load) / target`, so experts far from their target move fast and
    those near it barely move, where the sign rule keeps every bias oscillating by `rate`."""

    def _step(self, error, target):
        return error / jnp.maximum(target, 1e-9)


BIAS_UPDATES: dict[str, AbstractBiasUpdate] = {
    "sign": SignBiasUpdate(),
    "proportional": ProportionalBiasUpdate(),
}
"""The rules by the names `DeepSeekV3Config.bias_update` takes."""
