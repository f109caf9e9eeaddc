"""Balance losses as values (`dropless._balance_loss`): each against a direct numpy reference
on a routing, the global-batch one over micro-batches equal to the batch loss of their union
(hypothesis), and the choice made by `TrainConfig`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import (
    BALANCE_LOSSES,
    AbstractBalanceLoss,
    BatchBalanceLoss,
    GlobalBatchBalanceLoss,
    JnpTopK,
    RoutingSpec,
    SequenceBalanceLoss,
    routing_stats,
)
from dropless.train import TrainConfig

E, K = 6, 2
SPEC = RoutingSpec(E, K, "sigmoid")


def routing(seed: int, tokens: int):
    logits = 2 * jax.random.normal(jax.random.key(seed), (tokens, E))
    return JnpTopK()(logits, None, SPEC)


def reference(ids, scores, seq_len):
    """(batch-wise, sequence-wise) loss in float64, straight from their definitions."""
    ids, scores = np.asarray(ids), np.asarray(scores, np.float64)
    p = scores / scores.sum(-1, keepdims=True)

    def loss(ids, p):
        f = np.bincount(ids.reshape(-1), minlength=E) / ids.size
        return E * np.sum(f * p.mean(0))

    seqs = [loss(ids[i : i + seq_len], p[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    return loss(ids, p), np.mean(seqs)


@given(st.integers(0, 2**31 - 1), st.sampled_from([4, 8]), st.sampled_from([1, 2, 4]))
def test_each_loss_equals_its_definition(seed, seq_len, seqs):
    r, losses = each_loss(seed, seq_len * seqs, seq_len)
    batch, seq = reference(r.expert_ids, r.scores, seq_len)
    np.testing.assert_allclose(losses["batch"], batch, rtol=1e-5)
    np.testing.assert_allclose(losses["sequence"], seq, rtol=1e-5)
    # without the whole batch's loads, the global loss is the micro-batch's batch-wise one
    np.testing.assert_allclose(losses["global"], batch, rtol=1e-5)
    np.testing.assert_allclose(losses["weighted"], 0.5 * seq, rtol=1e-5)


@functools.partial(jax.jit, static_argnums=(1, 2))
def each_loss(seed, tokens, seq_len):
    r = routing(seed, tokens)
    stats = routing_stats(r, seq_len)
    return r, {
        "batch": BatchBalanceLoss()(stats),
        "sequence": SequenceBalanceLoss()(stats),
        "global": GlobalBatchBalanceLoss()(stats),
        "weighted": SequenceBalanceLoss(0.5).weighted(stats),
    }


def _stats(logits):
    return routing_stats(JnpTopK()(logits, None, SPEC))


@functools.partial(jax.jit, static_argnums=1)
@functools.partial(jax.value_and_grad)
def global_by_slices(logits, slices):
    loads = _stats(logits).tokens_per_expert
    parts = jnp.split(logits, slices)
    return jnp.mean(
        jnp.stack([GlobalBatchBalanceLoss(2.0).weighted(_stats(p), loads) for p in parts])
    )


@jax.jit
@jax.value_and_grad
def batch_of_union(logits):
    return BatchBalanceLoss(2.0).weighted(_stats(logits))


@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 4]))
def test_global_loss_over_micro_batches_is_the_batch_loss_of_their_union(seed, slices):
    """Each micro-batch's global-batch loss, given the union's loads, averages to the
    batch-wise loss of the union (values and gradients)."""
    logits = 2 * jax.random.normal(jax.random.key(seed), (16, E))
    got, g_got = global_by_slices(logits, slices)
    want, g_want = batch_of_union(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(g_got, g_want, atol=1e-6)
    assert GlobalBatchBalanceLoss.whole_batch and not BatchBalanceLoss.whole_batch


def test_the_per_micro_batch_loss_is_not_the_whole_batchs():
    logits = 2 * jax.random.normal(jax.random.key(0), (16, E))
    stats = [routing_stats(JnpTopK()(lg, None, SPEC)) for lg in jnp.split(logits, 2)]
    loads = routing_stats(JnpTopK()(logits, None, SPEC)).tokens_per_expert
    global_mean = np.mean([GlobalBatchBalanceLoss()(s, loads) for s in stats])
    local_mean = np.mean([_Local()(s, loads) for s in stats])
    np.testing.assert_allclose(local_mean, np.mean([BatchBalanceLoss()(s) for s in stats]))
    assert abs(global_mean - local_mean) > 1e-3


class _Local(AbstractBalanceLoss):
    """The batch-wise loss that ignores the whole batch's loads (what a slice sees alone)."""

    term = "local"

    def __call__(self, stats, loads=None):
        return BatchBalanceLoss()(stats)


def test_stacked_layers_give_one_loss_per_layer():
    stats = jax.vmap(lambda s: routing_stats(routing(s, 8), 4))(jnp.arange(3))
    for kind in BALANCE_LOSSES:
        assert kind()(stats).shape == (3,)
    one = routing_stats(routing(1, 8), 4)
    np.testing.assert_allclose(SequenceBalanceLoss()(stats)[1], SequenceBalanceLoss()(one))


def test_the_train_config_chooses_the_losses_by_their_coefficients():
    config = TrainConfig()  # DeepSeek-V3's sequence-wise loss, 1e-4
    assert config.balance_losses() == (SequenceBalanceLoss(1e-4),)
    chosen = config.with_balance_losses(BatchBalanceLoss(0.1), GlobalBatchBalanceLoss(0.01))
    assert (chosen.balance_loss_coef, chosen.seq_balance_loss_coef) == (0.1, 0.0)
    assert chosen.global_balance_loss_coef == 0.01
    assert chosen.balance_losses() == (BatchBalanceLoss(0.1), GlobalBatchBalanceLoss(0.01))
    assert config.with_balance_losses().balance_losses() == ()
    with pytest.raises(ValueError, match="at most once"):
        config.with_balance_losses(BatchBalanceLoss(0.1), BatchBalanceLoss(0.2))
    with pytest.raises(ValueError, match="with_balance_losses"):
        config.with_balance_losses(_Local(0.1))
    with pytest.raises(ValueError, match="global_balance_loss_coef"):
        config.with_balance_losses(GlobalBatchBalanceLoss(-1.0))
    # every loss has its coefficient field, named after its metric
    for kind in BALANCE_LOSSES:
        assert hasattr(config, f"{kind.term}_coef")
