"""XLA's own per-device memory analysis of the real train step: `dropless plan --compile`.

`compiled_memory` lowers and compiles the step that `dropless train` runs (the model prepared
for the mesh, the state sharded as `sharded_state.state_shardings` places it, donated) from an
abstract state, so nothing is allocated, and returns what XLA's buffer assignment needs per
device. The devices can be those at hand (the tests' emulated CPU devices) or `gpu_devices`:
NVIDIA GPUs described by XLA's target spec, compiled for on a machine with none. That needs
JAX's CUDA PJRT plugin at jax's own version (`pip install --no-deps jax-cuda12-pjrt==V
jax-cuda12-plugin==V`; its nvidia wheels are not needed), JAX on its CPU platform
(`JAX_PLATFORMS=cpu`: the plugin then skips its driver check but still compiles), and two
compiler options that keep XLA from asking a CUDA runtime for autotuning and for CUB's sort
scratch size (`GPU_COMPILER_OPTIONS`). The H100 spec is XLA's (h100_target_config.txtpb, beside
this file), the H200's the one XLA wrote on an H200 (h200_target_config.txtpb). Without
autotuning the figures can differ from a compile on the device by some percent.
"""

import dataclasses
import importlib.resources
import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dropless import sharding
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.step._sharded import sharded_train_step
from dropless.train.step._sharded_state import prepare_model, state_shardings
from dropless.train.step._step import init_state, train_step

# name -> XLA's target description, beside this file: the H100's from XLA's sources, the
# H200's as XLA wrote it on an H200
GPUS = {"H100": "h100_target_config.txtpb", "H200": "h200_target_config.txtpb"}
GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_cub_radix_sort": False}
GPUS_PER_HOST = 8


class PluginMissingError(RuntimeError):
    """The CUDA PJRT plugin that compiling for a GPU without one needs is not installed."""


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's per-device bytes of a compiled step (`compiled.memory_analysis()`)."""

    arguments: int
    outputs: int
    aliased: int  # outputs written over donated arguments
    temp: int
    device_kind: str
    seconds: float  # compile time

    @property
    def total(self) -> int:
        """The device's peak: arguments, outputs not written over them, temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temp


def target_config(gpu: str) -> str:
    """XLA's `GpuTargetConfigProto` text of `gpu` ("H100" or "H200")."""
    if gpu not in GPUS:
        raise ValueError(f"gpu ({gpu!r}) must be one of {tuple(GPUS)}")
    return (importlib.resources.files("dropless.train.plan") / GPUS[gpu]).read_text()


def cuda_plugin_version() -> str | None:
    """The installed CUDA PJRT plugin's version, None without one."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("jax-cuda12-pjrt", "jax-cuda13-pjrt"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _plugin_module() -> bool:
    """Whether the plugin's module imports (`jax_plugins` itself exists only with a plugin)."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:
        return False


def check_plugin() -> None:
    """`PluginMissingError`, with the one-line fix, unless the CUDA PJRT plugin is installed
    at jax's version."""
    plugin = cuda_plugin_version()
    if plugin is None or not _plugin_module() or plugin != jax.__version__:
        found = f"found {plugin}" if plugin else "none installed"
        raise PluginMissingError(
            f"--compile needs JAX's CUDA PJRT plugin at jax's version {jax.__version__} "
            f"({found}): pip install --no-deps jax-cuda12-pjrt=={jax.__version__} "
            f"jax-cuda12-plugin=={jax.__version__}"
        )


def gpu_devices(gpu: str, count: int) -> list:
    """`count` compile-only devices of `gpu`, 8 to a host (no GPU needed, see the module
    docstring); `PluginMissingError` when the plugin is absent (`check_plugin`)."""
    check_plugin()
    from jax.experimental import topologies

    per_host = min(count, GPUS_PER_HOST)
    if count % per_host:
        raise ValueError(f"devices ({count}) must be a multiple of {GPUS_PER_HOST} above it")
    topology = topologies.get_topology_desc(
        platform="cuda",
        topology=f"1x{count // per_host}x{per_host}",
        target_config=target_config(gpu),
    )
    return list(topology.devices)


def compiled_memory(
    config: DeepSeekV3Config,
    train: TrainConfig,
    mesh: str,
    devices: list | None = None,
    compiler_options: dict | None = None,
) -> CompiledMemory:
    """Compiles `dropless train`'s step of `config` and `train` (its batch, micro-batches,
    moments) on `mesh` ('fsdp=16,expert=8'; '' for one device) over `devices` (default: those
    at hand) and returns XLA's per-device memory analysis. Nothing is allocated."""
    import time

    sizes = sharding.parse_mesh(mesh)
    count = int(np.prod(list(sizes.values()))) if sizes else 1
    devices = list(devices if devices is not None else jax.devices())[:count]
    if len(devices) < count:
        raise ValueError(f"mesh {mesh!r} needs {count} devices, {len(devices)} at hand")
    device_mesh = sharding.mesh_from_spec(mesh, devices=devices) if count > 1 else None
    step, arrays, tokens = _abstract_step(config, train, device_mesh, devices[0])
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(arrays, tokens)
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    return CompiledMemory(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temp=m.temp_size_in_bytes,
        device_kind=str(getattr(devices[0], "device_kind", devices[0].platform)),
        seconds=seconds,
    )


def _abstract_step(config: DeepSeekV3Config, train: TrainConfig, device_mesh, device):
    """(the train step as a function of (state arrays, tokens), the abstract state arrays, the
    abstract batch), placed on `device_mesh`, or on `device` when it is None."""
    box = {}

    def build():
        model = DeepSeekV3(config, key=jax.random.key(0))
        if device_mesh is not None:
            model = prepare_model(model, device_mesh)
        state = init_state(model, train)
        if device_mesh is not None:
            # traced leaves are arrays to `state_shardings` (a ShapeDtypeStruct is not)
            box["shardings"] = state_shardings(state, device_mesh)
        arrays, box["static"] = eqx.partition(state, eqx.is_array)
        return arrays

    arrays = jax.eval_shape(build)
    window = (train.batch_size, train.seq_len + 1)
    static, micro = box["static"], train.micro_batches
    if device_mesh is None:
        place = jax.sharding.SingleDeviceSharding(device)
        arrays = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place), arrays
        )
        tokens = jax.ShapeDtypeStruct(window, jnp.int32, sharding=place)

        def step(arrays, tokens):
            return train_step(eqx.combine(arrays, static), tokens, micro)
    else:
        arrays = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            arrays,
            box["shardings"],
        )
        batch = NamedSharding(device_mesh, sharding.batch_spec(device_mesh))
        tokens = jax.ShapeDtypeStruct(window, jnp.int32, sharding=batch)

        def step(arrays, tokens):
            return sharded_train_step(device_mesh, eqx.combine(arrays, static), tokens, micro)

    return step, arrays, tokens
