"""Rotary position embeddings, with the linear and YaRN context extensions.

Frequencies follow Hugging Face `transformers` (`_compute_yarn_parameters` and DeepSeek-V3's
attention): YaRN blends interpolated and extrapolated frequencies with a linear ramp between the
dimensions that complete `beta_fast` and `beta_slow` rotations over the original context, and
scales cos/sin by `attention_scaling`. MLA additionally multiplies the softmax scale by
`yarn_get_mscale(factor, mscale_all_dim) ** 2` (see `softmax_scale`).

Frequencies are computed with numpy from static settings, so they are compile-time constants and
never parameters.
"""

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

ROPE_TYPES = ("default", "linear", "yarn")


def rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    """The scaling kind of a Hugging Face `rope_scaling` dict ("type" or "rope_type" key)."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    dim: int, theta: float, scaling: Mapping[str, Any], max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(
                factor, float(mscale_all_dim)
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency (high-frequency dimensions)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rope_frequencies(
    dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int = 2048,
) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim // 2] (float64 numpy) and the cos/sin `attention_scaling`.

    YaRN uses `rope_scaling["factor"]` as the extension factor, like DeepSeek's reference code;
    Hugging Face versions that derive it as `max_position_embeddings / original` agree on every
    released config, where the two are equal.
    """
    kind = rope_type(rope_scaling)
    if kind == "default":
        return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim), 1.0
    if kind == "linear":
        inv_freq, _ = rope_frequencies(dim, theta, None)
        return inv_freq / float(rope_scaling["factor"]), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, rope_scaling, max_position_embeddings)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; use one of {ROPE_TYPES}")


def softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, Any] | None = None) -> float:
    """MLA's attention logit scale: qk_head_dim^-0.5, times mscale^2 under YaRN with
    `mscale_all_dim` (the extended context sharpens attention; DeepSeek-V2/V3)."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        factor, mscale_all_dim = rope_scaling["factor"], rope_scaling["mscale_all_dim"]
        mscale = yarn_get_mscale(float(factor), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return scale


class RotaryEmbedding(eqx.Module):
    """cos/sin tables for given positions, and their application to the rope dimensions.

    `interleave=True` (DeepSeek checkpoints) rotates the pairs (x[2i], x[2i+1]); `False` rotates
    (x[i], x[i + dim/2]). Either way the output is in the half-split layout [rotated evens |
    rotated odds], as Hugging Face returns it; attention scores do not depend on that layout as
    long as queries and keys share it.
    """

    dim: int = eqx.field(static=True)
    inv_freq: tuple[float, ...] = eqx.field(static=True)
    attention_scaling: float = eqx.field(static=True)
    interleave: bool = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        theta: float = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int = 2048,
        interleave: bool = True,
    ):
        if dim % 2:
            raise ValueError(f"rotary dimension ({dim}) must be even")
        inv_freq, scaling = rope_frequencies(dim, theta, rope_scaling, max_position_embeddings)
        self.dim = dim
        self.inv_freq = tuple(float(f) for f in inv_freq)  # hashable, so it can be static
        self.attention_scaling = scaling
        self.interleave = interleave

    def cos_sin(
        self, positions: Int[Array, " seq"]
    ) -> tuple[Float[Array, "seq half"], Float[Array, "seq half"]]:
        """cos and sin of position * inv_freq, times `attention_scaling`, in float32."""
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        return jnp.cos(angles) * self.attention_scaling, jnp.sin(angles) * self.attention_scaling

    def __call__(
        self, x: Float[Array, "seq *heads rope"], positions: Int[Array, " seq"]
    ) -> Float[Array, "seq *heads rope"]:
        """Rotates the last axis of `x` by each position's angles (computed in float32)."""
        cos, sin = self.cos_sin(positions)
        extra = x.ndim - 2  # broadcast the tables over any head axes
        cos = cos.reshape(cos.shape[0], *([1] * extra), -1)
        sin = sin.reshape(sin.shape[0], *([1] * extra), -1)
        x32 = x.astype(jnp.float32)
        if self.interleave:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
        else:
            x1, x2 = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(x.dtype)
