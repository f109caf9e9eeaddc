"""dropless: dropless Mixture-of-Experts training in JAX.

The MoE pipeline, stage by stage: `TopKRouter` -> `AbstractDispatcher.dispatch` ->
`GroupedExperts` -> `AbstractDispatcher.combine`, assembled by `MoE`. Each stage's strategy is a
value (`MoE(..., dispatcher=..., gmm=..., topk=...)`, with portable defaults); a built model's
are swapped with `with_backend(model, backend)`, a `Backend` value (names, as the command
line's `--backend` takes them, are resolved at the edge: `dropless.train.get_backend`).
"""

from dropless._balance import (
    batch_balance_loss,
    coselection,
    dead_experts,
    global_balance_loss,
    max_violation,
    router_entropy,
    router_probability,
    router_z_loss,
    sequence_balance_loss,
    tokens_per_expert,
    update_expert_bias,
)
from dropless._balance_loss import (
    BALANCE_LOSSES,
    AbstractBalanceLoss,
    BatchBalanceLoss,
    GlobalBatchBalanceLoss,
    SequenceBalanceLoss,
)
from dropless._bias_update import (
    AbstractBiasUpdate,
    PIDBiasUpdate,
    PIDState,
    ProportionalBiasUpdate,
    SignBiasUpdate,
)
from dropless._dispatch import (
    AbstractDispatcher,
    AbstractExpertParallelDispatcher,
    AbstractRowWeightsDispatcher,
    Dispatched,
)
from dropless._experts import AbstractFusedSwiGLUMatmul, AbstractGroupedMatmul, GroupedExperts
from dropless._moe import MoE, MoEStats, routing_stats
from dropless._precision import apply_updates, cast_for_compute, f32_einsum
from dropless._routing import (
    AbstractTopK,
    JnpTopK,
    Routing,
    RoutingSpec,
    TopKRouter,
    replay_routing,
)
from dropless._swiglu import SwiGLU, swiglu
from dropless.backends import AutoBackend, Backend, BackendUnavailableError, with_backend

__all__ = [
    "BALANCE_LOSSES",
    "AbstractBalanceLoss",
    "BatchBalanceLoss",
    "GlobalBatchBalanceLoss",
    "SequenceBalanceLoss",
    "AutoBackend",
    "AbstractBiasUpdate",
    "PIDBiasUpdate",
    "PIDState",
    "ProportionalBiasUpdate",
    "SignBiasUpdate",
    "coselection",
    "dead_experts",
    "global_balance_loss",
    "replay_routing",
    "router_entropy",
    "router_probability",
    "AbstractDispatcher",
    "AbstractExpertParallelDispatcher",
    "AbstractFusedSwiGLUMatmul",
    "AbstractGroupedMatmul",
    "AbstractRowWeightsDispatcher",
    "AbstractTopK",
    "Backend",
    "BackendUnavailableError",
    "Dispatched",
    "GroupedExperts",
    "JnpTopK",
    "MoE",
    "MoEStats",
    "Routing",
    "RoutingSpec",
    "SwiGLU",
    "TopKRouter",
    "apply_updates",
    "batch_balance_loss",
    "cast_for_compute",
    "f32_einsum",
    "max_violation",
    "router_z_loss",
    "routing_stats",
    "sequence_balance_loss",
    "swiglu",
    "tokens_per_expert",
    "update_expert_bias",
    "with_backend",
]
