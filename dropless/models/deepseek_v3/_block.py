"""Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(x)); the FFN is dense or MoE."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from dropless._moe import MoE, MoEStats
from dropless._swiglu import SwiGLU
from dropless.nn._attention import GQA
from dropless.nn._mla import MLA
from dropless.nn._rmsnorm import RMSNorm


class DecoderBlock(eqx.Module):
    """One transformer layer, named as in Hugging Face DeepSeek-V3 (`model.layers.N.*`)."""

    input_layernorm: RMSNorm
    self_attn: MLA | GQA
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU | MoE

    def __init__(self, self_attn: MLA | GQA, mlp: SwiGLU | MoE, dim: int, *, eps: float, dtype):
        self.input_layernorm = RMSNorm(dim, eps=eps, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(dim, eps=eps, dtype=dtype)
        self.mlp = mlp

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        *,
        window: Int[Array, ""] | None = None,
        return_routing: bool = False,
        replay: Int[Array, "tokens k"] | None = None,
    ) -> tuple[Float[Array, "batch seq dim"], MoEStats | None]:
        """The new residual stream, and the MoE statistics (None for a dense block; with the
        routing, tokens flattened `batch * seq`, under `return_routing`). `window`: this
        layer's attention window in place of the attention's own (GQA only); `replay`: the
        MoE's expert choice, recorded so (`MoE.__call__`)."""
        with jax.named_scope("attention"):
            h = self.input_layernorm(x)
            x = x + (self.self_attn(h) if window is None else self.self_attn(h, window))
        with jax.named_scope("ffn"):
            h = self.post_attention_layernorm(x)
            if not isinstance(self.mlp, MoE):
                return x + self.mlp(h), None
            batch, seq, dim = h.shape
            # MoE code works on flat tokens; seq_len keeps the sequences apart for the
            # sequence-wise balance loss.
            y, stats = self.mlp(
                h.reshape(batch * seq, dim),
                seq_len=seq,
                return_routing=return_routing,
                replay=replay,
            )
            return x + y.reshape(batch, seq, dim).astype(x.dtype), stats
