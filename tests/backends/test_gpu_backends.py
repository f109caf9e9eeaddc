"""GPU stages (Transformer Engine, Pallas Mosaic GPU) against the jnp stages and the oracle.

Marked `gpu`: skipped without a GPU; each test also skips when its library does not load.
Tolerances: bf16 operands -> relative (Frobenius) error <= 1e-2 against an fp32 oracle on the
same bf16-rounded inputs.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_backends, gpu_grouped_matmuls

from dropless import JnpTopK, MoE, RoutingSpec
from dropless.backends import (
    AutoBackend,
    Backend,
    BackendUnavailableError,
    OneHotGroupedMatmul,
    SortDispatcher,
    jnp_capacity_backend,
    oracle_moe,
    with_backend,
)
from dropless.train import get_backend

pytestmark = pytest.mark.gpu
BF16 = 1e-2


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def load(what):
    try:
        if what == "te":
            from dropless.backends import _te as te

            te.load_te()
            return te
        from dropless.backends import _pallas as pallas

        pallas.load_kernels()
        return pallas
    except BackendUnavailableError as err:
        pytest.skip(str(err))


def group_sizes(kind, rows, e, seed):
    rng = np.random.default_rng(seed)
    if kind == "balanced":
        sizes = np.full(e, rows // e)
        sizes[0] += rows - sizes.sum()
    elif kind == "one_expert":
        sizes = np.zeros(e, int)
        sizes[e // 2] = rows
    else:  # skewed with empty experts
        p = rng.dirichlet(np.ones(e) * 0.3)
        p[: e // 4] = 0
        sizes = rng.multinomial(rows, p / p.sum())
    return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("gmm", gpu_grouped_matmuls())
@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert"])
@pytest.mark.parametrize("e", [8, 64])
def test_grouped_matmul_equals_oracle(gmm, kind, e):
    rows, k, n = 2048, 256, 512
    k1, k2, k3 = jax.random.split(jax.random.key(e), 3)
    lhs = jax.random.normal(k1, (rows, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n)) / k**0.5).astype(jnp.bfloat16)
    probe = jax.random.normal(k3, (rows, n), jnp.float32)
    sizes = group_sizes(kind, rows, e, seed=e)

    def loss(f, lhs, rhs):
        return jnp.sum(f(lhs, rhs, sizes).astype(jnp.float32) * probe)

    oracle = OneHotGroupedMatmul()
    f32 = (lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert rel_err(jax.jit(gmm)(lhs, rhs, sizes), oracle(*f32, sizes)) < BF16
    grads = jax.jit(jax.grad(lambda a, b: loss(gmm, a, b), argnums=(0, 1)))(lhs, rhs)
    ref = jax.grad(lambda a, b: loss(oracle, a, b), argnums=(0, 1))(*f32)
    for g, r in zip(grads, ref, strict=True):
        assert rel_err(g, r) < BF16


SPECS = [
    RoutingSpec(
        64, 8, "sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5, use_expert_bias=True
    ),
    RoutingSpec(16, 2, "softmax", norm_topk_prob=False),
    RoutingSpec(16, 4, "softmax", softmax_before_topk=False),
    RoutingSpec(32, 4, "sqrtsoftplus", n_group=4, topk_group=2),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.scoring_func}-{s.n_routed_experts}")
def test_te_topk_equals_jnp(spec):
    te = load("te")
    logits = jax.random.normal(jax.random.key(0), (512, spec.n_routed_experts)) * 2
    bias = (
        jax.random.normal(jax.random.key(1), (spec.n_routed_experts,)) * 0.1
        if spec.use_expert_bias
        else None
    )
    ours, theirs = JnpTopK()(logits, bias, spec), te.TETopK()(logits, bias, spec)
    np.testing.assert_array_equal(np.sort(ours.expert_ids, -1), np.asarray(theirs.expert_ids))
    order = np.argsort(np.asarray(ours.expert_ids), -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(ours.weights), order, -1),
        theirs.weights,
        rtol=1e-5,
        atol=1e-6,
    )
    probe = jax.random.normal(jax.random.key(2), (512, spec.num_experts_per_tok))

    def weight_loss(topk, logits):
        r = topk(logits, bias, spec)
        dense = jnp.einsum(
            "tke,tk->te", jax.nn.one_hot(r.expert_ids, spec.n_routed_experts), r.weights
        )
        return jnp.sum(
            dense * jnp.tile(probe, (1, spec.n_routed_experts // spec.num_experts_per_tok))
        )

    g_ours = jax.grad(lambda z: weight_loss(JnpTopK(), z))(logits)
    g_te = jax.grad(lambda z: weight_loss(te.TETopK(), z))(logits)
    np.testing.assert_allclose(g_te, g_ours, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("adversarial", ["none", "one_expert"])
def test_te_dispatcher_equals_sort(adversarial):
    te = load("te")
    spec = RoutingSpec(32, 4, "sigmoid")
    logits = jax.random.normal(jax.random.key(0), (256, 32))
    if adversarial == "one_expert":
        logits = logits.at[:, 5].add(100.0)
    routing = JnpTopK()(logits, None, spec)
    x = jax.random.normal(jax.random.key(1), (256, 64))
    scale = jax.random.normal(jax.random.key(2), (64,))

    def run(disp, x):
        d = disp.dispatch(x, routing)
        return disp.combine(d.rows * scale, d, routing), d.group_sizes

    (y_te, gs_te), (y_ref, gs_ref) = run(te.TEDispatcher(), x), run(SortDispatcher(), x)
    np.testing.assert_array_equal(gs_te, gs_ref)
    np.testing.assert_allclose(y_te, y_ref, rtol=1e-5, atol=1e-5)
    g_te = jax.grad(lambda x: run(te.TEDispatcher(), x)[0].sum())(x)
    g_ref = jax.grad(lambda x: run(SortDispatcher(), x)[0].sum())(x)
    np.testing.assert_allclose(g_te, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", gpu_backends())
def test_moe_layer_equals_oracle(backend):
    spec = SPECS[0]
    moe = MoE(256, 128, spec, n_shared_experts=1, key=jax.random.key(0))
    _check_layer_against_oracle(with_backend(moe, backend))


@pytest.mark.parametrize("fused_swiglu", [False, True])
def test_pallas_moe_layer_with_weights_before_down_equals_oracle(fused_swiglu):
    """`MoE(weights_before_down=True)` on our kernels, with and without the fused SwiGLU (which
    scales in its epilogue)."""
    from dropless.backends import PallasGroupedMatmul

    load("pallas")
    moe = MoE(
        256, 128, SPECS[0], n_shared_experts=1, weights_before_down=True, key=jax.random.key(0)
    )
    gmm = PallasGroupedMatmul(fused_swiglu=fused_swiglu)
    _check_layer_against_oracle(with_backend(moe, Backend(dispatcher=SortDispatcher(), gmm=gmm)))


@pytest.mark.parametrize("dims", [(256, 128), (192, 96)], ids=["tileable", "untileable"])
def test_auto_on_hopper_is_pallas_and_matches_the_oracle(dims):
    """'auto' on a Hopper GPU: our kernels, and jnp-capacity for widths they cannot tile."""
    from dropless.backends._backend import is_hopper

    if not is_hopper():
        pytest.skip("not a Hopper GPU")
    pallas = load("pallas")
    assert type(get_backend("auto").gmm) is pallas.PallasGroupedMatmul
    moe = MoE(*dims, SPECS[0], n_shared_experts=1, key=jax.random.key(0))
    _check_layer_against_oracle(with_backend(moe, AutoBackend()))


def _check_layer_against_oracle(moe):
    x = jax.random.normal(jax.random.key(1), (1024, moe.router.w_router.shape[1]), jnp.bfloat16)
    y = eqx.filter_jit(lambda m, x: m(x)[0])(moe, x)
    ref = eqx.filter_jit(oracle_moe)(moe, x.astype(jnp.float32))
    assert rel_err(y, ref) < BF16

    def loss(m, x, f):
        return jnp.sum(f(m, x).astype(jnp.float32) ** 2)

    g = eqx.filter_jit(eqx.filter_grad(loss))(moe, x, lambda m, x: m(x)[0])
    g_ref = eqx.filter_jit(eqx.filter_grad(loss))(moe, x.astype(jnp.float32), oracle_moe)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert rel_err(a, b) < 2 * BF16  # bf16 activations feed the weight gradients too


def _tiled_shapes():
    from dropless.backends import _pallas as pallas

    widths = {(1024, 512), (512, 1024), (7168, 2048), (2048, 7168), (256, 512)}
    return sorted(
        {(op, k, n) for op in ("fwd", "dgrad", "wgrad") for k, n in widths} | set(pallas.TUNED)
    )


@pytest.mark.parametrize("key", _tiled_shapes(), ids=lambda k: f"{k[0]}-{k[1]}x{k[2]}")
@pytest.mark.parametrize("kind", ["skewed", "one_expert"])
def test_pallas_tiles_are_exact(key, kind):
    """The tiles of JAX's kernels (the weight gradient's fallback, and tune_pallas.py's search)
    for each shape, tuned or default, compute their operation exactly on uneven and empty
    groups. (Tilings searched on balanced groups failed this.)"""
    pallas = load("pallas")
    op, k, n = key
    e, rows = 16, 1000  # a row count that fits no tile evenly
    sizes = group_sizes(kind, rows, e, seed=k + n)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (e, k, n), jnp.bfloat16)
    g = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)
    args = {"fwd": (x, w), "dgrad": (g, w), "wgrad": (x, g)}[op]
    got = pallas.run_op(op, *args, sizes, pallas.block_config(op, k, n))
    assert rel_err(got, pallas.reference_op(op, *args, sizes)) <= BF16


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("layout", ["skewed", "one_expert", "short", "trailing_empty"])
def test_mosaic_kernels_are_exact(op, layout):
    """Our kernels (the default `pallas` strategy's), each alone: 1000 rows fill no whole row
    tile; "short" leaves rows past the last group (zero input there, which the weight gradient
    ignores); "trailing_empty" ends on empty experts with a whole number of 64-row chunks, so
    their weight-gradient chunk would start at the end of the array without the clamp."""
    pallas = load("pallas")
    from dropless.backends import mosaic

    e, rows, k, n = 16, 1000, 512, 256
    if layout in ("skewed", "one_expert"):
        sizes = group_sizes(layout, rows, e, seed=3)
    elif layout == "short":
        sizes = group_sizes("skewed", rows - 37, e, seed=4)
    else:
        rows = 1024
        sizes = jnp.asarray([rows // 4] * 4 + [0] * (e - 4), jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    live = (jnp.arange(rows) < sizes.sum())[:, None]
    x = jnp.where(live, jax.random.normal(keys[0], (rows, k)), 0).astype(jnp.bfloat16)
    g = jnp.where(live, jax.random.normal(keys[2], (rows, n)), 0).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (e, k, n), jnp.bfloat16)
    if op == "fwd":
        args, got = (x, w), mosaic.grouped_matmul(x, w, sizes)
    elif op == "dgrad":
        args, got = (g, w), mosaic.grouped_matmul(g, w, sizes, transpose_rhs=True)
    else:
        args, got = (x, g), mosaic.grouped_weight_grad(x, g, sizes)
    assert rel_err(got, pallas.reference_op(op, *args, sizes)) <= BF16


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("layout", ["skewed", "one_expert", "short"])
@pytest.mark.parametrize("columns", [128, 64])
def test_chained_mosaic_kernel_is_exact(op, layout, columns):
    """`KernelConfig(chain=True)`: each thread block chains the pipelines of its row blocks.
    4000 rows and 1024 columns give more tiles than the H200 has SMs (132), so blocks run
    chains of two or three pipelines, and some a single one."""
    pallas = load("pallas")
    from dropless.backends import mosaic

    e, rows, k, n = 16, 4000, 512, 1024
    live_rows = rows - 37 if layout == "short" else rows  # "short": rows past the groups
    sizes = group_sizes("skewed" if layout == "short" else layout, live_rows, e, seed=5)
    stages = 4 if columns == 64 else 2
    config = mosaic.KernelConfig(tile_n=columns, max_concurrent_steps=stages, chain=True)
    keys = jax.random.split(jax.random.key(1), 3)
    live = (jnp.arange(rows) < sizes.sum())[:, None]
    x = jnp.where(live, jax.random.normal(keys[0], (rows, k)), 0).astype(jnp.bfloat16)
    g = jnp.where(live, jax.random.normal(keys[2], (rows, n)), 0).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (e, k, n), jnp.bfloat16)
    args = (x, w) if op == "fwd" else (g, w)
    got = mosaic.grouped_matmul(*args, sizes, transpose_rhs=op == "dgrad", config=config)
    want = pallas.reference_op(op, *args, sizes)  # rows past the groups are unspecified
    assert rel_err(got[:live_rows], want[:live_rows]) <= BF16


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("layout", ["skewed", "one_expert", "short"])
def test_mosaic_swiglu_kernel_is_exact(layout, scaled):
    """`grouped_matmul_swiglu` (the SwiGLU in the epilogue): the gate-and-up output equals
    the plain product with the interleaved weights, the hidden output silu(gate) * up of the
    rounded gate and up (times the rows' scales, `scaled`); 4000 rows so that thread blocks
    take several tiles."""
    pallas = load("pallas")
    from dropless.backends import mosaic

    e, rows, k, hidden = 16, 4000, 512, 512
    live_rows = rows - 37 if layout == "short" else rows
    sizes = group_sizes("skewed" if layout == "short" else layout, live_rows, e, seed=6)
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w_gate, w_up = (
        (jax.random.normal(key, (e, k, hidden)) / k**0.5).astype(jnp.bfloat16) for key in keys[1:]
    )
    w = mosaic.interleave_gate_up(w_gate, w_up)
    scale = jax.random.uniform(jax.random.key(3), (rows,), minval=0.1, maxval=2.0)
    gate_up, h = mosaic.grouped_matmul_swiglu(x, w, sizes, row_scale=scale if scaled else None)
    want = pallas.reference_op("fwd", x, w, sizes)
    assert rel_err(gate_up[:live_rows], want[:live_rows]) <= BF16
    plain = pallas.reference_op("fwd", x, jnp.concatenate([w_gate, w_up], -1), sizes)
    gate, up = jnp.split(plain.astype(jnp.bfloat16).astype(jnp.float32), 2, axis=-1)
    want_h = jax.nn.silu(gate) * up * (scale[:, None] if scaled else 1.0)
    assert rel_err(h[:live_rows], want_h[:live_rows]) <= BF16


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("layout", ["skewed", "one_expert"])
def test_pallas_fused_swiglu_equals_the_plain_strategy(layout, scaled):
    """`PallasGroupedMatmul(fused_swiglu=True)` against the plain strategy (matmul, then XLA's
    SwiGLU): value and gradients of the rows and both weights (and of the rows' scales,
    `scaled`), at proxy-2b's widths."""
    pallas = load("pallas")
    e, rows, dim, hidden = 16, 4000, 1024, 512
    sizes = group_sizes(layout, rows, e, seed=8)
    keys = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(keys[0], (rows, dim), jnp.bfloat16)
    w_gate, w_up = (jax.random.normal(k, (e, dim, hidden)) / dim**0.5 for k in keys[1:3])
    d_hidden = jax.random.normal(keys[3], (rows, hidden))
    scale = jax.random.uniform(keys[4], (rows,), minval=0.1, maxval=2.0)

    def loss(strategy, x, w_gate, w_up, scale):
        row_scale = scale if scaled else None
        hidden_rows = strategy.gate_up_swiglu(x, w_gate, w_up, sizes, row_scale=row_scale)
        return jnp.sum(hidden_rows.astype(jnp.float32) * d_hidden)

    grads = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4)), static_argnums=0)
    got = grads(pallas.PallasGroupedMatmul(fused_swiglu=True), x, w_gate, w_up, scale)
    want = grads(pallas.PallasGroupedMatmul(), x, w_gate, w_up, scale)
    assert (jnp.abs(want[1][3]).sum() > 0) == scaled
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(a, b) <= BF16


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("chain", [False, True])
def test_mosaic_kernel_with_32_column_contractions_is_exact(op, chain):
    """tune_mosaic's short-contraction candidates: contractions of 32 columns, four stages."""
    pallas = load("pallas")
    from dropless.backends import mosaic

    e, rows, k, n = 16, 4000, 512, 1024
    sizes = group_sizes("skewed", rows, e, seed=7)
    config = mosaic.KernelConfig(tile_k=32, max_concurrent_steps=4, chain=chain)
    keys = jax.random.split(jax.random.key(3), 2)
    w = jax.random.normal(keys[1], (e, k, n), jnp.bfloat16)
    a = jax.random.normal(keys[0], (rows, k if op == "fwd" else n), jnp.bfloat16)
    got = mosaic.grouped_matmul(a, w, sizes, transpose_rhs=op == "dgrad", config=config)
    assert rel_err(got, pallas.reference_op(op, a, w, sizes)) <= BF16


@pytest.mark.parametrize("layout", ["skewed", "one_expert", "short", "many_small", "all_empty"])
@pytest.mark.parametrize("segment_steps", [None, 1, 4, 64])
def test_segmented_weight_grad_is_exact(layout, segment_steps):
    """`WeightGradConfig(segment_steps=...)`: one pipeline walks a run of experts and stores
    each expert's tile when its rows end (None: one pipeline per expert). Checked expert by
    expert, so a tile stored to the wrong expert or an accumulator not cleared between experts
    cannot hide in a norm; empty experts must come out exactly zero. Rows past the groups hold
    random values ("short", "all_empty"): the kernel must not read them into any expert."""
    pallas = load("pallas")
    from dropless.backends import mosaic

    rows, k, n = 4000, 512, 256
    e = 64 if layout == "many_small" else 16
    if layout == "all_empty":
        sizes = jnp.zeros(e, jnp.int32)
    elif layout == "many_small":  # 0-119 rows each, a few empty: straddled chunks everywhere
        sizes = np.random.default_rng(7).integers(0, 120, e)
        sizes[::9] = 0
        sizes = jnp.asarray(sizes, jnp.int32)
    else:
        live_rows = rows - 333 if layout == "short" else rows
        sizes = group_sizes("skewed" if layout == "short" else layout, live_rows, e, seed=6)
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    g = jax.random.normal(keys[1], (rows, n), jnp.bfloat16)
    config = mosaic.WeightGradConfig(segment_steps=segment_steps)
    got = np.asarray(mosaic.grouped_weight_grad(x, g, sizes, config=config), np.float32)
    live = jnp.arange(rows)[:, None] < sizes.sum()  # the reference gives the rest to the last
    want = np.asarray(pallas.reference_op("wgrad", jnp.where(live, x, 0), g, sizes), np.float32)
    for expert, size in enumerate(np.asarray(sizes)):
        if size == 0:
            assert (got[expert] == 0).all(), f"expert {expert} is empty"
        else:
            assert rel_err(got[expert], want[expert]) <= BF16, f"expert {expert}, {size} rows"


def _stage_mix(name):
    """The bundle of a backend's name, or one TE stage inside jnp-capacity's bundle (to find
    which stage of an all-TE bundle goes wrong): "te-dispatch" or "te-topk"."""
    from dropless.backends import Backend, CapacityGroupedMatmul

    module = load("pallas" if name == "pallas" else "te")
    if name == "te-dispatch":
        return Backend(module.TEDispatcher(), CapacityGroupedMatmul(), JnpTopK())
    if name == "te-topk":
        return Backend(SortDispatcher(), CapacityGroupedMatmul(), module.TETopK())
    return get_backend(name)


SCAN_BUG = pytest.mark.xfail(
    strict=True,
    reason="TE 2.20.2's token_dispatch/token_combine: wrong gradients inside lax.scan "
    "(H200, 2026-12-03; test_te_dispatcher_under_scan)",
)
STAGE_MIXES = [
    "te",
    "te-gmm",
    "pallas",
    pytest.param("te-dispatch", marks=SCAN_BUG),
    "te-topk",
]


def _proxy(layers=3):
    from dropless.models.deepseek_v3 import get_preset

    config = get_preset("proxy-2b", compute_dtype="bfloat16", num_hidden_layers=layers)
    tokens = jax.random.randint(jax.random.key(1), (2, 1025), 0, config.vocab_size)
    return config, tokens


def _model_gradients(model, tokens):
    from dropless.train import TrainConfig
    from dropless.train.step import loss_terms, total_loss
    from dropless.train.step._step import hparams

    weights = hparams(TrainConfig())

    @eqx.filter_jit
    def grads(m):
        return eqx.filter_grad(lambda m: total_loss(loss_terms(m, tokens)[0], weights))(m)

    return grads(model)


@functools.cache
def _reference_gradients():
    from dropless.models.deepseek_v3 import DeepSeekV3

    config, tokens = _proxy()
    model = DeepSeekV3(config, backend=get_backend("jnp-capacity"), key=jax.random.key(0))
    return model, tokens, _model_gradients(model, tokens)


@pytest.mark.parametrize("backend", STAGE_MIXES)
def test_model_gradients_match_jnp_capacity(backend):
    """The gradient of the training loss of a 3-layer proxy-2b (bf16) w.r.t. every parameter,
    leaf by leaf, against jnp-capacity's on the same weights and batch."""
    bundle = _stage_mix(backend)
    model, tokens, want = _reference_gradients()
    got = _model_gradients(with_backend(model, bundle), tokens)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    worst = sorted(zip(errs, paths, strict=True), reverse=True)[:5]
    # 5 x the one-op bound: both sides round to bf16 after every op, through three layers and
    # two heads, and the differences compound (the one-layer tests above hold BF16)
    assert max(errs) < 5 * BF16, f"largest relative gradient errors: {worst}"


@pytest.mark.parametrize("backend", ["te-dispatch", "te-topk", "te-gmm"])
def test_te_stages_are_repeatable(backend):
    """The same inputs give bit-identical outputs and gradients, also after the device memory
    the stages will reuse was filled with NaNs (a kernel that reads an output buffer it did not
    initialise shows up here)."""
    bundle = _stage_mix(backend)
    spec = SPECS[0]
    moe = with_backend(MoE(256, 128, spec, n_shared_experts=1, key=jax.random.key(0)), bundle)
    x = jax.random.normal(jax.random.key(1), (1024, 256), jnp.bfloat16)

    @eqx.filter_jit
    def run(m, x):
        def loss(mx):
            m, x = mx
            return jnp.sum(m(x)[0].astype(jnp.float32) ** 2)

        return eqx.filter_value_and_grad(loss)((m, x))

    first = jax.tree.map(np.asarray, run(moe, x))
    for _ in range(3):
        jnp.full((1 << 26,), jnp.nan, jnp.float32).block_until_ready()
        again = jax.tree.map(np.asarray, run(moe, x))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", STAGE_MIXES)
def test_training_steps_track_jnp_capacity(backend):
    """Four optimiser steps of a 3-layer proxy-2b give jnp-capacity's losses within bf16 noise
    (2%; on CPU jnp and jnp-capacity differ by 0.02%, on the H200 pallas and jnp-capacity by
    0.3% on the full proxy-2b). Written after the all-TE bundle (TE's permutation included)
    reached loss 13.0 on proxy-2b in 4 steps where pallas and jnp-capacity reached 9.1
    (H200, 2026-12-02)."""
    _stage_mix(backend)  # skips when its library does not load
    want, got = _training_losses("jnp-capacity"), _training_losses(backend)
    assert want[-1] < want[0] - 0.3  # the reference run does learn
    np.testing.assert_allclose(got, want, rtol=0.02)


@functools.cache
def _training_losses(backend):
    from dropless.models.deepseek_v3 import DeepSeekV3
    from dropless.train import TrainConfig, init_state, train_step

    config, tokens = _proxy()
    bundle = backend if backend == "jnp-capacity" else _stage_mix(backend)
    model = DeepSeekV3(config, backend=get_backend(bundle), key=jax.random.key(0))
    state = init_state(model, TrainConfig(steps=100, warmup_steps=10))
    out = []
    for _ in range(4):
        state, metrics = train_step(state, tokens)
        out.append(float(metrics["loss"]))
    return np.array(out)


@SCAN_BUG
def test_te_dispatcher_under_scan():
    """TEDispatcher in two scanned MoE layers of proxy-2b's shape: gradients against
    jnp-capacity's. (In one unscanned layer they agree to 1e-5 in float32, 1e-2 in bf16.)"""
    from dropless.models.deepseek_v3 import get_preset

    bundle = _stage_mix("te-dispatch")
    spec = get_preset("proxy-2b").routing_spec()
    keys = jax.random.split(jax.random.key(0), 2)
    stack = eqx.filter_vmap(lambda k: MoE(1024, 512, spec, n_shared_experts=1, key=k))(keys)
    x = jax.random.normal(jax.random.key(1), (2048, 1024), jnp.bfloat16)

    def loss(m, x):
        params, static = eqx.partition(m, eqx.is_array)

        def body(h, p):
            return h + eqx.combine(p, static)(h)[0].astype(h.dtype), None

        return jnp.sum(jax.lax.scan(body, x, params)[0].astype(jnp.float32) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    want = grad(with_backend(stack, jnp_capacity_backend()), x)
    got = grad(with_backend(stack, bundle), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(a, b) < 5 * BF16  # two bf16 layers compound (see the docstring)
