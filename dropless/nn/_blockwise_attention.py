"""Blockwise (flash-style) softmax attention in plain JAX: no `[heads seq seq]` tensor is kept.

Queries go in blocks of `block_q` rows; each block runs an online softmax (a running row max,
row sum and float32 output) over the key blocks its mask reaches, so the largest live score
tensor is one block's `[batch heads block_q block_k]`. The custom VJP keeps only the output and
each row's log-sum-exp (`[batch heads seq]`, float32) beside the inputs, and recomputes each
block's probabilities in the backward (FlashAttention-2's algorithm, Dao 2023): a scan over key
blocks accumulates dK and dV, each visiting the query blocks that see it, with dQ summed into a
float32 buffer. Key blocks the mask hides entirely are skipped, not computed (a causal mask
costs about half the blocks).

Heads are `[per-head part | shared part]`: the shared part of the key (MLA's decoupled RoPE key)
is one vector for every head, contracted without broadcasting it per head. The query and key
widths may differ from the value width (MLA: 192 against 128 at DeepSeek-V3's shapes).
Position i of the queries and position j of the keys both count from 0; `causal` hides j > i,
`window` hides j <= i - window. A query that sees no key at all gets zeros (plain softmax
attention gives NaN there).

Scores, the softmax and its statistics are float32; the matmuls take the inputs' dtype
(probabilities and score gradients are rounded to it) and accumulate in float32, as
`dropless.f32_einsum` does for the einsum attention. Reverse-mode autodiff only.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class _Mask(NamedTuple):
    causal: bool
    window: int | None
    seq_q: int
    seq_k: int
    block_q: int
    block_k: int

    def allowed(self, i, j):
        """[block_q block_k] booleans: which keys of key block j the rows of query block i see."""
        rows = i * self.block_q + jnp.arange(self.block_q)[:, None]
        cols = j * self.block_k + jnp.arange(self.block_k)[None, :]
        ok = cols < self.seq_k
        if self.causal:
            ok &= cols <= rows
        if self.window is not None:
            ok &= cols > rows - self.window
        return ok

    def key_blocks(self, i):
        """[lo, hi) of the key blocks that query block i reaches."""
        first_row, last_row = i * self.block_q, (i + 1) * self.block_q - 1
        hi = self.n_k
        if self.causal:
            hi = jnp.minimum(hi, last_row // self.block_k + 1)
        lo = 0
        if self.window is not None:
            lo = jnp.maximum(0, (first_row - self.window + 1) // self.block_k)
        return lo, hi

    def query_blocks(self, j):
        """[lo, hi) of the query blocks that reach key block j."""
        first_col, last_col = j * self.block_k, (j + 1) * self.block_k - 1
        lo = first_col // self.block_q if self.causal else 0
        hi = self.n_q
        if self.window is not None:
            hi = jnp.minimum(hi, (last_col + self.window - 1) // self.block_q + 1)
        return lo, hi

    @property
    def n_q(self) -> int:
        return -(-self.seq_q // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.seq_k // self.block_k)


def blockwise_attention(
    q: Float[Array, "batch seq heads qk"],
    k: Float[Array, "batch seq_k heads qk"],
    v: Float[Array, "batch seq_k heads dv"],
    scale: float,
    *,
    q_shared: Float[Array, "batch seq heads shared"] | None = None,
    k_shared: Float[Array, "batch seq_k shared"] | None = None,
    causal: bool = True,
    window: int | None = None,
    block_q: int = 512,
    block_k: int = 512,
) -> Float[Array, "batch seq heads dv"]:
    """softmax(scale * (q.k + q_shared.k_shared) under the mask) @ v per head, block by block
    (see the module docstring). Blocks larger than the sequence shrink to it."""
    if (q_shared is None) != (k_shared is None):
        raise ValueError("blockwise_attention: give both q_shared and k_shared, or neither")
    if window is not None and window < 1:
        raise ValueError(f"blockwise_attention: window ({window}) must be >= 1 or None")
    batch, seq_q, heads, _ = q.shape
    seq_k = k.shape[1]
    if q_shared is None:  # a zero-width shared part contracts to zeros
        q_shared = jnp.zeros((batch, seq_q, heads, 0), q.dtype)
        k_shared = jnp.zeros((batch, seq_k, 0), k.dtype)
    mask = _Mask(causal, window, seq_q, seq_k, min(block_q, seq_q), min(block_k, seq_k))
    return _attention(q, q_shared, k, k_shared, v, float(scale), mask)


def _pad(x, axis: int, size: int, value=0):
    width = [(0, 0)] * x.ndim
    width[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, width, constant_values=value)


def _block(x, axis: int, index, size: int):
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _add_block(x, update, index, size: int):
    """x with update added to its block `index` along axis 1."""
    block = _block(x, 1, index, size) + update
    return jax.lax.dynamic_update_slice_in_dim(x, block, index * size, 1)


def _scores(q, qs, k, ks, scale, mask, i, j):
    """Masked float32 scores [batch heads block_q block_k] of query block i, key block j."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s += jnp.einsum("bqhd,bkd->bhqk", qs, ks, preferred_element_type=jnp.float32)
    return jnp.where(mask.allowed(i, j), s * scale, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, qs, k, ks, v, scale, mask):
    return _forward(q, qs, k, ks, v, scale, mask)[0]


def _forward(q, qs, k, ks, v, scale, mask: _Mask):
    bq, bk = mask.block_q, mask.block_k
    batch, _, heads, _ = q.shape
    dv = v.shape[-1]
    q, qs = (_pad(t, 1, mask.n_q * bq) for t in (q, qs))
    k, ks, v = (_pad(t, 1, mask.n_k * bk) for t in (k, ks, v))

    def query_block(i):
        q_i, qs_i = _block(q, 1, i, bq), _block(qs, 1, i, bq)

        def step(j, carry):
            row_max, row_sum, acc = carry
            s = _scores(q_i, qs_i, _block(k, 1, j, bk), _block(ks, 1, j, bk), scale, mask, i, j)
            new_max = jnp.maximum(row_max, s.max(-1))
            safe = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # rows with no key yet
            p = jnp.exp(s - safe[..., None])
            rescale = jnp.exp(row_max - safe)
            pv = jnp.einsum(
                "bhqk,bkhd->bhqd", p.astype(v.dtype), _block(v, 1, j, bk),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            return new_max, rescale * row_sum + p.sum(-1), rescale[..., None] * acc + pv

        stats = jnp.full((batch, heads, bq), -jnp.inf), jnp.zeros((batch, heads, bq))
        init = (*stats, jnp.zeros((batch, heads, bq, dv)))
        row_max, row_sum, acc = jax.lax.fori_loop(*mask.key_blocks(i), step, init)
        seen = row_sum > 0
        out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
        # +inf for a row that sees no key: its probabilities exp(s - lse) recompute as zeros
        lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), jnp.inf)
        return out.astype(v.dtype), lse

    out, lse = jax.lax.map(query_block, jnp.arange(mask.n_q))  # [n_q b h bq dv], [n_q b h bq]
    out = out.transpose(1, 0, 3, 2, 4).reshape(batch, -1, heads, dv)[:, : mask.seq_q]
    lse = lse.transpose(1, 2, 0, 3).reshape(batch, heads, -1)[..., : mask.seq_q]
    return out, lse


def _fwd(q, qs, k, ks, v, scale, mask):
    out, lse = _forward(q, qs, k, ks, v, scale, mask)
    return out, (q, qs, k, ks, v, out, lse)


def _bwd(scale, mask: _Mask, residuals, d_out):
    q, qs, k, ks, v, out, lse = residuals
    bq, bk = mask.block_q, mask.block_k
    dt = q.dtype
    d_out = d_out.astype(v.dtype)
    # D_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the softmax's backward term per row
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out, preferred_element_type=jnp.float32)
    q, qs, d_out = (_pad(t, 1, mask.n_q * bq) for t in (q, qs, d_out))
    lse = _pad(lse, 2, mask.n_q * bq, jnp.inf)
    delta = _pad(delta, 2, mask.n_q * bq)
    k, ks, v = (_pad(t, 1, mask.n_k * bk) for t in (k, ks, v))

    def key_block(dq_all, j):
        k_j, ks_j, v_j = _block(k, 1, j, bk), _block(ks, 1, j, bk), _block(v, 1, j, bk)

        def step(i, carry):
            dq, dqs, dk, dks, dv = carry
            q_i, qs_i, do_i = _block(q, 1, i, bq), _block(qs, 1, i, bq), _block(d_out, 1, i, bq)
            s = _scores(q_i, qs_i, k_j, ks_j, scale, mask, i, j)
            p = jnp.exp(s - _block(lse, 2, i, bq)[..., None])
            dv += jnp.einsum(
                "bhqk,bqhd->bkhd", p.astype(dt), do_i, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bqhd,bkhd->bhqk", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - _block(delta, 2, i, bq)[..., None]) * scale).astype(dt)
            dk += jnp.einsum("bhqk,bqhd->bkhd", ds, q_i, preferred_element_type=jnp.float32)
            dks += jnp.einsum("bhqk,bqhd->bkd", ds, qs_i, preferred_element_type=jnp.float32)
            ds_k = jnp.einsum("bhqk,bkhd->bqhd", ds, k_j, preferred_element_type=jnp.float32)
            ds_ks = jnp.einsum("bhqk,bkd->bqhd", ds, ks_j, preferred_element_type=jnp.float32)
            dq, dqs = _add_block(dq, ds_k, i, bq), _add_block(dqs, ds_ks, i, bq)
            return dq, dqs, dk, dks, dv

        zeros = jnp.zeros
        init = (*dq_all, zeros(k_j.shape), zeros(ks_j.shape), zeros(v_j.shape))
        dq, dqs, dk, dks, dv = jax.lax.fori_loop(*mask.query_blocks(j), step, init)
        return (dq, dqs), (dk, dks, dv)

    dq0 = (jnp.zeros(q.shape), jnp.zeros(qs.shape))
    (dq, dqs), (dk, dks, dv) = jax.lax.scan(key_block, dq0, jnp.arange(mask.n_k))

    def keys(t):  # [n_k b bk ...] -> [b seq_k ...]
        t = jnp.moveaxis(t, 0, 1)
        return t.reshape(t.shape[0], mask.n_k * bk, *t.shape[3:])[:, : mask.seq_k]

    sq = mask.seq_q
    return (
        dq[:, :sq].astype(dt),
        dqs[:, :sq].astype(qs.dtype),
        keys(dk).astype(k.dtype),
        keys(dks).astype(ks.dtype),
        keys(dv).astype(v.dtype),
    )


_attention.defvjp(_fwd, _bwd)
