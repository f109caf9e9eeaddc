"""The tiny preset's train step on the CPU (jnp backend, float32, where the gate-and-up
concatenation is one more copy of the weights rather than part of a cast), with gate and up as
one matmul (library) and as two (before); two rounds, one process. A measurement aid, not
library code: `python docs/bench_logs/cpu-2026-12-04-gate-up/cpu_gate_up.py` from the
repository root."""

import contextlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "experiments"), str(ROOT / "docs/bench_logs/h200-2026-12-04-run15")]

from bench_train import compare  # noqa: E402

from dropless.models.deepseek_v3 import get_preset  # noqa: E402

# step_gate_up.py runs its GPU comparison on import, so take only its patch from the source.
source = (ROOT / "docs/bench_logs/h200-2026-12-04-run15/step_gate_up.py").read_text()
scope: dict = {}
exec(source.split("bf16_moments =")[0], scope)  # noqa: S102

variants = {"one matmul (library)": contextlib.nullcontext, "two matmuls": scope["two_matmuls"]}
for _ in range(2):
    compare(get_preset("tiny"), "jnp", variants, batch=16, seq=64, steps=30)
