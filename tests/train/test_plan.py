"""`dropless.train.plan`: the plan against XLA's own memory analysis of the compiled train step,
and its parts (parameter counts, sharding, offload, FLOPs, the table and the command)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from dropless import cli
from dropless.experts import GroupedExperts
from dropless.models.deepseek_v3 import DeepSeekV3, count_params, get_preset
from dropless.train import TrainConfig, init_state, train_step
from dropless.train.plan import flops_per_token, format_plan, parse_bytes, plan

BATCH, SEQ = 16, 64  # TrainConfig's defaults: activations several times the state in tiny


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_plan_matches_xla_memory_analysis(remat):
    """The plan's device total within 15% of what XLA's CPU buffer assignment needs for the
    same single-device step: arguments (the donated state) + outputs not aliased to them +
    temporaries (gradients, activations)."""
    config = get_preset("tiny", remat=remat)
    state = init_state(DeepSeekV3(config, key=jax.random.key(0)), TrainConfig())
    tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
    memory = train_step.lower(state, tokens, 1).compile().compiled.memory_analysis()
    xla = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
    ratio = plan(config, "", BATCH, SEQ).total / xla
    print(f"remat={remat}: plan / XLA = {ratio:.3f} (XLA {xla} bytes)")
    assert 0.85 <= ratio <= 1.15, ratio


def test_parameter_count_and_bytes():
    config = get_preset("tiny")
    p = plan(config, "", BATCH, SEQ)
    counts = count_params(config)
    assert p.param_count == counts.total_with_mtp
    assert p.params == {"float32": 4 * counts.total_with_mtp}
    # every array but the routers' expert bias is trained; AdamW keeps two moments of each
    trained = counts.total_with_mtp - counts.expert_bias
    assert p.grads == {"float32": 4 * trained}
    assert p.moments == {"float32": 8 * trained}
    bf16 = plan(config, "", BATCH, SEQ, moments_dtype="bfloat16")
    assert bf16.moments == {"bfloat16": 4 * trained}


def _expert_elements(config) -> int:
    model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, GroupedExperts))
    return sum(a.size for n in nodes if isinstance(n, GroupedExperts) for a in jax.tree.leaves(n))


def test_sharding_divides_by_the_mesh():
    config = get_preset("tiny")
    total = count_params(config).total_with_mtp
    experts = _expert_elements(config)
    one = plan(config, "", BATCH, SEQ)
    ep = plan(config, "expert=4", BATCH, SEQ)
    # only the routed experts split over the expert axis
    assert sum(ep.params.values()) == 4 * (total - experts + experts // 4)
    assert ep.ep_buffers > 0 and ep.all_to_all_bytes > 0
    assert one.ep_buffers == one.all_to_all_bytes == 0
    # under fsdp every array of >= 2**16 elements halves (tiny's dims are even); fsdp=2 at
    # one sequence a device
    fsdp = plan(config, "fsdp=2", BATCH, SEQ)
    model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    big = sum(a.size for a in jax.tree.leaves(model) if a.size >= 2**16)
    assert sum(fsdp.params.values()) == 4 * (total - big // 2)
    assert fsdp.fsdp_gathered > 0 and one.fsdp_gathered == 0
    with pytest.raises(ValueError, match="batch_size"):
        plan(config, "data=3", BATCH, SEQ)
    with pytest.raises(ValueError, match="n_routed_experts"):
        plan(config, "expert=32", 32, SEQ)


def test_offload_moves_moments_to_the_host():
    config = get_preset("tiny")
    on = plan(config, "", BATCH, SEQ)
    off = plan(config, "", BATCH, SEQ, offload_optimizer=True)
    moments = sum(on.moments.values())
    assert off.total == on.total - moments and off.host == moments and on.host == 0


def test_flops_of_tiny_by_hand():
    c = get_preset("tiny")
    d, f, e, k, vocab = 64, 192, 64, 2, 512
    attn = d * 32 + 32 * 4 * 24 + d * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * d  # q, kv, o
    dense = attn + 3 * d * f
    moe = attn + d * 16 + 3 * d * e * (k + 1)  # router, k routed + 1 shared expert
    mtp = 2 * d * d + moe + vocab * d  # eh_proj, its block, the shared head
    # count_params' active counts also include norm weights and the expert bias: two norms of
    # d and the q and kv latent norms (32 each) per block, the final norm, MTP's three norms
    norms = 5 * (2 * d + 32 + 32) + d + 3 * d + 4 * 16
    matmul = dense + 3 * moe + d * vocab + mtp + norms
    attention = 2 * SEQ * 4 * (24 + 16)
    assert flops_per_token(c, SEQ) == 6 * matmul + 3 * 5 * attention
    assert plan(c, "", BATCH, SEQ).flops_per_step == flops_per_token(c, SEQ) * BATCH * SEQ


def test_format_has_every_row(capsys):
    text = format_plan(plan(get_preset("tiny"), "", BATCH, SEQ, device_memory=10**9))
    for row in (
        "mesh",
        "params / device",
        "grads / device",
        "moments (device)",
        "fsdp gathered",
        "activations",
        "ep buffers",
        "total / device",
        "FLOPs / step",
        "all-to-all / device",
        "fits",
    ):
        assert row in text, row
    assert "fits                 yes" in text


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("192GiB") == 192 * 2**30
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="device memory"):
        parse_bytes("lots")


def main(argv: list[str]) -> int:
    return cli.main(["plan", *argv])


def test_command(capsys):
    args = ["--preset", "tiny", "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    assert main([*args, "--device-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "total / device" in out and re.search(r"fits +yes: ", out) and "assumed" not in out
    assert main([*args, "--device-memory", "1000"]) == 0
    assert re.search(r"fits +NO: ", capsys.readouterr().out)
    # without --device-memory, the verdict is against an H200's, and says so
    assert main(args) == 0
    assert "of 141.00 GB (an H200's, assumed; --device-memory sets another)" in (
        capsys.readouterr().out
    )
    assert main([*args, "--mesh", "data=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless plan:") and err.count("\n") == 1
    assert main([*args, "--device-memory", "many"]) == 2
    assert main([*args, "--set", "model.remat=sideways"]) == 2
