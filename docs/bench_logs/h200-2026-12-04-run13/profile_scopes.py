"""The unrolled proxy-2b step (pallas, cuDNN attention, batch 8 x 2048): device time per scope,
then each scope's top kernels with the JAX op behind them, to see what besides cuDNN's kernels
fills the attention scope, and what fills dispatch, combine, route and ffn. A measurement aid
for the thirteenth run, not library code: `python profile_scopes.py` from experiments/,
command buffers off."""

import collections
import re

import _profile
import jax

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig, init_state, train_step

config = get_preset(
    "proxy-2b", compute_dtype="bfloat16", unroll_layers=True, attention_impl="cudnn"
)
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
print(f"total {sum(r['ms/step'] for r in scopes):.1f} ms/step of kernels")
for r in scopes:
    print(f"{r['scope']:>22} {r['ms/step']:8.2f} {r['share']:7.3f}")
names = _profile.op_names(hlo)
# Kernels of one scope summed by the JAX op they came from (layers merged: the path's digits
# and instruction suffixes differ per layer).
by_scope = collections.defaultdict(collections.Counter)
count = collections.defaultdict(collections.Counter)
for r in kernels:
    op = names.get(r["hlo op"], "?").split("/")[-1]
    kernel = re.sub(r"([._](\d+|clone))+$", "", r["kernel"])[:40]
    key = (kernel, op)
    by_scope[r["scope"]][key] += r["ms/step"]
    count[r["scope"]][key] += 1
for scope in [s["scope"] for s in scopes[:16]]:
    print(f"\n-- {scope}: ms/step, launches in 2 steps, kernel, op")
    for (kernel, op), ms in by_scope[scope].most_common(14):
        print(f"{ms:8.3f} {count[scope][(kernel, op)]:4d}  {kernel:40} {op[-70:]}")
