"""`dropless plan`: per-device memory, FLOPs and all-to-all traffic of a training step on a
mesh, without allocating the model.

    p = plan(get_preset("deepseek-v3-671b", compute_dtype="bfloat16", remat="full"),
             "fsdp=16,expert=8", batch_size=1920, seq_len=4096, moments_dtype="bfloat16",
             device_memory=parse_bytes("141GB"))
    print(format_plan(p))

Parameters, gradients and AdamW's moments come from `jax.eval_shape` of the real model and
optimiser state, each array divided over the mesh as `dropless.sharding` places it (a dimension
its mesh axes do not divide stays whole). Activations come from `plan_activations` (what the
backward keeps under the remat policy). FSDP: the sharded step
(`dropless.train.step.sharded_value_and_grad`) gathers each layer's fsdp-sharded
weights inside the layer scan and reduce-scatters their gradients in the backward scan
(`fsdp_gather="layer"`: the arrays outside the layers whole, and two layers' weights in
flight, a layer being all of its arrays at once, the matmul weights in the compute dtype they
are gathered in; at the backward's end the gradients of the arrays outside the layers and of
one layer, the last one reduce-scattered, are whole); `fsdp_gather="step"` prices a step that
would gather the whole local model at its start instead, to show what the per-layer gathers
save (never less than "layer").

Communication per device and step: FSDP's all-gathers (parameters, in their dtype) and
reduce-scatters (gradients), the all-reduces of gradients over the axes a parameter is
replicated on (ring: 2 (n-1)/n of its bytes sent), and the expert-parallel all-to-alls; their
time at NVLink-class and InfiniBand-class bandwidth per GPU against the compute time at a
stated MFU of a stated peak, so a mesh bound by its network shows.
"""

import math

import equinox as eqx
import jax.numpy as jnp

from dropless import sharding
from dropless.backends._ep import buffer_rows
from dropless.models.deepseek_v3 import DeepSeekV3Config, count_params
from dropless.train._config import MAX_BF16_BETA, TrainConfig
from dropless.train.plan import _state as state
from dropless.train.plan._activations import Activations, activations
from dropless.train.plan._attention import attention_flops_per_token
from dropless.train.plan._result import LINKS, MFU, PEAK_FLOPS, Plan
from dropless.train.plan._table import format_plan, parse_bytes

# `Plan`, its constants and the table live in their own modules; they are importable from here,
# where the command and the docs name them.
__all__ = [
    "EXCHANGES",
    "FSDP_GATHERS",
    "LINKS",
    "MFU",
    "PEAK_FLOPS",
    "Plan",
    "flops_per_token",
    "format_plan",
    "parse_bytes",
    "plan",
    "train_config",
]

EXCHANGES = ("ragged", "all_to_all")
FSDP_GATHERS = ("step", "layer")


def flops_per_token(config: DeepSeekV3Config, seq: int) -> float:
    """Model FLOPs per trained token, as the experiments count them: 6 x (active matmul
    parameters: active params without the input embedding, plus the MTP modules' active params
    and their pass through the shared head) + attention (QK^T and AV, 2 * keys * heads *
    (qk_head_dim + v_head_dim) per token per layer forward, times 3 for forward + backward;
    keys = `seq`, or min(seq, window) in a sliding-window layer; causal mask not discounted, as
    PaLM's MFU: `attention_flops_per_token`). The one count behind `dropless plan`, the
    experiments and `dropless.train.loop._throughput`'s MFU."""
    counts = count_params(config)
    depth = config.num_nextn_predict_layers
    head = counts.head or counts.embedding  # a tied head reuses the embedding matrix
    matmul_params = counts.active - counts.embedding + counts.mtp_active + depth * head
    return float(6 * matmul_params + attention_flops_per_token(config, seq))


def _fail(rule: str) -> None:
    raise ValueError(f"plan: {rule}")


def _by_dtype(pairs) -> dict[str, int]:
    out: dict[str, int] = {}
    for dtype, n in pairs:
        out[jnp.dtype(dtype).name] = out.get(jnp.dtype(dtype).name, 0) + n
    return out


def train_config(
    batch_size: int, seq_len: int, micro_batches: int = 1, moments_dtype: str = "float32"
) -> TrainConfig:
    """The `TrainConfig` a plan describes (bf16 moments with a bf16-safe second-moment beta)."""
    return TrainConfig(
        batch_size=batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
        moments_dtype=moments_dtype,
        b2=min(0.95, MAX_BF16_BETA) if moments_dtype == "bfloat16" else 0.95,
    )


# Over 60 lines: half of it is the Plan record, a field a line, each from the terms above it.
def plan(
    config: DeepSeekV3Config,
    mesh: str,
    batch_size: int,
    seq_len: int,
    *,
    micro_batches: int = 1,
    remat: str | None = None,
    moments_dtype: str = "float32",
    offload_optimizer: bool = False,
    device_memory: int | None = None,
    recv_factor: float | None = None,
    exchange: str = "ragged",
    fsdp_gather: str = "layer",
    mfu: float = MFU,
    peak_flops: float = PEAK_FLOPS,
) -> Plan:
    """The plan of training `config` on `mesh` ('fsdp=16,expert=8'; '' for one device) with
    global batches of `batch_size` sequences of `seq_len` tokens in `micro_batches` passes.
    `remat` overrides `config.remat`; `recv_factor` and `exchange` size the `ep` dispatcher's
    buffers as `dropless.backends._ep.buffer_rows` does (None: the worst case, its default);
    `mfu` and `peak_flops` (per device) give the compute time the network time is set against."""
    sizes = sharding.parse_mesh(mesh)
    full = {axis: sizes.get(axis, 1) for axis in sharding.MESH_AXES}
    if remat is not None:
        config = config.replace(remat=remat)
    _check_options(exchange, fsdp_gather, mfu)
    train = train_config(batch_size, seq_len, micro_batches, moments_dtype)
    local_batch = _local_batch(config, full, batch_size, seq_len, micro_batches)
    try:
        info, opt_info = eqx.filter_eval_shape(lambda: state.arrays(config, train, full))
    except ValueError as err:
        if "experts dimension" not in str(err):
            raise
        _fail(f"mesh {mesh!r}: {err}")
    params = state.param_terms(info, full)
    moments, other = state.optimizer_terms(opt_info, full, config)
    gathered, grads_extra = state.fsdp_terms(params, full, fsdp_gather)
    grad_bytes = _by_dtype(params.grads)
    if micro_batches > 1:  # a float32 sum beside each micro-batch's gradient
        sums = sum(s * 4 for s, _, _ in params.unsharded)
        grad_bytes["float32"] = grad_bytes.get("float32", 0) + sums
    act, ep_buffers, all_to_all = _ep_terms(
        config, full, local_batch, seq_len, micro_batches, recv_factor, exchange
    )
    # FSDP moves the parameters' other shards in and the gradients' out once per micro-batch,
    # the gathers twice inside the layer scan under remat (forward and recomputation)
    fsdp_moved = sum((n - s) * b for s, n, b in params.unsharded) * micro_batches
    gathers = 2 if fsdp_gather == "layer" and config.remat != "none" else 1

    return Plan(
        mesh=full,
        batch_size=batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
        remat=config.remat,
        params=_by_dtype(params.stored),
        grads=grad_bytes,
        moments=_by_dtype(moments),
        other_state=other,
        fsdp_gathered=gathered,
        fsdp_grads=grads_extra,
        stack_grad_copies=params.stack_copies if fsdp_gather == "layer" else 0,
        activations=act.total,
        recompute=act.recompute,
        ep_buffers=ep_buffers,
        weight_copies=act.weight_copies,
        offload_optimizer=offload_optimizer,
        param_count=sum(math.prod(shape) for shape, *_ in info),
        flops_per_step=flops_per_token(config, seq_len) * batch_size * seq_len,
        all_to_all_bytes=all_to_all,
        device_memory=device_memory,
        all_gather_bytes=gathers * fsdp_moved,
        reduce_scatter_bytes=fsdp_moved,
        all_reduce_bytes=params.all_reduce * micro_batches,
        mfu=mfu,
        peak_flops=peak_flops,
    )


def _check_options(exchange: str, fsdp_gather: str, mfu: float) -> None:
    if exchange not in EXCHANGES:
        _fail(f"exchange ({exchange!r}) must be one of {EXCHANGES}")
    if fsdp_gather not in FSDP_GATHERS:
        _fail(f"fsdp_gather ({fsdp_gather!r}) must be one of {FSDP_GATHERS}")
    if not 0 < mfu <= 1:
        _fail(f"mfu ({mfu}) must be in (0, 1]")


def _local_batch(
    config: DeepSeekV3Config,
    full: dict[str, int],
    batch_size: int,
    seq_len: int,
    micro_batches: int,
) -> int:
    """Sequences one device runs per micro-batch; fails where the mesh does not divide them."""
    shards = math.prod(full.values())  # every mesh axis splits the batch
    if (batch_size // micro_batches) % shards:
        _fail(
            f"batch_size ({batch_size}) / micro_batches ({micro_batches}) must be divisible by "
            f"the mesh's {shards} devices (every axis splits the batch)"
        )
    if seq_len > config.max_position_embeddings:
        _fail(f"seq_len ({seq_len}) must be <= max_position_embeddings")
    return batch_size // micro_batches // shards


def _ep_terms(
    config: DeepSeekV3Config,
    full: dict[str, int],
    local_batch: int,
    seq_len: int,
    micro_batches: int,
    recv_factor: float | None,
    exchange: str,
) -> tuple[Activations, int, int]:
    """The activations (with the expert-parallel receive buffer's rows), the EP buffers and the
    all-to-all bytes one device sends per step."""
    ep = full["expert"]
    tokens = local_batch * seq_len
    copies = tokens * config.num_experts_per_tok
    rows = buffer_rows(copies, ep, recv_factor, exchange) if ep > 1 else copies
    act = activations(config, local_batch, seq_len, rows if ep > 1 else None, ep)
    width = config.hidden_size * jnp.dtype(config.compute_jnp_dtype).itemsize
    ep_buffers = (copies + rows) * width if ep > 1 else 0
    exchanges = 4 if config.remat == "none" else 6  # dispatch + combine, fwd, bwd, recompute
    sent = (rows if exchange == "all_to_all" else copies) * width * (ep - 1) // ep
    all_to_all = exchanges * state.moe_layers(config) * sent * micro_batches if ep > 1 else 0
    return act, ep_buffers, all_to_all
