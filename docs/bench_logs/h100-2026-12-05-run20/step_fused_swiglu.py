"""The unrolled proxy-2b step (pallas, cuDNN; batch: the first argument, 16 if none) with the
experts' SwiGLU fused into the gate-and-up kernel (`PallasGroupedMatmul(fused_swiglu=True)`)
and without, two rounds in one process. Written after the twentieth run, not yet run. Run from
experiments/ with it on PYTHONPATH."""

import sys

from bench_train import compare

from dropless.backends import Backend
from dropless.backends.jnp import SortDispatcher
from dropless.backends.pallas import PallasGroupedMatmul
from dropless.models.deepseek_v3 import get_preset
from dropless.routing import JnpTopK

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
proxy = get_preset("proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn")


def pallas(fused: bool) -> Backend:
    gmm = PallasGroupedMatmul(fused_swiglu=fused)
    return Backend(dispatcher=SortDispatcher(), gmm=gmm, topk=JnpTopK())


for round_ in (1, 2):
    compare(
        proxy,
        "pallas",
        {
            f"fused SwiGLU ({round_})": {"backend": pallas(True)},
            f"plain ({round_})": {"backend": pallas(False)},
        },
        batch=batch,
    )
