"""DeepSeek-V3 multi-token prediction (MTP): `num_nextn_predict_layers` sequential modules.

Module d (0-based; the paper's k = d + 1) at position i combines the previous depth's hidden state
with the embedding of the token d + 1 places ahead and predicts the token d + 2 places ahead:

    h'_i  = eh_proj(concat(enorm(embed(tokens[i + d + 1])), hnorm(h_i)))
    h_i  <- block(h'_i)                         (a full decoder block, causal like the main model)
    mtp_logits[d, :, i] = lm_head(shared_head.norm(h_i))     -> predicts tokens[i + d + 2]

h for d = 0 is the main model's final hidden state after its final norm (the tensor `lm_head`
reads; what inference engines feed DeepSeek's released MTP weights). Embedding and output head
are the main model's (shared). Positions with i + d + 1 >= seq have no token to embed: they get a
zero embedding and their logits are meaningless; `mtp_targets` gives the matching targets and mask.
Names follow the Hugging Face checkpoint (`model.layers.{L}.{enorm,hnorm,eh_proj,shared_head}`).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from dropless._moe import MoEStats
from dropless._swiglu import init_linear
from dropless.backends import Backend
from dropless.models.deepseek_v3._block import DecoderBlock
from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._layers import REMAT, make_block, moe_strategies, whole_layer
from dropless.nn._rmsnorm import RMSNorm


class SharedHead(eqx.Module):
    """The MTP module's own norm before the shared output head."""

    norm: RMSNorm


class MTPModule(eqx.Module):
    """One prediction depth. Stacked over `depth` inside `MTP`."""

    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Float[Array, "two_dim dim"]  # input is [enorm(embedding) | hnorm(hidden)]
    block: DecoderBlock
    shared_head: SharedHead

    def __init__(
        self, config: DeepSeekV3Config, *, backend: Backend | None = None, key: PRNGKeyArray
    ):
        c, dt = config, config.param_jnp_dtype
        k_proj, k_block = jax.random.split(key)
        self.enorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dt)
        self.hnorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dt)
        d = c.hidden_size
        self.eh_proj = init_linear(k_proj, (2 * d, d), 2 * d, dt)
        # DeepSeek-V3's MTP block is the same kind as the last main layer (MoE there).
        moe = c.n_moe_layers > 0
        self.block = make_block(c, moe=moe, backend=backend, key=k_block)
        self.shared_head = SharedHead(RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dt))

    def __call__(
        self,
        h: Float[Array, "batch seq dim"],
        emb: Float[Array, "batch seq dim"],
        *,
        return_routing: bool = False,
        replay: Int[Array, "tokens k"] | None = None,
    ) -> tuple[Float[Array, "batch seq dim"], MoEStats | None]:
        """Next depth's hidden state (before `shared_head.norm`) and the block's MoE stats."""
        dt = h.dtype
        joined = jnp.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1)
        x = joined @ self.eh_proj.astype(dt)
        return self.block(x, return_routing=return_routing, replay=replay)


class MTP(eqx.Module):
    """`depth` MTP modules, stacked (leading `depth` axis) and scanned in order."""

    layers: MTPModule

    def __init__(
        self, config: DeepSeekV3Config, *, backend: Backend | None = None, key: PRNGKeyArray
    ):
        moe_strategies(backend)  # a wrong backend fails here, outside the vmap
        keys = jax.random.split(key, config.num_nextn_predict_layers)
        self.layers = eqx.filter_vmap(lambda k: MTPModule(config, backend=backend, key=k))(keys)

    def __call__(
        self,
        h: Float[Array, "batch seq dim"],
        emb: Float[Array, "batch seq dim"],
        head: Callable[[Float[Array, "batch seq dim"]], Float[Array, "batch seq head_out"]],
        *,
        remat: str = "none",
        return_routing: bool = False,
        replay: Int[Array, "depth tokens k"] | None = None,
    ) -> tuple[Float[Array, "depth batch seq head_out"], MoEStats | None]:
        """Logits of every depth from the main hidden state `h` and token embeddings `emb`
        (`head` of each depth's normed hidden state: the normed state itself for an identity
        `head`).

        Depth d's last d + 1 positions have no next token: their embedding input is zeros and
        their logits are masked out of the loss (`mtp_targets`), but their MoE routing counts in
        the block's stats (balance losses, the bias update's load) like any other position's:
        a share of (d + 1) / seq, which keeps every shape static. `return_routing` puts each
        depth's routing in its stats, and `replay` gives each depth's MoE the expert choice
        recorded so."""
        depth = jax.tree.leaves(eqx.filter(self.layers, eqx.is_array))[0].shape[0]
        seq = emb.shape[1]
        # Depth d reads the embedding of token i + d + 1: shift left, pad the end with zeros.
        shifted = jnp.stack(
            [jnp.pad(emb[:, d + 1 :], ((0, 0), (0, min(d + 1, seq)), (0, 0))) for d in range(depth)]
        )
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, xs):
            layer_arrays, emb_d, ids = xs
            layer = eqx.combine(whole_layer(layer_arrays, h.dtype), static)
            h, stats = layer(h, emb_d, return_routing=return_routing, replay=ids)
            return h, (head(layer.shared_head.norm(h)), stats)

        if REMAT[remat] is not None:
            body = jax.checkpoint(body, policy=REMAT[remat], prevent_cse=False)
        _, (logits, stats) = jax.lax.scan(body, h, (arrays, shifted, replay))
        return logits, stats


def mtp_targets(
    labels: Int[Array, "batch seq"], depth: int
) -> tuple[Int[Array, "depth batch seq"], Bool[Array, "depth batch seq"]]:
    """Targets and validity mask of `mtp_logits`, from the main next-token `labels`.

    With `labels[:, i] = tokens[:, i + 1]` (the main loss's targets), depth d predicts
    `labels[:, i + d + 1]`; positions i >= seq - d - 1 have no target (and saw a padded input).
    """
    seq = labels.shape[1]
    pos = jnp.arange(seq)
    targets, masks = [], []
    for d in range(depth):
        targets.append(jnp.pad(labels[:, d + 1 :], ((0, 0), (0, min(d + 1, seq)))))
        masks.append(jnp.broadcast_to(pos < seq - d - 1, labels.shape))
    return jnp.stack(targets), jnp.stack(masks)
