"""Gradient accumulation (`dropless.train.step._accumulate`): a step in micro-batches is the step in
one pass: the same gradients, losses and expert loads."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.data._datasets import SyntheticCorpus
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.step import _optim as optim
from dropless.train.step import eval_step, init_state, loss_terms, total_loss, train_step
from dropless.train.step._accumulate import accumulated, micro_batch_slices
from dropless.train.step._step import hparams

MODEL = get_preset("tiny", num_hidden_layers=2)  # a dense layer, an MoE layer, an MTP block


def tokens(batch: int = 8, seq: int = 32) -> jax.Array:
    corpus = SyntheticCorpus(512)
    return jnp.asarray(corpus.batch(0, seed=0, batch_size=batch, seq_len=seq).tokens)


def test_slices_are_strided_and_must_divide_the_batch():
    t = jnp.arange(12).reshape(6, 2)
    slices = micro_batch_slices(t, 3)
    assert slices.shape == (3, 2, 2)
    np.testing.assert_array_equal(slices[1], t[1::3])  # rows 1 and 4
    with pytest.raises(ValueError, match="micro_batches=4 must be >= 1 and divide the batch"):
        micro_batch_slices(t, 4)


@pytest.fixture(scope="module")
def one_pass():
    """(value_and_grad, params, batch, value_and_grad(params, batch)): the loss, its terms, the
    MoE statistics and the gradients of one pass over a batch, for every micro-batch count."""
    model = DeepSeekV3(MODEL, key=jax.random.key(0))
    params, frozen = eqx.partition(model, optim.trainable_filter(model))
    weights = hparams(TrainConfig(z_loss_coef=1e-3))

    def loss_fn(params, tokens):
        terms, out = loss_terms(eqx.combine(params, frozen), tokens)
        return total_loss(terms, weights), (terms, (out.moe_stats, out.mtp_moe_stats))

    value_and_grad = eqx.filter_value_and_grad(loss_fn, has_aux=True)
    batch = tokens()
    return value_and_grad, params, batch, eqx.filter_jit(value_and_grad)(params, batch)


@pytest.fixture(scope="module")
def traced(one_pass):
    """traced(micro_batches, grad_dtype): `accumulated` over the batch, traced once for the
    module (its jaxpr is read, its program run): a trace of the model's gradient takes
    seconds."""
    value_and_grad, params, batch, _ = one_pass

    @functools.cache
    def get(micro_batches, grad_dtype="float32"):
        run = accumulated(value_and_grad, micro_batches, grad_dtype=grad_dtype)
        return jax.jit(run).trace(params, batch)

    return get


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.slow
def test_accumulated_gradients_equal_the_one_pass_gradients(one_pass, traced, micro_batches):
    _, params, batch, ((loss, (terms, stats)), grads) = one_pass
    run = traced(micro_batches).lower().compile()
    (m_loss, (m_terms, m_stats)), m_grads = run(params, batch)

    np.testing.assert_allclose(m_loss, loss, rtol=1e-5)
    for name in ("ce", "mtp", "seq_balance_loss", "z_loss"):
        np.testing.assert_allclose(m_terms[name], terms[name], rtol=1e-5, err_msg=name)
    for whole, merged in zip(stats, m_stats, strict=True):
        np.testing.assert_array_equal(merged.tokens_per_expert, whole.tokens_per_expert)
        np.testing.assert_allclose(merged.max_vio, whole.max_vio, rtol=1e-6)
    leaves, m_leaves = jax.tree.leaves(grads), jax.tree.leaves(m_grads)
    assert len(leaves) == len(m_leaves) > 0
    for g, m in zip(leaves, m_leaves, strict=True):
        assert m.dtype == g.dtype
        np.testing.assert_allclose(m, g, rtol=0, atol=1e-5 * float(jnp.abs(g).max()) + 1e-9)


@pytest.mark.slow
def test_train_step_in_micro_batches_matches_one_pass(monkeypatch):
    from dropless.train.step import _step as step_module

    passes = []

    def spy(value_and_grad, micro_batches, **kwargs):
        passes.append(micro_batches)
        return accumulated(value_and_grad, micro_batches, **kwargs)

    monkeypatch.setattr(step_module, "accumulated", spy)

    def step(micro_batches):
        state = init_state(DeepSeekV3(MODEL, key=jax.random.key(0)), TrainConfig(steps=4))
        # batch 4 x 24 tokens: a shape no other test compiles, so both are traced here
        return train_step(state, tokens(4, 24), micro_batches)

    one_state, one = step(1)
    two_state, two = step(2)
    assert passes == [1, 2]
    for name in ("loss", "ce", "mtp", "seq_balance_loss", "grad_norm", "max_vio"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(two["tokens_per_expert"], one["tokens_per_expert"])
    # the bias update saw the whole batch's loads
    np.testing.assert_allclose(
        two_state.model.moe_layers.mlp.router.expert_bias,
        one_state.model.moe_layers.mlp.router.expert_bias,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"micro_batches": 3}, r"micro_batches \(3\) must divide batch_size \(16\)"),
        ({"micro_batches": 0}, "micro_batches must be >= 1"),
    ],
)
def test_bad_micro_batches_are_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TrainConfig(), **changes)


@pytest.mark.slow
def test_eval_step_in_micro_batches_matches_one_pass():
    model = DeepSeekV3(MODEL, key=jax.random.key(0))
    weights = hparams(TrainConfig())
    batch = tokens(4, 24)
    one = eval_step(model, batch, weights)
    two = eval_step(model, batch, weights, 2)
    for name in ("loss", "ce", "mtp", "seq_balance_loss", "z_loss", "max_vio"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(two["tokens_per_expert"], one["tokens_per_expert"])


@pytest.mark.slow
def test_gradients_sum_in_grad_accum_dtype(one_pass, traced):
    """`grad_dtype="bfloat16"`: the scan over micro-batches carries the gradient sum in bf16
    (float32 by default); the mean comes back in the gradients' dtype, within bf16 rounding of
    the one-pass gradient."""
    _, params, batch, (_, grads) = one_pass

    def carried_dtypes(grad_dtype):
        (scan,) = [e for e in traced(2, grad_dtype).jaxpr.eqns if e.primitive.name == "scan"]
        return {v.aval.dtype for v in scan.outvars}

    assert jnp.dtype(jnp.bfloat16) not in carried_dtypes("float32")
    assert jnp.dtype(jnp.bfloat16) in carried_dtypes("bfloat16")
    _, m_grads = traced(2, "bfloat16").lower().compile()(params, batch)
    for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(m_grads), strict=True):
        assert m.dtype == g.dtype
        np.testing.assert_allclose(m, g, rtol=0, atol=2**-7 * float(jnp.abs(g).max()) + 1e-9)
