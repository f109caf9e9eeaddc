"""Kernel time of the unrolled proxy-2b step (pallas, cuDNN attention, batch 8 x 2048) with the
library's split layers and with a fully unrolled `jax.lax.scan`, one process, each compiled
afresh and profiled: per scope side by side, then the kernels (summed over layers by kernel
and JAX op) whose time differs most. A measurement aid for the thirteenth run, not library
code: `python profile_split.py` from experiments/, command buffers off."""

import collections
import re

import _profile
import jax

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset, layers
from dropless.train import TrainConfig, init_state, train_step

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
variants = {
    "split": layers.unrolled_scan,
    "scan": lambda body, x, xs: jax.lax.scan(body, x, xs, unroll=True),
}
per_scope, per_kernel = {}, {}
for name, fn in variants.items():
    jax.clear_caches()
    layers.unrolled_scan = fn
    model = DeepSeekV3(config, backend="pallas", key=jax.random.key(0))
    state = init_state(model, TrainConfig(steps=1000, warmup_steps=10))
    tokens = jax.random.randint(jax.random.key(1), (8, 2049), 0, config.vocab_size)
    hlo = train_step.lower(state, tokens, 1).compile().compiled.as_text()
    state, metrics = train_step(state, tokens, 1)
    jax.block_until_ready(metrics["loss"])

    def run():
        global state, metrics
        state, metrics = train_step(state, tokens, 1)
        jax.block_until_ready(metrics["loss"])

    scopes, kernels = _profile.profile(run, hlo, steps=2, top=100_000)
    names = _profile.op_names(hlo)
    per_scope[name] = {r["scope"]: r["ms/step"] for r in scopes}
    sums = collections.Counter()
    for r in kernels:
        op = names.get(r["hlo op"], "?").split("/")[-1]
        kernel = re.sub(r"([._](\d+|clone))+$", "", r["kernel"])[:40]
        sums[(r["scope"], kernel, op)] += r["ms/step"]
    per_kernel[name] = sums
    print(f"== {name}: {sum(per_scope[name].values()):.1f} ms/step of kernels", flush=True)

print(f"\n{'scope':>22} {'split':>8} {'scan':>8}")
for scope in sorted(per_scope["scan"], key=lambda s: -per_scope["scan"][s])[:20]:
    a, b = per_scope["split"].get(scope, 0.0), per_scope["scan"][scope]
    print(f"{scope:>22} {a:8.2f} {b:8.2f}")
keys = set(per_kernel["split"]) | set(per_kernel["scan"])
diff = sorted(keys, key=lambda k: -abs(per_kernel["split"][k] - per_kernel["scan"][k]))
print("\nsplit - scan, ms/step: scope, kernel, op")
for k in diff[:25]:
    d = per_kernel["split"][k] - per_kernel["scan"][k]
    print(f"{d:+8.3f} {per_kernel['split'][k]:8.3f} {k[0]:18} {k[1]:40} {k[2][-50:]}")
