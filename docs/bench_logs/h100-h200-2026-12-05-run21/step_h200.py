"""The unrolled proxy-2b step (pallas, cuDNN) on an H200, variants alternated in one process:
float32 logits (the default), bfloat16 logits, bfloat16 logits with the experts' SwiGLU fused
into the gate-and-up kernel (`PallasGroupedMatmul(fused_swiglu=True)`), and bfloat16 logits
with each tile candidate named (tune_mosaic.py's names) in place of `config_for`'s tiles.
Arguments: batch (24), rounds (2), variants (comma-separated names of `OPTIONS` or of tile
candidates; default "f32,bf16,fused"). JAX's persistent compilation cache is on, so a
later round reloads each variant's step instead of compiling it again. Run from experiments/
with it on PYTHONPATH. Written for the twenty-first run."""

import sys
from unittest import mock

import jax
from bench_train import compare, with_overrides
from tune_mosaic import ROW_CANDIDATES

from dropless.backends import Backend, mosaic_gmm
from dropless.backends.jnp import SortDispatcher
from dropless.backends.pallas import PallasGroupedMatmul
from dropless.models.deepseek_v3 import get_preset
from dropless.routing import JnpTopK

jax.config.update("jax_compilation_cache_dir", "/tmp/jax_cache")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 24
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
names = (sys.argv[3] if len(sys.argv) > 3 else "f32,bf16,fused").split(",")
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
bf16 = ["logits_dtype=bfloat16"]


def pallas(fused: bool) -> Backend:
    gmm = PallasGroupedMatmul(fused_swiglu=fused)
    return Backend(dispatcher=SortDispatcher(), gmm=gmm, topk=JnpTopK())


OPTIONS = {
    "f32": {},
    "bf16": {"set": bf16},
    "fused": {"set": bf16, "backend": pallas(True)},
    # written after the run's calls, for the next: float32 logits (the default) with the fused
    # SwiGLU, and the routing weights before the down projection
    "fused32": {"backend": pallas(True)},
    "early": {"set": ["moe_weights_before_down=true"]},
    # written in the twenty-third session: both, the scale in the fused kernel's epilogue
    "fused_early": {"set": ["moe_weights_before_down=true"], "backend": pallas(True)},
}


def run(name: str, round_: int):
    """One variant. A tile candidate runs as a context (`compare` takes options or a context,
    not both) on the config with bfloat16 logits already set."""
    label = f"{name} ({round_})"
    if name in OPTIONS:
        return compare(proxy, "pallas", {label: OPTIONS[name]}, batch=batch)
    config = ROW_CANDIDATES[name]  # the proxy's widths fit every candidate (tune_mosaic checks)
    patch = lambda: mock.patch.object(mosaic_gmm, "config_for", lambda out_width: config)  # noqa: E731
    return compare(with_overrides(proxy, bf16), "pallas", {label: patch}, batch=batch)


for round_ in range(1, rounds + 1):
    for name in names:
        run(name, round_)
