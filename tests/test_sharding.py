"""Meshes, the logical-to-mesh table, sharded parameters / optimizer state / batches, and the
sharded train step against the unsharded one (8 emulated CPU devices, from tests/conftest.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dropless import sharding
from dropless.backends import with_backend
from dropless.moe import MoE
from dropless.routing import RoutingSpec

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
    assert specs.shared.w_down == P("fsdp", None)
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


def test_experts_must_divide():
    moe = make_moe()
    mesh = sharding.make_mesh(data=2, expert=3, devices=jax.devices()[:6])
    with pytest.raises(ValueError, match=r"experts dimension \(16\) must be divisible"):
        sharding.param_specs(moe, mesh)


def test_shard_model_and_opt_state():
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    moe = with_backend(make_moe(), "ep")
    step = sharding.make_train_step(lambda m, b: 0.0, optax.adam(1e-3), mesh, fsdp_min_size=256)
    placed, opt_state = step.init(moe)
    assert placed.experts.w_up.sharding.spec == P("expert", None, "fsdp")
    assert placed.router.w_router.sharding.spec == P(None, None)
    adam = opt_state[0]
    assert adam.mu.experts.w_up.sharding.spec == P("expert", None, "fsdp")
    assert adam.nu.shared.w_down.sharding.spec == P("fsdp", None)
    assert adam.count.sharding.spec == P()
    # the local shard really is a slice
    assert placed.experts.w_up.addressable_shards[0].data.shape == (E // 2, DIM, HIDDEN // 2)


def test_shard_batch():
    mesh = sharding.make_mesh(data=2, expert=4)
    batch = {"x": np.zeros((16, 3), np.float32), "t": np.zeros((16,), np.int32)}
    placed = sharding.shard_batch(batch, mesh)
    assert placed["x"].sharding.spec == P(("data", "expert"))
    assert placed["x"].addressable_shards[0].data.shape == (2, 3)


# --- ShardedMoE with fsdp, and the train step --------------------------------------------------


def test_sharded_moe_with_fsdp_matches_single_device():
    mesh = sharding.make_mesh(fsdp=2, expert=4)
    moe = make_moe()
    x = jax.random.normal(jax.random.key(3), (32, DIM))

    def loss(m, x):
        y, stats = m(x) if isinstance(m, sharding.ShardedMoE) else m(x, seq_len=4)
        return jnp.sum(jnp.sin(y)), stats

    f = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    layer = sharding.shard_moe(with_backend(moe, "ep"), mesh, seq_len=4, fsdp_min_size=256)
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


def moe_loss(model, batch):
    y, stats = model(batch["x"], seq_len=4)
    loss = jnp.mean((y - batch["y"]) ** 2) + 1e-2 * stats.z_loss + 1e-2 * stats.seq_balance_loss
    return loss, stats.tokens_per_expert


@eqx.filter_jit
def unsharded_step(model, opt_state, batch, optimizer, diff_filter):
    params, rest = eqx.partition(model, diff_filter)
    (loss, aux), grads = eqx.filter_value_and_grad(
        lambda p: moe_loss(eqx.combine(p, rest), batch), has_aux=True
    )(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss, aux


def test_sharded_train_step_equals_unsharded():
    """Three SGD-with-momentum steps on every kind of axis at once (data, fsdp and expert),
    with the expert bias kept out of the optimizer by a tree of bools."""
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    optimizer = optax.sgd(0.1, momentum=0.9)
    moe = make_moe()

    def no_bias(model):  # a tree of bools, like dropless.train.optim.trainable_filter's
        keep = jax.tree.map(eqx.is_inexact_array, model)
        return eqx.tree_at(lambda m: m.router.expert_bias, keep, False)

    key = jax.random.key(4)
    batches = []
    for _ in range(3):
        key, kx = jax.random.split(key)
        x = jax.random.normal(kx, (64, DIM))
        batches.append({"x": x, "y": jnp.tanh(x[:, ::-1])})

    ep_moe = with_backend(moe, "ep")
    step = sharding.make_train_step(
        moe_loss, optimizer, mesh, has_aux=True, diff_filter=no_bias(ep_moe), fsdp_min_size=256
    )
    model, opt_state = step.init(ep_moe)
    ref_model, ref_opt = moe, optimizer.init(eqx.filter(moe, no_bias(moe)))
    for batch in batches:
        model, opt_state, loss, counts = step(model, opt_state, step.shard_batch(batch))
        ref_model, ref_opt, ref_loss, ref_counts = unsharded_step(
            ref_model, ref_opt, batch, optimizer, no_bias(moe)
        )
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
        # aux is averaged over the 8 shards
        np.testing.assert_allclose(counts * 8, ref_counts, rtol=RTOL, atol=ATOL)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert model.experts.w_gate.sharding.spec == P("expert", None, "fsdp")
    assert not jnp.array_equal(model.router.w_router, moe.router.w_router)  # it trained
    assert jnp.array_equal(model.router.expert_bias, moe.router.expert_bias)  # not trained


def test_train_step_refuses_a_single_device_dispatcher():
    mesh = sharding.make_mesh(data=2, expert=4)
    step = sharding.make_train_step(moe_loss, optax.sgd(0.1), mesh, has_aux=True)
    with pytest.raises(ValueError, match="with_backend"):
        step.init(make_moe())


def test_sharded_step_keeps_parameter_dtypes():
    mesh = sharding.make_mesh(data=2, expert=4)
    moe = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
        with_backend(make_moe(), "ep"),
    )
    to_f32 = optax.stateless(lambda u, _: jax.tree.map(lambda x: x.astype(jnp.float32), u))
    step = sharding.make_train_step(
        moe_loss, optax.chain(optax.sgd(0.1), to_f32), mesh, has_aux=True
    )
    model, opt_state = step.init(moe)
    key = jax.random.key(5)
    x = jax.random.normal(key, (64, DIM), jnp.bfloat16)
    model, *_ = step(model, opt_state, step.shard_batch({"x": x, "y": jnp.tanh(x)}))
    dtypes = [a.dtype for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    assert set(dtypes) == {jnp.dtype(jnp.bfloat16)}  # float32 updates, bf16 parameters
    assert not jnp.array_equal(model.router.w_router, moe.router.w_router)


def test_dispatchers_must_exchange_over_the_expert_axis():
    from dropless.backends.ep import AllToAllDispatcher

    mesh = sharding.make_mesh(data=2, expert=4)
    moe = with_backend(make_moe(), "ep")
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


@pytest.mark.slow
@pytest.mark.parametrize("unroll", [False, True], ids=["scan", "unrolled"])
def test_deepseek_v3_tiny_sharded_step_equals_unsharded(unroll):
    models = pytest.importorskip("dropless.models.deepseek_v3")
    # Unrolled: two MoE layers, so that their stacks are split and their gradients written
    # back slice by slice. The reference runs the same split, so this checks the sharded
    # layout (on a CPU the gradient buffer starts as zeros, not uninitialised).
    n_layers = 3 if unroll else 2
    config = models.get_preset(
        "tiny", num_hidden_layers=n_layers, num_nextn_predict_layers=0, unroll_layers=unroll
    )
    model = models.DeepSeekV3(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, config.vocab_size)

    def loss_fn(m, batch):
        out = m(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch[:, 1:]).mean()
        return ce + 1e-2 * out.moe_stats.seq_balance_loss.sum()

    optimizer = optax.sgd(0.5)
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    step = sharding.make_train_step(loss_fn, optimizer, mesh, fsdp_min_size=1024)
    sharded, opt_state = step.init(with_backend(model, "ep"))

    @eqx.filter_jit
    def ref_step(m, o, b):
        loss, g = eqx.filter_value_and_grad(loss_fn)(m, b)
        u, o = optimizer.update(g, o, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, u), o, loss

    ref, ref_opt = model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(2):
        sharded, opt_state, loss, _ = step(sharded, opt_state, step.shard_batch(tokens))
        ref, ref_opt, ref_loss = ref_step(ref, ref_opt, tokens)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ref, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
