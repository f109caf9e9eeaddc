"""The arrays a train step's forward keeps for its backward (JAX's `saved_residuals`, traced,
nothing compiled or run), largest first, for a preset at a batch size:

    python residuals.py BACKEND BATCH ATTENTION_IMPL

A measurement aid for the sixteenth run, not library code; run from experiments/."""

import collections
import dataclasses
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.step import hparams, weighted_loss

backend, batch, attention = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = dataclasses.replace(
    get_preset("proxy-2b"), unroll_layers=True, compute_dtype="bfloat16", attention_impl=attention
)
model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, backend=backend, key=jax.random.key(0)))
params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
weights = hparams(TrainConfig())
tokens = jax.ShapeDtypeStruct((batch, 2049), jnp.int32)


def loss(params, tokens):
    return weighted_loss(eqx.combine(params, static), tokens, weights)[0]


size, count, total = collections.Counter(), collections.Counter(), 0
for aval, why in saved_residuals(loss, params, tokens):
    if "from the argument" in why:
        continue
    key = (aval.str_short(), why.split(" at ")[0][:100])
    size[key] += aval.size * aval.dtype.itemsize
    count[key] += 1
    total += aval.size * aval.dtype.itemsize
for key, b in sorted(size.items(), key=lambda kv: -kv[1])[:40]:
    print(f"{b / 2**30:8.3f} GiB x{count[key]:3d} {key[0]:30s} {key[1]}")
print(f"residuals in all: {total / 2**30:.2f} GiB ({backend}, batch {batch}, {attention})")
