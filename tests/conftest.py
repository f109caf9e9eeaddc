"""Test-wide settings: 8 emulated CPU devices (for expert parallelism), hypothesis profiles,
the `gpu` marker, the one short TrainConfig of the tests' runs, and fixtures that read programs.
The one list of strategy values that the property tests run over is in tests/helpers.py."""

import os

# Must happen before jax is imported anywhere. Eight CPU devices for the mesh tests. Without a
# GPU, LLVM's optimisations and XLA's newer CPU fusion emitters off too: the tests' programs are
# small and many, so compiling is most of their time, and XLA then compiles the tiny model's
# train step in 3.4 s instead of 7.3 s (both off) or 11.0 s (both on); subprocesses, the CLI's
# and the experiments', inherit the flags. A GPU machine keeps them, so that the `gpu` tests
# run the kernels that training runs.
# The older emitters also split each program's machine code into LLVM modules compiled apart;
# one module halves the memory mappings of the many small programs (the tiny model's eager
# init: 589 instead of 1,195, so test workers clear their compiled programs less often,
# `_release_compiled_programs`) and compiles them in 3.5 s instead of 4.0 s (three runs each).
# jaxlib 0.12 has only the fusion emitters (its XLA aborts on the flag); read from the package
# metadata, since XLA reads the flags when jax is first imported.
from importlib.metadata import version  # noqa: E402

_EMITTERS_FLAG = tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11)
_FLAGS = "--xla_force_host_platform_device_count=8"
if not os.path.exists("/dev/nvidia0"):
    _FLAGS += " --xla_backend_optimization_level=0"
    if _EMITTERS_FLAG:
        _FLAGS += " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("XLA_FLAGS", _FLAGS)
# What the `default_xla_jit` fixture gives back to one compilation.
_XLA_DEFAULTS = {"xla_cpu_use_fusion_emitters": True} if _EMITTERS_FLAG else {}

import contextlib  # noqa: E402
import gc  # noqa: E402

# Transformer Engine must load its CUDA libraries (cuDNN) before JAX initialises its GPU backend,
# or the two can pick up mismatched cuDNN builds; importing it is cheap and harmless elsewhere.
with contextlib.suppress(ImportError, OSError):
    import transformer_engine.jax  # noqa: F401

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=20,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("DROPLESS_HYPOTHESIS_PROFILE", "ci"))

# No persistent compilation cache: with jax 0.10.2 on the CPU, test workers segfault inside
# XLA reading an executable from it and serialising one into it (`put_executable_and_time`).


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after a test module once the worker holds many memory
    mappings (tests/train/{step,loop} and tests/models: 551 s against 608 s when every module
    dropped them, `pytest -n 2` on a 2-core box). On the CPU each program holds memory
    mappings of its machine code, and a test worker that keeps them all passes the kernel's
    65,530 mappings per process (`vm.max_map_count`) before the suite ends: XLA then aborts
    inside a compilation (a worker holds about 27,000 mappings after 3.5 minutes of tests)."""
    yield
    if _memory_mappings() > _MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


# Clear below a third of the kernel's limit: the modules after it compile fewer programs again
# (a train step of the tiny model, say) than if every module cleared the caches.
_MAPPINGS_BEFORE_CLEARING = 20_000


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # no /proc: clear after every module
        return _MAPPINGS_BEFORE_CLEARING + 1


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without a GPU. `mesh8` tests (meshes over the 8 CPU devices set up
    above) skip where JAX's default devices are fewer: on a machine with one or two GPUs, whose
    devices replace the emulated ones; their `gpu` tests pick their own devices."""
    gpu, devices = has_gpu(), jax.device_count()
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    few = pytest.mark.skip(reason=f"needs 8 devices, this machine has {devices}")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(no_gpu)
        elif "mesh8" in item.keywords and "gpu" not in item.keywords and devices < 8:
            item.add_marker(few)


# Tests compare float32 results with float32 tolerances, which assume float32 matmuls; on a GPU,
# XLA's default precision multiplies float32 in TF32 (about 1e-3 relative error; 11 such failures
# in test_jnp when it ran on an H200). So everything here, module fixtures included, runs at
# "highest" precision, which changes nothing on the CPU.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def gpu_tests_at_default_precision(request):
    """`gpu` tests run at XLA's default precision, the one training uses."""
    if "gpu" not in request.keywords:
        yield
        return
    with jax.default_matmul_precision(None):
        yield


# The tests' short run: 3 steps of 8 sequences x 32 tokens, one warm-up step, no evaluation,
# checkpoints or plots.
SHORT_RUN = dict(
    steps=3,
    batch_size=8,
    seq_len=32,
    warmup_steps=1,
    eval_every=0,
    eval_batches=1,
    checkpoint_every=0,
    plots=False,
)


@pytest.fixture(scope="session")
def train_config():
    """**changes -> the tests' short `TrainConfig` (`SHORT_RUN`) with `changes` applied."""
    from dropless.train import TrainConfig

    return lambda **changes: TrainConfig(**{**SHORT_RUN, **changes})


def _dot_generals(jaxpr) -> list:
    """Every dot_general equation of a jaxpr, nested ones (loops, custom VJPs) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_generals(sub)
    return found


@pytest.fixture
def dot_generals():
    """fn, *args -> the dot_general equations of jax.grad(fn, argnums=(0, 1))(*args)."""
    return lambda fn, *args: _dot_generals(
        jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(*args).jaxpr
    )


def _lowered(fn, *args, platform: str) -> str:
    """The StableHLO text of jit(fn)(*args) lowered for `platform` ("cpu", "cuda") on this
    machine: no device of that kind needed, nothing run. Skips where this jaxlib cannot lower
    for it."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    except (ImportError, NotImplementedError) as err:
        if platform in str(err).lower() and "platform" in str(err).lower():
            pytest.skip(f"this jaxlib cannot lower for {platform}: {err}")
        raise


@pytest.fixture
def lowered():
    """fn, *args, platform= -> the program jit(fn) lowers to for that platform (see _lowered)."""
    return _lowered


@pytest.fixture
def default_xla_jit():
    """fn -> eqx.filter_jit(fn) compiled with XLA's default CPU fusion emitters, as training
    compiles it: for the few comparisons of two algorithms whose float32 rounding noise sits
    near their tolerance, where the emitters of the tests' fast compiles round differently
    (gradients of two grouped matmuls: 9 of 32,768 elements 6e-6 apart, tolerance 1e-6)."""
    return lambda fn: eqx.filter_jit(fn, compiler_options=_XLA_DEFAULTS)


def _unchecked(fn):
    """`fn` past the tests' runtime type checks (jaxtyping + beartype wrap every function of
    the package): for tests of the library's own checks, which the type checks would
    otherwise pre-empt. Without the hook there is nothing to unwrap."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


@pytest.fixture
def unchecked():
    """fn -> fn without the tests' runtime type checks (see _unchecked)."""
    return _unchecked
