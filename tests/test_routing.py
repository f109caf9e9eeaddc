"""Routing invariants, property-based, against an independent numpy reference."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import JnpTopK, RoutingSpec, TopKRouter, replay_routing
from dropless._routing import _top_k

# (experts, k, n_group, topk_group): a small set so jit compiles stay few.
SHAPES = [(8, 2, 1, 1), (16, 4, 4, 2), (16, 3, 2, 1), (32, 8, 8, 4), (6, 6, 1, 1), (12, 2, 6, 3)]
SCORING = ["softmax", "sigmoid", "sqrtsoftplus"]
TOKENS = 24


def reference_routing(logits, bias, spec):
    """The routing rule written directly in numpy, one token at a time."""
    logits = np.asarray(logits, np.float64)
    ids_all, weights_all = [], []
    for row in logits:
        if spec.scoring_func == "softmax":
            scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        elif spec.scoring_func == "sigmoid":
            scores = 1 / (1 + np.exp(-row))
        else:
            scores = np.sqrt(np.log1p(np.exp(row)))
        after = spec.scoring_func == "softmax" and not spec.softmax_before_topk
        choice = (row if after else scores) + (0 if bias is None else np.asarray(bias))
        eligible = np.ones_like(choice, bool)
        if spec.n_group > 1:
            groups = choice.reshape(spec.n_group, -1)
            if spec.group_score == "max":
                gs = groups.max(-1)
            else:
                gs = np.sort(groups, -1)[:, -2:].sum(-1)
            best = np.argsort(-gs, kind="stable")[: spec.topk_group]
            eligible = np.isin(np.arange(choice.size) // groups.shape[1], best)
        masked = np.where(eligible, choice, -np.inf)
        ids = np.argsort(-masked, kind="stable")[: spec.num_experts_per_tok]
        if after:
            w = np.exp(row[ids] - row[ids].max())
            w = w / w.sum()
        else:
            w = scores[ids]
            if spec.norm_topk_prob:
                w = w / (w.sum() + 1e-20)
        ids_all.append(ids)
        weights_all.append(w * spec.routed_scaling_factor)
    return np.array(ids_all), np.array(weights_all)


@st.composite
def routing_case(draw):
    e, k, n_group, topk_group = draw(st.sampled_from(SHAPES))
    scoring = draw(st.sampled_from(SCORING))
    group_score = draw(st.sampled_from(["top2_sum", "max"]))
    if group_score == "top2_sum" and n_group > 1 and e // n_group < 2:
        group_score = "max"
    spec = RoutingSpec(
        e,
        k,
        scoring,
        n_group=n_group,
        topk_group=topk_group,
        group_score=group_score,
        norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        use_expert_bias=draw(st.booleans()),
        softmax_before_topk=draw(st.booleans()),
    )
    seed = draw(st.integers(0, 2**31 - 1))
    return spec, seed


def random_logits(seed, e):
    k1, k2 = jax.random.split(jax.random.key(seed))
    logits = jax.random.normal(k1, (TOKENS, e)) * 2
    bias = jax.random.normal(k2, (e,)) * 0.3
    return logits, bias


@given(routing_case())
def test_matches_reference_and_invariants(case):
    spec, seed = case
    logits, bias = random_logits(seed, spec.n_routed_experts)
    bias = bias if spec.use_expert_bias else None
    r = jax.jit(JnpTopK(), static_argnums=2)(logits, bias, spec)
    ids, w = np.asarray(r.expert_ids), np.asarray(r.weights)
    ref_ids, ref_w = reference_routing(logits, bias, spec)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    # exactly k distinct ids per token, in range
    assert ids.shape == (TOKENS, spec.num_experts_per_tok)
    assert ((ids >= 0) & (ids < spec.n_routed_experts)).all()
    assert all(len(set(row)) == spec.num_experts_per_tok for row in ids)
    assert (w >= 0).all()
    normalised = spec.norm_topk_prob or (
        spec.scoring_func == "softmax" and not spec.softmax_before_topk
    )
    if normalised:
        np.testing.assert_allclose(w.sum(-1), spec.routed_scaling_factor, rtol=1e-5)


@given(routing_case())
def test_group_limit_picks_only_from_top_groups(case):
    spec, seed = case
    if spec.n_group == 1:
        spec = RoutingSpec(16, 4, spec.scoring_func, n_group=4, topk_group=2)
    logits, _ = random_logits(seed, spec.n_routed_experts)
    r = JnpTopK()(logits, None, spec)
    per_group = spec.n_routed_experts // spec.n_group
    scores = np.asarray(r.scores)
    after = spec.scoring_func == "softmax" and not spec.softmax_before_topk
    choice = np.asarray(logits) if after else scores
    groups = choice.reshape(TOKENS, spec.n_group, per_group)
    gs = groups.max(-1) if spec.group_score == "max" else np.sort(groups, -1)[..., -2:].sum(-1)
    allowed = np.argsort(-gs, axis=-1, kind="stable")[:, : spec.topk_group]
    chosen_groups = np.asarray(r.expert_ids) // per_group
    for t in range(TOKENS):
        assert set(chosen_groups[t]) <= set(allowed[t])


@given(routing_case())
def test_bias_changes_selection_not_weights(case):
    spec, seed = case
    spec = RoutingSpec(
        spec.n_routed_experts,
        spec.num_experts_per_tok,
        "sigmoid",
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        group_score=spec.group_score,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        use_expert_bias=True,
    )
    logits, bias = random_logits(seed, spec.n_routed_experts)
    big_bias = jnp.zeros_like(bias).at[0].set(100.0)  # expert 0 always chosen
    r = JnpTopK()(logits, big_bias, spec)
    assert (np.asarray(r.expert_ids) == 0).any(-1).all()
    # Weights are the scores of the chosen experts, the bias nowhere in them.
    w = np.take_along_axis(np.asarray(r.scores), np.asarray(r.expert_ids), -1)
    if spec.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    np.testing.assert_allclose(r.weights, w * spec.routed_scaling_factor, rtol=1e-6)


def test_ties_break_to_lowest_expert_id():
    spec = RoutingSpec(16, 4, "sigmoid", n_group=4, topk_group=2)
    r = JnpTopK()(jnp.zeros((5, 16)), None, spec)
    np.testing.assert_array_equal(r.expert_ids, np.tile([0, 1, 2, 3], (5, 1)))
    spec = RoutingSpec(16, 6, "softmax", n_group=4, topk_group=2)
    r = JnpTopK()(jnp.zeros((5, 16)), None, spec)
    np.testing.assert_array_equal(r.expert_ids, np.tile([0, 1, 2, 3, 4, 5], (5, 1)))


# Few distinct values, so rows are full of ties, signed zeros, infinities and NaNs of both
# signs (their order is IEEE's total order: by sign, then payload).
_NANS = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0xFFFFFFF0], np.uint32).view(np.float32)
_TIE_POOL = [-np.inf, -1.5, -0.0, 0.0, 0.25, 0.25, 3.0, np.inf, *_NANS]


@given(
    st.sampled_from([(7, 1), (8, 4), (64, 6), (8, 8), (256, 8)]),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
)
def test_top_k_equals_lax_top_k_with_ties_and_infinities(n_k, batch_dims, seed):
    """The k-round argmax gives exactly `jax.lax.top_k`'s indices (largest first, lowest index
    among equals, -0.0 below +0.0), also where several values are -inf, as masked groups are."""
    n, k = n_k
    rng = np.random.default_rng(seed)
    shape = (3, 2, 5)[:batch_dims] + (n,)
    values = np.asarray(_TIE_POOL, np.float32)[rng.integers(0, len(_TIE_POOL), shape)]
    values[..., rng.integers(0, n, size=n // 2)] = -np.inf  # more -inf than n - k at times
    got = _top_k(jnp.asarray(values), k)
    want = jax.lax.top_k(jnp.asarray(values), k)[1]
    assert got.shape == shape[:-1] + (k,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)


def test_top_k_keeps_ids_distinct_for_the_all_ones_nan_and_checks_k():
    """The one key shared by two values (the all-ones NaN and its neighbour) must not be the
    taken key: every row still gets k distinct ids."""
    nan = np.array([0xFFFFFFFF, 0xFFFFFFFE], np.uint32).view(np.float32)
    values = jnp.asarray([[nan[0], 1.0, nan[0], nan[1]]])
    np.testing.assert_array_equal(np.sort(_top_k(values, 4), -1), [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="k=5 must be in"):
        _top_k(values, 5)


def test_router_gets_gradients_through_weights_only():
    spec = RoutingSpec(8, 2, "sigmoid", use_expert_bias=True)
    router = TopKRouter(16, spec, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (10, 16))

    def loss(router):
        return router(x).weights.sum()

    g = jax.grad(loss)(router)
    assert jnp.abs(g.w_router).sum() > 0
    np.testing.assert_array_equal(g.expert_bias, 0.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_routed_experts=8, num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(n_routed_experts=8, num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(n_routed_experts=0, num_experts_per_tok=1), "n_routed_experts"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=3), "n_group"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=5), "topk_group"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=0), "topk_group"),
        (dict(n_routed_experts=8, num_experts_per_tok=5, n_group=4, topk_group=2), "topk_group"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, scoring_func="relu"), "scoring_func"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, group_score="mean"), "group_score"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=8, topk_group=2), "top2_sum"),
        (dict(n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=0.0), "routed"),
    ],
)
def test_bad_spec_names_the_field(kwargs, field):
    # Under the runtime type checker a bad Literal fails before __post_init__ (a TypeError that
    # also names the field); without it our own ValueError does.
    with pytest.raises((ValueError, TypeError), match=field):
        RoutingSpec(**kwargs)


@pytest.mark.parametrize(
    "field, value, rule",
    [("use_expert_bias", "False", "True or False"), ("norm_topk_prob", "no", "True or False"),
     ("num_experts_per_tok", 2.0, "an int"), ("routed_scaling_factor", "2", "a number")],
)  # fmt: skip
def test_spec_field_kinds(field, value, rule):
    # set past the constructor: the tests' runtime type checks would reject the value first,
    # where a value from a YAML file or a script's arithmetic reaches the validation
    spec = RoutingSpec(8, 2)
    object.__setattr__(spec, field, value)
    with pytest.raises(ValueError, match=re.escape(f"{field} ({value!r}) must be {rule}")):
        spec.__post_init__()


@pytest.mark.parametrize(
    "field, value, message",
    [("scoring_func", "relu", "scoring_func ('relu') must be one of 'softmax', 'sigmoid'"),
     ("group_score", "mean", "group_score ('mean') must be 'top2_sum' or 'max'")],
)  # fmt: skip
def test_literal_fields_own_messages(field, value, message):
    # test_bad_spec_names_the_field may see the type checker's error first; this is ours
    spec = RoutingSpec(8, 2)
    object.__setattr__(spec, field, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.__post_init__()


def test_infinite_scaling_is_rejected():
    with pytest.raises(ValueError, match="routed_scaling_factor .inf. must be > 0 and finite"):
        RoutingSpec(8, 2, routed_scaling_factor=float("inf"))


def test_wrong_shapes_are_rejected(unchecked):
    spec = RoutingSpec(8, 2)
    router = TopKRouter(16, spec, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"x has shape \(4, 8\), want \[tokens 16\]"):
        unchecked(TopKRouter.__call__)(router, jnp.zeros((4, 8)))
    with pytest.raises(ValueError, match=r"x has shape \(2, 4, 16\)"):
        unchecked(TopKRouter.__call__)(router, jnp.zeros((2, 4, 16)))
    with pytest.raises(ValueError, match="n_routed_experts"):
        JnpTopK()(jnp.zeros((4, 6)), None, spec)


@given(routing_case())
def test_replayed_choice_is_weighted_as_the_routers_own(case):
    """Replaying the router's own choice changes nothing; replaying another choice weighs it
    as the reference weighs a choice (its scores, normalisation, scaling)."""
    spec, seed = case
    logits, bias = random_logits(seed, spec.n_routed_experts)
    bias = bias if spec.use_expert_bias else None
    routing = JnpTopK()(logits, bias, spec)
    same = replay_routing(routing, routing.expert_ids, spec)
    np.testing.assert_array_equal(same.expert_ids, routing.expert_ids)
    np.testing.assert_array_equal(same.weights, routing.weights)
    e, k = spec.n_routed_experts, spec.num_experts_per_tok
    keys = jax.random.split(jax.random.key(seed), TOKENS)
    other = jax.vmap(lambda key: jax.random.permutation(key, e)[:k])(keys).astype(jnp.int32)
    got = replay_routing(routing, other, spec)
    np.testing.assert_array_equal(got.expert_ids, other)
    want = _weights_for(np.asarray(logits, np.float64), np.asarray(other), spec)
    np.testing.assert_allclose(got.weights, want, rtol=2e-5, atol=1e-6)


def _weights_for(logits, ids, spec):
    """The reference routing's weights of the choice `ids` (numpy)."""
    rows = []
    for row, chosen in zip(logits, ids, strict=True):
        if spec.scoring_func == "softmax":
            scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        elif spec.scoring_func == "sigmoid":
            scores = 1 / (1 + np.exp(-row))
        else:
            scores = np.sqrt(np.log1p(np.exp(row)))
        if spec.scoring_func == "softmax" and not spec.softmax_before_topk:
            w = np.exp(row[chosen] - row[chosen].max())
            w = w / w.sum()
        else:
            w = scores[chosen]
            if spec.norm_topk_prob:
                w = w / (w.sum() + 1e-20)
        rows.append(w * spec.routed_scaling_factor)
    return np.asarray(rows)


def test_replay_keeps_the_router_differentiable_and_checks_shapes():
    spec = RoutingSpec(8, 2, "sigmoid")
    router = TopKRouter(4, spec, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 4))
    ids = jnp.asarray([[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]], jnp.int32)

    def loss(router):
        return jnp.sum(router(x, ids).weights ** 2)

    grad = jax.grad(loss)(router)
    assert float(jnp.abs(grad.w_router).max()) > 0
    np.testing.assert_array_equal(router(x, ids).expert_ids, ids)
    with pytest.raises(ValueError, match="replayed expert_ids"):
        router(x, ids[:, :1])


def test_router_bias_is_part_of_the_logits():
    """gpt-oss's router: logits = x W^T + b, so the bias moves selection and weights, and it
    gets a gradient (unlike the selection-only expert bias)."""
    spec = RoutingSpec(n_routed_experts=6, num_experts_per_tok=2, router_bias=True)
    router = TopKRouter(8, spec, key=jax.random.key(0))
    assert router.logit_bias.shape == (6,) and router.expert_bias is None
    x = jax.random.normal(jax.random.key(1), (5, 8))
    bias = jnp.array([0.0, 0.0, 0.0, 0.0, 0.0, 50.0])
    biased = eqx.tree_at(lambda r: r.logit_bias, router, bias)
    out = biased(x)
    np.testing.assert_allclose(out.logits, x @ router.w_router.T + bias, rtol=1e-6, atol=1e-6)
    assert bool((out.expert_ids[:, 0] == 5).all())  # the bias decides the first choice
    grad = jax.grad(lambda r: r(x).weights[:, 1].sum())(biased)
    assert float(jnp.abs(grad.logit_bias).sum()) > 0
    assert TopKRouter(8, RoutingSpec(6, 2), key=jax.random.key(0)).logit_bias is None
