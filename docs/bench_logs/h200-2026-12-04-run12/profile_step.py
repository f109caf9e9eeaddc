"""Where the unrolled proxy-2b step (pallas, cuDNN attention, batch 8 x 2048) spends its device
time, with the JAX op behind each of the top kernels, and the compiled HLO kept for reading
(`$OUT/step_hlo.txt.gz`). A measurement aid for the twelfth run, not library code:
`python profile_step.py` from experiments/, command buffers off."""

import gzip
import os
import pathlib

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
out = pathlib.Path(os.environ.get("OUT", "."))
with gzip.open(out / "step_hlo.txt.gz", "wt") as f:
    f.write(hlo)
state, metrics = train_step(state, tokens, 1)
jax.block_until_ready(metrics["loss"])


def run():
    global state, metrics
    state, metrics = train_step(state, tokens, 1)
    jax.block_until_ready(metrics["loss"])


scopes, kernels = _profile.profile(run, hlo, steps=2, top=60)
print(f"total {sum(r['ms/step'] for r in scopes):.1f} ms/step of kernels")
for r in scopes:
    print(f"{r['scope']:>22} {r['ms/step']:8.2f} {r['share']:7.3f}")
names = _profile.op_names(hlo)
print("\ntop kernels: ms/step, kernel, hlo op, scope, op_name")
for r in kernels:
    op_name = names.get(r["hlo op"], "")
    where = f"{r['kernel'][:44]:44} {r['hlo op']:34} {r['scope']:18}"
    print(f"{r['ms/step']:7.3f}  {where} {op_name[-140:]}")
