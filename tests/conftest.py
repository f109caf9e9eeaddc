"""Test-wide settings: 8 emulated CPU devices (for expert parallelism), hypothesis profiles,
the `gpu` marker, the one list of backends under test, and fixtures that read programs."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import contextlib  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

# Transformer Engine must load its CUDA libraries (cuDNN) before JAX initialises its GPU backend,
# or the two can pick up mismatched cuDNN builds; importing it is cheap and harmless elsewhere.
with contextlib.suppress(ImportError, OSError):
    import transformer_engine.jax  # noqa: F401

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

# Many tests compile the same programs (the tiny model's train and eval steps) in both xdist
# workers: a compilation cache shared by the workers of one run compiles each once (clean-clone
# runs on a 2-core box on 2026-12-05: 973 s of tests without it, 913 s with it). One directory
# per run (xdist's run id): JAX writes an entry in place, so an entry left truncated by a killed run
# must never be read by a later one (shared across runs, such an entry segfaulted two CI runs on
# 2026-12-05). The size bound turns on the cache's file lock, which keeps a worker from reading
# an entry while the other writes it. Directories an hour old are earlier runs', removed here.
# Without xdist, or with JAX_COMPILATION_CACHE_DIR set, this does nothing.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN_ID and not jax.config.jax_compilation_cache_dir:
    _TMP = pathlib.Path(tempfile.gettempdir())
    for _old in _TMP.glob("dropless-tests-jax-*"):
        with contextlib.suppress(OSError):
            if time.time() - _old.stat().st_mtime > 3600:
                shutil.rmtree(_old, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", str(_TMP / f"dropless-tests-jax-{_RUN_ID}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_compilation_cache_max_size", 2**31)


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def full_float32_matmuls(request):
    """Tests without the `gpu` marker compare float32 results with float32 tolerances, which
    assume float32 matmuls; on a GPU, XLA's default precision multiplies float32 in TF32 (about
    1e-3 relative error; 11 such failures in test_jnp when it ran on an H200). Those tests run
    at "highest" precision, which changes nothing on the CPU; `gpu` tests keep the default
    that training uses."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


def backends_under_test() -> list[str]:
    """Every single-device backend that loads here ("ep" needs a mesh: tested on its own)."""
    from dropless.backends import available_backends

    return [name for name in available_backends() if name not in ("ep", "nccl_ep")]


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", backends_under_test())


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
