"""Stacked layers: the matmul weights cast once to the compute dtype before the layer loop, with
their gradients stacked in that dtype behind a barrier (the gradients are those of the plain
per-layer casts); unrolled, the stacked gradients written slice by slice."""

from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset, layers


def _bf16_model(**changes):
    config = get_preset("tiny", compute_dtype="bfloat16", **changes)
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

    def run():
        # A fresh function each time: a cached trace would not see the patch below.
        grad = eqx.filter_value_and_grad(lambda m, t: _loss(m, t))
        jaxpr = jax.make_jaxpr(grad)(model, tokens)
        return Counter(_barriers(jaxpr.jaxpr)), eqx.filter_jit(grad)(model, tokens)

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


@pytest.mark.parametrize("remat", ["none", "full"])
def test_stacked_gradients_pass_a_barrier(remat):
    """A stacked gradient is assembled from per-layer ones (by slice updates when unrolled);
    it is materialised behind a barrier, in bf16 when the weights were cast up front (no
    remat), else in their own float32."""
    model = _bf16_model(unroll_layers=True, remat=remat)
    tokens = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(eqx.filter_grad(_loss))(model, tokens)
    dtype = jnp.dtype(jnp.bfloat16 if remat == "none" else jnp.float32)
    stacked = {(leaf.shape, dtype) for leaf in _stacked_matmul_weights(model)}
    seen = Counter(_barriers(jaxpr.jaxpr))
    assert len(stacked) >= 5 and all(seen[s] >= 1 for s in stacked)


def test_unrolled_stacked_gradients_are_written_slice_by_slice():
    """Unrolled, no stacked gradient is a concatenation of the layers' (a slow fused kernel
    on a GPU); each is a chain of in-place slice updates."""
    model = _bf16_model(unroll_layers=True)
    stacked = {leaf.shape for leaf in _stacked_matmul_weights(model)}
    jaxpr = jax.make_jaxpr(eqx.filter_grad(_loss))(model, jnp.zeros((1, 8), jnp.int32))
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


def test_unrolled_remat_keeps_recomputation_apart():
    """Unrolled layers are straight-line code, so their remat must ask XLA not to merge the
    recomputation with the forward (`prevent_cse`); inside a scan it need not."""

    def prevent_cse(unroll):
        model = _bf16_model(unroll_layers=unroll, remat="full")
        jaxpr = jax.make_jaxpr(eqx.filter_grad(_loss))(model, jnp.zeros((1, 8), jnp.int32))
        return {e.params["prevent_cse"] for e in _eqns(jaxpr.jaxpr) if "prevent_cse" in e.params}

    # (Stacks that are scanned either way, such as the MTP block's, keep False.)
    assert True in prevent_cse(True)
    assert prevent_cse(False) == {False}


def test_latent_norms_keep_their_own_epsilon():
    # DeepSeek's and transformers' MLA build q_a_layernorm and kv_a_layernorm with eps 1e-6,
    # whatever rms_norm_eps; the other norms follow the config
    model = DeepSeekV3(get_preset("tiny", rms_norm_eps=1e-2), key=jax.random.key(0))
    block = model.moe_layers
    assert block.input_layernorm.eps == block.post_attention_layernorm.eps == 1e-2
    assert block.self_attn.q_a_layernorm.eps == block.self_attn.kv_a_layernorm.eps == 1e-6
