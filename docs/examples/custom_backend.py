"""A new backend in plain jnp: a dispatcher and a grouped matmul, bundled and swapped into an MoE.

Run it (`python docs/examples/custom_backend.py`) to check it against the dense oracle;
tests/test_docs_examples.py does the same. See docs/backends.md for the protocol.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

import dropless
from dropless.backends import oracle_moe


class ArgsortPlan(eqx.Module):
    order: jax.Array  # row r of the dispatched buffer holds copy order[r]


class ArgsortDispatcher(dropless.AbstractDispatcher):
    """Copies sorted by expert id; plain autodiff (its gradient scatters, see docs/backends.md)."""

    requires_gpu = False  # every strategy says whether it needs a GPU

    def _dispatch(self, x, routing):
        tokens, k = routing.expert_ids.shape
        ids = routing.expert_ids.reshape(-1)  # copy c = (token c // k, choice c % k)
        order = jnp.argsort(ids, stable=True)
        group_sizes = jnp.bincount(ids, length=routing.scores.shape[-1]).astype(jnp.int32)
        return dropless.Dispatched(
            rows=x[order // k], group_sizes=group_sizes, plan=ArgsortPlan(order)
        )

    def _combine(self, y_rows, dispatched, routing):
        tokens, k = routing.expert_ids.shape
        y_copies = jnp.zeros_like(y_rows).at[dispatched.plan.order].set(y_rows)
        return jnp.einsum("tkd,tk->td", y_copies.reshape(tokens, k, -1), routing.weights)


class MaskedGroupedMatmul(dropless.AbstractGroupedMatmul):
    """Every row times every expert's matrix, keeping its own: O(experts) work, obviously right."""

    requires_gpu = False

    def _impl(self, lhs, rhs, group_sizes):
        rows = jnp.arange(lhs.shape[0])
        owner = jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right")  # experts = none

        def one_expert(out, e):
            return jnp.where((owner == e)[:, None], lhs @ rhs[e], out), None

        out = jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
        return jax.lax.scan(one_expert, out, jnp.arange(rhs.shape[0]))[0]


BACKEND = dropless.Backend(dispatcher=ArgsortDispatcher(), gmm=MaskedGroupedMatmul())


def compare_with_oracle(seed: int = 0):
    """Output and gradients (w.r.t. every weight and the input) of a small MoE on the custom
    backend, next to the dense oracle's: ((y, grads), (y_oracle, grads_oracle))."""
    spec = dropless.RoutingSpec(8, 2, "sigmoid", n_group=2, topk_group=1, use_expert_bias=True)
    k_model, k_x = jax.random.split(jax.random.key(seed))
    moe = dropless.MoE(12, 10, spec, n_shared_experts=1, key=k_model)
    moe = dropless.with_backend(moe, BACKEND)  # same arrays, our strategies
    x = jax.random.normal(k_x, (20, 12))

    @eqx.filter_jit
    def run(layer, moe, x):
        loss = lambda mx: jnp.sum(layer(*mx) ** 2)
        return layer(moe, x), jax.tree.leaves(eqx.filter_grad(loss)((moe, x)))

    return run(lambda m, x: m(x)[0], moe, x), run(oracle_moe, moe, x)


if __name__ == "__main__":
    (y, grads), (y_ref, grads_ref) = compare_with_oracle()
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, grads_ref, strict=True))
    print(f"max |y - oracle| = {float(jnp.max(jnp.abs(y - y_ref))):.1e}, gradients {gap:.1e}")
