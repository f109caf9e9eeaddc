"""The warp-specialised Mosaic GPU grouped matmul: its tile schedule, and the kernel itself run
on the CPU through Mosaic GPU's interpreter (the H200 runs are the `gpu` tests)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mosaic_threads_compiled_once
from hypothesis import example, given
from hypothesis import strategies as st

from dropless.backends import _pallas as pallas
from dropless.backends import mosaic
from dropless.backends.mosaic import _launch, _weight_grad


@st.composite
def layouts(draw):
    tile_m = draw(st.sampled_from([8, 64, 128]))
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=12))
    if draw(st.booleans()):  # many empty groups, or all rows in one
        sizes = [s if draw(st.booleans()) else 0 for s in sizes]
    tail = draw(st.integers(0, 2 * tile_m))  # rows past the last group
    rows = -(-(sum(sizes) + tail) // tile_m) * tile_m or tile_m
    return np.array(sizes), rows, tile_m


# Compiled, a program per layout's shapes: op by op, each new shape compiles every primitive.
_tile_schedule = jax.jit(mosaic.tile_schedule, static_argnums=(1, 2))
_expert_segments = jax.jit(mosaic.expert_segments, static_argnums=(1, 2))


@pytest.mark.slow
@given(layouts())
@example((np.array([3, 0, 200, 1]), 256, 128))  # a tile moved back to end at `rows`
def test_schedule_covers_every_row_once_with_its_group(layout):
    sizes, rows, tile_m = layout
    schedule, n_items = _tile_schedule(jnp.asarray(sizes, jnp.int32), rows, tile_m)
    group, row0, first, end = np.asarray(schedule)
    row0 = row0 * mosaic.ROW_ALIGN
    n = int(n_items[0])
    assert n <= schedule.shape[1] == rows // tile_m + len(sizes) - 1
    owner = np.repeat(np.arange(len(sizes)), sizes)
    owner = np.concatenate([owner, np.full(rows - len(owner), len(sizes) - 1)])
    covered = []
    for i in range(n):
        assert 0 <= row0[i] <= rows - tile_m  # every TMA load in bounds
        assert 0 <= first[i] < end[i] <= tile_m
        rows_of_item = row0[i] + np.arange(first[i], end[i])
        assert (owner[rows_of_item] == group[i]).all()
        covered.extend(rows_of_item)
    assert covered == list(range(rows))  # each row once, in row order
    # Tiles start at their group's first row (rounded down to ROW_ALIGN): a group of n rows
    # takes ceil(n / tile_m) passes, one more at most for the rounding, never more than the
    # fixed row blocks it touches (where a block shared by two groups costs a pass for each).
    n_rows = np.bincount(owner, minlength=len(sizes))
    ends = np.cumsum(n_rows)
    starts = ends - n_rows
    passes = np.bincount(group[:n], minlength=len(sizes))
    assert (passes >= -(-n_rows // tile_m)).all()
    assert (passes <= -(-(n_rows + mosaic.ROW_ALIGN - 1) // tile_m)).all()
    blocks_touched = np.where(n_rows > 0, -(-ends // tile_m) - starts // tile_m, 0)
    assert (passes <= blocks_touched).all()


@given(layouts(), st.integers(1, 6))
@example((np.array([5, 0, 5]), 16, 8), 2)  # a group starts exactly at the share
@example((np.array([0, 0]), 8, 8), 3)  # no rows at all
def test_expert_segments_split_the_rows_at_group_starts(layout, segments):
    """The segmented weight gradient's runs of groups: they cover every group once, in order,
    and run s starts at the first group that starts at or past s / segments of the rows."""
    sizes, rows, _ = layout
    first = np.asarray(_expert_segments(jnp.asarray(sizes, jnp.int32), rows, segments))
    assert len(first) == segments + 1 and first[0] == 0 and first[-1] == len(sizes)
    assert (np.diff(first) >= 0).all()
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for s in range(1, segments):
        share = sizes.sum() * s // segments
        assert (starts[: first[s]] < share).all() and (starts[first[s] :] >= share).all()


def _interpret(monkeypatch):
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as err:
        pytest.skip(f"this jaxlib has no Mosaic GPU interpreter: {err}")
    monkeypatch.setattr(_launch, "INTERPRET", InterpretGPUParams())
    mosaic_threads_compiled_once(monkeypatch)


@pytest.mark.parametrize(
    ("chain", "tile_k", "stages"), [(False, 64, 2), (True, 64, 2), (True, 32, 4)]
)
@pytest.mark.slow
def test_kernel_equals_each_groups_matmul_in_the_interpreter(monkeypatch, chain, tile_k, stages):
    """Uneven groups, an empty one, a block shared by three groups, and rows that fill no
    whole block (the last group's weights cover them). The input-gradient form (`transpose_rhs`)
    is left to the GPU tests: the interpreter cannot run a transposed wgmma operand.
    With `chain`, the interpreter's 4 thread blocks each chain two or three pipelines; with
    32-column contractions, four stages in flight."""
    _interpret(monkeypatch)
    sizes = np.array([0, 70, 3, 0, 120])
    rows, k, n = 200, 128, 256  # two column blocks of 2 x 64
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
    config = mosaic.KernelConfig(
        tile_m=64, tile_n=64, tile_k=tile_k, max_concurrent_steps=stages, band=2, chain=chain
    )
    # Two weight sets in turn: a row the kernel forgot to store would keep whatever the
    # interpreter's output buffer held (NaN, or the first call's result), never the right value.
    for seed in (1, 2):
        w = jax.random.normal(jax.random.key(seed), (len(sizes), k, n), jnp.bfloat16)
        gs = jnp.asarray(sizes, jnp.int32)
        got = mosaic.grouped_matmul(x, w, gs, config=config)
        want = pallas.reference_op("fwd", x, w, gs)  # rows past the groups: the last group's
        assert got.shape == (rows, n) and got.dtype == jnp.bfloat16
        got, want = np.asarray(got, np.float32), np.asarray(want)
        # numpy's max, not XLA's: on the CPU XLA's max reduction skips NaN (fast min/max)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2  # bf16 output of f32 sums


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.slow
def test_swiglu_kernel_equals_the_matmul_and_its_swiglu_in_the_interpreter(monkeypatch, scaled):
    """`grouped_matmul_swiglu` on uneven groups (an empty one, a block shared by three): the
    gate-and-up output equals the plain product with the interleaved weights, and the hidden
    output equals silu(gate) * up of the rounded gate and up, in the hidden units' order
    (times each row's scale, `scaled`: 200 rows, so the last tile's TMA copy of scales is
    of padding rows)."""
    _interpret(monkeypatch)
    sizes = np.array([0, 70, 3, 0, 120])
    rows, k, hidden = 200, 128, 128
    config = mosaic.KernelConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, band=2)
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    # two calls: a row or column left unstored keeps the first call's value (one with the
    # scale, whose stores are the same code; the interpreter takes ~3 s a call)
    for seed in (1,) if scaled else (1, 2):
        keys = jax.random.split(jax.random.key(seed))
        w_gate, w_up = (
            (jax.random.normal(key, (5, k, hidden)) / 8).astype(jnp.bfloat16) for key in keys
        )
        w = mosaic.interleave_gate_up(w_gate, w_up, config)
        scale = jax.random.uniform(jax.random.key(seed + 2), (rows,), minval=0.1, maxval=2.0)
        row_scale = scale if scaled else None
        gate_up, h = mosaic.grouped_matmul_swiglu(x, w, gs, row_scale=row_scale, config=config)
        assert gate_up.shape == (rows, 2 * hidden) and h.shape == (rows, hidden)
        want = np.asarray(pallas.reference_op("fwd", x, w, gs))
        got = np.asarray(gate_up, np.float32)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
        plain = pallas.reference_op("fwd", x, jnp.concatenate([w_gate, w_up], -1), gs)
        gate, up = np.split(np.asarray(plain.astype(jnp.bfloat16), np.float32), 2, axis=-1)
        want_h = gate / (1 + np.exp(-gate)) * up * (np.asarray(scale)[:, None] if scaled else 1)
        got_h = np.asarray(h, np.float32)
        assert np.abs(got_h - want_h).max() / np.abs(want_h).max() < 1e-2


def test_interleave_gate_up_alternates_blocks_of_half_a_tile_and_splits_back():
    config = mosaic.KernelConfig(tile_n=4)
    w_gate = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 2, 8)
    w_up = -w_gate
    w = mosaic.interleave_gate_up(w_gate, w_up, config)
    np.testing.assert_array_equal(
        w[0, 1], [8, 9, -8, -9, 10, 11, -10, -11, 12, 13, -12, -13, 14, 15, -14, -15]
    )
    gate, up = mosaic.split_gate_up(w, config)  # the inverse
    np.testing.assert_array_equal(gate, w_gate)
    np.testing.assert_array_equal(up, w_up)
    with pytest.raises(ValueError, match="hidden=7 must be a multiple of 2"):
        mosaic.interleave_gate_up(jnp.zeros((2, 7)), jnp.zeros((2, 7)), config)
    with pytest.raises(ValueError, match="hidden=7 must be a multiple of 2"):
        mosaic.split_gate_up(jnp.zeros((2, 14)), config)


def test_a_single_chained_pipeline_runs_unchained(monkeypatch):
    """One row block and one column block: one thread block has a single pipeline, which
    must both start and stop the chain (the others have none)."""
    _interpret(monkeypatch)
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (2, 128, 128), jnp.bfloat16)
    gs = jnp.asarray([40, 24], jnp.int32)
    config = mosaic.KernelConfig(tile_m=64, tile_n=64, max_concurrent_steps=2, chain=True)
    got = np.asarray(mosaic.grouped_matmul(x, w, gs, config=config), np.float32)
    want = np.asarray(pallas.reference_op("fwd", x, w, gs))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


def test_matmul_fits_says_which_widths_and_chains_run():
    chained = mosaic.KernelConfig(max_concurrent_steps=3, chain=True)
    assert mosaic.matmul_fits(7168, 2048)
    assert not mosaic.matmul_fits(100, 256)  # k: 64-row steps
    assert not mosaic.matmul_fits(256, 384, mosaic.KernelConfig())  # n: 2 x 128 columns
    assert not mosaic.matmul_fits(256, 256, chained)  # 4 steps, 3 stages
    assert mosaic.matmul_fits(192, 256, chained)  # 3 steps


def test_chain_needs_the_stages_to_divide_the_steps():
    config = mosaic.KernelConfig(max_concurrent_steps=3, chain=True)
    w = jnp.zeros((2, 256, 256), jnp.bfloat16)  # k / tile_k = 4 steps
    with pytest.raises(ValueError, match="max_concurrent_steps=3 to divide the k / tile_k = 4"):
        mosaic.grouped_matmul(
            jnp.zeros((16, 256), jnp.bfloat16), w, jnp.array([8, 8]), config=config
        )


@pytest.mark.parametrize(
    ("k", "n", "transpose", "named"),
    [(100, 256, False, "k=100 must be a multiple of 64"), (128, 200, True, "n=200")],
)
def test_widths_the_tiles_do_not_divide_are_named(k, n, transpose, named):
    x = jnp.zeros((16, k), jnp.bfloat16)
    w = jnp.zeros((2, n, k) if transpose else (2, k, n), jnp.bfloat16)
    with pytest.raises(ValueError, match=named):
        mosaic.grouped_matmul(x, w, jnp.array([8, 8]), transpose_rhs=transpose)


def test_zero_rows_and_mixed_dtypes():
    w = jnp.zeros((2, 128, 256), jnp.bfloat16)
    out = mosaic.grouped_matmul(jnp.zeros((0, 128), jnp.bfloat16), w, jnp.array([0, 0]))
    assert out.shape == (0, 256)
    grads = mosaic.grouped_weight_grad(
        jnp.zeros((0, 256), jnp.bfloat16), jnp.zeros((0, 128), jnp.bfloat16), jnp.array([0, 0])
    )
    assert grads.shape == (2, 256, 128) and not grads.any()
    with pytest.raises(ValueError, match="share a 16-bit float dtype"):
        mosaic.grouped_matmul(jnp.zeros((8, 128)), w, jnp.array([4, 4]))


def test_output_width_picks_the_tiles():
    assert mosaic.config_for(2048) == mosaic.KernelConfig()
    assert mosaic.config_for(384).tile_n == 64
    with pytest.raises(ValueError, match="tile_m=96 must be a power of two"):
        mosaic.KernelConfig(tile_m=96)


@pytest.mark.parametrize(
    ("rows", "groups", "segmented", "runs"),
    [
        (256 * 256, 256, True, 16),
        (512 * 64, 64, True, 8),
        (513 * 64, 64, False, None),
        (2048 * 8, 8, False, None),
        (1000, 16, True, 1),
        (64 * 64 * 6, 64, True, 4),  # 6 runs of 64 chunks round down to 4
    ],
)
def test_small_experts_take_the_segmented_weight_gradient(
    monkeypatch, rows, groups, segmented, runs
):
    """Experts averaging at most 512 rows get runs of 64 chunks, in a power-of-two count of at
    most one per expert; bigger experts one pipeline each. (The launchers are replaced by spies:
    the kernels run on the GPU.)"""
    launched = []
    out = jnp.zeros((groups, 256, 128), jnp.bfloat16)

    def in_runs(bounds, first_groups, *_):
        launched.append(("runs", first_groups.shape[0] - 1))
        return out

    monkeypatch.setattr(_weight_grad, "_launch_segmented_weight_grad", in_runs)
    monkeypatch.setattr(
        _weight_grad,
        "_launch_weight_grad",
        lambda *_: launched.append(("per expert", None)) or out,
    )
    x = jnp.zeros((rows, 256), jnp.bfloat16)
    g = jnp.zeros((rows, 128), jnp.bfloat16)
    mosaic.grouped_weight_grad(x, g, jnp.full(groups, rows // groups, jnp.int32))
    assert launched == [("runs", runs) if segmented else ("per expert", None)]
    with pytest.raises(ValueError, match="segment_steps=0 must be None or >= 1"):
        mosaic.WeightGradConfig(segment_steps=0)


@pytest.mark.parametrize(
    "kernel",
    ["fwd", "dgrad", "fwd+swiglu", "fwd+swiglu scaled", "wgrad per expert", "wgrad in runs"],
)
def test_kernels_lower_for_cuda_on_the_cpu(kernel, lowered):
    """Each kernel goes through Mosaic GPU's lowering (layouts, allocations) into one custom
    call: the part of a GPU run that a CPU can check. What it computes is the GPU tests'."""
    x = jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((16,), jnp.int32)
    if kernel.startswith("fwd+swiglu"):
        w = jax.ShapeDtypeStruct((16, 512, 512), jnp.bfloat16)
        scale = jax.ShapeDtypeStruct((1000,), jnp.float32)
        text = lowered(
            lambda a, b, s, r: mosaic.grouped_matmul_swiglu(
                a, b, s, row_scale=r if kernel.endswith("scaled") else None
            ),
            x,
            w,
            sizes,
            scale,
            platform="cuda",
        )
    elif kernel in ("fwd", "dgrad"):
        w = jax.ShapeDtypeStruct((16, 512, 512), jnp.bfloat16)
        dgrad = kernel == "dgrad"
        text = lowered(
            lambda a, b, s: mosaic.grouped_matmul(a, b, s, transpose_rhs=dgrad),
            x,
            w,
            sizes,
            platform="cuda",
        )
    else:
        g = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16)
        steps = 64 if kernel == "wgrad in runs" else None
        config = mosaic.WeightGradConfig(segment_steps=steps)
        text = lowered(
            lambda a, b, s: mosaic.grouped_weight_grad(a, b, s, config=config),
            x,
            g,
            sizes,
            platform="cuda",
        )
    assert text.count("custom_call @mosaic_gpu") == 1


def test_a_layout_mosaic_cannot_take_fails_when_lowering_on_the_cpu(lowered):
    """32-row weight-gradient chunks: the mask's row index cannot take the WGMMA layout. On the
    H200 this failed a tile search; lowering on the CPU finds it first."""
    x = jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((16,), jnp.int32)
    config = mosaic.WeightGradConfig(tile_k=32)
    with pytest.raises(ValueError, match="Cannot cast to layout"):
        lowered(
            lambda a, b, s: mosaic.grouped_weight_grad(a, b, s, config=config),
            x,
            g,
            sizes,
            platform="cuda",
        )


@pytest.mark.parametrize("scaled", [False, True])
def test_swiglu_grad_interleaved_equals_autodiff_of_the_split_halves(scaled):
    """The one-pass gradient in the interleaved layout against jax.vjp of
    silu(gate) * up (* scale per row, `scaled`) on the halves `split_gate_up` gives,
    interleaved again (fails if gate and up swap roles), and the scale's gradient."""
    config = mosaic.KernelConfig(tile_n=64)
    keys = jax.random.split(jax.random.key(3), 3)
    gate_up = 3.0 * jax.random.normal(keys[0], (40, 256), jnp.float32)
    d_hidden = jax.random.normal(keys[1], (40, 128), jnp.float32)
    scale = jax.random.uniform(keys[2], (40,), minval=0.1, maxval=2.0)
    gate, up = mosaic.split_gate_up(gate_up, config)
    _, vjp = jax.vjp(lambda g, u, s: jax.nn.silu(g) * u * s[:, None], gate, up, scale)
    d_gate, d_up, want_d_scale = vjp(d_hidden)
    if not scaled:
        _, vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, gate, up)
        d_gate, d_up = vjp(d_hidden)
    want = mosaic.interleave_gate_up(d_gate, d_up, config)
    got, d_scale = mosaic.swiglu_grad_interleaved(
        gate_up, d_hidden, config, row_scale=scale if scaled else None
    )
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if scaled:
        np.testing.assert_allclose(d_scale, want_d_scale, rtol=1e-5, atol=1e-5)
    else:
        assert d_scale is None


def test_a_row_scale_of_the_wrong_length_is_named(unchecked):
    """The function's own check, past the tests' type checks (which would object first)."""
    w = jnp.zeros((2, 128, 256), jnp.bfloat16)
    call = unchecked(mosaic.grouped_matmul_swiglu)
    with pytest.raises(ValueError, match=r"row_scale has shape \(15,\), want \(16,\)"):
        call(jnp.zeros((16, 128), jnp.bfloat16), w, jnp.array([8, 8]), row_scale=jnp.ones(15))
