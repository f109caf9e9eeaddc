"""Meshes, the logical-to-mesh table, sharded parameters / optimizer state / batches, and
`ShardedMoE` against the unsharded layer (8 emulated CPU devices, from tests/conftest.py). The
train step on a mesh: tests/train/step/test_sharded.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from dropless import MoE, RoutingSpec, sharding
from dropless.backends import ep_backend, with_backend

pytestmark = pytest.mark.mesh8  # meshes over the 8 devices (tests/conftest.py)

# float32, same math in a different layout and summation order (fixed, never loosened)
RTOL, ATOL = 1e-5, 1e-5

E, K, DIM, HIDDEN = 16, 2, 8, 32


def make_moe(seed: int = 0) -> MoE:
    spec = RoutingSpec(E, K, use_expert_bias=True, scoring_func="sigmoid")
    return MoE(DIM, HIDDEN, spec, n_shared_experts=1, key=jax.random.key(seed))


# --- meshes ------------------------------------------------------------------------------------


def test_parse_mesh():
    assert sharding.parse_mesh("data=2,expert=4") == {"data": 2, "expert": 4}
    assert sharding.parse_mesh(" data = 2 , fsdp=2,expert=2 ") == {
        "data": 2,
        "fsdp": 2,
        "expert": 2,
    }
    assert sharding.parse_mesh("") == {}
    for bad, rule in [
        ("data:2", "expected 'axis=size"),
        ("model=2", "unknown axis 'model'"),
        ("data=2,data=4", "given twice"),
        ("expert=0", "size >= 1"),
    ]:
        with pytest.raises(ValueError, match=rule):
            sharding.parse_mesh(bad)


def test_make_mesh():
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    assert mesh.axis_names == ("data", "fsdp", "expert")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(sharding.mesh_from_spec("expert=8").shape) == {"data": 1, "fsdp": 1, "expert": 8}
    assert dict(sharding.mesh_from_spec("").shape)["data"] == 8
    with pytest.raises(ValueError, match="must equal the device count"):
        sharding.make_mesh(data=2, expert=2)
    with pytest.raises(ValueError, match=">= 1"):
        sharding.make_mesh(data=0, expert=8)


def test_batch_spec_follows_the_table():
    assert sharding.AXIS_RULES["batch"] == ("data", "fsdp", "expert")
    assert sharding.batch_spec(sharding.make_mesh(data=2, fsdp=2, expert=2)) == P(
        ("data", "fsdp", "expert")
    )
    # axes of size 1 drop out
    assert sharding.batch_spec(sharding.make_mesh(data=2, expert=4)) == P(("data", "expert"))
    assert sharding.batch_spec(sharding.make_mesh(expert=8)) == P(("expert",))


# --- parameters --------------------------------------------------------------------------------


def test_param_specs_follow_the_table():
    moe = make_moe()
    # stacked (scanned) layers: experts is the third dimension from the end
    stacked = eqx.tree_at(
        lambda m: (m.experts.w_gate, m.experts.w_up, m.experts.w_down),
        moe,
        (
            jnp.zeros((3, E, DIM, HIDDEN)),
            jnp.zeros((3, E, DIM, HIDDEN)),
            jnp.zeros((3, E, HIDDEN, DIM)),
        ),
    )
    logical = sharding.logical_param_specs(stacked, fsdp_min_size=256)
    assert logical.experts.w_gate == P(None, "experts", None, "fsdp")
    assert logical.experts.w_down == P(None, "experts", "fsdp", None)
    assert logical.router.w_router == P(None, None)  # 128 elements: below fsdp_min_size
    assert logical.shared.w_gate == P(None, "fsdp")

    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    specs = sharding.param_specs(stacked, mesh, fsdp_min_size=256)
    assert specs.experts.w_gate == P(None, "expert", None, "fsdp")
    assert specs.experts.w_down == P(None, "expert", "fsdp", None)
    assert specs.router.w_router == P(None, None)
    assert specs.router.expert_bias == P(None)
    # a dense weight splits over fsdp x expert, an experts' weight over fsdp alone
    assert specs.shared.w_down == P(("fsdp", "expert"), None)
    # every spec is the logical one sent through AXIS_RULES
    for leaf, lspec, mspec in zip(
        jax.tree.leaves(eqx.filter(stacked, eqx.is_array)),
        jax.tree.leaves(logical),
        jax.tree.leaves(specs),
        strict=True,
    ):
        assert mspec == sharding.to_mesh_spec(lspec, leaf.shape, mesh)

    # no expert axis: experts stay whole; fsdp of 8 does not divide 8 * 32 's smaller dims
    only_data = sharding.param_specs(moe, sharding.make_mesh(data=8), fsdp_min_size=256)
    assert only_data.experts.w_gate == P(None, None, None)
    fsdp8 = sharding.param_specs(moe, sharding.make_mesh(fsdp=8), fsdp_min_size=256)
    assert fsdp8.shared.w_gate == P(None, "fsdp")  # 32 % 8 == 0
    odd = eqx.tree_at(lambda m: m.shared.w_gate, moe, jnp.zeros((DIM, 36)))
    assert sharding.param_specs(
        odd, sharding.make_mesh(fsdp=8), fsdp_min_size=256
    ).shared.w_gate == P(None, None)  # 36 % 8 != 0: replicated, not an error


def test_dense_weights_take_the_expert_axis_where_it_divides():
    mesh = sharding.make_mesh(fsdp=2, expert=4)
    logical = P(None, "fsdp")
    assert sharding.to_mesh_spec(logical, (3, 16), mesh) == P(None, ("fsdp", "expert"))
    assert sharding.to_mesh_spec(logical, (3, 6), mesh) == P(None, "fsdp")  # 6 % 8, 6 % 2 == 0
    assert sharding.to_mesh_spec(logical, (3, 5), mesh) == P(None, None)
    # the axis sizes alone give the same specs (what the planner has)
    assert sharding.to_mesh_spec(logical, (3, 16), {"fsdp": 2, "expert": 4}) == P(
        None, ("fsdp", "expert")
    )
    # the experts dimension takes the expert axis first; fsdp then splits alone
    assert sharding.to_mesh_spec(P("experts", "fsdp"), (8, 16), mesh) == P("expert", "fsdp")
    # what gather_fsdp gathers: the fsdp dimension only, never the experts
    moe = make_moe()
    gathers = sharding.fsdp_specs(moe, mesh, fsdp_min_size=256)
    assert gathers.experts.w_gate == P(None, None, "fsdp")
    assert gathers.shared.w_gate == P(None, ("fsdp", "expert"))
    assert gathers.router.w_router == P(None, None)  # below fsdp_min_size


def test_abstract_leaves_are_arrays_to_the_specs():
    """`jax.ShapeDtypeStruct` leaves (a state from `eqx.filter_eval_shape`) get the specs of
    the arrays they stand for, and the optimizer moments follow their parameters."""
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    moe = make_moe()
    abstract = eqx.filter_eval_shape(make_moe)
    assert isinstance(abstract.experts.w_gate, jax.ShapeDtypeStruct)
    concrete = sharding.param_specs(moe, mesh, fsdp_min_size=256)
    specs = sharding.param_specs(abstract, mesh, fsdp_min_size=256)
    assert jax.tree.leaves(specs) == jax.tree.leaves(concrete)
    assert specs.experts.w_gate == P("expert", None, "fsdp")
    params = eqx.filter(abstract, sharding.is_array_like)
    opt_state = eqx.filter_eval_shape(optax.adam(1e-3).init, params)
    opt_specs = sharding.opt_state_specs(opt_state, params, specs)
    assert opt_specs[0].nu.experts.w_gate == P("expert", None, "fsdp")


def test_experts_must_divide():
    moe = make_moe()
    mesh = sharding.make_mesh(data=2, expert=3, devices=jax.devices()[:6])
    with pytest.raises(ValueError, match=r"experts dimension \(16\) must be divisible"):
        sharding.param_specs(moe, mesh)


def test_shard_model_and_opt_state():
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    moe = with_backend(make_moe(), ep_backend())
    placed = sharding.shard_model(moe, mesh, fsdp_min_size=256)
    params = eqx.filter(placed, eqx.is_inexact_array)
    opt_state = optax.adam(1e-3).init(params)
    specs = sharding.param_specs(params, mesh, fsdp_min_size=256)
    opt_specs = sharding.opt_state_specs(opt_state, params, specs)
    opt_state = jax.device_put(opt_state, jax.tree.map(lambda s: NamedSharding(mesh, s), opt_specs))
    assert placed.experts.w_up.sharding.spec == P("expert", None, "fsdp")
    assert placed.router.w_router.sharding.spec == P(None, None)
    adam = opt_state[0]
    assert adam.mu.experts.w_up.sharding.spec == P("expert", None, "fsdp")
    assert adam.nu.shared.w_down.sharding.spec == P(("fsdp", "expert"), None)
    assert adam.count.sharding.spec == P()
    # the local shard really is a slice
    assert placed.experts.w_up.addressable_shards[0].data.shape == (E // 2, DIM, HIDDEN // 2)


def test_shard_batch():
    mesh = sharding.make_mesh(data=2, expert=4)
    batch = {"x": np.zeros((16, 3), np.float32), "t": np.zeros((16,), np.int32)}
    placed = sharding.shard_batch(batch, mesh)
    assert placed["x"].sharding.spec == P(("data", "expert"))
    assert placed["x"].addressable_shards[0].data.shape == (2, 3)


# --- ShardedMoE with fsdp, and the checks --------------------------------------------------------


def test_sharded_moe_with_fsdp_matches_single_device():
    mesh = sharding.make_mesh(fsdp=2, expert=4)
    moe = make_moe()
    x = jax.random.normal(jax.random.key(3), (32, DIM))

    def loss(m, x):
        y, stats = m(x) if isinstance(m, sharding.ShardedMoE) else m(x, seq_len=4)
        return jnp.sum(jnp.sin(y)), stats

    f = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    layer = sharding.shard_moe(with_backend(moe, ep_backend()), mesh, seq_len=4, fsdp_min_size=256)
    (value, st), g = f(layer, x)
    (l_ref, st_ref), g_ref = f(moe, x)
    np.testing.assert_allclose(value, l_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(st.tokens_per_expert, st_ref.tokens_per_expert)
    np.testing.assert_allclose(st.seq_balance_loss, st_ref.seq_balance_loss, rtol=RTOL, atol=ATOL)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(g.moe, eqx.is_array)),
        jax.tree.leaves(eqx.filter(g_ref, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_dispatchers_must_exchange_over_the_expert_axis():
    from dropless.backends import AllToAllDispatcher

    mesh = sharding.make_mesh(data=2, expert=4)
    moe = with_backend(make_moe(), ep_backend())
    sharding.check_expert_parallel(moe, mesh)  # the "ep" backend's axis
    for axis, message in (("data", "but the experts are split over 'expert'"),
                          ("model", "which is not an axis of the mesh")):  # fmt: skip
        wrong = eqx.tree_at(lambda m: m.dispatcher, moe, AllToAllDispatcher(axis_name=axis))
        with pytest.raises(ValueError, match=message):
            sharding.check_expert_parallel(wrong, mesh)
    # experts not split at all, tokens exchanged over the data axis: as wrong
    data_only = sharding.make_mesh(data=2, expert=1, devices=jax.devices()[:2])
    wrong = eqx.tree_at(lambda m: m.dispatcher, moe, AllToAllDispatcher(axis_name="data"))
    with pytest.raises(ValueError, match="split over 'expert' \\(size 1\\)"):
        sharding.check_expert_parallel(wrong, data_only)
    sharding.check_expert_parallel(moe, data_only)  # "expert" of size 1 is fine
