"""The cross-entropy and its hand-written backward: optax's values and gradients, no
scatter or gather, and only the logits kept for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.train.step import cross_entropy
from dropless.train.step._cross_entropy import (
    _combine,
    _logsumexp_one_pass,
    _logsumexp_two_passes,
    token_cross_entropy,
)


@pytest.mark.parametrize("masked", [False, True])
def test_cross_entropy_equals_optax_and_its_gradient_has_no_scatter(masked):
    """The target's logit is picked by a one-hot mask (no gather, so no scatter in the
    gradient, which stays one fusible expression); values and gradients are optax's."""
    keys = jax.random.split(jax.random.key(3), 3)
    logits = (4 * jax.random.normal(keys[0], (2, 5, 11))).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[1], (2, 5), 0, 11)
    mask = jax.random.bernoulli(keys[2], 0.6, (2, 5)) if masked else None

    def reference(logits):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return ce.mean() if mask is None else jnp.sum(jnp.where(mask, ce, 0.0)) / mask.sum()

    def ours(logits):
        return cross_entropy(logits, targets, mask)

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    grad = jax.grad(lambda x: ours(x.astype(jnp.float32)))(logits.astype(jnp.float32))
    want = jax.grad(lambda x: reference(x.astype(jnp.float32)))(logits.astype(jnp.float32))
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(jax.grad(ours))(logits))
    assert "scatter" not in jaxpr and "gather" not in jaxpr


def test_backward_keeps_the_logits_and_one_number_per_position():
    from jax._src.ad_checkpoint import saved_residuals

    logits = jnp.zeros((2, 5, 11))
    targets = jnp.zeros((2, 5), jnp.int32)
    kept = [
        (aval.shape, aval.dtype)
        for aval, why in saved_residuals(lambda x: token_cross_entropy(x, targets), logits)
        if "from the argument" not in why
    ]
    # Besides the logits (the argument): the targets and the logsumexp.
    assert sorted(kept, key=str) == [((2, 5), jnp.float32), ((2, 5), jnp.int32)]


def test_bfloat16_logits_are_widened_as_read_and_kept_as_they_came():
    """bf16 logits (`logits_dtype="bfloat16"`): the loss is exactly the loss of their float32
    values, the gradient exactly that loss's gradient rounded to bf16, and the backward keeps
    no float32 copy of them (only the targets and the logsumexp besides the argument)."""
    keys = jax.random.split(jax.random.key(8), 2)
    logits = (6 * jax.random.normal(keys[0], (3, 7, 29))).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[1], (3, 7), 0, 29)
    wide = logits.astype(jnp.float32)
    np.testing.assert_array_equal(
        token_cross_entropy(logits, targets), token_cross_entropy(wide, targets)
    )
    grad = jax.grad(lambda x: cross_entropy(x, targets))(logits)
    want = jax.grad(lambda x: cross_entropy(x, targets))(wide)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(grad, want.astype(jnp.bfloat16))
    from jax._src.ad_checkpoint import saved_residuals

    kept = [
        (aval.shape, aval.dtype)
        for aval, why in saved_residuals(lambda x: token_cross_entropy(x, targets), logits)
        if "from the argument" not in why
    ]
    assert sorted(kept, key=str) == [((3, 7), jnp.float32), ((3, 7), jnp.int32)]


FORWARDS = {"one pass": _logsumexp_one_pass, "two passes": _logsumexp_two_passes}


def _float64_logsumexp(logits):
    x = np.asarray(logits, np.float64)
    top = x.max(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return top + np.log(np.exp(x - top[..., None]).sum(-1))


@pytest.mark.parametrize("forward", FORWARDS)
def test_both_forwards_are_exact_on_extreme_logits(forward):
    """Each platform's forward (the public function runs one of them, by platform) equals
    float64's logsumexp and target pick where a plain sum of exponentials would overflow
    (logits of +-1e4), where every logit is equal, and with -inf logits (masked words), first
    in a row, several in a row, or all of a row but one."""
    keys = jax.random.split(jax.random.key(6), 3)
    spread = 1e4 * jax.random.normal(keys[0], (3, 4, 37))
    equal = jnp.full((3, 4, 37), -7.5)
    masked = jnp.where(jax.random.bernoulli(keys[2], 0.7, (3, 4, 37)), -jnp.inf, spread / 1e3)
    masked = masked.at[..., 0].set(-jnp.inf).at[0, 0, 1:].set(-jnp.inf).at[0, 0, 5].set(2.0)
    targets = jax.random.randint(keys[1], (3, 4), 0, 37).at[0, 0].set(5)
    for logits in (spread, equal, masked):
        lse, picked = jax.jit(FORWARDS[forward])(logits, targets)
        np.testing.assert_allclose(lse, _float64_logsumexp(logits), rtol=1e-6)
        want = np.take_along_axis(np.asarray(logits), np.asarray(targets)[..., None], -1)[..., 0]
        np.testing.assert_array_equal(picked, want)


def test_one_pass_combine_is_order_free_and_takes_equal_maxima():
    """The one-pass reduction may combine elements in any order (a GPU reduces in a tree):
    its combiner is commutative and associative on random partial results, and two -inf
    maxima (two masked words) add their sums where exp(-inf - -inf) would give nan."""
    keys = jax.random.split(jax.random.key(4), 3)
    a, b, c = (
        (
            3 * jax.random.normal(k, (64,)),
            jax.random.uniform(k, (64,), minval=1, maxval=9),
            jax.random.normal(k, (64,)),
        )
        for k in keys
    )
    for got, want in zip(_combine(a, b), _combine(b, a), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    left, right = _combine(_combine(a, b), c), _combine(a, _combine(b, c))
    for got, want in zip(left, right, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    lse = lambda m, s: m + np.log(np.asarray(s, np.float64))  # noqa: E731
    np.testing.assert_allclose(
        lse(*_combine(a, b)[:2]), np.logaddexp(lse(*a[:2]), lse(*b[:2])), rtol=1e-6
    )
    minus_inf = (jnp.float32(-jnp.inf), jnp.float32(1), jnp.float32(0))
    top, total, _ = _combine(minus_inf, minus_inf)
    assert top == -jnp.inf and total == 2


def test_minus_infinity_logits_equal_optax():
    """-inf logits (masked words), first in the row too, where a -inf initial maximum would
    give nan: values and gradients are optax's; a -inf logit gets zero gradient."""
    logits = jnp.array(
        [[[-jnp.inf, 0.0, 1.0, -jnp.inf], [2.0, -jnp.inf, -jnp.inf, -jnp.inf]]], jnp.float32
    )
    targets = jnp.array([[2, 0]])

    def reference(x):
        return optax.softmax_cross_entropy_with_integer_labels(x, targets).mean()

    np.testing.assert_allclose(cross_entropy(logits, targets), reference(logits), rtol=1e-6)
    grad = jax.grad(lambda x: cross_entropy(x, targets))(logits)
    np.testing.assert_allclose(grad, jax.grad(reference)(logits), rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(grad)[np.isinf(np.asarray(logits))] == 0)


@pytest.mark.parametrize(("platform", "reductions"), [("cuda", [3]), ("cpu", [1, 1, 1])])
def test_forward_is_one_reduction_on_gpus_and_two_passes_on_the_cpu(platform, reductions):
    """Lowered for a GPU, the forward reads the logits in one reduction with three results
    (maximum, rescaled sum, target logit); for the CPU, the maximum and then two sums (which
    XLA fuses into one pass). Exported for each platform, so this runs without a GPU."""
    logits = jax.ShapeDtypeStruct((2, 5, 11), jnp.float32)
    targets = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    exported = jax.export.export(jax.jit(token_cross_entropy), platforms=[platform])
    text = exported(logits, targets).mlir_module()
    # One line per reduce: its results are listed before the "=" as %name:N or %name.
    heads = [line.split("=")[0] for line in text.splitlines() if "stablehlo.reduce(" in line]
    counts = [int(h.split(":")[1]) if ":" in h else 1 for h in heads]
    assert counts == reductions, text


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_head_cross_entropy_equals_the_loss_on_the_whole_logits(masked, chunk):
    """The chunked head + loss equals cross_entropy over the logits the model's head makes,
    in value and in the gradients of the hidden states and the weight, whether the chunk
    divides the positions (2 x 14) or not, and with a mask."""
    from dropless import f32_einsum
    from dropless.train.step import head_cross_entropy

    keys = jax.random.split(jax.random.key(5), 4)
    hidden = jax.random.normal(keys[0], (2, 14, 8))
    w = jax.random.normal(keys[1], (8, 19))
    targets = jax.random.randint(keys[2], (2, 14), 0, 19)
    mask = jax.random.bernoulli(keys[3], 0.6, (2, 14)) if masked else None

    def whole(hidden, w):
        return cross_entropy(f32_einsum("bsd,dv->bsv", hidden, w), targets, mask)

    def chunked(hidden, w):
        return head_cross_entropy(hidden, w, targets, mask, chunk=chunk)

    np.testing.assert_allclose(chunked(hidden, w), whole(hidden, w), rtol=1e-6)
    grads = jax.grad(chunked, argnums=(0, 1))(hidden, w)
    want = jax.grad(whole, argnums=(0, 1))(hidden, w)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    # A cotangent other than 1 scales both gradients.
    scaled = jax.grad(lambda h, w: 3.0 * chunked(h, w), argnums=(0, 1))(hidden, w)
    for got, ref in zip(scaled, want, strict=True):
        np.testing.assert_allclose(got, 3.0 * ref, rtol=1e-5, atol=1e-7)


def test_head_cross_entropy_in_bfloat16_and_bad_arguments():
    """bf16 hidden states and weight (the training case): float32 logits as the model's head
    makes them, the gradients in bf16 and within bf16 rounding of the whole-logits loss's;
    mixed dtypes and a chunk that is not a positive int are refused by name."""
    from dropless import f32_einsum
    from dropless.train.step import head_cross_entropy

    keys = jax.random.split(jax.random.key(6), 3)
    hidden = jax.random.normal(keys[0], (3, 10, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (16, 37)).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (3, 10), 0, 37)

    def whole(hidden, w):
        return cross_entropy(f32_einsum("bsd,dv->bsv", hidden, w), targets)

    def chunked(hidden, w):
        return head_cross_entropy(hidden, w, targets, chunk=8)

    np.testing.assert_allclose(chunked(hidden, w), whole(hidden, w), rtol=1e-6)
    _assert_bf16_gradients_agree(chunked, whole, hidden, w)
    with pytest.raises(TypeError, match="w is float32, hidden is bfloat16"):
        head_cross_entropy(hidden, w.astype(jnp.float32), targets, chunk=8)
    with pytest.raises(ValueError, match=r"chunk \(0\) must be an int >= 1"):
        head_cross_entropy(hidden, w, targets, chunk=0)


def test_head_cross_entropy_with_bfloat16_logits():
    """`logits_dtype=bfloat16`: the chunked loss equals the one-pass loss on the bf16 logits
    that the model's head then writes, to the logits' rounding (XLA may keep a bf16 value
    that it fuses in float32: its excess-precision rule), gradients in bf16 and within bf16
    rounding."""
    from dropless.train.step import head_cross_entropy

    keys = jax.random.split(jax.random.key(9), 3)
    hidden = jax.random.normal(keys[0], (2, 9, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (16, 41)).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (2, 9), 0, 41)

    def whole(hidden, w):
        logits = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.bfloat16)
        return cross_entropy(logits, targets)

    def chunked(hidden, w):
        return head_cross_entropy(hidden, w, targets, chunk=5, logits_dtype=jnp.bfloat16)

    # Rounding to bf16 moves a logit by at most 2^-9 of its size, a position's loss by twice that.
    logits = jnp.einsum("bsd,dv->bsv", hidden, w, preferred_element_type=jnp.float32)
    bound = 2 * 2**-9 * float(jnp.abs(logits).max())
    np.testing.assert_allclose(chunked(hidden, w), whole(hidden, w), rtol=0, atol=bound)
    _assert_bf16_gradients_agree(chunked, whole, hidden, w)


def _assert_bf16_gradients_agree(chunked, whole, hidden, w):
    """The gradients of `hidden` and `w` are bf16 and within bf16 rounding of the whole loss's
    (2^-7 of the largest entry: a few roundings of bf16's 2^-9)."""
    grads = jax.grad(chunked, argnums=(0, 1))(hidden, w)
    want = jax.grad(whole, argnums=(0, 1))(hidden, w)
    for got, ref in zip(grads, want, strict=True):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.abs(ref.astype(jnp.float32)).max())
        np.testing.assert_allclose(
            got.astype(jnp.float32), ref.astype(jnp.float32), atol=2**-7 * scale
        )


def test_the_package_does_not_hide_the_module():
    """`dropless.train` must not re-export the function `cross_entropy`: it would take the
    submodule's place as the package's attribute (`import ... as` would give the function)."""
    import inspect

    import dropless.train.step._cross_entropy as module

    assert inspect.ismodule(module)
    assert callable(module.cross_entropy)
