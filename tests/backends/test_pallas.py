"""The Pallas backend's tile table (CPU-checkable parts; the kernels are tested under `gpu`)."""

import json
import re

import pytest

from dropless.backends import _pallas as pallas


def test_untuned_shape_gets_the_default_tiles():
    assert pallas.block_config("fwd", 7 * 128, 3 * 128) == pallas.BlockConfig()


@pytest.mark.parametrize(
    ("op", "in_width", "out_width", "named"),
    [
        ("fwd", 100, 128, "block_k=64"),  # contracts the input width
        ("fwd", 128, 100, "block_n*grid_block_n=128"),
        ("dgrad", 128, 100, "block_k=64"),  # contracts the output width
        ("dgrad", 100, 128, "block_n*grid_block_n=128"),
        ("wgrad", 100, 128, "block_m=128"),
        ("wgrad", 128, 100, "block_n=128"),
    ],
)
def test_widths_that_tiles_do_not_divide_are_named(op, in_width, out_width, named):
    with pytest.raises(
        ValueError, match=rf"\({op}, widths {in_width} -> {out_width}\).*{re.escape(named)}"
    ):
        pallas.block_config(op, in_width, out_width)


def test_tuned_entries_divide_their_shapes():
    for (op, in_width, out_width), cfg in pallas.TUNED.items():
        pallas.check_divides(op, cfg, in_width, out_width)


def test_a_tiles_file_overrides_the_table(tmp_path):
    path = tmp_path / "tiles.json"
    entry = {"op": "dgrad", "in": 384, "out": 256, "block_m": 64, "block_n": 128}
    entry |= {"block_k": 128, "max_concurrent_steps": 2, "grid_block_n": 3}
    path.write_text(json.dumps([entry]))
    tiles = pallas.TileTable.from_file(path)
    assert pallas.block_config("dgrad", 384, 256, tiles) == pallas.BlockConfig(64, 128, 128, 2, 3)
    assert pallas.block_config("fwd", 384, 256, tiles) == pallas.BlockConfig()  # not in the file
    assert pallas.block_config("dgrad", 384, 256) == pallas.BlockConfig()  # without the tiles
    entry["out"] = 250  # 250 is no multiple of block_k=128, which dgrad contracts
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match="width 250 must be a multiple of block_k=128"):
        pallas.block_config("dgrad", 384, 250, pallas.TileTable.from_file(bad))


def test_the_strategys_tiles_reach_the_weight_gradient(monkeypatch):
    """The custom VJP hands `PallasGroupedMatmul.tiles` to JAX's weight-gradient kernel (run
    where ours cannot tile the widths): checked on any platform with the kernels replaced by
    the reference ops."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    seen = []

    def run_op(op, a, b, group_sizes, cfg):
        seen.append((op, cfg))
        return pallas.reference_op(op, a, b, group_sizes).astype(a.dtype)

    monkeypatch.setattr(pallas, "run_op", run_op)
    monkeypatch.setattr(pallas.mosaic, "weight_grad_fits", lambda in_width, out_width: False)
    monkeypatch.setattr(
        pallas.mosaic,
        "grouped_matmul",
        lambda a, b, sizes, transpose_rhs=False: pallas.reference_op(
            "dgrad" if transpose_rhs else "fwd", a, b, sizes
        ).astype(a.dtype),
    )
    cfg = pallas.BlockConfig(64, 128, 64, 2, 1)
    tiles = pallas.TileTable(((("wgrad", 128, 256), cfg),))
    sizes = jnp.array([5, 0, 11], jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (16, 128))
    rhs = jax.random.normal(jax.random.key(1), (3, 128, 256))
    gmm = pallas.PallasGroupedMatmul(compute_dtype="bfloat16", tiles=tiles)
    grad = jax.grad(lambda w: gmm(lhs, w, sizes).astype(jnp.float32).sum())(rhs)
    assert seen == [("wgrad", cfg)]
    want = pallas.reference_op("wgrad", lhs, jnp.ones((16, 256)), sizes)
    np.testing.assert_allclose(grad, want, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_reference_op_is_each_groups_matmul(op):
    import jax
    import numpy as np

    sizes = np.array([3, 0, 5, 1])  # an empty group too
    rows, k, n = sizes.sum(), 6, 4
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(rows, k)), rng.normal(size=(rows, n))
    w = rng.normal(size=(len(sizes), k, n))
    a, b = {"fwd": (x, w), "dgrad": (g, w), "wgrad": (x, g)}[op]
    got = pallas.reference_op(op, jax.numpy.asarray(a), jax.numpy.asarray(b), sizes)
    ends = np.cumsum(sizes)
    parts = []
    for e, (start, end) in enumerate(zip(ends - sizes, ends, strict=True)):
        if op == "fwd":
            parts.append(x[start:end] @ w[e])
        elif op == "dgrad":
            parts.append(g[start:end] @ w[e].T)
        else:
            parts.append(x[start:end].T @ g[start:end])
    want = np.stack(parts) if op == "wgrad" else np.concatenate(parts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("in_width", "out_width", "used"),
    [
        (512, 256, "mosaic"),
        (384, 256, "jax"),  # 384: no multiple of the 2 x 128 weight-gradient rows
    ],
)
def test_weight_gradient_kernel_choice(monkeypatch, in_width, out_width, used):
    """Our weight-gradient kernel where its tiles divide the widths, JAX's elsewhere. (The
    kernels run on the GPU; here each is replaced by the reference and the choice recorded.)"""
    import jax
    import jax.numpy as jnp

    from dropless.backends import mosaic

    calls = []

    def grouped_matmul(a, b, s, *, transpose_rhs=False, config=None):
        return pallas.reference_op("dgrad" if transpose_rhs else "fwd", a, b, s).astype(a.dtype)

    monkeypatch.setattr(mosaic, "grouped_matmul", grouped_matmul)

    def spy(name):
        return lambda a, b, s, *_, **__: (
            calls.append(name) or pallas.reference_op("wgrad", a, b, s).astype(a.dtype)
        )

    monkeypatch.setattr(mosaic, "grouped_weight_grad", spy("mosaic"))
    monkeypatch.setattr(pallas, "run_op", lambda op, a, b, s, cfg: spy("jax")(a, b, s))
    sizes = jnp.array([3, 0, 5])
    x = jnp.ones((8, in_width), jnp.bfloat16)
    w = jnp.ones((3, in_width, out_width), jnp.bfloat16)
    loss = lambda w: pallas.pallas_grouped_matmul(x, w, sizes).astype(float).sum()  # noqa: E731
    grad = jax.grad(loss)(w)
    assert calls == [used]
    assert float(grad[1].sum()) == 0 and float(grad[0, 0, 0]) == 3  # three rows of ones


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("compute_dtype", "float32", "compute_dtype")],
)
def test_bad_settings_are_named(field, value, named):
    from jaxtyping import TypeCheckError

    # with the tests' runtime type checks on, a value outside a Literal fails its annotation first
    with pytest.raises((ValueError, TypeCheckError), match=named):
        pallas.PallasGroupedMatmul(**{field: value})
    # set past the constructor: the library's own message, which a user without the type
    # checker gets
    gmm = pallas.PallasGroupedMatmul()
    object.__setattr__(gmm, field, value)
    with pytest.raises(ValueError, match=rf"PallasGroupedMatmul.{field}='{value}' must be"):
        gmm.__check_init__()


def test_widths_are_checked_before_the_kernels():
    """A width the backward's tiles do not divide fails in the forward, naming both widths
    (not first under jax.grad, with the kernel's own name for the width)."""
    import jax.numpy as jnp

    gmm = pallas.PallasGroupedMatmul()
    with pytest.raises(ValueError, match=r"widths \[192 256\].*multiples of 128.*fallback"):
        gmm(jnp.zeros((8, 192)), jnp.zeros((2, 192, 256)), jnp.array([4, 4]))


def test_widths_the_kernels_cannot_tile_go_to_the_fallback(monkeypatch):
    """With a fallback, a layer of untileable widths runs on it (value and gradients), and the
    kernels are never asked for; tileable widths still go to the kernels."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.backends import CapacityGroupedMatmul

    def no_kernels(*_):
        raise AssertionError("the kernels were asked for")

    monkeypatch.setattr(pallas, "pallas_grouped_matmul", no_kernels)
    fallback = CapacityGroupedMatmul()
    gmm = pallas.PallasGroupedMatmul(fallback=fallback)
    sizes = jnp.array([5, 0, 3])
    x = jax.random.normal(jax.random.key(0), (8, 96))
    w = jax.random.normal(jax.random.key(1), (3, 96, 160))

    def loss(strategy, x, w):
        return (strategy(x, w, sizes) ** 2).sum()

    got = jax.value_and_grad(loss, argnums=(1, 2))(gmm, x, w)
    want = jax.value_and_grad(loss, argnums=(1, 2))(fallback, x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(AssertionError, match="kernels were asked"):
        gmm(jnp.zeros((8, 128)), jnp.zeros((3, 128, 256)), sizes)


def test_auto_picks_pallas_with_a_fallback_on_hopper(monkeypatch):
    """'auto' on a Hopper GPU is our kernels with jnp-capacity for untileable widths; where the
    kernels do not load it warns and falls back to te-gmm (here missing) and jnp-capacity."""
    from dropless.backends import BackendUnavailableError, CapacityGroupedMatmul
    from dropless.backends import _auto as backends
    from dropless.train import get_backend

    def te_missing():
        raise BackendUnavailableError("needs `pip install 'transformer-engine[jax]'`")

    monkeypatch.setattr(backends, "_te_gmm", te_missing)
    monkeypatch.setattr(backends, "is_hopper", lambda: True)
    monkeypatch.setattr(backends, "has_gpu", lambda: True)
    monkeypatch.setattr(pallas, "load_kernels", lambda: None)
    backends._auto_choice.cache_clear()
    try:
        chosen = get_backend("auto")
        assert type(chosen.gmm) is pallas.PallasGroupedMatmul
        assert type(chosen.gmm.fallback) is CapacityGroupedMatmul
        backends._auto_choice.cache_clear()

        def kernels_missing():
            raise BackendUnavailableError("Mosaic GPU kernels are not importable")

        monkeypatch.setattr(pallas, "load_kernels", kernels_missing)
        with pytest.warns(UserWarning, match="not importable; not using 'pallas'"):
            chosen = get_backend("auto")
        assert type(chosen.gmm) is CapacityGroupedMatmul
    finally:
        backends._auto_choice.cache_clear()


def test_pallas_on_a_gpu_before_hopper_is_unavailable(monkeypatch):
    """An A100 (8.0) has a GPU but not the warpgroup matmuls: the backend says so when asked
    for, instead of failing later in the kernels' compilation."""
    import jax

    from dropless.backends import BackendUnavailableError
    from dropless.train import get_backend

    class Ampere:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    monkeypatch.setattr(jax, "devices", lambda *args: [Ampere()])
    pallas.load_kernels.cache_clear()
    try:
        with pytest.raises(
            BackendUnavailableError,
            match=r"Hopper GPU .compute capability 9.x.; the first device is NVIDIA A100",
        ):
            get_backend("pallas")
    finally:
        pallas.load_kernels.cache_clear()


def _reference_kernels(monkeypatch):
    """Our three kernels and the fused SwiGLU one replaced by float32 references of their
    contracts (outputs in the operands' dtype), so the custom VJPs around them run on a CPU."""
    import jax
    import jax.numpy as jnp

    from dropless.backends import mosaic

    def grouped_matmul(a, b, s, *, transpose_rhs=False, config=None):
        return pallas.reference_op("dgrad" if transpose_rhs else "fwd", a, b, s).astype(a.dtype)

    def grouped_weight_grad(a, g, s, *, config=None):
        return pallas.reference_op("wgrad", a, g, s).astype(a.dtype)

    def grouped_matmul_swiglu(a, w, s, *, row_scale=None, config=None):
        gate_up = pallas.reference_op("fwd", a, w, s).astype(a.dtype)
        gate, up = mosaic.split_gate_up(gate_up.astype(jnp.float32), config)
        scale = 1.0 if row_scale is None else row_scale[:, None]
        return gate_up, (jax.nn.silu(gate) * up * scale).astype(a.dtype)

    monkeypatch.setattr(mosaic, "grouped_matmul", grouped_matmul)
    monkeypatch.setattr(mosaic, "grouped_weight_grad", grouped_weight_grad)
    monkeypatch.setattr(mosaic, "grouped_matmul_swiglu", grouped_matmul_swiglu)


@pytest.mark.parametrize("scaled", [False, True])
def test_fused_swiglu_equals_the_matmul_then_swiglu_with_gradients(monkeypatch, scaled):
    """`PallasGroupedMatmul(fused_swiglu=True)`: the experts' SwiGLU from the fused kernel
    (here its reference) equals the plain strategy's matmul-then-SwiGLU, in value and in the
    gradients of the rows and both weights (and of the rows' scale, `scaled`), on uneven
    groups with an empty one: the custom VJP's de-interleaving, SwiGLU gradient and kernel
    calls are checked on the CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    _reference_kernels(monkeypatch)
    sizes = jnp.array([70, 0, 30, 100])
    keys = jax.random.split(jax.random.key(0), 5)
    rows = jax.random.normal(keys[0], (200, 256)).astype(jnp.bfloat16)  # 256: our wgrad's rows
    w_gate, w_up = (jax.random.normal(k, (4, 256, 256)) / 16 for k in keys[1:3])
    d_hidden = jax.random.normal(keys[3], (200, 256))
    scale = jax.random.uniform(keys[4], (200,), minval=0.5, maxval=2.0)

    def loss(strategy, rows, w_gate, w_up, scale):
        row_scale = scale if scaled else None
        hidden = strategy.gate_up_swiglu(rows, w_gate, w_up, sizes, row_scale=row_scale)
        assert hidden.dtype == rows.dtype and hidden.shape == (200, 256)
        return jnp.sum(hidden.astype(jnp.float32) * d_hidden)

    grads = jax.value_and_grad(loss, argnums=(1, 2, 3, 4))
    got = grads(pallas.PallasGroupedMatmul(fused_swiglu=True), rows, w_gate, w_up, scale)
    want = grads(pallas.PallasGroupedMatmul(), rows, w_gate, w_up, scale)
    assert (np.abs(np.asarray(want[1][3])).sum() > 0) == scaled
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)  # bf16 compute either way
