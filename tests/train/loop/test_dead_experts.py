"""Dead experts over a window of steps: the tracker against counting the window's loads
directly (hypothesis), and a tiny run whose routers can never choose four experts: its records
count them (and never fewer), and its expert-load plot is drawn."""

import json

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless import dead_experts
from dropless.models.deepseek_v3 import get_preset
from dropless.train.loop import _setup as setup
from dropless.train.loop._dead_experts import META_KEY, DeadExperts
from dropless.train.loop._finish import finish
from dropless.train.loop._loop import run_steps

loads = st.lists(
    st.lists(st.sampled_from([0, 0, 1, 5]), min_size=6, max_size=6), min_size=1, max_size=12
)


@given(loads, st.integers(1, 5), st.integers(0, 3))
def test_the_count_is_the_windows_never_chosen_experts(steps, window, first):
    tracker = DeadExperts(window)
    history = np.asarray(steps, np.float32).reshape(len(steps), 2, 3)  # 2 layers of 3 experts
    for t, load in enumerate(history):
        got = tracker.update(first + t + 1, load)
        seen = history[max(0, t - window + 1) : t + 1]
        assert got == int(np.asarray(dead_experts(jnp.asarray(seen))).sum())


@given(loads, st.integers(1, 5), st.integers(1, 11))
def test_a_saved_tracker_continues_as_the_uninterrupted_one(steps, window, cut):
    """What a checkpoint's metadata keeps (JSON) restores the count of the whole run."""
    history = np.asarray(steps, np.float32).reshape(len(steps), 2, 3)
    whole, first = DeadExperts(window), DeadExperts(window)
    want = [whole.update(t + 1, load) for t, load in enumerate(history)]
    cut = min(cut, len(history))
    for t in range(cut):
        first.update(t + 1, history[t])
    resumed = DeadExperts(window)
    resumed.restore(json.loads(json.dumps(first.saved())))
    got = [resumed.update(t + 1, history[t]) for t in range(cut, len(history))]
    assert got == want[cut:]
    fresh = DeadExperts(window)
    fresh.restore(None)  # a checkpoint from before the count was kept
    assert fresh.saved() is None


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window"):
        DeadExperts(0)


FORCED = 4  # experts per MoE layer that no token can choose


@pytest.mark.slow
def test_a_run_counts_the_experts_it_never_chooses(tmp_path, train_config):
    model_config = get_preset("tiny", num_hidden_layers=2)
    config = train_config(
        data="synthetic", steps=4, dead_expert_steps=2, bias_update_rate=0.0, plots=True
    )
    run = setup.start(model_config, config, backend="jnp", out_dir=str(tmp_path), callbacks=())

    def biases(state):
        model = state.model
        return [
            model.moe_layers.mlp.router.expert_bias,
            model.mtp.layers.block.mlp.router.expert_bias,
        ]

    # selection-only biases far below every sigmoid score: experts 0-3 are never in a top-2
    forced = [b.at[:, :FORCED].set(-1e3) for b in biases(run.state)]
    run.state = eqx.tree_at(biases, run.state, forced)
    try:
        records, _ = run_steps(run)
        results = finish(run, records, [])
    finally:
        run.lock.release()
    rows = len(results.layer_names)  # the MoE layer and the MTP block
    assert rows == 2
    unused = [r["unused_experts"] for r in records]  # chosen by no token in that step alone
    dead = [r["dead_experts"] for r in records]
    assert dead[0] == unused[0]  # a window of one step so far
    for t in range(1, len(records)):
        # dead over steps t-1 and t: at most those unused in either step, never fewer than forced
        assert rows * FORCED <= dead[t] <= min(unused[t - 1], unused[t])
    assert np.all(results.expert_load[:, :FORCED] == 0)
    # the final checkpoint keeps the window for a resume: the forced experts never chosen
    kept = run.checkpointer.read_meta(4)[META_KEY]
    assert [row[:FORCED] for row in kept] == [[None] * FORCED] * rows
    assert (tmp_path / "expert_load.png").stat().st_size > 10_000
