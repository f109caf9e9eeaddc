"""Peak temporary memory XLA assigns to a train step (`memory_analysis()` of the compiled
step, CPU), with RMSNorm, SwiGLU and the cross-entropy by autodiff and with their hand-written
backwards, layers scanned (the default) and unrolled:

    python memory_scanned.py [LAYERS] [BATCH] [SEQ]

proxy-2b's widths with fewer layers, float32 weights, bf16 compute, the jnp-capacity backend,
XLA attention. The hand-written backwards are the library's at d78f5a4 (RMSNorm and SwiGLU
taken out in fb5c263), so this runs at d78f5a4. A measurement aid for the sixteenth run, not
library code; run from experiments/ with docs/bench_logs/h200-2026-12-04-run16 on
PYTHONPATH."""

import contextlib
import dataclasses
import sys

import jax
from step_backwards import autodiff_backwards

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig, init_state, train_step

layers, batch, seq = (int(a) for a in (sys.argv[1:] + ["4", "2", "1024"][len(sys.argv) - 1 :]))
for unroll in (False, True):
    config = dataclasses.replace(
        get_preset("proxy-2b"),
        num_hidden_layers=layers,
        compute_dtype="bfloat16",
        attention_impl="xla",
        unroll_layers=unroll,
    )
    state = init_state(
        DeepSeekV3(config, backend="jnp-capacity", key=jax.random.key(0)), TrainConfig()
    )
    tokens = jax.numpy.zeros((batch, seq + 1), jax.numpy.int32)
    for name, context in (
        ("autodiff", autodiff_backwards),
        ("hand-written", contextlib.nullcontext),
    ):
        jax.clear_caches()
        with context():
            memory = train_step.lower(state, tokens).compile().compiled.memory_analysis()
        print(
            f"== layers {layers} ({'unrolled' if unroll else 'scanned'}), batch {batch} x {seq}, "
            f"{name}: temp {memory.temp_size_in_bytes / 2**30:.2f} GiB",
            flush=True,
        )
