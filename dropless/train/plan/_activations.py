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

A sliding-window layer under the "xla" attention keeps a full layer's residuals: the window
masks its `[seq seq]` scores; the model FLOPs count the window (`.attention`).

Whatever the policy, the head's residuals (the logits the cross-entropy keeps, `[b s vocab]`
per prediction depth) and the residual stream around the layers are kept too. Under remat the
backward recomputes one layer at a time, so one layer's "none" residuals are live on top
(`recompute`: the largest of a dense block, an MoE block and an MTP module, traced alone).

Expert parallelism: the trace runs the single-device dispatcher, whose rows are the
`tokens * k` copies; the `ep` dispatcher computes on a static receive buffer instead
(`dropless.backends._ep.buffer_rows`), so every residual dimension of `tokens * k` rows is scaled
to that buffer. Parameters that the backward reads are parameters, counted once, not here;
their compute-dtype casts (bf16 copies of float32 weights, kept under remat "none") are weights,
not activations: they do not grow with the batch, and an expert weight's copy holds the
device's experts only (`Activations.weight_copies`).
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
from dropless.models.deepseek_v3._layers import unstack
from dropless.train.plan._attention import traced_without_cudnn
from dropless.train.step._loss import weighted_loss
from dropless.train.step._optim import trainable_filter


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes on one device for one micro-batch (see the module docstring)."""

    saved: int  # residuals of the whole loss under the remat policy
    recompute: int  # one layer's residuals recomputed in the backward (0 without remat)
    weight_copies: int  # residuals that do not grow with the batch: compute-dtype weight casts

    @property
    def total(self) -> int:
        return self.saved + self.recompute


def _bytes(aval, copies: int, rows: int, experts: int, ep: int) -> int:
    """Bytes of a residual on one device: dimensions of `copies` rows become the EP buffer's
    `rows`; with `ep` > 1 (a weight's copy only) an experts dimension is this device's share."""
    size = aval.dtype.itemsize
    for dim in aval.shape:
        if dim == copies and rows != copies:
            size *= rows
        elif dim == experts and ep > 1:
            size *= dim // ep
        else:
            size *= dim
    return size


def _split(small, large, copies: int, rows: int, experts: int, ep: int) -> tuple[int, int]:
    """(activation bytes, weight-shaped bytes) of the residuals `small` traced at one batch,
    told apart by `large`, the same residuals traced at twice the batch: an activation grows
    with the batch, a weight's compute-dtype copy (or a position table) does not."""
    same_program = len(small) == len(large)
    act = weights = 0
    for i, (aval, why) in enumerate(small):
        if "argument" in why:  # a parameter (or the batch) read by the backward
            continue
        if same_program and large[i][0].shape == aval.shape:
            weights += _bytes(aval, copies, rows, experts, ep)
        else:
            act += _bytes(aval, copies, rows, experts, 1)
    return act, weights


def _residuals(config: DeepSeekV3Config, batch: int, seq: int) -> dict[str, list]:
    """JAX's saved residuals of the training loss (`"loss"`) under `config.remat` and, under
    remat, of one dense block, MoE block and MTP module with nothing rematerialised."""
    weights = {
        name: jnp.float32(1.0)
        for name in (
            "mtp_loss_weight",
            "balance_loss_coef",
            "seq_balance_loss_coef",
            "global_balance_loss_coef",
            "z_loss_coef",
        )
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
    if config.remat != "none":
        jax.eval_shape(lambda: trace_layers(config.replace(remat="none")))
    return found


@functools.cache
def activations(
    config: DeepSeekV3Config, batch: int, seq: int, rows: int | None = None, ep: int = 1
) -> Activations:
    """Residual bytes of a training step's backward for `batch` sequences of `seq` tokens on
    one device, under `config.remat`; `rows` is the expert-parallel receive buffer's rows
    (None: the `batch * seq * k` copies themselves), `ep` the expert axis (a device holds
    1/ep of the experts). Nothing is allocated. cuDNN's attention is traced as
    `traced_without_cudnn` says."""
    config = traced_without_cudnn(config)
    copies = batch * seq * config.num_experts_per_tok
    rows = copies if rows is None else rows
    small, large = _residuals(config, batch, seq), _residuals(config, 2 * batch, seq)
    sizes = (copies, rows, config.n_routed_experts, ep)
    saved, weight_copies = _split(small.pop("loss"), large.pop("loss"), *sizes)
    recompute = 0
    if small:  # under remat: one layer's activations, twice (its forward and its backward)
        recompute = 2 * max(_split(small[n], large[n], *sizes)[0] for n in small)
    return Activations(saved=saved, recompute=recompute, weight_copies=weight_copies)
