"""NCCL EP (Transformer Engine) behind the dispatcher interface.

What runs anywhere: buffer sizing against Transformer Engine's rule, settings validation, and the
errors that name what a machine lacks. What needs >= 2 Hopper GPUs, NCCL >= 2.30.4 and TE
(`gpu`-marked, skipped elsewhere): EP through NCCL equals the single-device layer, forward and
backward, in bfloat16.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import AbstractExpertParallelDispatcher, MoE, RoutingSpec, sharding
from dropless.backends import BackendUnavailableError, NcclEPDispatcher, with_backend
from dropless.backends import _nccl_ep as nccl_ep
from dropless.backends._nccl_ep import recv_capacity


def te_capacity(*, num_experts, num_experts_per_tok, max_tokens_per_rank, ep_size, factor):
    """Transformer Engine 2.20's `get_moe_recv_capacity_per_rank`, transcribed line by line."""
    alignment = 128
    nle = num_experts // ep_size
    group = ep_size * max_tokens_per_rank
    assignments = group * min(num_experts_per_tok, nle)
    nonempty = min(nle, assignments)
    padded = assignments + (alignment - 1) * nonempty
    aligned = ((padded + alignment - 1) // alignment) * alignment
    per_expert = nle * ((group + alignment - 1) // alignment) * alignment
    worst = min(per_expert, aligned)
    if factor is None:
        return worst
    balanced = (max_tokens_per_rank * num_experts_per_tok + nle - 1) // nle
    balanced_aligned = nle * ((balanced + alignment - 1) // alignment) * alignment
    requested = math.ceil(balanced_aligned * factor)
    return min(((requested + alignment - 1) // alignment) * alignment, worst)


@pytest.mark.parametrize("n_experts,k,tokens,ep", [(256, 8, 4096, 8), (16, 2, 64, 2), (8, 8, 5, 4)])
@pytest.mark.parametrize("factor", [None, 1.0, 1.25, 4.0])
def test_recv_capacity_is_transformer_engines(n_experts, k, tokens, ep, factor):
    got = recv_capacity(n_experts=n_experts, k=k, tokens_per_rank=tokens, ep=ep, recv_factor=factor)
    want = te_capacity(
        num_experts=n_experts,
        num_experts_per_tok=k,
        max_tokens_per_rank=tokens,
        ep_size=ep,
        factor=factor,
    )
    assert got == want
    assert got % 128 == 0
    worst = recv_capacity(n_experts=n_experts, k=k, tokens_per_rank=tokens, ep=ep)
    assert got <= worst
    # the worst case holds every copy of the group, however routed (each block aligned)
    local = n_experts // ep
    assert worst >= ep * tokens * min(k, local)


def test_recv_capacity_errors():
    with pytest.raises(ValueError, match="recv_factor must be None"):
        recv_capacity(n_experts=8, k=2, tokens_per_rank=8, ep=2, recv_factor=0.5)
    with pytest.raises(ValueError, match="recv_factor must be None"):
        recv_capacity(n_experts=8, k=2, tokens_per_rank=8, ep=2, recv_factor=float("nan"))
    with pytest.raises(ValueError, match=r"n_experts \(10\) must be divisible"):
        recv_capacity(n_experts=10, k=2, tokens_per_rank=8, ep=4)
    with pytest.raises(ValueError, match="tokens_per_rank must be >= 1"):
        recv_capacity(n_experts=8, k=2, tokens_per_rank=0, ep=2)
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        recv_capacity(n_experts=8, k=2, tokens_per_rank=8, ep=2, alignment=0)


def test_dispatcher_settings():
    with pytest.raises(ValueError, match="recv_factor must be None"):
        NcclEPDispatcher(recv_factor=0.9)
    with pytest.raises((TypeError, ValueError), match="overflow"):
        NcclEPDispatcher(overflow="ignore")
    d = NcclEPDispatcher(recv_factor=1.5, overflow="drop")
    assert isinstance(d, AbstractExpertParallelDispatcher) and type(d).requires_gpu
    # set past the constructor, where the tests' runtime type checks would object first
    for field, value, message in (
        ("axis_name", "", "axis_name must be a non-empty mesh axis name, got ''"),
        ("recv_factor", "2", "recv_factor must be None"),
        ("alignment", 1.5, "alignment must be an int >= 1, got 1.5"),
    ):
        bad = NcclEPDispatcher()
        object.__setattr__(bad, field, value)
        with pytest.raises(ValueError, match=re.escape(message)):
            bad.__check_init__()


@pytest.mark.mesh8
def test_mesh_rules():
    with pytest.raises(ValueError, match="at most one mesh axis"):
        nccl_ep.outer_axis(sharding.make_mesh(data=2, fsdp=2, expert=2))
    with pytest.raises(ValueError, match="size >= 2"):
        nccl_ep.outer_axis(sharding.make_mesh(data=8))
    assert nccl_ep.outer_axis(sharding.make_mesh(data=2, expert=4)) == "data"
    assert nccl_ep.outer_axis(sharding.make_mesh(expert=8)) is None


def has_nccl_ep() -> bool:
    return not nccl_ep.missing_requirements()


@pytest.mark.mesh8
@pytest.mark.skipif(has_nccl_ep(), reason="this machine can run NCCL EP")
def test_unavailable_here_names_what_is_missing():
    """Both entry points name what is missing: on a CPU or one GPU, the GPU count among it."""
    missing = nccl_ep.missing_requirements()
    assert missing  # what the skipif asks
    if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
        assert any(">= 2 GPUs" in m for m in missing)
    named = "backend 'nccl_ep' needs: " + re.escape("; ".join(missing))
    with pytest.raises(BackendUnavailableError, match=named):
        nccl_ep.nccl_ep_backend()
    with pytest.raises(BackendUnavailableError, match=named):
        nccl_ep.bootstrap(
            sharding.make_mesh(expert=8), n_experts=16, k=2, tokens_per_rank=8, hidden=8
        )


def test_tokens_must_be_bfloat16():
    moe = MoE(8, 16, RoutingSpec(16, 2), key=jax.random.key(0))
    dispatcher = NcclEPDispatcher()
    x = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        dispatcher.dispatch(x, moe.router(x))


@pytest.mark.gpu
@pytest.mark.skipif(not has_nccl_ep(), reason="needs >= 2 Hopper GPUs, NCCL >= 2.30.4 and TE")
def test_nccl_ep_matches_single_device_bf16():
    n = len(jax.devices())
    mesh = sharding.make_mesh(expert=n)
    n_experts, k, dim, hidden, tokens = 4 * n, 2, 128, 256, 64 * n
    spec = RoutingSpec(n_experts, k)
    moe = MoE(dim, hidden, spec, dtype=jnp.bfloat16, key=jax.random.key(0))
    nccl_ep.bootstrap(mesh, n_experts=n_experts, k=k, tokens_per_rank=tokens // n, hidden=dim)
    x = jax.random.normal(jax.random.key(1), (tokens, dim), jnp.bfloat16)
    probe = jax.random.normal(jax.random.key(2), (tokens, dim), jnp.float32)

    @eqx.filter_jit
    def value_and_grad(layer, x):
        def loss(args):
            layer, x = args
            y = layer(x)[0]
            return jnp.sum(y.astype(jnp.float32) * probe), y

        (_, y), g = eqx.filter_value_and_grad(loss, has_aux=True)((layer, x))
        return y, g

    layer = sharding.shard_moe(with_backend(moe, nccl_ep.nccl_ep_backend()), mesh)
    y, (g_layer, g_x) = value_and_grad(layer, x)
    y_ref, (g_ref, g_x_ref) = value_and_grad(moe, x)
    # bfloat16 tolerances (one rounding of ~8 bits per stage)
    close = dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), **close)
    np.testing.assert_allclose(np.float32(g_x), np.float32(g_x_ref), **close)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(g_layer.moe, eqx.is_array)),
        jax.tree.leaves(eqx.filter(g_ref, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.float32(a), np.float32(b), **close)
