"""The train step on a mesh (`dropless.train.step._sharded`) against the unsharded one: its
gradient, `sharded_value_and_grad`, under an optimizer on an MoE layer and on the tiny DeepSeek-V3
(every kind of mesh axis at once), and `sharded_train_step` itself against `train_step` (8 emulated
CPU devices, from tests/conftest.py). The whole loop on a mesh: tests/train/loop/test_mesh.py."""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dropless import MoE, RoutingSpec, apply_updates, sharding
from dropless.backends import ep_backend, jnp_capacity_backend, with_backend
from dropless.models import get_preset as get_any_preset
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.step import _sharded_state as sharded_state
from dropless.train.step import (
    init_state,
    prepare_model,
    shard_state,
    sharded_train_step,
    sharded_value_and_grad,
    train_step,
)

pytestmark = pytest.mark.mesh8  # meshes over the 8 devices (tests/conftest.py)

# float32, same math in a different layout and summation order (fixed, never loosened)
RTOL, ATOL = 1e-5, 1e-5

E, K, DIM, HIDDEN = 16, 2, 8, 32


def make_moe(seed: int = 0) -> MoE:
    spec = RoutingSpec(E, K, use_expert_bias=True, scoring_func="sigmoid")
    return MoE(DIM, HIDDEN, spec, n_shared_experts=1, key=jax.random.key(seed))


def ep(model):
    return with_backend(model, ep_backend())


def make_step(loss_fn, optimizer, mesh, *, has_aux=False, diff_filter=eqx.is_inexact_array, **kw):
    """`(init, step)`: `sharded_value_and_grad` then `optimizer` on the arrays `diff_filter`
    selects, as `sharded_train_step` composes them."""
    value_and_grad = sharded_value_and_grad(
        loss_fn, mesh, has_aux=has_aux, diff_filter=diff_filter, **kw
    )

    def init(model):
        sharding.check_expert_parallel(model, mesh)
        model = sharding.shard_model(model, mesh, **kw)
        return model, optimizer.init(eqx.filter(model, diff_filter))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        out, grads = value_and_grad(model, batch)
        loss, aux = out if has_aux else (out, None)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, diff_filter))
        return apply_updates(model, updates), opt_state, loss, aux

    return init, step


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


def test_sharded_gradient_step_equals_unsharded():
    """Three SGD-with-momentum steps on every kind of axis at once (data, fsdp and expert),
    with the expert bias kept out of the optimizer by a tree of bools."""
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    optimizer = optax.sgd(0.1, momentum=0.9)
    moe = make_moe()

    def no_bias(model):  # a tree of bools, like dropless.train.step.trainable_filter's
        keep = jax.tree.map(eqx.is_inexact_array, model)
        return eqx.tree_at(lambda m: m.router.expert_bias, keep, False)

    key = jax.random.key(4)
    batches = []
    for _ in range(3):
        key, kx = jax.random.split(key)
        x = jax.random.normal(kx, (64, DIM))
        batches.append({"x": x, "y": jnp.tanh(x[:, ::-1])})

    ep_moe = ep(moe)
    init, step = make_step(
        moe_loss, optimizer, mesh, has_aux=True, diff_filter=no_bias(ep_moe), fsdp_min_size=256
    )
    model, opt_state = init(ep_moe)
    ref_model, ref_opt = moe, optimizer.init(eqx.filter(moe, no_bias(moe)))
    for batch in batches:
        model, opt_state, loss, counts = step(model, opt_state, sharding.shard_batch(batch, mesh))
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


def test_sharded_gradient_refuses_a_single_device_dispatcher():
    mesh = sharding.make_mesh(data=2, expert=4)
    value_and_grad = sharded_value_and_grad(moe_loss, mesh, has_aux=True)
    batch = {"x": jnp.zeros((8, DIM)), "y": jnp.zeros((8, DIM))}
    with pytest.raises(ValueError, match="with_backend"):
        value_and_grad(make_moe(), batch)


def test_sharded_step_keeps_parameter_dtypes():
    mesh = sharding.make_mesh(data=2, expert=4)
    moe = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, ep(make_moe())
    )
    to_f32 = optax.stateless(lambda u, _: jax.tree.map(lambda x: x.astype(jnp.float32), u))
    init, step = make_step(moe_loss, optax.chain(optax.sgd(0.1), to_f32), mesh, has_aux=True)
    model, opt_state = init(moe)
    key = jax.random.key(5)
    x = jax.random.normal(key, (64, DIM), jnp.bfloat16)
    model, *_ = step(model, opt_state, sharding.shard_batch({"x": x, "y": jnp.tanh(x)}, mesh))
    dtypes = [a.dtype for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    assert set(dtypes) == {jnp.dtype(jnp.bfloat16)}  # float32 updates, bf16 parameters
    assert not jnp.array_equal(model.router.w_router, moe.router.w_router)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "unroll", "changes"),
    [
        ("tiny", False, {}),
        ("tiny", True, {}),
        ("qwen3-moe-tiny", False, {}),
        ("olmoe-tiny", False, {}),
        ("mixtral-tiny", False, {"sliding_window": 3}),
        ("gpt-oss-tiny", True, {}),
    ],
    ids=["scan", "unrolled", "qwen3-moe", "olmoe", "mixtral-window3", "gpt-oss-unrolled"],
)
def test_tiny_sharded_gradient_step_equals_unsharded(preset, unroll, changes):
    # Unrolled: two MoE layers, so that their stacks are split and their gradients written
    # back slice by slice. The reference runs the same split, so this checks the sharded
    # layout (on a CPU the gradient buffer starts as zeros, not uninitialised). The other
    # families: grouped-query attention's weights sharded as well; Mixtral's softmax over the
    # top-k logits and a window shorter than the sequence; gpt-oss's biases and sinks, and its
    # layers' windows split with the unrolled layers.
    n_layers = 3 if unroll else 2
    config = get_any_preset(
        preset,
        num_hidden_layers=n_layers,
        num_nextn_predict_layers=0,
        unroll_layers=unroll,
        **changes,
    )
    model = DeepSeekV3(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, config.vocab_size)

    def loss_fn(m, batch):
        out = m(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch[:, 1:]).mean()
        return ce + 1e-2 * out.moe_stats.seq_balance_loss.sum()

    optimizer = optax.sgd(0.5)
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    init, step = make_step(loss_fn, optimizer, mesh, fsdp_min_size=1024)
    sharded, opt_state = init(ep(model))

    @eqx.filter_jit
    def ref_step(m, o, b):
        loss, g = eqx.filter_value_and_grad(loss_fn)(m, b)
        u, o = optimizer.update(g, o, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, u), o, loss

    ref, ref_opt = model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(2):
        sharded, opt_state, loss, _ = step(sharded, opt_state, sharding.shard_batch(tokens, mesh))
        ref, ref_opt, ref_loss = ref_step(ref, ref_opt, tokens)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(sharded, eqx.is_array)),
        jax.tree.leaves(eqx.filter(ref, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _two_steps_on_a_mesh_and_one_device(config):
    """Two train steps of `config` on a data=2, fsdp=2, expert=2 mesh and on one device, from
    the same initial state: (mesh state, one-device state, [(metrics, its metrics)] a step)."""
    train_config = TrainConfig(steps=2, batch_size=8, seq_len=8, warmup_steps=0)
    mesh = sharding.make_mesh(data=2, fsdp=2, expert=2)
    model = prepare_model(DeepSeekV3(config, key=jax.random.key(0)), mesh)
    state = shard_state(init_state(model, train_config), mesh)
    # its own arrays: both steps donate their state
    ref = init_state(DeepSeekV3(config, key=jax.random.key(0)), train_config)
    steps = []
    for step in range(2):
        tokens = jax.random.randint(jax.random.key(step), (8, 9), 0, config.vocab_size)
        state, metrics = sharded_train_step(mesh, state, sharding.shard_batch(tokens, mesh))
        ref, ref_metrics = train_step(ref, tokens)
        steps.append((metrics, ref_metrics))
    return state, ref, steps


@pytest.mark.slow
def test_sharded_train_step_equals_train_step():
    """`sharded_train_step` (AdamW, expert-bias update, every kind of mesh axis) against
    `train_step` on one device: the same metrics, and the arrays stay placed on the mesh."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    state, ref, steps = _two_steps_on_a_mesh_and_one_device(config)
    for metrics, ref_metrics in steps:
        for name in ("loss", "ce", "seq_balance_loss", "max_vio"):
            np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(state.expert_load, ref.expert_load)
    experts = eqx.filter(state.model.moe_layers.mlp.experts, eqx.is_array)
    assert all("expert" in str(a.sharding.spec) for a in jax.tree.leaves(experts))


def test_prepare_model_keeps_an_expert_parallel_backend_and_replaces_others():
    """On an expert axis > 1 a single-device dispatcher gives way to the "ep" backend's, the
    other stages (grouped matmul, top-k) staying the user's; an expert-parallel dispatcher,
    with its own settings, stays as given."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    mesh = sharding.make_mesh(data=4, expert=2)

    def dispatcher(model):
        return model.moe_layers.mlp.dispatcher

    own = DeepSeekV3(config, backend=ep_backend(recv_factor=3.0), key=jax.random.key(0))
    assert dispatcher(prepare_model(own, mesh)) == dispatcher(own)
    capacity = DeepSeekV3(config, backend=jnp_capacity_backend(), key=jax.random.key(0))
    plain = prepare_model(capacity, mesh)
    assert dispatcher(plain) == ep_backend().dispatcher
    assert sharded_state.stages(plain) == {
        "dispatcher": "AllToAllDispatcher",
        "gmm": "CapacityGroupedMatmul",  # the user's, not the "ep" bundle's ChunkedGroupedMatmul
        "topk": "JnpTopK",
    }
    before_down = get_preset(
        "tiny", num_hidden_layers=2, num_nextn_predict_layers=0, moe_weights_before_down=True
    )
    with pytest.raises(ValueError, match="moe_weights_before_down needs a dispatcher with row"):
        prepare_model(DeepSeekV3(before_down, key=jax.random.key(0)), mesh)
    # expert=1: nothing to exchange, the model's own backend stays
    single = DeepSeekV3(config, key=jax.random.key(0))
    assert dispatcher(prepare_model(single, sharding.make_mesh(data=8))) == dispatcher(single)


# Two micro-batches on the mesh crashed XLA's CPU runtime (segmentation fault) in one of two
# full-suite runs on 2026-12-07 and passed alone; skipped in the suite until the cause is
# known (issue 55). Run alone: pytest "tests/train/step/test_sharded.py::\
# test_global_balance_loss_on_a_mesh_is_the_single_device_loss_of_the_whole_batch"
_CRASHED = pytest.mark.skipif(
    os.environ.get("DROPLESS_RUN_CRASHING") != "1",
    reason="segfaulted once in the full suite; DROPLESS_RUN_CRASHING=1 runs it",
)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, pytest.param(2, marks=_CRASHED)])
def test_global_balance_loss_on_a_mesh_is_the_single_device_loss_of_the_whole_batch(
    micro_batches,
):
    """The global-batch balance loss on 8 devices (data and expert axes), in one pass or in
    micro-batches, equals the batch-wise loss of the whole batch on one device, and the step
    equals that device's; the per-device batch-wise loss does not."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    train_config = TrainConfig(
        steps=2,
        batch_size=16,
        seq_len=8,
        warmup_steps=0,
        micro_batches=micro_batches,
        global_balance_loss_coef=0.1,
        seq_balance_loss_coef=0.0,
    )
    mesh = sharding.make_mesh(data=4, expert=2)
    model = prepare_model(DeepSeekV3(config, key=jax.random.key(0)), mesh)
    state = shard_state(init_state(model, train_config), mesh)
    ref = init_state(DeepSeekV3(config, key=jax.random.key(0)), train_config)
    tokens = jax.random.randint(jax.random.key(0), (16, 9), 0, config.vocab_size)
    state, metrics = sharded_train_step(
        mesh, state, sharding.shard_batch(tokens, mesh), micro_batches
    )
    ref, ref_metrics = train_step(ref, tokens)  # one device, one pass
    for name in ("loss", "global_balance_loss"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        ref_metrics["global_balance_loss"], ref_metrics["balance_loss"], rtol=RTOL
    )
    assert abs(float(metrics["balance_loss"]) - float(ref_metrics["balance_loss"])) > 1e-4
    got = state.model.moe_layers.mlp.router.w_router
    want = ref.model.moe_layers.mlp.router.w_router
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fresh_state_is_made_sharded():
    """`init_sharded_state`: every array of a fresh state (bf16 weights with float32 master
    weights, so that every part is there) is placed on the mesh as `state_shardings` says, the
    moments like their parameters; the compiled initialisation writes each device's shards and
    needs under half the memory of the whole one; the values are the unsharded `init_state`'s."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0, hidden_size=256)
    train_config = TrainConfig(weight_dtype="bfloat16")
    mesh = sharding.make_mesh(fsdp=4, expert=2)

    def make():
        return DeepSeekV3(config, key=jax.random.key(0))

    state = sharded_state.init_sharded_state(make, train_config, mesh)
    arrays = eqx.filter(state, eqx.is_array)
    wanted = sharded_state.state_shardings(arrays, mesh)
    for leaf, sharding_ in zip(jax.tree.leaves(arrays), jax.tree.leaves(wanted), strict=True):
        assert leaf.sharding == sharding_
    assert state.model.embed_tokens.dtype == jnp.bfloat16
    assert state.master.embed_tokens.dtype == jnp.float32
    assert state.master.embed_tokens.sharding.spec == P(("fsdp", "expert"), None)
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.shape == (512, 256)]
    assert len(moments) == 2  # the embedding's two Adam moments
    assert all(m.sharding.spec == P(("fsdp", "expert"), None) for m in moments)

    abstract = sharded_state.abstract_sharded_state(make, train_config, mesh)
    placed, _ = eqx.partition(abstract, sharding.is_array_like)

    def build():
        fresh = init_state(prepare_model(make(), mesh), train_config)
        return eqx.filter(fresh, eqx.is_array)

    out_shardings = jax.tree.map(lambda a: a.sharding, placed)
    memory = jax.jit(build, out_shardings=out_shardings).lower().compile().memory_analysis()
    device = jax.devices()[0]
    shards = [s for a in jax.tree.leaves(arrays) for s in a.addressable_shards]
    per_device = sum(s.data.nbytes for s in shards if s.device == device)
    whole = sum(a.nbytes for a in jax.tree.leaves(arrays))
    assert per_device < whole / 2  # the sharded arrays are most of the state
    assert abs(memory.output_size_in_bytes - per_device) <= 0.01 * per_device
    # the whole initialisation on one device, compiled by the same XLA (whose temporaries
    # differ between versions): the sharded one needs under half its peak
    alone = jax.jit(lambda: eqx.filter(init_state(make(), train_config), eqx.is_array))
    alone = alone.lower().compile().memory_analysis()
    peak = memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert peak < (alone.output_size_in_bytes + alone.temp_size_in_bytes) / 2

    # eager on one device: equal up to rounding that XLA fuses differently (which can tip a
    # bf16 weight by one bf16 ulp)
    ref = eqx.filter(init_state(make(), train_config), eqx.is_array)
    for a, b in zip(jax.tree.leaves(arrays), jax.tree.leaves(ref), strict=True):
        rtol = 1e-6 if a.dtype != jnp.bfloat16 else 2**-7
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol, 1e-7)


def _computations(hlo: str) -> dict[str, str]:
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name, lines = head.group(1), []
        elif line.startswith("}") and name is not None:
            out[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return out


def _all_gathers(hlo: str) -> tuple[list[str], list[str]]:
    """The output shapes of the all-gathers of a compiled program's HLO text: (those inside a
    while loop's body, those elsewhere)."""
    comps = _computations(hlo)
    callee = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)")
    roots = [m.group(1) for t in comps.values() for m in re.finditer(r"body=%?([\w.\-]+)", t)]
    inside, todo = set(), roots
    while todo:
        c = todo.pop()
        if c in inside or c not in comps:
            continue
        inside.add(c)
        for match in callee.finditer(comps[c]):
            todo += [n.strip(" %") for n in match.group(1).split(",")]
    # one array, or a tuple of them where XLA combined several gathers into one
    gather = re.compile(r"= (\([^=]*\)|\S+) all-gather(?:-start)?\(")
    array = re.compile(r"\w+\[[\d,]*\]")

    def shapes(names):
        found = [m.group(1) for n in names for m in gather.finditer(comps[n])]
        return [shape for text in found for shape in array.findall(text)]

    return shapes(inside), shapes(set(comps) - inside)


@pytest.mark.slow
def test_sharded_step_gathers_one_layer_at_a_time():
    """In the compiled sharded step the layers' FSDP all-gathers sit inside the layer loops
    (main stack and MTP; forward and backward), and the only ones outside gather arrays that
    are no layer's (the embedding, the head)."""
    # every stack two layers or more: XLA removes a loop of one trip
    config = get_preset(
        "tiny",
        num_hidden_layers=3,
        first_k_dense_replace=0,
        num_nextn_predict_layers=2,
        hidden_size=256,
    )
    mesh = sharding.make_mesh(fsdp=8)
    train_config = TrainConfig(batch_size=8, seq_len=8)
    state = sharded_state.init_sharded_state(
        lambda: DeepSeekV3(config, key=jax.random.key(0)), train_config, mesh
    )
    tokens = sharding.shard_batch(jnp.zeros((8, 9), jnp.int32), mesh)
    hlo = sharded_train_step.lower(mesh, state, tokens).compile().compiled.as_text()
    inside, outside = _all_gathers(hlo)
    # per layer: the experts' gate, up (and down) weights, whole in their fsdp dimension
    assert {"f32[16,256,64]", "f32[16,64,256]"} <= set(inside), inside
    top_level = {"f32[512,256]", "f32[256,512]"}  # embed_tokens, lm_head
    assert outside and set(outside) <= top_level, outside


@pytest.mark.slow
def test_the_pid_rules_memory_on_a_mesh_is_the_single_device_ones():
    """The PID bias rule's memory (`TrainState.bias_state`) is replicated on the mesh and
    moves as on one device: two steps, the same biases and memory."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    config = config.replace(bias_update="pid", bias_pid_ki=0.5, bias_pid_kd=0.5)
    state, ref, _ = _two_steps_on_a_mesh_and_one_device(config)
    main, ref_main = state.bias_state[0], ref.bias_state[0]
    assert main.integral.sharding.is_fully_replicated
    assert float(jnp.abs(ref_main.integral).max()) > 0
    np.testing.assert_allclose(main.integral, ref_main.integral, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(main.error, ref_main.error, rtol=RTOL, atol=ATOL)
    got = state.model.moe_layers.mlp.router.expert_bias
    np.testing.assert_allclose(got, ref.model.moe_layers.mlp.router.expert_bias, atol=1e-6)
