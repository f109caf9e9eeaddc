"""The `Plan` record: one device's share of a training step (memory by term, FLOPs, the bytes
each collective moves) and what follows from it (the peak, the fit, compute and network time).
`dropless.train.plan.plan` fills it in; `dropless.train.plan.format_plan` prints it."""

import dataclasses
import math

# Bytes a second one GPU sends: NVLink 4 (H100, H200: 900 GB/s both ways together) and one
# 400 Gb/s InfiniBand NDR adapter per GPU.
LINKS = {"NVLink-class": 450e9, "InfiniBand-class": 50e9}
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16
MFU = 0.4


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
