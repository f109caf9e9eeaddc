"""The pre-norm decoder block: its residual stream written out by hand, dense and MoE."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import MoE, RoutingSpec, SwiGLU
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.nn import MLA

DIM, BATCH, SEQ = 16, 2, 6


def _block(ffn: str) -> DecoderBlock:
    k_attn, k_ffn, k_norm = jax.random.split(jax.random.key(0), 3)
    attn = MLA(
        DIM,
        2,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        key=k_attn,
    )
    if ffn == "dense":
        mlp = SwiGLU(DIM, 24, key=k_ffn)
    else:
        mlp = MoE(DIM, 8, RoutingSpec(4, 2), n_shared_experts=1, key=k_ffn)
    block = DecoderBlock(attn, mlp, DIM, eps=1e-6, dtype=jnp.float32)
    # norm weights away from 1, so that a norm left out or swapped changes the result
    w_in, w_post = jax.random.uniform(k_norm, (2, DIM), minval=0.5, maxval=2.0)
    block = eqx.tree_at(lambda b: b.input_layernorm.weight, block, w_in)
    return eqx.tree_at(lambda b: b.post_attention_layernorm.weight, block, w_post)


@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_block_is_attention_then_ffn_on_the_residual_stream(ffn):
    """x + attn(norm1(x)), then + ffn(norm2(.)); the MoE on flat tokens, with its statistics
    over sequences of the input's length (None for a dense block)."""
    block = _block(ffn)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, DIM))
    got, stats = block(x)
    h = x + block.self_attn(block.input_layernorm(x))
    normed = block.post_attention_layernorm(h)
    if ffn == "dense":
        want = h + block.mlp(normed)
        assert stats is None
    else:
        y, want_stats = block.mlp(normed.reshape(BATCH * SEQ, DIM), seq_len=SEQ)
        want = h + y.reshape(BATCH, SEQ, DIM)
        np.testing.assert_allclose(stats.seq_balance_loss, want_stats.seq_balance_loss, rtol=1e-6)
        assert float(stats.tokens_per_expert.sum()) == BATCH * SEQ * 2  # k copies per token
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
