"""Aux-loss-free balancing: rules that move each router's selection-only `expert_bias` after an
optimiser step, from the step's tokens per expert, towards a target load.

A rule is a value on the router (`TopKRouter(..., bias_update=...)`, the model's
`DeepSeekV3Config.bias_update`); the step size comes from the trainer
(`TrainConfig.bias_update_rate`), as data, so changing it recompiles nothing. A rule with a
memory (`PIDBiasUpdate`) keeps it in a state that the caller carries, as an optax optimiser's:
`init(bias)`, then `update(...)` each step (the trainer keeps it in `TrainState.bias_state`).
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree


class AbstractBiasUpdate(eqx.Module):
    """`rule.update(bias, load, rate, target=None, state=None) -> (new bias, new state)`.

    - `bias`, `load`: `[*layers experts]`: the biases and the tokens each expert received.
    - `rate`: the step size (a float or a float32 scalar array); 0 leaves the bias, and the
      state, unchanged.
    - `target`: the load each expert should receive, broadcastable to `load`; None: the mean
      load of the layer (perfect balance).
    - `state`: what the rule remembers between steps, from `init(bias)` and then each update's
      (None for a rule without memory, the sign and proportional rules); None: `init(bias)`.

    `rule(bias, load, rate, target=None) -> new bias` is one update from `init`'s state: all a
    rule without memory needs. The new bias never carries a gradient. Rules fill in
    `_step(error, target, state) -> (change per unit rate, new state)`, given
    `error = target - load`, and `init` if they keep a state.
    """

    def init(self, bias: Float[Array, "*layers experts"]) -> PyTree:
        """The state before the first update (None: the rule keeps none)."""
        return None

    def __call__(
        self,
        bias: Float[Array, "*layers experts"],
        load: Float[Array, "*layers experts"],
        rate: float | Float[Array, ""],
        target: Float[Array, "*layers experts"] | None = None,
    ) -> Float[Array, "*layers experts"]:
        return self.update(bias, load, rate, target)[0]

    def update(
        self,
        bias: Float[Array, "*layers experts"],
        load: Float[Array, "*layers experts"],
        rate: float | Float[Array, ""],
        target: Float[Array, "*layers experts"] | None = None,
        state: PyTree = None,
    ) -> tuple[Float[Array, "*layers experts"], PyTree]:
        if bias.shape != load.shape:
            raise ValueError(f"bias {bias.shape} and load {load.shape} must have one shape")
        if state is None:
            state = self.init(bias)
        load = jax.lax.stop_gradient(load).astype(jnp.float32)
        if target is None:
            target = load.mean(-1, keepdims=True)
        target = jnp.broadcast_to(jax.lax.stop_gradient(target), load.shape).astype(jnp.float32)
        step, new_state = self._step(target - load, target, state)
        # a rate of 0 is "off": the state waits too, rather than gathering error it never acts on
        new_state = jax.tree.map(lambda new, old: jnp.where(rate != 0, new, old), new_state, state)
        return jax.lax.stop_gradient(bias + (rate * step).astype(bias.dtype)), new_state

    @abc.abstractmethod
    def _step(
        self, error: Float[Array, "*layers experts"], target: Float[Array, "*layers experts"], state
    ) -> tuple[Float[Array, "*layers experts"], PyTree]: ...


def _relative(error, target):
    return error / jnp.maximum(target, 1e-9)


class SignBiasUpdate(AbstractBiasUpdate):
    """DeepSeek-V3's rule: every bias moves by exactly `rate`, up for experts below their
    target, down for those above (an expert exactly at its target stays). The default."""

    def _step(self, error, target, state):
        return jnp.sign(error), state


class ProportionalBiasUpdate(AbstractBiasUpdate):
    """A proportional controller (as LongCat-Flash's): each bias moves by `rate` times its
    relative error `(target - load) / target`, so experts far from their target move fast and
    those near it barely move, where the sign rule keeps every bias oscillating by `rate`."""

    def _step(self, error, target, state):
        return _relative(error, target), state


class PIDState(eqx.Module):
    """`PIDBiasUpdate`'s memory, one entry per bias."""

    integral: Float[Array, "*layers experts"]  # sum of the relative errors so far
    error: Float[Array, "*layers experts"]  # the last update's relative error


class PIDBiasUpdate(AbstractBiasUpdate):
    """A PID controller on each expert's relative error `e_t = (target - load) / target`:
    the bias moves by `rate * (kp * e_t + ki * (e_1 + ... + e_t) + kd * (e_t - e_{t-1}))`,
    with `e_0 = 0` (the first update's derivative term is `kd * e_1`).

    The proportional term is `ProportionalBiasUpdate` (kp alone equals it); the integral term
    removes the offset that a load pulled steadily away from its target (a router that keeps
    preferring an expert) leaves a proportional rule with; the derivative term damps the
    overshoot. The state is `PIDState` (`init`: zeros).
    """

    # static: a model holding the rule goes through jax transformations (eval_shape, scan over
    # stacked layers), which would otherwise turn the gains into traced arrays
    kp: float = eqx.field(default=1.0, static=True)
    ki: float = eqx.field(default=0.05, static=True)
    kd: float = eqx.field(default=0.0, static=True)

    def init(self, bias):
        # two arrays, not one twice: a train step donates each buffer once
        return PIDState(
            integral=jnp.zeros(bias.shape, jnp.float32), error=jnp.zeros(bias.shape, jnp.float32)
        )

    def _step(self, error, target, state):
        e = _relative(error, target)
        integral = state.integral + e
        step = self.kp * e + self.ki * integral + self.kd * (e - state.error)
        return step, PIDState(integral=integral, error=e)


BIAS_UPDATES: dict[str, AbstractBiasUpdate] = {
    "sign": SignBiasUpdate(),
    "proportional": ProportionalBiasUpdate(),
    "pid": PIDBiasUpdate(),
}
"""The rules by the names `DeepSeekV3Config.bias_update` takes (the PID rule's gains there are
`bias_pid_kp`, `bias_pid_ki` and `bias_pid_kd`)."""
