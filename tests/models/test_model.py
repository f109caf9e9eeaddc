"""The DeepSeek-V3 model: scanned == looped, causality by gradients, MTP alignment, full forward
and gradient through the MoE layers, dtypes, remat, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backends, jaxtyping_disabled
from jaxtyping import TypeCheckError

from dropless.backends import Backend, jnp_capacity_backend, ragged_backend, with_backend
from dropless.models import get_preset as get_any_preset
from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    check_tokens,
    get_preset,
    mtp_targets,
    recorded_routing,
    unstack,
    with_updated_expert_bias,
)
from dropless.models.deepseek_v3 import (
    _layers as layers,
)

BATCH, SEQ = 2, 12


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(get_preset("tiny"), key=jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, 512)


@pytest.fixture(scope="module")
def forward():
    return eqx.filter_jit(lambda m, t: m(t))


def loss_fn(model, tokens):
    """Next-token + MTP cross-entropy + balance losses, as a trainer would combine them."""
    out = model(tokens)
    labels = jnp.roll(tokens, -1, axis=1)  # the last position's target is junk: masked below
    mask = jnp.arange(SEQ) < SEQ - 1
    ce = -jnp.take_along_axis(jax.nn.log_softmax(out.logits), labels[..., None], -1)[..., 0]
    main = jnp.sum(ce * mask) / (mask.sum() * BATCH)
    targets, valid = mtp_targets(jnp.where(mask, labels, 0), model.config.num_nextn_predict_layers)
    valid = valid & mask
    mtp_ce = -jnp.take_along_axis(jax.nn.log_softmax(out.mtp_logits), targets[..., None], -1)
    mtp = jnp.sum(mtp_ce[..., 0] * valid) / valid.sum()
    aux = out.moe_stats.seq_balance_loss.sum() + out.mtp_moe_stats.seq_balance_loss.sum()
    return main + 0.3 * mtp + 1e-2 * aux


def looped(model, tokens):
    """The same forward pass with the stacked layers unstacked and applied in a Python loop."""
    c = model.config
    h = jnp.take(model.embed_tokens, tokens, axis=0)
    emb, stats = h, []
    for i in range(c.n_dense_layers):
        h, _ = unstack(model.dense_layers, i)(h)
    for i in range(c.n_moe_layers):
        h, s = unstack(model.moe_layers, i)(h)
        stats.append(s)
    h = model.norm(h)
    logits, mtp_logits = model.head(h), []
    for d in range(c.num_nextn_predict_layers):
        module = unstack(model.mtp.layers, d)
        # depth d embeds token i + d + 1 (zeros past the end)
        shifted = jnp.concatenate([emb[:, d + 1 :], jnp.zeros_like(emb[:, : d + 1])], axis=1)
        h, _ = module(h, shifted)
        mtp_logits.append(model.head(module.shared_head.norm(h)))
    return logits, jnp.stack(mtp_logits), jax.tree.map(lambda *xs: jnp.stack(xs), *stats)


def test_forward_shapes(model, tokens, forward):
    out = forward(model, tokens)
    c = model.config
    assert out.logits.shape == (BATCH, SEQ, c.vocab_size) and out.logits.dtype == jnp.float32
    assert out.mtp_logits.shape == (1, BATCH, SEQ, c.vocab_size)
    assert out.moe_stats.tokens_per_expert.shape == (c.n_moe_layers, c.n_routed_experts)
    assert out.mtp_moe_stats.max_vio.shape == (1,)
    # every layer routes every token copy: nothing dropped
    np.testing.assert_array_equal(out.moe_stats.tokens_per_expert.sum(-1), BATCH * SEQ * 2)
    assert np.isfinite(np.asarray(out.logits)).all()


def test_stacked_layout(model):
    c = model.config
    assert model.dense_layers.self_attn.q_a_proj.shape == (1, 64, 32)
    assert model.moe_layers.mlp.experts.w_gate.shape == (3, 16, 64, 64)
    assert model.moe_layers.mlp.router.expert_bias.shape == (3, 16)
    assert model.mtp.layers.eh_proj.shape == (1, 128, 64)
    assert model.mtp.layers.block.mlp.router.w_router.shape == (1, 16, 64)
    assert model.lm_head.shape == (64, c.vocab_size)


def test_scan_equals_python_loop(model, tokens, forward):
    out = forward(model, tokens)
    logits, mtp_logits, stats = eqx.filter_jit(looped)(model, tokens)
    np.testing.assert_allclose(out.logits, logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.mtp_logits, mtp_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.moe_stats.tokens_per_expert, stats.tokens_per_expert)
    np.testing.assert_allclose(out.moe_stats.seq_balance_loss, stats.seq_balance_loss, rtol=1e-5)


def test_one_scan_per_stack(model, tokens):
    # A scan per stack (dense, MoE, MTP), each of its stack's length: not an unrolled loop.
    jaxpr = jax.make_jaxpr(lambda m, t: m(t))(model, tokens)
    lengths = sorted(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")
    assert lengths == [1, 1, 3]


def test_causal_by_gradients(model, tokens):
    emb = jnp.take(model.embed_tokens, tokens, axis=0)

    @eqx.filter_jit
    def grad(model, emb, t, w_main, w_mtp):
        # One compile for every (t, which logits): the choices are traced (array) arguments.
        def f(e):  # sequence 0, position t
            out = model.from_embeddings(e)
            main, mtp = jnp.sum(out.logits[0, t] ** 2), jnp.sum(out.mtp_logits[0, 0, t] ** 2)
            return w_main * main + w_mtp * mtp

        return jnp.abs(jax.grad(f)(emb)).sum(-1)

    for t in (0, 5, SEQ - 2):
        t_, one, zero = jnp.asarray(t), jnp.asarray(1.0), jnp.asarray(0.0)
        main = np.asarray(grad(model, emb, t_, one, zero))
        assert np.all(main[0, t + 1 :] == 0), f"main logits at {t} see the future"
        assert np.all(main[0, : t + 1] > 0), f"main logits at {t} miss the past"
        assert np.all(main[1] == 0), "sequences interact"
        # MTP depth 0 at position t reads token t + 1, and nothing later.
        mtp = np.asarray(grad(model, emb, t_, zero, one))
        assert np.all(mtp[0, t + 2 :] == 0), f"MTP logits at {t} see past token {t + 1}"
        assert np.all(mtp[0, : t + 2] > 0), f"MTP logits at {t} miss tokens <= {t + 1}"


def test_changing_a_token_changes_only_later_logits(model, tokens, forward):
    t = 6
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 512)
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_allclose(a.logits[:, :t], b.logits[:, :t], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a.logits[:, t], b.logits[:, t])
    # MTP position t - 1 embeds token t: it changes, the one before does not.
    np.testing.assert_allclose(a.mtp_logits[:, :, : t - 1], b.mtp_logits[:, :, : t - 1], atol=1e-6)
    assert not np.allclose(a.mtp_logits[:, :, t - 1], b.mtp_logits[:, :, t - 1])


def test_mtp_targets():
    labels = jnp.arange(10).reshape(2, 5)
    targets, mask = mtp_targets(labels, 2)
    for d in range(2):
        for i in range(5):
            assert bool(mask[d, 0, i]) == (i + d + 1 < 5)
            if mask[d, 0, i]:
                np.testing.assert_array_equal(targets[d, :, i], labels[:, i + d + 1])


@pytest.fixture(scope="module")
def value_and_grad(model, tokens):
    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, tokens)


def test_full_gradient(value_and_grad):
    loss, grads = value_and_grad
    assert np.isfinite(loss)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(np.asarray(g)).all(), jax.tree_util.keystr(path)
    moe = grads.moe_layers.mlp
    for name, g in [
        ("router", moe.router.w_router),
        ("experts", moe.experts.w_gate),
        ("shared", moe.shared.w_down),
        ("kv_b", grads.moe_layers.self_attn.kv_b_proj),
        ("mtp eh_proj", grads.mtp.layers.eh_proj),
        ("mtp experts", grads.mtp.layers.block.mlp.experts.w_up),
    ]:
        assert np.abs(np.asarray(g)).max() > 0, f"no gradient reaches {name}"
    # The expert bias steers selection only: it gets no gradient.
    assert np.all(np.asarray(moe.router.expert_bias) == 0)


@pytest.mark.slow
def test_capacity_gradients_agree_with_chunked_under_scan(
    model, tokens, value_and_grad, default_xla_jit
):
    """The two pure-jnp grouped matmuls, each a hand-written custom VJP, give the same model
    gradients inside the scanned layers (TE's permutation did not), with rows overflowing
    jnp-capacity's slots."""
    swapped = with_backend(model, jnp_capacity_backend())
    long_tokens = jax.random.randint(jax.random.key(5), (4, 48), 0, 512)  # 384 copies, 16 experts

    def probe_loss(m, t):  # and the loads, from the same pass
        out = m(t)
        probe = jax.random.normal(jax.random.key(6), out.logits.shape)
        loss = jnp.sum(out.logits * probe) + jnp.sum(out.mtp_logits * probe[None])
        return loss, out.moe_stats.tokens_per_expert

    want, loads = default_xla_jit(eqx.filter_grad(probe_loss, has_aux=True))(model, long_tokens)
    assert int(loads.max()) > 30  # past the 1.25 x 24 = 30 slots: the overflow loop runs
    got, _ = default_xla_jit(eqx.filter_grad(probe_loss, has_aux=True))(swapped, long_tokens)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        eqx.filter_jit(loss_fn)(swapped, tokens), value_and_grad[0], rtol=1e-6
    )


def test_expert_bias_update(model, tokens, forward):
    out = forward(model, tokens)
    new = with_updated_expert_bias(model, out, 0.01)
    load = np.asarray(out.moe_stats.tokens_per_expert)
    step = np.asarray(
        new.moe_layers.mlp.router.expert_bias - model.moe_layers.mlp.router.expert_bias
    )
    over = load > load.mean(-1, keepdims=True)
    assert np.all(step[over] < 0) and np.all(step[load < load.mean(-1, keepdims=True)] > 0)
    mtp_step = (
        new.mtp.layers.block.mlp.router.expert_bias - model.mtp.layers.block.mlp.router.expert_bias
    )
    assert np.abs(np.asarray(mtp_step)).max() > 0


@pytest.mark.parametrize("policy", ["full", "dots"])
@pytest.mark.slow
def test_remat_keeps_values_and_gradients(policy, model, tokens, value_and_grad):
    remat = DeepSeekV3(model.config.replace(remat=policy), key=jax.random.key(0))  # same params
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(remat, tokens)
    np.testing.assert_allclose(loss, value_and_grad[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(value_and_grad[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_keep_values_and_gradients(remat, model, tokens, value_and_grad):
    config = model.config.replace(unroll_layers=True, remat=remat)
    unrolled = DeepSeekV3(config, key=jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(loss_fn)(unrolled, tokens))
    # No scan over the MoE stack: its layers are inline.
    assert f"length={model.config.n_moe_layers}" not in jaxpr
    assert f"length={model.config.n_moe_layers}" in str(jax.make_jaxpr(loss_fn)(model, tokens))
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(unrolled, tokens)
    np.testing.assert_allclose(loss, value_and_grad[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(value_and_grad[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_weights_before_down_keeps_values_and_gradients(model, tokens, value_and_grad):
    config = model.config.replace(moe_weights_before_down=True)
    early = DeepSeekV3(config, key=jax.random.key(0))
    assert early.moe_layers.mlp.weights_before_down  # the setting reaches the layers
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(early, tokens)
    np.testing.assert_allclose(loss, value_and_grad[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(value_and_grad[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_compute_fp32_params(model, tokens, forward):
    bf16 = DeepSeekV3(model.config.replace(compute_dtype="bfloat16"), key=jax.random.key(0))
    assert bf16.moe_layers.mlp.experts.w_gate.dtype == jnp.float32
    out, ref = forward(bf16, tokens), forward(model, tokens)
    assert out.logits.dtype == jnp.float32
    err = np.abs(np.asarray(out.logits - ref.logits))
    assert err.mean() < 0.05 * np.abs(np.asarray(ref.logits)).mean()


def test_bf16_logits_are_the_float32_logits_rounded(model, tokens, forward):
    """`logits_dtype="bfloat16"`: the head (main and MTP) writes its float32-accumulated
    logits rounded to bf16, nothing else changes.

    Two float32 sums of the same products in another order (another CPU's kernel) can land on
    either side of a bf16 rounding midpoint: where the bf16 logit is not the float32 logit
    rounded, it is the other bf16 neighbour, with the float32 logit within two summation
    bounds of the midpoint between them. Summing in bf16 fails this on most logits."""
    config = model.config.replace(compute_dtype="bfloat16")
    wide = DeepSeekV3(config, key=jax.random.key(0))
    narrow = DeepSeekV3(config.replace(logits_dtype="bfloat16"), key=jax.random.key(0))
    out, ref = forward(narrow, tokens), forward(wide, tokens)
    assert out.logits.dtype == out.mtp_logits.dtype == jnp.bfloat16
    features = eqx.filter_jit(lambda m, t: m.features(t))(narrow, tokens)
    w = np.asarray(narrow.head_weight().astype(jnp.bfloat16), np.float64)
    pairs = (
        (out.logits, ref.logits, features.hidden),
        (out.mtp_logits, ref.mtp_logits, features.mtp_hidden),
    )
    for logits, float32_logits, hidden in pairs:
        # bf16 x bf16 products are exact in float32; a float32 sum of K of them is within
        # K u sum|products| (u = 2^-24) of the exact sum, whatever the order
        k = w.shape[0]
        bound = 1.01 * k * 2.0**-24 * (np.abs(np.asarray(hidden, np.float64)) @ np.abs(w))
        got = np.asarray(logits, np.float64)
        f32 = np.asarray(float32_logits, np.float64)
        rounded = np.asarray(float32_logits.astype(jnp.bfloat16), np.float64)
        differ = got != rounded
        excess = np.abs(f32 - got) - np.abs(f32 - rounded)
        # excess = 2 |f32 - midpoint|, and |f32 - midpoint| <= 2 bound
        np.testing.assert_array_less(excess[differ], 4 * bound[differ] + 1e-30)


def test_dense_only_tied_model():
    config = get_preset("tiny", first_k_dense_replace=4, tie_word_embeddings=True)
    dense = DeepSeekV3(config, key=jax.random.key(0))
    assert dense.moe_layers is None and dense.lm_head is None
    out = eqx.filter_jit(lambda m, t: m(t))(dense, jnp.zeros((1, 4), jnp.int32))
    assert out.logits.shape == (1, 4, 512) and out.mtp_logits.shape == (1, 1, 4, 512)
    assert out.moe_stats.tokens_per_expert.shape == (0, 16)  # the empty stack
    assert out.mtp_moe_stats.tokens_per_expert.shape == (0, 16)  # the MTP block is dense too
    h = jax.random.normal(jax.random.key(1), (1, 2, 64))
    np.testing.assert_allclose(dense.head(h), h @ dense.embed_tokens.T, rtol=1e-5, atol=1e-5)


def test_v2_lite_shaped_model():
    # DeepSeek-V2-Lite's structure at toy size: direct q_proj, greedy softmax, no bias, no MTP.
    config = get_preset(
        "tiny",
        q_lora_rank=None,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        n_shared_experts=2,
        num_nextn_predict_layers=0,
    )
    model = DeepSeekV3(config, key=jax.random.key(0))
    assert model.mtp is None and model.dense_layers.self_attn.q_a_proj is None
    assert model.moe_layers.mlp.router.expert_bias is None
    out = eqx.filter_jit(lambda m, t: m(t))(model, jnp.arange(8).reshape(1, 8))
    assert out.logits.shape == (1, 8, 512) and out.mtp_logits is None
    assert out.mtp_moe_stats.max_vio.shape == (0,)
    assert eqx.tree_equal(with_updated_expert_bias(model, out, 0.1), model)  # no bias: no-op


def test_bad_tokens(model):
    c = model.config
    with pytest.raises(ValueError, match=r"token id 512 at \[1, 2\] is outside the vocabulary"):
        check_tokens(np.array([[0, 1, 2], [3, 4, 512]]), c)
    with pytest.raises(ValueError, match=r"token id -1 at \[0, 0\]"):
        check_tokens(np.array([[-1, 1]]), c)
    with pytest.raises(ValueError, match="must be integers"):
        check_tokens(np.zeros((1, 2), np.float32), c)
    with pytest.raises(ValueError, match=r"must be \[batch seq\]"):
        check_tokens(np.zeros((3,), np.int32), c)
    with pytest.raises(ValueError, match=r"sequence length 513 exceeds max_position_embeddings"):
        check_tokens(np.zeros((1, 513), np.int32), c)
    check_tokens(np.array([[0, 511]]), c)  # the edges are fine
    # The model itself: concrete ids are checked, lengths always (they are static).
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(jnp.array([[1, 600]]))
    # a 1-D batch: with the tests' runtime type checks on, the annotation may object first
    with pytest.raises((ValueError, TypeCheckError), match=r"batch seq"):
        model(jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        jax.jit(lambda t: model(t))(jnp.zeros((1, 513), jnp.int32))


@pytest.mark.slow
def test_return_routing_gives_every_moe_layers_routing(model, tokens, forward):
    """`return_routing=True`: each MoE layer's (and MTP block's) expert ids and weights, stacked
    [layers batch*seq k], are its router's on that layer's input; the logits do not change, and
    the ids count to the stats' loads. Without it, no routing is computed into the output."""
    c = model.config
    plain = forward(model, tokens)
    assert plain.moe_stats.expert_ids is None and plain.mtp_moe_stats.weights is None
    out = eqx.filter_jit(lambda m, t: m(t, return_routing=True))(model, tokens)
    np.testing.assert_array_equal(out.logits, plain.logits)
    k, tokens_flat = c.num_experts_per_tok, BATCH * SEQ
    for stats, n_layers in ((out.moe_stats, c.n_moe_layers), (out.mtp_moe_stats, 1)):
        assert stats.expert_ids.shape == stats.weights.shape == (n_layers, tokens_flat, k)
        loads = jax.vmap(lambda ids: jnp.bincount(ids.ravel(), length=c.n_routed_experts))
        np.testing.assert_array_equal(loads(stats.expert_ids), stats.tokens_per_expert)

    @eqx.filter_jit
    def layer_by_layer(model, tokens):
        """The router of each MoE block, on that block's normed input."""
        h, routings = jnp.take(model.embed_tokens, tokens, axis=0), []
        for i in range(c.n_dense_layers):
            h, _ = unstack(model.dense_layers, i)(h)
        for i in range(c.n_moe_layers):
            block = unstack(model.moe_layers, i)
            x = block.input_layernorm(h)
            x = h + block.self_attn(x)
            normed = block.post_attention_layernorm(x).reshape(tokens_flat, -1)
            routings.append(block.mlp.router(normed))
            h, _ = block(h)
        return routings

    for i, routing in enumerate(layer_by_layer(model, tokens)):
        np.testing.assert_array_equal(out.moe_stats.expert_ids[i], routing.expert_ids)
        np.testing.assert_allclose(out.moe_stats.weights[i], routing.weights, rtol=1e-5, atol=1e-6)


def test_backend_is_a_value():
    """A `Backend` (its None fields keep the defaults) or None; a name raises TypeError naming
    `get_backend`."""
    c = get_preset("tiny")
    ragged = ragged_backend()
    model = DeepSeekV3(c, backend=ragged, key=jax.random.key(0))
    assert model.moe_layers.mlp.experts.gmm == ragged.gmm
    default = DeepSeekV3(c, key=jax.random.key(0))
    assert jax.tree.structure(with_backend(default, ragged)) == jax.tree.structure(model)
    # the tests' runtime type checks object first (naming `backend`); a user's script reaches
    # the model's own message
    with pytest.raises((TypeError, TypeCheckError), match="backend"):
        DeepSeekV3(c, backend="ragged", key=jax.random.key(0))
    with jaxtyping_disabled(), pytest.raises(TypeError, match=r"get_backend\('ragged'\)"):
        DeepSeekV3(c, backend="ragged", key=jax.random.key(0))
    # a Backend's None fields keep MoE's defaults: here the router's top-k
    no_topk = Backend(dispatcher=ragged.dispatcher, gmm=ragged.gmm, topk=None)
    assert set(layers.moe_strategies(no_topk)) == {"dispatcher", "gmm"}
    assert layers.moe_strategies(None) == {}


def test_empty_batches_and_ids_outside_the_vocabulary_under_jit(model, unchecked):
    call = unchecked(type(model).__call__)
    for shape in ((0, 16), (2, 0)):
        with pytest.raises(ValueError, match=r"tokens must hold at least one token, got shape"):
            call(model, jnp.zeros(shape, jnp.int32))
        with pytest.raises(ValueError, match="at least one token"):
            check_tokens(np.zeros(shape, np.int32), model.config)
    # traced ids cannot raise: any id outside [0, vocab) embeds as NaN, and its sequence's
    # logits turn NaN from its position on (attention spreads NaN even to earlier ones)
    vocab = model.config.vocab_size
    logits = eqx.filter_jit(lambda m, t: m(t).logits)
    assert bool(jnp.isfinite(logits(model, jnp.array([[1, 2, 3, 4]]))).all())
    for bad_id in (vocab, -1, 10 * vocab):
        out = logits(model, jnp.array([[1, 2, bad_id, 4]]))
        assert bool(jnp.isnan(out[:, 2:]).all())


# --- the grouped-query-attention families (Qwen3-MoE, Mixtral, OLMoE) ------------------------

FAMILY_PRESETS = ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny"]


def plain_loss(model, tokens):
    logp = jax.nn.log_softmax(model(tokens).logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


@pytest.mark.slow
@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("backend", backends())
def test_family_backends_equal_the_default(preset, backend, tokens):
    """Every CPU backend's loss and gradients equal the default strategies' (each backend is
    held to the MoE oracle in tests/test_moe.py) on each family's model."""
    model = DeepSeekV3(get_any_preset(preset, num_hidden_layers=2), key=jax.random.key(0))
    run = eqx.filter_jit(eqx.filter_value_and_grad(plain_loss))
    loss, grads = run(model, tokens)
    got_loss, got = run(with_backend(model, backend), tokens)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_sliding_window_bounds_what_a_position_sees(tokens):
    """Two layers with a window of 3: position t reads positions t - 4 .. t, no further."""
    config = get_any_preset("mixtral-tiny", num_hidden_layers=2, sliding_window=3)
    model = DeepSeekV3(config, key=jax.random.key(0))
    emb = jnp.take(model.embed_tokens, tokens, axis=0)

    @jax.jit
    def reach(emb, t):
        def f(e):
            return jnp.sum(model.from_embeddings(e).logits[0, t] ** 2)

        return jnp.abs(jax.grad(f)(emb)).sum(-1)[0]

    for t in (2, 9, SEQ - 1):
        seen = np.asarray(reach(emb, t)) > 0
        np.testing.assert_array_equal(np.flatnonzero(seen), np.arange(max(t - 4, 0), t + 1))


@pytest.mark.slow
def test_replayed_routing_reproduces_the_forward_and_trains_the_router(model, tokens):
    """Routing replay: the recorded choice of every MoE layer (main stack and MTP) given back
    reproduces the logits exactly; another choice changes them; and through a replayed
    forward every router still gets a gradient (its weights come from its own scores)."""
    out = eqx.filter_jit(lambda m, t: m(t, return_routing=True))(model, tokens)
    replay = recorded_routing(out)
    assert replay[1] is not None  # the tiny preset has an MTP block

    @eqx.filter_jit
    def replayed(model, replay):
        return model(tokens, replay=replay)

    again = replayed(model, replay)
    np.testing.assert_array_equal(again.logits, out.logits)
    np.testing.assert_array_equal(again.mtp_logits, out.mtp_logits)
    e = model.config.n_routed_experts
    shifted = ((replay[0] + 1) % e, (replay[1] + 1) % e)
    assert not np.allclose(replayed(model, shifted).logits, out.logits)

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model, replay):
        result = model(tokens, replay=replay)
        return jnp.sum(result.logits**2) + jnp.sum(result.mtp_logits**2)

    g = grads(model, replay)
    for router in (g.moe_layers.mlp.router, g.mtp.layers.block.mlp.router):
        per_layer = jnp.abs(router.w_router).reshape(router.w_router.shape[0], -1).max(-1)
        assert bool(jnp.all(per_layer > 0))
    with pytest.raises(ValueError, match="return_routing"):
        recorded_routing(model(tokens))
