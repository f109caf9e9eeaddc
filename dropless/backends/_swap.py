"""`with_backend`: a model's MoE strategies replaced by a backend's, its arrays untouched."""

import jax

from dropless._dispatch import AbstractDispatcher
from dropless._experts import AbstractGroupedMatmul
from dropless._routing import AbstractTopK
from dropless.backends._auto import AutoBackend
from dropless.backends._backend import Backend

_STRATEGIES = (AbstractDispatcher, AbstractGroupedMatmul, AbstractTopK)


def with_backend(model, backend: Backend | AutoBackend):
    """The same model (same arrays) with its MoE stages' strategies replaced by `backend`'s.

    `backend`: a `Backend` of strategies, where a stage left as None keeps what the model has
    (the built-in bundles: `dropless.backends._bundles`, `te.te_backend()`, ...), or
    `AutoBackend()` (the best this machine runs; `select` says which). Names ("jnp", "pallas",
    ...) are resolved at the edge: `dropless.train.get_backend(name)`. `model` is any pytree
    holding MoE layers (a `MoE`, a `DeepSeekV3`, a list of them): every dispatcher, grouped
    matmul and router top-k in it is swapped; nothing else changes, so outputs agree across
    backends up to rounding."""
    if isinstance(backend, AutoBackend):
        backend = backend.select()[1]
    if not isinstance(backend, Backend):
        hint = (
            f"; for a backend's name, pass dropless.train.get_backend({backend!r})"
            if isinstance(backend, str)
            else ""
        )
        raise TypeError(f"with_backend takes a Backend or AutoBackend, got {backend!r}{hint}")
    swaps = (
        (AbstractDispatcher, backend.dispatcher),
        (AbstractGroupedMatmul, backend.gmm),
        (AbstractTopK, backend.topk),
    )

    def swap(node):
        for kind, strategy in swaps:
            if isinstance(node, kind) and strategy is not None:
                return strategy
        return node

    return jax.tree_util.tree_map(swap, model, is_leaf=lambda node: isinstance(node, _STRATEGIES))
