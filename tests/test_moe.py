"""The MoE layer: every backend equals the dense oracle, output and gradients."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backends
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxtyping import TypeCheckError

import dropless
from dropless import AbstractDispatcher, JnpTopK, MoE, RoutingSpec
from dropless._moe import computing_part
from dropless.backends import (
    Backend,
    BackendUnavailableError,
    ChunkedGroupedMatmul,
    SortDispatcher,
    jnp_backend,
    oracle_moe,
    ragged_backend,
    with_backend,
)
from dropless.backends import _auto as auto_backend
from dropless.train import get_backend, resolve_backend_name

FP32 = dict(rtol=1e-4, atol=1e-5)
# (spec, shared experts): a handful of layer shapes, so each compiles once per run.
SPECS = [
    (RoutingSpec(8, 2, "softmax"), 0),
    (
        RoutingSpec(
            16,
            4,
            "sigmoid",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            use_expert_bias=True,
        ),
        1,
    ),
    (
        RoutingSpec(
            8, 3, "sqrtsoftplus", n_group=2, topk_group=1, group_score="max", norm_topk_prob=False
        ),
        1,
    ),
    (RoutingSpec(4, 2, "softmax", softmax_before_topk=False), 0),
]


@st.composite
def moe_case(draw):
    spec, shared = draw(st.sampled_from(SPECS))
    adversarial = draw(st.sampled_from(["none", "one_expert", "empty_experts"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return spec, shared, adversarial, seed


def build(spec, shared, adversarial, seed, backend, **options):
    """The layer, with the strategies of `backend`, and 20 tokens. The
    adversarial routings steer through the tokens' first feature, set to 1: a router row's
    first weight then shifts that expert's logit for every token alike (by 12, several times
    the spread of the rest), and the case is checked here."""
    k_model, k_x = jax.random.split(jax.random.key(seed))
    moe = MoE(12, 10, spec, n_shared_experts=shared, key=k_model, **options)
    moe = with_backend(moe, backend)
    x = jax.random.normal(k_x, (20, 12)).at[:, 0].set(1.0)
    w = moe.router.w_router
    half = spec.n_routed_experts // 2
    if adversarial == "one_expert":  # every token chooses the same expert
        w = w.at[1, 0].set(12.0)
        if moe.router.expert_bias is not None:
            # sigmoid scores saturate at 1, so another group's best two can outscore expert 1's
            # group; a choice bias of 2 keeps that group among the best for every token
            bias = moe.router.expert_bias.at[1].set(2.0)
            moe = eqx.tree_at(lambda m: m.router.expert_bias, moe, bias)
    elif adversarial == "empty_experts":  # the first half of the experts are never chosen
        w = w.at[:half].set(0.0).at[:half, 0].set(-12.0)
    moe = eqx.tree_at(lambda m: m.router.w_router, moe, w)
    ids = moe.router(x).expert_ids
    if adversarial == "one_expert":
        assert (ids == 1).any(axis=1).all()
    elif adversarial == "empty_experts":
        assert (ids >= half).all()
    return moe, x


def _layer(moe, x):
    return moe(x)[0]


# Module-level jitted function: jit caches by function, so each shape compiles once per run.
@eqx.filter_jit
def _output_and_grads(moe, x, probe, forward):
    """forward(moe, x), and the gradients of sum(forward(moe, x) * probe) w.r.t. every weight
    and the input: one program."""
    y, pullback = eqx.filter_vjp(forward, moe, x)
    return y, pullback(probe)


@pytest.mark.parametrize("backend", backends())
@settings(max_examples=12)
@given(moe_case())
@pytest.mark.slow
def test_backend_equals_oracle(backend, case):
    moe, x = build(*case, backend=backend)
    probe = jax.random.normal(jax.random.key(7), x.shape)
    y, grads = _output_and_grads(moe, x, probe, _layer)  # w.r.t. every weight and the input
    y_ref, ref = _output_and_grads(moe, x, probe, oracle_moe)
    np.testing.assert_allclose(y, y_ref, **FP32)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert jnp.isfinite(a).all()
        np.testing.assert_allclose(a, b, **FP32)
    assert jnp.abs(grads[0].router.w_router).sum() > 0  # the router learns through the weights


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("adversarial", ["none", "one_expert"])
def test_gpt_oss_experts_equal_the_oracle(backend, adversarial):
    """gpt-oss's MoE (a learnt router bias, expert biases, a clamp at 0.5 that binds) with
    each backend's strategies against the oracle, output and every gradient."""
    spec = RoutingSpec(8, 2, "softmax", softmax_before_topk=False, router_bias=True)
    options = dict(experts_bias=True, swiglu_limit=0.5)
    moe, x = build(spec, 0, adversarial, 3, backend, **options)
    where = lambda m: (  # noqa: E731
        m.router.logit_bias,
        m.experts.gate_bias,
        m.experts.up_bias,
        m.experts.down_bias,
    )
    keys = jax.random.split(jax.random.key(4), 4)
    random = [jax.random.normal(k, b.shape) for k, b in zip(keys, where(moe), strict=True)]
    random[0] = jnp.zeros_like(random[0])  # the adversarial routing steers through w_router
    moe = eqx.tree_at(where, moe, tuple(random))
    probe = jax.random.normal(jax.random.key(7), x.shape)
    y, grads = _output_and_grads(moe, x, probe, _layer)
    y_ref, ref = _output_and_grads(moe, x, probe, oracle_moe)
    np.testing.assert_allclose(y, y_ref, **FP32)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, **FP32)
    assert jnp.abs(grads[0].router.logit_bias).sum() > 0
    assert jnp.abs(grads[0].experts.down_bias).sum() > 0


@settings(max_examples=8)
@given(moe_case())
def test_weights_before_down_equals_the_oracle(case):
    """`weights_before_down=True` (the routing weights scale the hidden units, the combine only
    sums): output and every gradient equal the oracle's, the router's through the experts."""
    moe, x = build(*case, backend=jnp_backend(), weights_before_down=True)
    probe = jax.random.normal(jax.random.key(7), x.shape)
    y, grads = _output_and_grads(moe, x, probe, _layer)
    y_ref, ref = _output_and_grads(moe, x, probe, oracle_moe)
    np.testing.assert_allclose(y, y_ref, **FP32)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, **FP32)
    assert jnp.abs(grads[0].router.w_router).sum() > 0


KEY = jax.random.key(0)


class _NoRowWeights(AbstractDispatcher):
    """`SortDispatcher`'s dispatch and combine, without row weights."""

    requires_gpu = False

    def _dispatch(self, x, routing):
        return SortDispatcher().dispatch(x, routing)

    def _combine(self, y_rows, dispatched, routing):
        return SortDispatcher().combine(y_rows, dispatched, routing)


def test_weights_before_down_needs_row_weights():
    spec = SPECS[0][0]
    plain = Backend(dispatcher=_NoRowWeights(), gmm=ChunkedGroupedMatmul())
    with pytest.raises(ValueError, match="weights_before_down=True needs a dispatcher"):
        MoE(12, 10, spec, dispatcher=plain.dispatcher, weights_before_down=True, key=KEY)
    moe = with_backend(MoE(12, 10, spec, weights_before_down=True, key=jax.random.key(0)), plain)
    with pytest.raises(ValueError, match="_NoRowWeights cannot give each row its routing weight"):
        moe(jnp.ones((4, 12)))


def test_strategies_are_values_with_defaults():
    spec = SPECS[0][0]
    moe = MoE(12, 10, spec, key=jax.random.key(0))
    assert isinstance(moe.dispatcher, SortDispatcher)
    assert isinstance(moe.experts.gmm, ChunkedGroupedMatmul)
    assert isinstance(moe.router.topk, JnpTopK)
    ragged = ragged_backend().gmm
    moe = MoE(12, 10, spec, gmm=ragged, key=jax.random.key(0))
    assert moe.experts.gmm is ragged and isinstance(moe.dispatcher, SortDispatcher)
    with pytest.raises(TypeError):
        MoE(12, 10, spec, backend="jnp", key=jax.random.key(0))  # names go to get_backend
    with pytest.raises((TypeError, TypeCheckError), match="gmm"):
        MoE(12, 10, spec, gmm="ragged", key=jax.random.key(0))


def test_return_routing_puts_the_routers_choice_in_the_stats():
    spec = RoutingSpec(8, 2, "sigmoid", use_expert_bias=True)
    moe = MoE(12, 10, spec, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 12))
    y, stats = moe(x, seq_len=8)
    assert stats.expert_ids is None and stats.weights is None
    y_r, stats_r = moe(x, seq_len=8, return_routing=True)
    routing = moe.router(x)
    np.testing.assert_array_equal(stats_r.expert_ids, routing.expert_ids)
    np.testing.assert_array_equal(stats_r.weights, routing.weights)
    np.testing.assert_array_equal(y_r, y)
    np.testing.assert_array_equal(stats_r.tokens_per_expert, stats.tokens_per_expert)


def test_stats_and_nothing_dropped():
    spec = RoutingSpec(8, 2, "sigmoid", use_expert_bias=True)
    moe = MoE(12, 10, spec, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 12))
    _, stats = moe(x, seq_len=8)
    assert float(stats.tokens_per_expert.sum()) == 32 * 2
    assert float(stats.dropped) == 0.0
    assert float(stats.max_vio) >= 0.0
    for loss in (stats.balance_loss, stats.seq_balance_loss, stats.z_loss):
        assert jnp.isfinite(loss) and loss > 0


def test_with_backend_swaps_strategies_not_arrays():
    moe = MoE(12, 10, SPECS[1][0], n_shared_experts=1, key=jax.random.key(0))
    swapped = with_backend(moe, ragged_backend())
    assert type(swapped.experts.gmm).__name__ == "RaggedDot"
    before, after = jax.tree.leaves(moe), jax.tree.leaves(swapped)
    assert len(before) == len(after) and all(a is b for a, b in zip(before, after, strict=True))
    custom = dropless.Backend(dispatcher=swapped.dispatcher, gmm=moe.experts.gmm)
    back = with_backend(swapped, custom)
    assert type(back.experts.gmm).__name__ == "ChunkedGroupedMatmul"


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match="known backends: .*jnp"):
        get_backend("cuda-magic")


def test_missing_te_names_what_to_install():
    try:
        import transformer_engine.jax  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="transformer-engine"):
            get_backend("te")
    else:
        pytest.skip("Transformer Engine is installed here")


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_without_te(monkeypatch, gpu):
    """Without TE, 'auto' is the chunked 'jnp' on a CPU and 'jnp-capacity' on a GPU before
    Hopper (warning that TE is missing), whose batched matmul does not wait on the host."""

    def missing():
        raise BackendUnavailableError("needs `pip install 'transformer-engine[jax]'`")

    monkeypatch.setattr(auto_backend, "_te_gmm", missing)
    monkeypatch.setattr(auto_backend, "has_gpu", lambda: gpu)
    monkeypatch.setattr(auto_backend, "is_hopper", lambda: False)  # a Hopper GPU takes pallas
    auto_backend._auto_choice.cache_clear()
    try:
        if gpu:
            with pytest.warns(UserWarning, match="transformer-engine.*'jnp-capacity'"):
                chosen = get_backend("auto")
        else:
            chosen = get_backend("auto")
        name = resolve_backend_name("auto")  # the cached choice, no second warning
    finally:
        auto_backend._auto_choice.cache_clear()
    want = "CapacityGroupedMatmul" if gpu else "ChunkedGroupedMatmul"
    assert type(chosen.gmm).__name__ == want
    assert name == ("jnp-capacity" if gpu else "jnp")
    assert resolve_backend_name("ragged") == "ragged"


def test_wrong_input_shape_is_rejected():
    moe = MoE(12, 10, SPECS[0][0], key=jax.random.key(0))
    message = "x must be [tokens dim] with dim = 12, got shape (4, 5)"
    with pytest.raises(ValueError, match=re.escape(message)):
        moe(jnp.zeros((4, 5)))
    # with the tests' runtime type checks on, the annotation may object to the rank first
    with pytest.raises((ValueError, TypeCheckError), match=r"tokens dim"):
        moe(jnp.zeros((2, 4, 12)))


@pytest.mark.parametrize(
    "sizes, message",
    [((0, 10, 0), "dim (0) must be >= 1"), ((12, 0, 0), "moe_intermediate_size (0) must be >= 1"),
     ((12, 10, -1), "n_shared_experts (-1) must be >= 0")],
)  # fmt: skip
def test_bad_sizes_name_the_argument(sizes, message):
    dim, hidden, shared = sizes
    with pytest.raises(ValueError, match=re.escape(f"MoE: {message}")):
        MoE(dim, hidden, SPECS[0][0], n_shared_experts=shared, key=jax.random.key(0))


def test_non_float_dtype_is_rejected():
    with pytest.raises(ValueError, match=re.escape("MoE: dtype (int32) must be a floating-point")):
        MoE(12, 10, SPECS[0][0], dtype=jnp.int32, key=jax.random.key(0))


@pytest.mark.parametrize("seq_len", [0, -4])
def test_bad_seq_len_names_the_argument(seq_len):
    moe = MoE(12, 10, SPECS[0][0], key=jax.random.key(0))
    with pytest.raises(ValueError, match=re.escape(f"MoE: seq_len ({seq_len}) must be >= 1")):
        moe(jnp.zeros((4, 12)), seq_len=seq_len)


_DISPATCHER = "Backend.dispatcher must be an AbstractDispatcher or None, got "


@pytest.mark.parametrize(
    "parts, message",
    [
        (
            ("jnp", "ragged"),
            _DISPATCHER + "'jnp' (a backend's name goes to dropless.train.get_backend",
        ),
        ((ChunkedGroupedMatmul(), SortDispatcher()), _DISPATCHER + "ChunkedGroupedMatmul()"),
        (
            (SortDispatcher(), SortDispatcher()),
            "Backend.gmm must be an AbstractGroupedMatmul or None, got SortDispatcher()",
        ),
        (
            (SortDispatcher(), ChunkedGroupedMatmul(), "jnp"),
            "Backend.topk must be an AbstractTopK or None, got 'jnp'",
        ),
    ],
)
def test_backend_rejects_wrong_strategy_kinds(parts, message):
    # the tests' runtime type checks may object to the field first (TypeCheckError, also naming
    # it); a user's script reaches Backend's own check
    field = message.split()[0].removeprefix("Backend.")
    with pytest.raises((TypeError, TypeCheckError), match=field):
        Backend(*parts)
    backend = Backend(SortDispatcher(), ChunkedGroupedMatmul())
    for name, value in zip(("dispatcher", "gmm", "topk"), parts, strict=False):
        object.__setattr__(backend, name, value)
    with pytest.raises(TypeError, match=re.escape(message)):
        backend.__check_init__()


def test_an_empty_batch_or_integer_input_is_a_clear_error(unchecked):
    moe = MoE(12, 10, SPECS[0][0], key=jax.random.key(0))
    call = unchecked(type(moe).__call__)  # the library's own checks, past the annotations
    with pytest.raises(ValueError, match=re.escape("MoE: x must hold at least one token")):
        call(moe, jnp.zeros((0, 12)))
    with pytest.raises(TypeError, match="MoE: x must be a floating-point array .* got dtype int32"):
        call(moe, jnp.zeros((4, 12), jnp.int32))


# --- zero-computation experts -----------------------------------------------------------------


def dense_zero_reference(moe: MoE, x):
    """The layer written directly: every token through each of its chosen experts, one at a
    time, a zero-computation choice adding the token (identity) or nothing, times its weight."""
    routing = moe.router(x)
    n_experts = moe.experts.w_gate.shape[0]
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(n_experts + moe.n_zero_experts):
        w = jnp.where(routing.expert_ids == e, routing.weights, 0).sum(-1)[:, None]
        if e < n_experts:
            ex = moe.experts
            out = (jax.nn.silu(x @ ex.w_gate[e]) * (x @ ex.w_up[e])) @ ex.w_down[e]
        else:
            out = x if moe.zero_output == "identity" else jnp.zeros_like(x)
        y = y + w * out
    return y if moe.shared is None else y + moe.shared(x)


@pytest.mark.slow
@settings(deadline=None, max_examples=12)
@given(
    st.sampled_from([(6, 2, 2), (8, 3, 4), (4, 4, 1)]),
    st.sampled_from(["identity", "zero"]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_zero_computation_experts_equal_the_dense_reference(shape, output, before_down, seed):
    """k of (E + Z) choices: outputs and gradients equal the dense reference; the dispatcher
    gets only the computing copies (no rows of zero-computation experts in any group); the
    statistics count computing and zero-computation copies apart."""
    e, k, z = shape
    spec = RoutingSpec(e, k, "sigmoid", use_expert_bias=True)
    moe = MoE(
        8,
        16,
        spec,
        n_zero_experts=z,
        zero_output=output,
        n_shared_experts=1,
        weights_before_down=before_down,
        key=jax.random.key(seed % 1000),
    )
    # a bias that makes zero-computation experts likely, so most cases mix both kinds
    bias = jnp.concatenate([jnp.zeros(e), jnp.full((z,), 0.2)])
    moe = eqx.tree_at(lambda m: m.router.expert_bias, moe, bias)
    x = jax.random.normal(jax.random.key(seed), (12, 8))
    (got, got_grad), (want, want_grad), stats, group_sizes = _zero_case(moe, x)
    np.testing.assert_allclose(got, want, **FP32)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(g, w, **FP32)
    ids = np.asarray(stats.expert_ids)
    assert stats.tokens_per_expert.shape == (e,) and stats.zero_tokens.shape == (z,)
    np.testing.assert_array_equal(stats.tokens_per_expert, np.bincount(ids[ids < e], minlength=e))
    np.testing.assert_array_equal(stats.zero_tokens, np.bincount(ids[ids >= e] - e, minlength=z))
    np.testing.assert_allclose(stats.active_experts, (ids < e).sum() / 12)
    assert int(group_sizes.sum()) == int((ids < e).sum())


# Compiled, one program per layer shape and setting (module-level, so examples of the same
# setting share it): op by op, the reference's per-expert loop runs 4-5x slower, and the
# statistics and the dispatch compile each primitive apart.
@eqx.filter_jit
def _zero_case(moe, x):
    """sum(sin(output)) and its gradients w.r.t. every weight, of the layer (`seq_len=6`) and
    of `dense_zero_reference`; the layer's statistics with the routing; the group sizes of
    dispatching the computing copies."""

    @eqx.filter_value_and_grad
    def loss(moe, f):
        return jnp.sum(jnp.sin(f(moe, x)))

    got = loss(moe, lambda m, x: m(x, seq_len=6)[0])
    want = loss(moe, dense_zero_reference)
    _, stats = moe(x, seq_len=6, return_routing=True)
    n_experts = moe.experts.w_gate.shape[0]
    dispatched = moe.dispatcher.dispatch(x, computing_part(moe.router(x), n_experts))
    return got, want, stats, dispatched.group_sizes


def test_zero_experts_bias_target_steers_active_compute():
    spec = RoutingSpec(6, 2, "sigmoid", use_expert_bias=True)
    moe = MoE(8, 16, spec, n_zero_experts=2, active_experts=1.0, key=jax.random.key(0))
    loads = jnp.asarray([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 8.0, 4.0])  # 24 copies: 12 tokens
    target = moe.bias_target(loads)
    # 1 computing expert per token over 6 experts, the other choice over the 2 zero ones
    np.testing.assert_allclose(target, [2.0] * 6 + [6.0, 6.0])
    np.testing.assert_allclose(target.sum(), loads.sum())
    assert MoE(8, 16, spec, key=jax.random.key(0)).bias_target(loads[:6]) is None
    with pytest.raises(ValueError, match="active_experts"):
        MoE(8, 16, spec, n_zero_experts=2, active_experts=3.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="n_group"):
        grouped = RoutingSpec(8, 2, n_group=2, topk_group=1, group_score="max")
        MoE(8, 16, grouped, n_zero_experts=2, key=jax.random.key(0))
