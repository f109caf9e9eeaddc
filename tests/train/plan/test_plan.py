"""`dropless.train.plan`: the plan against XLA's own memory analysis of the compiled train step,
and its parts (parameter counts, sharding, offload, FLOPs, communication, the table and the
command, `--compile` for GPUs)."""

import json
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from dropless import GroupedExperts, cli
from dropless.models.deepseek_v3 import DeepSeekV3, count_params, get_preset
from dropless.train import TrainConfig, init_state, train_step
from dropless.train.plan import (
    compiled_memory,
    flops_per_token,
    format_plan,
    parse_bytes,
    plan,
    train_config,
)
from dropless.train.plan._compile import cuda_plugin_version, target_config

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


_CASES = [
    (mesh, layers)
    for mesh in ("fsdp=8", "fsdp=4,expert=2", "data=2,fsdp=2,expert=2")
    for layers in (2, 4, 8)
]


@pytest.mark.slow
@pytest.mark.mesh8
@pytest.mark.parametrize(("mesh", "layers"), _CASES)
def test_plan_within_10_percent_of_the_compiled_sharded_step(mesh, layers):
    """The plan's device total within 10% of XLA's buffer assignment for the train step that
    `dropless train` runs on the mesh (8 emulated CPU devices, remat full), whatever that step
    is: `compiled_memory` compiles the current one."""
    config = get_preset("tiny", remat="full", num_hidden_layers=layers)
    xla = compiled_memory(config, train_config(BATCH, SEQ), mesh)
    p = plan(config, mesh, BATCH, SEQ)
    # the arguments are the sharded state and this device's tokens, to the byte
    tokens = BATCH // 8 * (SEQ + 1) * 4
    state = sum(p.params.values()) + sum(p.moments.values()) + p.other_state
    assert xla.arguments == state + tokens
    ratio = p.total / xla.total
    print(f"{mesh}, {layers} layers: plan / XLA = {ratio:.3f} (XLA {xla.total} bytes)")
    assert 0.9 <= ratio <= 1.1, ratio


_COMPILE_FOR_GPUS = """
import json
from dropless.models.deepseek_v3 import get_preset
from dropless.train.plan import compiled_memory, plan, train_config
from dropless.train.plan._compile import GPU_COMPILER_OPTIONS, gpu_devices
config = get_preset("tiny", remat="full")
m = compiled_memory(config, train_config(16, 64), "fsdp=8", gpu_devices("H200", 8),
                    GPU_COMPILER_OPTIONS)
p = plan(config, "fsdp=8", 16, 64)
state = sum(p.params.values()) + sum(p.moments.values()) + p.other_state
print(json.dumps(dict(kind=m.device_kind, arguments=m.arguments, total=m.total, state=state,
                      plan=p.total)))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    cuda_plugin_version() != jax.__version__, reason="needs the CUDA PJRT plugin at jax's version"
)
# plan / XLA 0.61 for tiny on 8 H200s since the step gathers per layer (issue 52): strict, so
# a planner that closes the gap turns this into a failure to be unmarked
@pytest.mark.xfail(strict=True, reason="plan below XLA under per-layer FSDP gathers")
def test_compiles_for_8_gpus_without_one():
    """tiny's sharded step compiled for 8 H200s on this machine (JAX on its CPU platform, in a
    subprocess: the plugin must not start a GPU backend): XLA's arguments are the plan's
    sharded state and tokens to the byte, its total within 15% of the plan's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_GPUS], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "H200" in got["kind"]
    assert got["arguments"] == got["state"] + 16 // 8 * 65 * 4
    assert 0.85 <= got["plan"] / got["total"] <= 1.15, got


_DESCRIBE_GPUS = """
import json
from dropless.train.plan._compile import GPUS, gpu_devices
print(json.dumps({gpu: gpu_devices(gpu, 8)[0].device_kind for gpu in GPUS}))
"""


@pytest.mark.skipif(
    cuda_plugin_version() != jax.__version__, reason="needs the CUDA PJRT plugin at jax's version"
)
def test_every_gpu_spec_describes_its_gpu():
    """The kept target descriptions parse and name their GPU (in a subprocess: the plugin must
    not start a GPU backend here); the H200's carries the memory XLA saw on one."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _DESCRIBE_GPUS], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    kinds = json.loads(run.stdout.strip().splitlines()[-1])
    assert kinds == {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}
    assert "device_memory_size: 150109880320" in target_config("H200")


def test_compile_without_the_plugin_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("dropless.train.plan._compile.cuda_plugin_version", lambda: None)
    args = ["--preset", "tiny", "--batch-size", "16", "--seq-len", "64", "--mesh", "fsdp=8"]
    assert main([*args, "--compile", "H200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless plan: error: --compile needs JAX's CUDA PJRT plugin")
    assert err.count("\n") == 1 and f"jax-cuda12-pjrt=={jax.__version__}" in err
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--compile", "B200"])
    assert exit_.value.code == 2 and "--compile" in capsys.readouterr().err


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


@pytest.mark.slow
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
    assert re.search(r"^fits +yes", text, re.M)


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


@pytest.mark.slow
def test_communication_per_device_by_hand():
    """fsdp=2: every fsdp-sharded array moves its other half in (gather) and its gradient's
    out (reduce-scatter); the small replicated ones all-reduce their gradient (ring, 2 (n-1)/n
    of it). data=2: no gathers, every gradient all-reduced."""
    config = get_preset("tiny")
    trained = count_params(config).total_with_mtp - count_params(config).expert_bias
    model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    big = sum(a.size for a in jax.tree.leaves(model) if a.size >= 2**16)
    fsdp = plan(config, "fsdp=2", BATCH, SEQ)
    assert fsdp.all_gather_bytes == fsdp.reduce_scatter_bytes == 4 * big // 2
    assert fsdp.all_reduce_bytes == 4 * (trained - big)
    assert fsdp.all_to_all_bytes == 0
    data = plan(config, "data=2", BATCH, SEQ, micro_batches=2)
    assert data.all_gather_bytes == data.reduce_scatter_bytes == 0
    assert data.all_reduce_bytes == 2 * 4 * trained  # once per micro-batch
    layer = plan(config, "fsdp=2", BATCH, SEQ, remat="full", fsdp_gather="layer")
    assert layer.all_gather_bytes == 2 * fsdp.all_gather_bytes  # forward and recomputation


def test_network_time_against_compute_time():
    config = get_preset("tiny")
    p = plan(config, "fsdp=2,expert=4", 64, SEQ, mfu=0.5, peak_flops=1e15)
    assert p.compute_seconds == pytest.approx(p.flops_per_device / 5e14)
    assert p.comm_seconds(1e9) == pytest.approx(p.comm_bytes / 1e9)
    text = format_plan(p)
    for row in ("all-gather / device", "reduce-scatter / device", "all-reduce / device"):
        assert row in text
    # tiny moves more bytes than it computes: network-bound over either link
    assert "(InfiniBand-class)" in text and "network-bound" in text
    assert "50% MFU of 1000 TFLOP/s" in text
    with pytest.raises(ValueError, match="mfu"):
        plan(config, "", BATCH, SEQ, mfu=0.0)


@pytest.mark.slow
def test_weight_copies_are_not_activations():
    """bf16 compute, remat none: the backward keeps bf16 casts of the weights. They do not
    grow with the batch, and under expert=4 a device keeps its quarter of the experts'."""
    config = get_preset("tiny", compute_dtype="bfloat16")
    one, twice = plan(config, "", BATCH, SEQ), plan(config, "", 2 * BATCH, SEQ)
    assert one.weight_copies > 0 and twice.weight_copies == one.weight_copies
    assert twice.activations > 1.9 * one.activations
    ep = plan(config, "expert=4", 4 * BATCH, SEQ)  # the same 16 sequences per device
    assert 0 < ep.weight_copies < one.weight_copies


@pytest.mark.slow
def test_layer_gathers_never_exceed_step_gathers():
    for layers in (2, 8):
        config = get_preset("tiny", num_hidden_layers=layers)
        step = plan(config, "fsdp=8", BATCH, SEQ, fsdp_gather="step")
        layer = plan(config, "fsdp=8", BATCH, SEQ, fsdp_gather="layer")
        assert layer.fsdp_gathered <= step.fsdp_gathered and layer.total <= step.total
    assert layer.fsdp_gathered < step.fsdp_gathered  # 8 layers: two in flight, not all


@pytest.mark.slow
def test_plan_counts_the_gpu_attention_path():
    """cuDNN's attention keeps what the blockwise one keeps (output and a statistic per row),
    far below the einsum attention's float32 probabilities at a long sequence."""
    config = get_preset("tiny", remat="none")
    xla = plan(config, "", 2, 512)
    cudnn = plan(config.replace(attention_impl="cudnn"), "", 2, 512)
    blockwise = plan(config.replace(attention_impl="blockwise"), "", 2, 512)
    assert cudnn.activations == blockwise.activations
    heads = config.num_attention_heads
    assert xla.activations - cudnn.activations > config.num_hidden_layers * 2 * heads * 512**2 * 4
