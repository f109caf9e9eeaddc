"""Balance losses as values: which load-balancing loss a trainer adds, with its coefficient.

    loss = ... + sum over the chosen losses of coef * (the loss, summed over MoE layers)

Each loss reads the MoE layers' statistics (`MoEStats`, stacked over layers) of one
micro-batch: the batch-wise (Switch) and the sequence-wise (DeepSeek-V3) losses are that
micro-batch's own; the global-batch loss (Qwen's) takes its load fractions from the tokens per
expert of the whole step's batch, summed over data shards and micro-batches, so that it equals
the loss of the whole batch in one pass. The trainer chooses them by their coefficients
(`TrainConfig.balance_losses`, the fields `<term>_coef`).
"""

import abc
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from dropless import _balance as balance
from dropless._moe import MoEStats


class AbstractBalanceLoss(eqx.Module):
    """`loss(stats, loads=None) -> [*layers]`: each MoE layer's unweighted loss, from a
    micro-batch's `stats` (`MoEStats`, fields stacked over `*layers`); `loss.weighted(stats,
    loads)`: `coef` times its sum over layers, what the training loss adds.

    - `coef`: the loss's weight (a float, or a float32 scalar array: the trainer's is data, so
      a new coefficient recompiles nothing); 0 leaves the loss out.
    - `loads`: `[*layers experts]` tokens per expert of the whole step's batch, read by the
      losses whose `whole_batch` is True; None: the micro-batch's own (`stats`').
    - `term`: the loss's name in the step's metrics (and `TrainConfig`'s `<term>_coef`).
    """

    coef: float | Float[Array, ""] = 0.0
    term: ClassVar[str]
    whole_batch: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(
        self, stats: MoEStats, loads: Float[Array, "*layers experts"] | None = None
    ) -> Float[Array, "*layers"]: ...

    def weighted(
        self, stats: MoEStats, loads: Float[Array, "*layers experts"] | None = None
    ) -> Float[Array, ""]:
        return self.coef * jnp.sum(self(stats, loads))


class BatchBalanceLoss(AbstractBalanceLoss):
    """Switch Transformer's loss `E * sum_i f_i * P_i` over each micro-batch
    (`dropless.batch_balance_loss`): with micro-batches or data shards, the mean of their
    losses, not the whole batch's."""

    term: ClassVar[str] = "balance_loss"

    def __call__(self, stats, loads=None):
        return stats.balance_loss


class SequenceBalanceLoss(AbstractBalanceLoss):
    """DeepSeek-V3's sequence-wise loss: the batch-wise loss within each sequence, averaged
    (`dropless.sequence_balance_loss`)."""

    term: ClassVar[str] = "seq_balance_loss"

    def __call__(self, stats, loads=None):
        return stats.seq_balance_loss


class GlobalBatchBalanceLoss(AbstractBalanceLoss):
    """Qwen's global-batch loss: `f` from `loads`, the whole step's batch (no gradient), `P`
    the micro-batch's own (`dropless.global_balance_loss`). Without `loads` it is the
    batch-wise loss of the micro-batch."""

    term: ClassVar[str] = "global_balance_loss"
    whole_batch: ClassVar[bool] = True

    def __call__(self, stats, loads=None):
        loads = stats.tokens_per_expert if loads is None else loads
        return balance.global_balance_loss(stats.router_probability, loads)


BALANCE_LOSSES: tuple[type[AbstractBalanceLoss], ...] = (
    BatchBalanceLoss,
    SequenceBalanceLoss,
    GlobalBatchBalanceLoss,
)
"""The balance losses a trainer chooses from, each by its coefficient (`TrainConfig`'s
`<term>_coef`); every one's term is in the step's metrics, whatever its coefficient."""
