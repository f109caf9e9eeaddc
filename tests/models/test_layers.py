"""Stacked layers: the matmul weights cast once to the compute dtype before the layer loop, with
their gradients stacked in that dtype behind a barrier (the gradients are those of the plain
per-layer casts); unrolled, the stacked gradients written slice by slice."""

import functools
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.models.deepseek_v3 import _layers as layers


def _bf16_model(**changes):
    # Three layers, not the preset's four: still a dense stack and a stack of two MoE layers,
    # and an unrolled model compiles quicker.
    config = get_preset("tiny", compute_dtype="bfloat16", num_hidden_layers=3, **changes)
    return DeepSeekV3(config, key=jax.random.key(0))


def _loss(model, tokens):
    out = model(tokens)
    return jnp.mean(out.logits.astype(jnp.float32) ** 2) + jnp.mean(out.mtp_logits**2)


def _named_leaves(tree):
    flat = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat if eqx.is_array(leaf)}


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():  # scan, custom_vjp, pjit bodies
            sub = getattr(param, "jaxpr", param)
            if hasattr(sub, "eqns"):
                yield from _eqns(sub)


def _barriers(jaxpr):
    """(shape, dtype) of every optimisation barrier's operand, nested jaxprs included."""
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name == "optimization_barrier":
            yield from ((v.aval.shape, v.aval.dtype) for v in eqn.invars)


def _stacked_matmul_weights(model):
    """The MoE stack's `MATMUL_WEIGHTS` leaves."""
    leaves = _named_leaves(model.moe_layers)
    return [leaf for name, leaf in leaves.items() if name.split(".")[-1] in layers.MATMUL_WEIGHTS]


def test_every_stacked_weight_used_in_the_compute_dtype_is_cast():
    stack = _bf16_model().moe_layers
    cast = _named_leaves(layers.matmul_weights_cast(stack, jnp.bfloat16))
    for name, leaf in _named_leaves(stack).items():
        matrix = leaf.ndim >= 3 and jnp.issubdtype(leaf.dtype, jnp.floating)
        in_f32 = "w_router" in name  # routing runs in float32
        want = jnp.bfloat16 if matrix and not in_f32 else leaf.dtype
        assert cast[name].dtype == want, name


@pytest.mark.parametrize("unroll", [False, True])
@pytest.mark.slow
def test_cast_stacks_keep_values_and_gradients(unroll, monkeypatch):
    """Against the blocks' own per-layer casts (the cast-up-front taken out): the same loss
    and bitwise the same gradients, since a bf16 gradient cast to float32 is exact and a
    stacked weight gets one gradient per layer."""
    model = _bf16_model(unroll_layers=unroll)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 512)

    arrays, static = eqx.partition(model, eqx.is_array)

    def run():
        # A fresh function each time: a cached trace would not see the patch below. One trace
        # gives both the program's equations and what it computes.
        grad = eqx.filter_value_and_grad(_loss)
        traced = jax.jit(lambda a, t: grad(eqx.combine(a, static), t)).trace(arrays, tokens)
        return Counter(_barriers(traced.jaxpr.jaxpr)), traced.lower().compile()(arrays, tokens)

    cast_barriers, (loss, grads) = run()
    monkeypatch.setattr(layers, "matmul_weights_cast", lambda arrays, dtype: arrays)
    plain_barriers, (want_loss, want_grads) = run()
    # Two different programs: the cast adds a barrier per stacked weight.
    assert sum((cast_barriers - plain_barriers).values()) >= 5
    assert loss == want_loss
    got, want = _named_leaves(grads), _named_leaves(want_grads)
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture(scope="module")
def grad_jaxpr():
    """(unroll, remat) -> the bf16 model with those settings and the jaxpr of its gradient on
    a sequence of 8 tokens, traced once for the tests that read the same one."""

    @functools.cache
    def trace(unroll: bool, remat: str):
        model = _bf16_model(unroll_layers=unroll, remat=remat)
        return model, jax.make_jaxpr(eqx.filter_grad(_loss))(model, jnp.zeros((1, 8), jnp.int32))

    return trace


@pytest.mark.parametrize("remat", ["none", "full"])
def test_stacked_gradients_pass_a_barrier(remat, grad_jaxpr):
    """A stacked gradient is assembled from per-layer ones (by slice updates when unrolled);
    it is materialised behind a barrier, in bf16 when the weights were cast up front (no
    remat), else in their own float32."""
    model, jaxpr = grad_jaxpr(True, remat)
    dtype = jnp.dtype(jnp.bfloat16 if remat == "none" else jnp.float32)
    stacked = {(leaf.shape, dtype) for leaf in _stacked_matmul_weights(model)}
    seen = Counter(_barriers(jaxpr.jaxpr))
    assert len(stacked) >= 5 and all(seen[s] >= 1 for s in stacked)


def test_unrolled_stacked_gradients_are_written_slice_by_slice(grad_jaxpr):
    """Unrolled, no stacked gradient is a concatenation of the layers' (a slow fused kernel
    on a GPU); each is a chain of in-place slice updates."""
    model, jaxpr = grad_jaxpr(True, "none")
    stacked = {leaf.shape for leaf in _stacked_matmul_weights(model)}
    built = Counter(
        (eqn.primitive.name, eqn.outvars[0].aval.shape)
        for eqn in _eqns(jaxpr.jaxpr)
        if eqn.outvars and eqn.outvars[0].aval.shape in stacked
    )
    n_layers = model.config.n_moe_layers
    assert len(stacked) >= 5 and n_layers >= 2
    for shape in stacked:
        assert built["concatenate", shape] == 0, shape
        assert built["dynamic_update_slice", shape] >= n_layers, shape


def test_unrolled_remat_keeps_recomputation_apart(grad_jaxpr):
    """Unrolled layers are straight-line code, so their remat must ask XLA not to merge the
    recomputation with the forward (`prevent_cse`); inside a scan it need not."""

    def prevent_cse(unroll):
        _, jaxpr = grad_jaxpr(unroll, "full")
        return {e.params["prevent_cse"] for e in _eqns(jaxpr.jaxpr) if "prevent_cse" in e.params}

    # (Stacks that are scanned either way, such as the MTP block's, keep False.)
    assert True in prevent_cse(True)
    assert prevent_cse(False) == {False}


def test_latent_norms_keep_their_own_epsilon():
    # DeepSeek's and transformers' MLA build q_a_layernorm and kv_a_layernorm with eps 1e-6,
    # whatever rms_norm_eps; the other norms follow the config
    block = _bf16_model(rms_norm_eps=1e-2).moe_layers
    assert block.input_layernorm.eps == block.post_attention_layernorm.eps == 1e-2
    assert block.self_attn.q_a_layernorm.eps == block.self_attn.kv_a_layernorm.eps == 1e-6
