"""XLA's memory figure for a train step compiled without a GPU, against the same step compiled
and run on one.

    # on the GPU: the real compile's memory analysis, the step's measured peak, and the GPU's
    # own target description (kept as dropless's spec for compiles without a GPU)
    python benchmarks/gpu_memory_check.py --out results/gpu_memory_h200.json \
        --save-target h200_target_config.txtpb
    # on a CPU machine with the CUDA PJRT plugin: the same step compiled for that target
    python benchmarks/gpu_memory_check.py --deviceless h200_target_config.txtpb \
        --out results/gpu_memory_deviceless.json

Both compile `train_step` from an abstract state (shapes and shardings only) for one device;
per-device bytes = arguments + outputs + temp - aliased (the state is donated). On the GPU the
step also runs once and `memory_stats()["peak_bytes_in_use"]` is read. Sorting programs need
`--xla_gpu_enable_cub_radix_sort=false` without a GPU (XLA asks CUDA for CUB's scratch size);
`--same-flags` sets it (and autotuning off) on the GPU too, to compare like with like.
"""

import argparse
import json
import os
import sys
import time

DEVICELESS_FLAGS = "--xla_gpu_enable_cub_radix_sort=false --xla_gpu_autotune_level=0"


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="proxy-2b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--remat", default="full")
    p.add_argument("--backend", default="jnp-capacity")
    p.add_argument("--deviceless", metavar="TARGET_TXTPB", help="compile for this GPU spec")
    p.add_argument("--same-flags", action="store_true", help="the deviceless XLA flags on a GPU")
    p.add_argument("--save-target", metavar="PATH", help="write this GPU's target description")
    p.add_argument("--out")
    return p.parse_args()


ARGS = parse()
if ARGS.deviceless or ARGS.same_flags:  # both read when JAX starts its backends
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICELESS_FLAGS}".strip()
if ARGS.deviceless:
    os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin skips cuInit, keeps its compiler

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset  # noqa: E402
from dropless.train import TrainConfig, get_backend, init_state, train_step  # noqa: E402

GIB = 2**30


def device():
    if not ARGS.deviceless:
        return jax.devices()[0]
    from jax.experimental import topologies

    with open(ARGS.deviceless) as f:
        spec = f.read()
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=spec)
    return topo.devices[0]


def save_target(path):
    from jax._src.lib import xla_client

    topo = xla_client.get_topology_for_devices(jax.devices())
    with open(path, "w") as f:
        f.write(str(topo.target_config))
    print(f"wrote {path}")


def per_device_bytes(compiled):
    m = compiled.memory_analysis()
    parts = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
    }
    parts["total"] = parts["arguments"] + parts["outputs"] + parts["temp"] - parts["aliased"]
    return {k: v / GIB for k, v in parts.items()}


def main():
    if ARGS.save_target:
        save_target(ARGS.save_target)
    config = get_preset(ARGS.preset, compute_dtype="bfloat16", remat=ARGS.remat)
    backend = get_backend(ARGS.backend)
    dev = device()
    mesh = jax.sharding.Mesh(np.array([dev]), ("data",))
    place = NamedSharding(mesh, PartitionSpec())

    def fresh():
        return init_state(DeepSeekV3(config, backend=backend, key=jax.random.key(0)), TrainConfig())

    def is_leaf_array(x):
        return isinstance(x, jax.Array | jax.ShapeDtypeStruct)

    abstract = eqx.filter_eval_shape(fresh)
    dyn, static = eqx.partition(abstract, is_leaf_array)
    dyn = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place), dyn)
    tokens = jax.ShapeDtypeStruct((ARGS.batch, ARGS.seq + 1), np.int32, sharding=place)

    def step(dyn, tokens):
        state, metrics = train_step(eqx.combine(dyn, static), tokens, 1)
        return eqx.partition(state, is_leaf_array)[0], metrics["loss"]

    step = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(dyn, tokens).compile()
    row = {
        "preset": ARGS.preset,
        "batch": ARGS.batch,
        "seq": ARGS.seq,
        "remat": ARGS.remat,
        "backend": ARGS.backend,
        "target": dev.device_kind,
        "deviceless": bool(ARGS.deviceless),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "compile_s": round(time.perf_counter() - t0, 1),
        "compiled_gib": per_device_bytes(compiled),
    }
    if not ARGS.deviceless:
        state = eqx.partition(fresh(), is_leaf_array)[0]
        batch = jax.random.randint(jax.random.key(1), tokens.shape, 0, config.vocab_size)
        state, loss = compiled(state, batch)
        jax.block_until_ready(loss)
        stats = dev.memory_stats() or {}
        row["measured_peak_gib"] = stats.get("peak_bytes_in_use", 0) / GIB
        row["loss"] = float(loss)
    print(json.dumps(row, indent=1))
    if ARGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
        with open(ARGS.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
