"""The proxy-2b batch-8 step (pallas, cuDNN attention, layers unrolled) with MLA's two
projections of x (q_a and kv_a) as one matmul on side-by-side weights (library since this run)
and as two matmuls (before); one process. A measurement aid for the fifteenth run, not library
code; run from experiments/ (or with it on PYTHONPATH)."""

import contextlib

import jax
from bench_train import compare, patched

from dropless.models.deepseek_v3 import get_preset
from dropless.nn.mla import MLA


def two_matmuls(self, x):  # MLA.__call__ before this run
    dt = x.dtype
    batch, seq, _ = x.shape
    h, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
    positions = jax.numpy.arange(seq)
    rope_batched = jax.vmap(self.rope, in_axes=(0, None))
    with jax.named_scope("q"):
        if self.q_proj is None:
            q = self.q_a_layernorm(x @ self.q_a_proj.astype(dt)) @ self.q_b_proj.astype(dt)
        else:
            q = x @ self.q_proj.astype(dt)
        q = q.reshape(batch, seq, h, nope + rope)
        q_nope = q[..., :nope]
        q_rope = rope_batched(q[..., nope:], positions)
    with jax.named_scope("kv"):
        kv_a = x @ self.kv_a_proj_with_mqa.astype(dt)
        latent = self.kv_a_layernorm(kv_a[..., : self.kv_lora_rank])
        k_rope = rope_batched(kv_a[..., self.kv_lora_rank :], positions)
        kv = (latent @ self.kv_b_proj.astype(dt)).reshape(batch, seq, h, nope + self.v_head_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
    with jax.named_scope("attention"):
        if self.impl == "cudnn":
            out = self._cudnn(q_nope, q_rope, k_nope, k_rope, v)
        else:
            out = self._xla(q_nope, q_rope, k_nope, k_rope, v)
    return out.reshape(batch, seq, h * self.v_head_dim) @ self.o_proj.astype(dt)


config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
compare(
    config,
    "pallas",
    {
        "MLA: x in one matmul (library)": contextlib.nullcontext,
        "MLA: q_a and kv_a as two matmuls (before)": lambda: patched(MLA, "__call__", two_matmuls),
    },
)
