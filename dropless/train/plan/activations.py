"""The activation model of `dropless.train.plan.plan`: the bytes one device keeps for the backward.

The model is read off the program, not hand-counted: `jax.eval_shape` builds the model, and
JAX's own remat bookkeeping (`saved_residuals`, what `jax.ad_checkpoint.print_saved_residuals`
prints) lists every residual that the training loss's backward keeps under the config's remat
policy, at one device's micro-batch shape. What each policy keeps per scanned layer:

- "none": every intermediate the backward reads (projections, attention scores and
  probabilities in float32, the MoE's dispatched rows and expert activations, ...).
- "full" (`nothing_saveable`): only each layer's input (the residual stream, `[b s dim]`).
- "dots" (`dots_saveable`): the layer input and every matmul output (attention scores
  included); elementwise results are recomputed.
- "dots_no_batch": the layer input and the matmul outputs without batch dimensions (the
  projections; not the attention scores or the per-head products).

Whatever the policy, the head's residuals (the logits the cross-entropy keeps, `[b s vocab]`
per prediction depth) and the residual stream around the layers are kept too. Under remat the
backward recomputes one layer at a time, so one layer's "none" residuals are live on top
(`recompute`: the largest of a dense block, an MoE block and an MTP module, traced alone).

Expert parallelism: the trace runs the single-device dispatcher, whose rows are the
`tokens * k` copies; the `ep` dispatcher computes on a static receive buffer instead
(`dropless.backends.ep.buffer_rows`), so every residual dimension of `tokens * k` rows is scaled
to that buffer. Parameters that the backward reads are parameters, counted once, not here.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp

# JAX's list of a function's saved residuals; public only as a printer
# (`jax.ad_checkpoint.print_saved_residuals`), which calls this.
from jax._src.ad_checkpoint import saved_residuals

from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.models.deepseek_v3.layers import unstack
from dropless.train.step.optim import trainable_filter
from dropless.train.step.step import weighted_loss


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes on one device for one micro-batch (see the module docstring)."""

    saved: int  # residuals of the whole loss under the remat policy
    recompute: int  # one layer's residuals recomputed in the backward (0 without remat)

    @property
    def total(self) -> int:
        return self.saved + self.recompute


def _bytes(residuals, copies: int, rows: int) -> int:
    total = 0
    for aval, why in residuals:
        if "argument" in why:  # a parameter (or the batch) read by the backward
            continue
        size = 1
        for dim in aval.shape:
            size *= rows if dim == copies and rows != copies else dim
        total += size * aval.dtype.itemsize
    return total


@functools.cache
def activations(
    config: DeepSeekV3Config, batch: int, seq: int, rows: int | None = None
) -> Activations:
    """Residual bytes of a training step's backward for `batch` sequences of `seq` tokens on
    one device, under `config.remat`; `rows` is the expert-parallel receive buffer's rows
    (None: the `batch * seq * k` copies themselves). Nothing is allocated."""
    copies = batch * seq * config.num_experts_per_tok
    rows = copies if rows is None else rows
    weights = {
        name: jnp.float32(1.0)
        for name in ("mtp_loss_weight", "balance_loss_coef", "seq_balance_loss_coef", "z_loss_coef")
    }
    found: dict[str, list] = {}

    def trace(config):
        model = DeepSeekV3(config, key=jax.random.key(0))
        params, frozen = eqx.partition(model, trainable_filter(model))
        tokens = jnp.zeros((batch, seq + 1), jnp.int32)

        def loss(params):
            return weighted_loss(eqx.combine(params, frozen), tokens, weights)[0]

        found["loss"] = saved_residuals(loss, params)
        return 0

    def trace_layers(config):
        model = DeepSeekV3(config, key=jax.random.key(0))
        dt = config.compute_jnp_dtype
        x = jnp.zeros((batch, seq, config.hidden_size), dt)
        blocks = [("dense", model.dense_layers), ("moe", model.moe_layers)]
        for name, stack in blocks:
            if stack is not None:
                found[name] = saved_residuals(lambda b, x: b(x)[0], unstack(stack, 0), x)
        if model.mtp is not None:
            module = unstack(model.mtp.layers, 0)
            found["mtp"] = saved_residuals(lambda m, h: m(h, h)[0], module, x)
        return 0

    jax.eval_shape(lambda: trace(config))
    saved = _bytes(found.pop("loss"), copies, rows)
    recompute = 0
    if config.remat != "none":
        jax.eval_shape(lambda: trace_layers(config.replace(remat="none")))
        recompute = 2 * max(_bytes(r, copies, rows) for r in found.values())
    return Activations(saved=saved, recompute=recompute)
