"""`keep_freed_memory`: glibc reuses freed large buffers instead of faulting in fresh pages.

Checked in fresh interpreters (the setting must come before JAX starts): the default grouped
matmul's fwd+bwd at 128 experts, whose weight gradient (64 MiB) is too large for a worker
thread's malloc arena and above glibc's largest mmap threshold, is called repeatedly, and the
median fresh pages of its later calls are compared with and without the setting (a block is
now and then faulted in afresh even with it).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from dropless import _allocator
from dropless._allocator import keep_freed_memory

GLIBC_LINUX = _allocator._is_glibc()

FRESH_PAGES = textwrap.dedent(
    """
    import resource, sys
    from dropless._allocator import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else False
    import jax, jax.numpy as jnp
    from dropless.backends._chunked import chunked_grouped_matmul
    # 8 rows an expert: the 64 MiB weight gradient is what matters, not the rows' work
    rows, experts = 1024, 128
    lhs, rhs = jnp.ones((rows, 256)), jnp.ones((experts, 256, 512))
    group_sizes = jnp.full((experts,), rows // experts, jnp.int32)
    loss = lambda a, b: chunked_grouped_matmul(a, b, group_sizes, 16).sum()
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for _ in range(8):  # glibc's free lists settle over the first calls
        jax.block_until_ready(fwd_bwd(lhs, rhs))
    fresh_mib = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(fwd_bwd(lhs, rhs))
        pages = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        fresh_mib.append(pages * resource.getpagesize() / 2**20)
    print(applied, sorted(fresh_mib)[6])
    """
)


def _median_fresh_mib_per_call(mode: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    run = subprocess.run(
        [sys.executable, "-c", FRESH_PAGES, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    applied, mib = run.stdout.split()
    return applied, float(mib)


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc's allocator only")
@pytest.mark.slow
def test_a_freed_large_buffer_is_reused_instead_of_faulted_in():
    applied, kept_mib = _median_fresh_mib_per_call("keep")
    assert applied == "True"
    _, default_mib = _median_fresh_mib_per_call("default")
    # by default the weight gradient is mmapped and faulted in afresh at every call
    assert default_mib > 48, default_mib
    assert kept_mib < 4, kept_mib


@pytest.mark.skipif(not GLIBC_LINUX, reason="glibc's allocator only")
def test_too_late_once_jax_runs(monkeypatch):
    import jax.numpy as jnp

    jnp.ones(2).block_until_ready()  # JAX has started in this process
    monkeypatch.setattr(_allocator, "_applied", False)
    with pytest.warns(RuntimeWarning, match="before the first JAX computation"):
        assert keep_freed_memory() is False
    assert keep_freed_memory(warn=False) is False


def test_nothing_to_do_off_glibc(monkeypatch):
    monkeypatch.setattr(_allocator, "_applied", False)
    monkeypatch.setattr(_allocator, "_is_glibc", lambda: False)
    assert keep_freed_memory() is False


@pytest.mark.parametrize("threshold", [0, 1000, 2**20 - 1, 2**31])
def test_bad_threshold_names_the_field(monkeypatch, threshold):
    monkeypatch.setattr(_allocator, "_applied", False)
    with pytest.raises(ValueError, match=r"threshold .* from 1 MiB .* to 2\*\*31 - 1 bytes"):
        keep_freed_memory(threshold)
