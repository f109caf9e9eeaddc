"""Expert parallelism (AllToAllDispatcher) on 2, 4 and 8 CPU devices against one device.

tests/conftest.py gives 8 emulated CPU devices. Each configuration compiles once (forward and
backward together); routings differ only in values (a selection-only expert bias steers every
token where a test wants it), so they share that compile.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import AbstractExpertParallelDispatcher, MoE, RoutingSpec, sharding
from dropless.backends import AllToAllDispatcher, ep_backend, with_backend
from dropless.backends import _ep_exchange as ep_exchange
from dropless.backends._ep import (
    buffer_rows,
    check_ep_settings,
    pair_bound,
    ragged_bound,
    resolve_exchange,
)
from dropless.train import get_backend

pytestmark = pytest.mark.mesh8  # meshes over the 8 devices (tests/conftest.py)

# Tolerances for float32 MoE layers computed on different layouts (same math, different
# summation order): fixed, never loosened.
RTOL, ATOL = 1e-5, 1e-5

E, K, DIM, HIDDEN = 16, 2, 8, 16
TOKENS = 64  # global; 8 per device on 8 devices
SEQ_LEN = 4  # sequences never straddle shards, so the sequence-wise loss is exact

ROUTINGS = ("random", "one_device_first", "one_device_last", "two_experts")


def bias_for(routing: str) -> jax.Array:
    """A selection-only bias that sends every token where `routing` says."""
    bias = np.zeros(E, np.float32)
    if routing == "one_device_first":  # every copy to experts 0, 1: device 0 at any ep <= 8
        bias[:K] = 1e3
    elif routing == "one_device_last":
        bias[E - K :] = 1e3
    elif routing == "two_experts":  # experts 0 and E-1 only: every other expert empty
        bias[[0, E - 1]] = 1e3
    return jnp.asarray(bias)


def make_moe(routing: str = "random", *, seed: int = 0) -> MoE:
    spec = RoutingSpec(E, K, use_expert_bias=True)
    moe = MoE(DIM, HIDDEN, spec, n_shared_experts=1, key=jax.random.key(seed))
    return eqx.tree_at(lambda m: m.router.expert_bias, moe, bias_for(routing))


def inputs(seed: int = 1):
    kx, kp = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (TOKENS, DIM)), jax.random.normal(kp, (TOKENS, DIM))


def ep_mesh(ep: int):
    return sharding.make_mesh(data=8 // ep, expert=ep)


def _loss(args, probe):
    layer, x = args
    if isinstance(layer, MoE):
        y, stats = layer(x, seq_len=SEQ_LEN)
    else:
        y, stats = layer(x)
    return jnp.sum(y * probe), (y, stats)


@eqx.filter_jit
def value_and_grad(layer, x, probe):
    """(y, stats, grads w.r.t. the layer's arrays and x): one compile per layer structure."""
    (_, (y, stats)), grads = eqx.filter_value_and_grad(_loss, has_aux=True)((layer, x), probe)
    return y, stats, grads


@eqx.filter_jit
def balance_losses(moe, parts):
    """The batch-wise balance loss of each part of the tokens, `[parts]`."""
    return jax.vmap(lambda part: moe(part)[1].balance_loss)(parts)


def sharded(moe: MoE, mesh, **dispatcher_settings) -> sharding.ShardedMoE:
    """`moe` on `mesh`, with the "ep" dispatcher (default settings unless given)."""
    moe = with_backend(moe, ep_backend())
    if dispatcher_settings:
        dispatcher = AllToAllDispatcher(**dispatcher_settings)
        moe = eqx.tree_at(lambda m: m.dispatcher, moe, dispatcher)
    return sharding.shard_moe(moe, mesh, seq_len=SEQ_LEN)


def assert_close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def assert_same_grads(got, want):
    (g_layer, g_x), (w_layer, w_x) = got, want
    g_moe = g_layer.moe if isinstance(g_layer, sharding.ShardedMoE) else g_layer
    leaves_got = jax.tree.leaves(eqx.filter(g_moe, eqx.is_array))
    leaves_want = jax.tree.leaves(eqx.filter(w_layer, eqx.is_array))
    assert len(leaves_got) == len(leaves_want)
    for g, w in zip(leaves_got, leaves_want, strict=True):
        assert_close(g, w)
    assert_close(g_x, w_x)


# --- EP equals one device: outputs, statistics, gradients ----------------------------------


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_matches_single_device(ep):
    mesh = ep_mesh(ep)
    x, probe = inputs()
    for routing in ROUTINGS:
        moe = make_moe(routing)
        y_ref, st_ref, g_ref = value_and_grad(moe, x, probe)
        y, st, g = value_and_grad(sharded(moe, mesh), x, probe)
        assert_close(y, y_ref)
        assert_same_grads(g, g_ref)
        np.testing.assert_array_equal(st.tokens_per_expert, st_ref.tokens_per_expert)
        assert_close(st.z_loss, st_ref.z_loss)
        # the batch-wise loss is documented as the mean of the 8 devices' own (docs/distributed.md)
        per_device = balance_losses(make_moe(routing), jnp.stack(jnp.split(x, 8)))
        assert_close(st.balance_loss, per_device.mean())
        assert_close(st.seq_balance_loss, st_ref.seq_balance_loss)
        assert_close(st.max_vio, st_ref.max_vio)
        assert float(st.dropped) == 0.0
        if routing != "random":  # the steering worked: only the biased experts got tokens
            assert int((st.tokens_per_expert > 0).sum()) == K


def test_ep_hypothesis_routings():
    """Random skewed biases and inputs at ep=4 (values only: the compile is shared)."""
    mesh = ep_mesh(4)

    @given(
        seed=st.integers(0, 2**16),
        hot=st.lists(st.integers(0, E - 1), min_size=0, max_size=4),
    )
    def check(seed, hot):
        moe = make_moe(seed=seed)
        bias = np.zeros(E, np.float32)
        bias[hot] = 5.0
        moe = eqx.tree_at(lambda m: m.router.expert_bias, moe, jnp.asarray(bias))
        x, probe = inputs(seed + 1)
        y_ref, _, g_ref = value_and_grad(moe, x, probe)
        y, st_, g = value_and_grad(sharded(moe, mesh), x, probe)
        assert_close(y, y_ref)
        assert_same_grads(g, g_ref)
        assert float(st_.dropped) == 0.0

    check()


# --- the ragged exchange, checked on CPU through an emulation of ragged_all_to_all ----------


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`'s documented semantics, from all_gathers (XLA:CPU cannot
    compile the real one)."""
    ops = jax.lax.all_gather(operand, axis_name)
    src_off = jax.lax.all_gather(input_offsets, axis_name)
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    dst_off = jax.lax.all_gather(output_offsets, axis_name)
    me = jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    result = output
    for q in range(ops.shape[0]):
        start, n, src = dst_off[q, me], sizes[q, me], src_off[q, me]
        inside = (rows >= start) & (rows < start + n)
        index = jnp.clip(src + rows - start, 0, operand.shape[0] - 1)
        result = jnp.where(inside[:, None], ops[q][index], result)
    # the contract: what I expect from each source is what it sends me
    return eqx.error_if(result, jnp.any(recv_sizes != sizes[:, me]), "recv_sizes mismatch")


@pytest.fixture
def emulate_ragged(monkeypatch):
    monkeypatch.setattr(ep_exchange, "_ragged_all_to_all", emulated_ragged_all_to_all)


def test_ragged_exchange_matches_single_device(emulate_ragged):
    mesh = ep_mesh(4)
    x, probe = inputs()
    for routing in ROUTINGS:
        moe = make_moe(routing)
        y_ref, _, g_ref = value_and_grad(moe, x, probe)
        y, st_, g = value_and_grad(sharded(moe, mesh, exchange="ragged"), x, probe)
        assert_close(y, y_ref)
        assert_same_grads(g, g_ref)
        assert float(st_.dropped) == 0.0


# --- undersized buffers: counted, dropped or raised; never silent -----------------------------


def expected_keep(expert_ids: np.ndarray, ep: int, n_groups: int, exchange: str, factor: float):
    """Which copies fit, by the documented rule: copies sorted by (expert, copy index) per source;
    padded exchange keeps the first `pair_bound` per (source, destination); ragged fills each
    destination's buffer source by source."""
    tokens, k = expert_ids.shape
    local_tokens = tokens // (n_groups * ep)
    n_copies = local_tokens * k
    keep = np.ones((tokens, k), bool)
    local = E // ep
    for g in range(n_groups):
        blocks = {}
        for q in range(ep):
            s = g * ep + q
            ids = expert_ids[s * local_tokens : (s + 1) * local_tokens].reshape(-1)
            order = np.argsort(ids, kind="stable")
            for d in range(ep):
                blocks[q, d] = [c for c in order if ids[c] // local == d]
        for d in range(ep):
            filled = 0
            for q in range(ep):
                block = blocks[q, d]
                if exchange == "all_to_all":
                    fits = min(len(block), pair_bound(n_copies, ep, factor))
                else:
                    room = ragged_bound(n_copies, ep, factor) - filled
                    fits = max(0, min(len(block), room))
                    filled += len(block)
                s = g * ep + q
                for c in block[fits:]:
                    keep[s * local_tokens + c // k, c % k] = False
    return keep


def masked_oracle(moe: MoE, x, keep):
    """The dense one-hot MoE with the copies `keep` marks False removed."""
    routing = moe.router(x)
    one_hot = jax.nn.one_hot(routing.expert_ids, E) * keep[..., None]
    weights = jnp.einsum("tke,tk->te", one_hot, routing.weights)
    ex = moe.experts
    gate = jnp.einsum("td,edh->teh", x, ex.w_gate)
    up = jnp.einsum("td,edh->teh", x, ex.w_up)
    out = jnp.einsum("teh,ehd->ted", jax.nn.silu(gate) * up, ex.w_down)
    return jnp.einsum("ted,te->td", out, weights) + moe.shared(x)


@eqx.filter_jit
def oracle_value_and_grad(moe, x, probe, keep):
    def loss(args):
        m, x = args
        y = masked_oracle(m, x, keep)
        return jnp.sum(y * probe), y

    (_, y), grads = eqx.filter_value_and_grad(loss, has_aux=True)((moe, x))
    return y, grads


@pytest.mark.parametrize("exchange", ["all_to_all", "ragged"])
def test_overflow_drop_counts_and_drops_exactly(exchange, emulate_ragged):
    ep, factor = 4, 0.75
    mesh = ep_mesh(ep)
    x, probe = inputs()
    for routing in ("random", "one_device_first"):
        moe = make_moe(routing)
        layer = sharded(moe, mesh, recv_factor=factor, overflow="drop", exchange=exchange)
        y, st_, g = value_and_grad(layer, x, probe)
        ids = np.asarray(moe.router(x).expert_ids)
        keep = expected_keep(ids, ep, 8 // ep, exchange, factor)
        assert float(st_.dropped) == float((~keep).sum()) > 0
        y_ref, g_ref = oracle_value_and_grad(moe, x, probe, jnp.asarray(keep, jnp.float32))
        assert_close(y, y_ref)
        assert_same_grads(g, g_ref)


def test_overflow_raise():
    mesh = ep_mesh(4)
    x, probe = inputs()
    layer_of = lambda routing: sharded(  # noqa: E731
        make_moe(routing), mesh, recv_factor=2.0, overflow="raise"
    )
    y, st_, _ = value_and_grad(layer_of("random"), x, probe)  # fits: no error, nothing dropped
    assert float(st_.dropped) == 0.0
    with pytest.raises(Exception, match="overflowed the expert-parallel receive buffer"):
        jax.block_until_ready(value_and_grad(layer_of("one_device_first"), x, probe))


# --- buffer sizing, settings, and errors (no compile) ------------------------------------------


def test_buffer_sizes():
    copies, ep = 16, 4
    assert pair_bound(copies, ep, None) == copies  # one source may send all its copies anywhere
    assert ragged_bound(copies, ep, None) == ep * copies  # every source may send all to one
    assert buffer_rows(copies, ep, None, "all_to_all") == ep * copies
    assert buffer_rows(copies, ep, None, "ragged") == ep * copies
    assert pair_bound(copies, ep, 1.0) == 4 and ragged_bound(copies, ep, 1.0) == 16
    assert pair_bound(copies, ep, 1.5) == 6 and ragged_bound(copies, ep, 1.5) == 24
    assert pair_bound(copies, ep, 100.0) == copies and ragged_bound(copies, ep, 100.0) == 64
    assert pair_bound(copies, ep, 1e-6) == 1 and ragged_bound(copies, ep, 1e-6) == 1


def test_resolve_exchange():
    assert resolve_exchange("auto", "cpu") == "all_to_all"
    assert resolve_exchange("auto", "gpu") == "ragged"
    assert resolve_exchange("auto", "tpu") == "ragged"
    assert resolve_exchange("all_to_all", "gpu") == "all_to_all"
    assert resolve_exchange("auto") == "all_to_all"  # this machine is a CPU


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_recv_factor(bad):
    with pytest.raises(ValueError, match="recv_factor must be None"):
        AllToAllDispatcher(recv_factor=bad)


@pytest.mark.parametrize("bad", ["2", True])
def test_recv_factor_of_wrong_type(bad):
    # the runtime type checker (tests) or __check_init__ (everywhere) refuses it, naming it
    with pytest.raises((TypeError, ValueError), match="recv_factor"):
        AllToAllDispatcher(recv_factor=bad)
    with pytest.raises(ValueError, match=f"recv_factor must be None .* got {bad!r}"):
        check_ep_settings("expert", bad)  # __check_init__'s own rule


def test_bad_settings():
    # Literal-typed settings: the runtime type checker (tests) or __check_init__ refuses them
    with pytest.raises((TypeError, ValueError), match="overflow"):
        AllToAllDispatcher(overflow="ignore")
    with pytest.raises((TypeError, ValueError), match="exchange"):
        AllToAllDispatcher(exchange="nccl")
    with pytest.raises(ValueError, match="axis_name must be"):
        AllToAllDispatcher(axis_name="")
    # set past the constructor: __check_init__'s own messages, which the type checker pre-empts
    for field, value, message in (
        ("overflow", "ignore", "overflow must be 'raise' or 'drop', got 'ignore'"),
        ("exchange", "nccl", "exchange must be 'auto', 'all_to_all' or 'ragged', got 'nccl'"),
    ):
        dispatcher = AllToAllDispatcher()
        object.__setattr__(dispatcher, field, value)
        with pytest.raises(ValueError, match=message):
            dispatcher.__check_init__()


def test_registry_entry():
    bundle = get_backend("ep")
    assert isinstance(bundle.dispatcher, AllToAllDispatcher)
    assert bundle.dispatcher.axis_name == "expert"
    assert isinstance(bundle.dispatcher, AbstractExpertParallelDispatcher)
    assert not bundle.requires_gpu
    custom = ep_backend(recv_factor=1.5, overflow="drop")
    assert custom.dispatcher.recv_factor == 1.5 and custom.dispatcher.overflow == "drop"


def test_outside_shard_map_is_a_clear_error():
    moe = with_backend(make_moe(), ep_backend())
    x, _ = inputs()
    with pytest.raises(ValueError, match="must run inside jax.shard_map"):
        jax.eval_shape(moe, x)


def test_experts_not_divisible_by_expert_axis():
    mesh = sharding.make_mesh(data=2, expert=3, devices=jax.devices()[:6])
    moe = with_backend(make_moe(), ep_backend())
    with pytest.raises(ValueError, match="divisible"):
        sharding.shard_moe(moe, mesh)
    # the dispatcher checks too, when a caller writes its own shard_map
    x, _ = inputs()

    def local(x):
        routing = moe.router(x)
        return moe.dispatcher.dispatch(x, routing).rows

    run = jax.shard_map(
        local, mesh=mesh, in_specs=sharding.batch_spec(mesh), out_specs=sharding.batch_spec(mesh)
    )
    with pytest.raises(ValueError, match=r"n_routed_experts \(16\) must be divisible"):
        jax.eval_shape(run, x[:60])


def test_single_device_dispatcher_on_expert_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="with_backend"):
        sharding.shard_moe(make_moe(), ep_mesh(4))


def test_dispatcher_axis_missing_from_mesh():
    moe = eqx.tree_at(lambda m: m.dispatcher, make_moe(), AllToAllDispatcher(axis_name="experts"))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        sharding.shard_moe(moe, ep_mesh(4))


# --- on GPUs: the real ragged_all_to_all --------------------------------------------------------


@pytest.mark.gpu
def test_exchanges_on_gpus():
    """Both exchanges, with XLA's own collectives, on as many GPUs as divide the experts (one
    GPU still compiles and runs the real ragged_all_to_all, over an axis of size 1)."""
    gpus = jax.devices("gpu")
    n = max(d for d in (1, 2, 4, 8) if d <= len(gpus))
    mesh = sharding.make_mesh(expert=n, devices=gpus[:n])
    assert resolve_exchange("auto") == "ragged"
    x, probe = inputs()
    with jax.default_matmul_precision("highest"):  # no TF32: the layouts must agree in float32
        for routing in ROUTINGS:
            moe = make_moe(routing)
            y_ref, _, g_ref = value_and_grad(moe, x, probe)
            for exchange in ("ragged", "all_to_all"):
                y, st_, g = value_and_grad(sharded(moe, mesh, exchange=exchange), x, probe)
                assert_close(y, y_ref)
                assert_same_grads(g, g_ref)
                assert float(st_.dropped) == 0.0


@pytest.mark.parametrize("exchange", ["all_to_all", "ragged"])
def test_zero_computation_experts_are_not_exchanged(exchange, monkeypatch):
    """Zero-computation choices never enter the all-to-all: the EP layer equals one device
    (outputs, gradients, counts), and with every choice a zero-computation one nothing is
    computed at all."""
    if exchange == "ragged":
        monkeypatch.setattr(ep_exchange, "_ragged_all_to_all", emulated_ragged_all_to_all)
    mesh = ep_mesh(4)
    x, probe = inputs()
    spec = RoutingSpec(E, K, use_expert_bias=True)
    for zero_bias in (0.0, 0.02, 1e3):
        moe = MoE(DIM, HIDDEN, spec, n_zero_experts=2, key=jax.random.key(0))
        bias = jnp.concatenate([jnp.zeros(E), jnp.full((2,), zero_bias)])
        moe = eqx.tree_at(lambda m: m.router.expert_bias, moe, bias)
        y_ref, st_ref, g_ref = value_and_grad(moe, x, probe)
        y, st_, g = value_and_grad(sharded(moe, mesh, exchange=exchange), x, probe)
        assert_close(y, y_ref)
        assert_same_grads(g, g_ref)
        np.testing.assert_array_equal(st_.tokens_per_expert, st_ref.tokens_per_expert)
        np.testing.assert_array_equal(st_.zero_tokens, st_ref.zero_tokens)
        if zero_bias == 1e3:
            assert float(st_.tokens_per_expert.sum()) == 0.0
            kept = moe.router(x).weights.sum(-1, keepdims=True)
            assert_close(y, kept * x)  # no shared expert here


def test_ep_matches_single_device_with_gpt_oss_experts():
    """gpt-oss's MoE (a router bias, expert biases, the clamped SwiGLU): each device holds its
    experts' biases with their weights, and the layer equals one device's."""
    spec = RoutingSpec(E, K, router_bias=True)
    moe = MoE(DIM, HIDDEN, spec, experts_bias=True, swiglu_limit=0.5, key=jax.random.key(3))
    keys = jax.random.split(jax.random.key(4), 4)
    ex = moe.experts
    biases = (moe.router.logit_bias, ex.gate_bias, ex.up_bias, ex.down_bias)
    random = tuple(jax.random.normal(k, b.shape) for k, b in zip(keys, biases, strict=True))
    where = lambda m: (
        m.router.logit_bias,
        m.experts.gate_bias,
        m.experts.up_bias,
        m.experts.down_bias,
    )  # noqa: E731
    moe = eqx.tree_at(where, moe, random)
    x, probe = inputs()
    y_ref, st_ref, g_ref = value_and_grad(moe, x, probe)
    y, st, g = value_and_grad(sharded(moe, ep_mesh(4)), x, probe)
    assert_close(y, y_ref)
    assert_same_grads(g, g_ref)
    np.testing.assert_array_equal(st.tokens_per_expert, st_ref.tokens_per_expert)
