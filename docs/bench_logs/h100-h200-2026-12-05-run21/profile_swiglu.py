"""Where the fused SwiGLU's step time goes: the unrolled proxy-2b step (pallas, cuDNN, batch:
the first argument, 16 if none) profiled with `PallasGroupedMatmul(fused_swiglu=True)` and
without (bench_train.bench's profile: time by scope, top kernels, kernels by op of the
costliest scopes). Run from experiments/ with this folder on PYTHONPATH and XLA's command
buffers off (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`). Written for the twenty-first run."""

import pathlib
import sys

from bench_train import bench

from dropless.backends import Backend
from dropless.backends.jnp import SortDispatcher
from dropless.backends.pallas import PallasGroupedMatmul
from dropless.models.deepseek_v3 import get_preset
from dropless.routing import JnpTopK

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")
for fused in (True, False):
    backend = Backend(
        dispatcher=SortDispatcher(), gmm=PallasGroupedMatmul(fused_swiglu=fused), topk=JnpTopK()
    )
    name = "fused" if fused else "plain"
    print(f"\n######## {name}", flush=True)
    t, _ = bench(proxy, backend, batch, 2048, 2, profile_to=pathlib.Path(f"/tmp/prof/{name}"))
    print(f"== {name}: step {t:.4f} s (command buffers off)", flush=True)
