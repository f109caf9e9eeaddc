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
(`dropless.train.step.sharded.sharded_value_and_grad`) gathers each layer's fsdp-sharded
weights inside the layer scan and reduce-scatters their gradients in the backward scan
(`fsdp_gather="layer"`: the arrays outside the layers whole, and two layers' weights and
gradients in flight); `fsdp_gather="step"` prices a step that would gather the whole local model
at its start instead, to show what the per-layer gathers save (never less than "layer").

Communication per device and step: FSDP's all-gathers (parameters, in their dtype) and
reduce-scatters (gradients), the all-reduces of gradients over the axes a parameter is
replicated on (ring: 2 (n-1)/n of its bytes sent), and the expert-parallel all-to-alls; their
time at NVLink-class and InfiniBand-class bandwidth per GPU against the compute time at a
stated MFU of a stated peak, so a mesh bound by its network shows.
"""

import dataclasses
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp

from dropless import sharding
from dropless.backends.ep import buffer_rows
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, count_params
from dropless.train.config import MAX_BF16_BETA, TrainConfig
from dropless.train.plan.activations import activations
from dropless.train.plan.attention import attention_flops_per_token
from dropless.train.step import optim
from dropless.train.step.step import HPARAM_FIELDS

EXCHANGES = ("ragged", "all_to_all")
FSDP_GATHERS = ("step", "layer")
# Bytes a second one GPU sends: NVLink 4 (H100, H200: 900 GB/s both ways together) and one
# 400 Gb/s InfiniBand NDR adapter per GPU.
LINKS = {"NVLink-class": 450e9, "InfiniBand-class": 50e9}
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16
MFU = 0.4
# The arrays that a scan over layers (or MTP modules) holds stacked, leading axis first.
_STACKS = ("dense_layers", "moe_layers", "mtp")


def flops_per_token(config: DeepSeekV3Config, seq: int) -> float:
    """Model FLOPs per trained token, as the experiments count them: 6 x (active matmul
    parameters: active params without the input embedding, plus the MTP modules' active params
    and their pass through the shared head) + attention (QK^T and AV, 2 * keys * heads *
    (qk_head_dim + v_head_dim) per token per layer forward, times 3 for forward + backward;
    keys = `seq`, or min(seq, window) in a sliding-window layer; causal mask not discounted, as
    PaLM's MFU: `attention_flops_per_token`). The one count behind `dropless plan`, the
    experiments and `dropless.train.loop.throughput`'s MFU."""
    counts = count_params(config)
    depth = config.num_nextn_predict_layers
    head = counts.head or counts.embedding  # a tied head reuses the embedding matrix
    matmul_params = counts.active - counts.embedding + counts.mtp_active + depth * head
    return float(6 * matmul_params + attention_flops_per_token(config, seq))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One device's share of a training step. Bytes are per device; dicts map dtype names to
    bytes. `total` is the device's peak estimate: the state (parameters, moments unless
    offloaded, other state), FSDP's gathered parameters, EP buffers and weight copies, plus the
    larger of the backward's two ends (`backward`)."""

    mesh: dict[str, int]
    batch_size: int
    seq_len: int
    micro_batches: int
    remat: str
    params: dict[str, int]
    grads: dict[str, int]
    moments: dict[str, int]
    other_state: int  # optimiser counts and numbers, expert loads
    fsdp_gathered: int  # unsharded parameter copies under fsdp
    fsdp_grads: int  # unsharded gradients beyond the device's shard, at the backward's end
    activations: int
    recompute: int  # part of `activations`: one layer recomputed under remat
    ep_buffers: int
    weight_copies: int  # compute-dtype casts of the weights that the backward keeps
    offload_optimizer: bool
    param_count: int
    flops_per_step: float  # the whole batch's model FLOPs
    all_to_all_bytes: int  # sent by one device per step
    device_memory: int | None
    stack_grad_copies: int = 0  # second copies of layer-stack gradients at the backward's end
    all_gather_bytes: int = 0  # received by one device per step (FSDP)
    reduce_scatter_bytes: int = 0  # sent by one device per step (FSDP)
    all_reduce_bytes: int = 0  # sent by one device per step (replicated gradients)
    mfu: float = MFU
    peak_flops: float = PEAK_FLOPS

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def host(self) -> int:
        return sum(self.moments.values()) if self.offload_optimizer else 0

    @property
    def backward(self) -> int:
        """The backward's peak beyond the state: at its start every saved activation and one
        layer's recomputation live; as it runs down the layers, each layer's activations make
        way for its gradients, so at its end every gradient (unsharded under step-wide FSDP)
        and the last layer's recomputation (its forward's half) live. A layer stack's gradient
        whose fsdp dimension is not the first of a layer's is there twice: the backward scan
        writes each layer's reduce-scattered gradient with the scattered dimension outermost,
        and XLA copies the whole stack into the parameter's layout once the scan ends (seen in
        its buffer assignment for DeepSeek-V3 671B on 128 H200s: 3 x 6.8 GB of expert
        gradients in both layouts)."""
        grads = sum(self.grads.values()) + self.fsdp_grads + self.stack_grad_copies
        return max(self.activations, grads + self.recompute // 2)

    @property
    def total(self) -> int:
        moments = 0 if self.offload_optimizer else sum(self.moments.values())
        return (
            sum(self.params.values())
            + moments
            + self.other_state
            + self.fsdp_gathered
            + self.backward
            + self.ep_buffers
            + self.weight_copies
        )

    @property
    def comm_bytes(self) -> int:
        """Bytes one device moves per step over all collectives."""
        return (
            self.all_gather_bytes
            + self.reduce_scatter_bytes
            + self.all_reduce_bytes
            + self.all_to_all_bytes
        )

    @property
    def compute_seconds(self) -> float:
        """One device's FLOPs per step at `mfu` of `peak_flops`."""
        return self.flops_per_device / (self.mfu * self.peak_flops)

    def comm_seconds(self, bytes_per_second: float) -> float:
        """The step's collectives at `bytes_per_second` per device, none overlapped."""
        return self.comm_bytes / bytes_per_second

    @property
    def flops_per_device(self) -> float:
        return self.flops_per_step / self.devices

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.total <= self.device_memory


def _fail(rule: str) -> None:
    raise ValueError(f"plan: {rule}")


def _by_dtype(pairs) -> dict[str, int]:
    out: dict[str, int] = {}
    for dtype, n in pairs:
        out[jnp.dtype(dtype).name] = out.get(jnp.dtype(dtype).name, 0) + n
    return out


def _is_spec(node) -> bool:
    return isinstance(node, jax.sharding.PartitionSpec)


def _spec_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=_is_spec)


def _mesh_spec(logical, shape, sizes: dict[str, int]) -> jax.sharding.PartitionSpec:
    """`sharding.to_mesh_spec` on axis sizes alone (there is no device `Mesh` to plan on)."""
    return sharding.to_mesh_spec(logical, shape, sizes)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one entry of a mesh spec."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _local(shape, spec, sizes: dict[str, int]) -> int:
    """Elements of one device's shard of an array of `shape` with mesh spec `spec`."""
    n = math.prod(shape)
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else tuple(entry or ()):
            n //= sizes[axis]
    return n


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
    buffers as `dropless.backends.ep.buffer_rows` does (None: the worst case, its default);
    `mfu` and `peak_flops` (per device) give the compute time the network time is set against."""
    sizes = sharding.parse_mesh(mesh)
    full = {axis: sizes.get(axis, 1) for axis in sharding.MESH_AXES}
    if remat is not None:
        config = config.replace(remat=remat)
    if exchange not in EXCHANGES:
        _fail(f"exchange ({exchange!r}) must be one of {EXCHANGES}")
    if fsdp_gather not in FSDP_GATHERS:
        _fail(f"fsdp_gather ({fsdp_gather!r}) must be one of {FSDP_GATHERS}")
    if not 0 < mfu <= 1:
        _fail(f"mfu ({mfu}) must be in (0, 1]")
    train = train_config(batch_size, seq_len, micro_batches, moments_dtype)
    shards = math.prod(full.values())  # every mesh axis splits the batch
    if (batch_size // micro_batches) % shards:
        _fail(
            f"batch_size ({batch_size}) / micro_batches ({micro_batches}) must be divisible by "
            f"the mesh's {shards} devices (every axis splits the batch)"
        )
    if seq_len > config.max_position_embeddings:
        _fail(f"seq_len ({seq_len}) must be <= max_position_embeddings")
    local_batch = batch_size // micro_batches // shards

    def arrays():
        """(shape, dtype, mesh spec, trainable) of every model array, and (shape, dtype, mesh
        spec) of every optimiser-state array: plain data, so eval_shape hands it back."""
        model = DeepSeekV3(config, key=jax.random.key(0))
        mask = optim.trainable_filter(model)
        params = eqx.filter(model, mask)
        specs = jax.tree.map(
            lambda a, s: None if s is None else _mesh_spec(s, a.shape, full),
            model,
            sharding.logical_param_specs(model),
            is_leaf=lambda n: n is None,
        )
        info = []

        def note(path, a, spec, trainable):
            if eqx.is_array(a):
                names = {getattr(k, "name", None) for k in path}
                stacked = bool(names & set(_STACKS))
                info.append((a.shape, a.dtype, spec, trainable, stacked))

        jax.tree_util.tree_map_with_path(note, model, specs, mask, is_leaf=lambda n: n is None)
        opt = optim.optimizer_state(train, params)
        opt_specs = sharding.opt_state_specs(opt, params, eqx.filter(specs, mask, is_leaf=_is_spec))
        opt_info = [
            (a.shape, a.dtype, s)
            for a, s in zip(jax.tree.leaves(opt), _spec_leaves(opt_specs), strict=True)
        ]
        return info, opt_info

    try:
        info, opt_info = eqx.filter_eval_shape(arrays)
    except ValueError as err:
        if "experts dimension" not in str(err):
            raise
        _fail(f"mesh {mesh!r}: {err}")
    stored, unsharded, grads = [], [], []
    whole, per_layer, all_reduce, stack_copies = 0, 0, 0, 0
    for shape, dtype, spec, trainable, stacked in info:
        size = jnp.dtype(dtype).itemsize
        local = _local(shape, spec, full)
        stored.append((dtype, local * size))
        if trainable:
            no_fsdp = _local(shape, [e if e != "fsdp" else None for e in spec], full)
            grads.append((dtype, local * size))
            unsharded.append((local, no_fsdp, size))
            if stacked:  # one layer's slice
                per_layer = max(per_layer, no_fsdp * size // shape[0])
                if full["fsdp"] > 1 and any("fsdp" in _axes(e) for e in spec[2:]):
                    stack_copies += local * size
            else:
                whole += no_fsdp * size
            used = {
                a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())
            }
            replicas = math.prod(n for a, n in full.items() if a not in used)
            all_reduce += 2 * (replicas - 1) * local * size // replicas
    moments, other = [], 0
    for shape, dtype, spec in opt_info:
        size = jnp.dtype(dtype).itemsize
        if len(shape):
            moments.append((dtype, _local(shape, spec, full) * size))
        else:
            other += size
    moe_layers = config.n_moe_layers + (
        config.num_nextn_predict_layers if config.n_moe_layers else 0
    )
    other += moe_layers * config.n_routed_experts * 4  # TrainState.expert_load
    other += 4 * len(HPARAM_FIELDS)  # TrainState.hparams, float32 scalars

    gathered = grads_extra = 0
    if full["fsdp"] > 1:
        gathered = sum(n * b for _, n, b in unsharded)
        grads_extra = sum((n - s) * b for s, n, b in unsharded)
        if fsdp_gather == "layer":  # two layers' weights and gradients in flight
            gathered = min(gathered, whole + 2 * per_layer)
            grads_extra = min(grads_extra, whole + 2 * per_layer)
    grad_bytes = _by_dtype(grads)
    if micro_batches > 1:  # a float32 sum beside each micro-batch's gradient
        grad_bytes["float32"] = grad_bytes.get("float32", 0) + sum(s * 4 for s, _, _ in unsharded)

    ep = full["expert"]
    tokens = local_batch * seq_len
    copies = tokens * config.num_experts_per_tok
    rows = buffer_rows(copies, ep, recv_factor, exchange) if ep > 1 else copies
    act = activations(config, local_batch, seq_len, rows if ep > 1 else None, ep)
    width = config.hidden_size * jnp.dtype(config.compute_jnp_dtype).itemsize
    ep_buffers = (copies + rows) * width if ep > 1 else 0
    exchanges = 4 if config.remat == "none" else 6  # dispatch + combine, fwd, bwd, recompute
    sent = (rows if exchange == "all_to_all" else copies) * width * (ep - 1) // ep
    all_to_all = exchanges * moe_layers * sent * micro_batches if ep > 1 else 0
    # FSDP moves the parameters' other shards in and the gradients' out once per micro-batch,
    # the gathers twice inside the layer scan under remat (forward and recomputation)
    fsdp_moved = sum((n - s) * b for s, n, b in unsharded) * micro_batches
    gathers = 2 if fsdp_gather == "layer" and config.remat != "none" else 1

    return Plan(
        mesh=full,
        batch_size=batch_size,
        seq_len=seq_len,
        micro_batches=micro_batches,
        remat=config.remat,
        params=_by_dtype(stored),
        grads=grad_bytes,
        moments=_by_dtype(moments),
        other_state=other,
        fsdp_gathered=gathered,
        fsdp_grads=grads_extra,
        stack_grad_copies=stack_copies if fsdp_gather == "layer" else 0,
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
        all_reduce_bytes=all_reduce * micro_batches,
        mfu=mfu,
        peak_flops=peak_flops,
    )


# --- the table and the command ----------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB' -> 141e9, '192GiB' -> 192 * 2**30, '1000' -> 1000 bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        _fail(
            f"device memory {text!r}: expected a number of bytes with an optional unit, e.g. "
            "141GB, 192GiB or 1000000"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _dtypes(d: dict[str, int]) -> str:
    parts = [f"{_gb(n)} {name}" for name, n in sorted(d.items())]
    return ", ".join(parts) if parts else _gb(0)


def format_plan(p: Plan) -> str:
    """The plan as a two-column table: every memory term, the total, FLOPs, traffic, fit."""
    mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items() if n > 1) or "one device"
    where = "host (offloaded)" if p.offload_optimizer else "device"
    rows = [
        ("mesh", f"{mesh} ({p.devices} devices)"),
        ("batch", f"{p.batch_size} x {p.seq_len} tokens, {p.micro_batches} micro-batches"),
        ("remat", p.remat),
        ("parameters", f"{p.param_count / 1e9:.3f} B"),
        ("params / device", _dtypes(p.params)),
        ("grads / device", _dtypes(p.grads)),
        (f"moments ({where})", _dtypes(p.moments)),
        ("other state", _gb(p.other_state)),
        ("fsdp gathered", f"{_gb(p.fsdp_gathered)} (gradients {_gb(p.fsdp_grads)})"),
        ("stack gradient copies", _gb(p.stack_grad_copies)),
        ("activations", f"{_gb(p.activations)} (recompute {_gb(p.recompute)})"),
        ("backward peak", f"{_gb(p.backward)} (activations, or gradients at its end)"),
        ("ep buffers", _gb(p.ep_buffers)),
        ("weight copies", _gb(p.weight_copies)),
        ("total / device", _gb(p.total)),
        ("host / device", _gb(p.host)),
        ("FLOPs / step", f"{p.flops_per_step:.3e} ({p.flops_per_device:.3e} / device)"),
        ("all-gather / device", f"{_gb(p.all_gather_bytes)} / step"),
        ("reduce-scatter / device", f"{_gb(p.reduce_scatter_bytes)} / step"),
        ("all-reduce / device", f"{_gb(p.all_reduce_bytes)} / step"),
        ("all-to-all / device", f"{_gb(p.all_to_all_bytes)} / step"),
        (
            "compute / step",
            f"{p.compute_seconds:.3g} s at {p.mfu:.0%} MFU of {p.peak_flops / 1e12:.0f} TFLOP/s",
        ),
    ]
    for link, speed in LINKS.items():
        seconds = p.comm_seconds(speed)
        bound = "network-bound" if seconds > p.compute_seconds else "compute-bound"
        rows.append(
            (f"network / step ({link})", f"{seconds:.3g} s at {speed / 1e9:.0f} GB/s: {bound}")
        )
    if p.device_memory is not None:
        verdict = "yes" if p.fits else "NO"
        rows.append(("fits", f"{verdict}: {_gb(p.total)} of {_gb(p.device_memory)}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
