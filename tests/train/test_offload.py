"""Optimizer-state host offload: the moments live in pinned host memory between steps and the
steps equal the in-device ones (on CPU, placement differs only in the memory kind's label)."""

import dataclasses

import jax
import numpy as np
import pytest

from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig, offload, train
from dropless.train.sharded import prepare_model, shard_state
from dropless.train.step import init_state
from dropless.train.data import SyntheticCorpus
from dropless.models.deepseek_v3 import DeepSeekV3
from dropless import sharding

STEPS = 3
CONFIG = TrainConfig(
    steps=STEPS, batch_size=8, seq_len=16, eval_every=0, eval_batches=1, plots=False, warmup_steps=1
)


def _states(mesh):
    config = get_preset("tiny")
    model = DeepSeekV3(config, key=jax.random.key(0))
    if mesh is not None:
        model = prepare_model(model, mesh)
    state = init_state(model, CONFIG)
    return state if mesh is None else shard_state(state, mesh)


def _run(mesh, offloaded: bool):
    state = _states(mesh)
    if offloaded:
        state = offload.to_host(state)
        assert offload.moment_memory_kinds(state) == {offload.HOST}
    corpus = SyntheticCorpus(get_preset("tiny").vocab_size)
    losses = []
    for i in range(STEPS):
        tokens = corpus.batch(i, seed=0, batch_size=8, seq_len=16).tokens
        if offloaded:
            state, metrics = offload.train_step(mesh, state, tokens)
            assert offload.moment_memory_kinds(state) == {offload.HOST}
        elif mesh is None:
            from dropless.train.step import train_step
            state, metrics = train_step(state, jax.numpy.asarray(tokens))
        else:
            from dropless.train.sharded import sharded_train_step
            state, metrics = sharded_train_step(mesh, state, sharding.shard_batch(tokens, mesh))
        losses.append(float(metrics["loss"]))
    return losses, state


def test_offloaded_step_equals_device_step():
    want, want_state = _run(None, False)
    got, got_state = _run(None, True)
    assert got == want
    for a, b in zip(jax.tree.leaves(want_state.opt_state), jax.tree.leaves(got_state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
