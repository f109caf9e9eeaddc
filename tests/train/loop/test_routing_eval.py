"""Evaluation with recorded routing: the recorded choice is each batch's forward's, and a
replayed evaluation (in batches that split the file unevenly) equals one replayed forward over
every sequence; with the routers moved since, the recorded routing still rules."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    get_preset,
    load_routing,
    recorded_routing,
    save_routing,
)
from dropless.train import TrainConfig
from dropless.train.loop._routing_eval import evaluate_replay, record_routing
from dropless.train.step import cross_entropy
from dropless.train.store import LoadedRun

ROWS, WINDOW = 4, 13


@pytest.fixture(scope="module")
def model():
    return DeepSeekV3(get_preset("tiny", num_hidden_layers=2), key=jax.random.key(0))


def loaded(model) -> LoadedRun:
    return LoadedRun(
        run_dir="r",
        model_config=model.config,
        train_config=TrainConfig(batch_size=3),
        model=model,
        step=1,
        steps=[1],
        backend="jnp",
        tokenizer=None,
        tokenizer_source=None,
    )


@eqx.filter_jit
def forward(model, tokens, replay=None):
    out = model(tokens[:, :-1], replay=replay, return_routing=True)
    return cross_entropy(out.logits, tokens[:, 1:]), recorded_routing(out)


@pytest.mark.slow
def test_record_then_replay(model, tmp_path):
    windows = [
        np.asarray(jax.random.randint(jax.random.key(i), (ROWS, WINDOW), 0, 512), np.int32)
        for i in range(2)
    ]
    tokens, replay = record_routing(model, windows)
    assert tokens.shape == (2 * ROWS, WINDOW)
    c = model.config
    assert replay[0].shape == (c.n_moe_layers, 2 * ROWS * (WINDOW - 1), c.num_experts_per_tok)
    assert replay[1].shape[0] == c.num_nextn_predict_layers  # the MTP block's too
    ce_all, own = forward(model, jnp.asarray(tokens))
    for got, want in zip(replay, own, strict=True):
        np.testing.assert_array_equal(got, want)  # the batches' choices, in the batch order
    path = tmp_path / "routing.npz"
    save_routing(path, tokens, replay)

    result = evaluate_replay(loaded(model), path)  # batches of 3, 3 and 2 sequences
    assert (result["sequences"], result["tokens"]) == (2 * ROWS, 2 * ROWS * (WINDOW - 1))
    assert result["routing_agreement"] == 1.0
    np.testing.assert_allclose(result["ce"], ce_all, rtol=1e-5)
    np.testing.assert_allclose(result["ce_own_routing"], ce_all, rtol=1e-5)

    # the routers move (training since the recording): the recorded choice still routes
    def where(m):
        return m.moe_layers.mlp.router.w_router

    noise = jax.random.normal(jax.random.key(9), where(model).shape)
    moved = eqx.tree_at(where, model, where(model) + noise)
    replayed_ce, _ = forward(moved, jnp.asarray(tokens), replay)
    own_ce, _ = forward(moved, jnp.asarray(tokens))
    result = evaluate_replay(loaded(moved), path)
    np.testing.assert_allclose(result["ce"], replayed_ce, rtol=1e-5)
    np.testing.assert_allclose(result["ce_own_routing"], own_ce, rtol=1e-5)
    assert 0 < result["routing_agreement"] < 1
    assert abs(result["ce"] - result["ce_own_routing"]) > 1e-4


def test_routing_files_round_trip_and_bad_ones_are_named(model, tmp_path):
    tokens = np.arange(2 * 5, dtype=np.int32).reshape(2, 5)
    main = np.zeros((model.config.n_moe_layers, 2 * 4, 2), np.int32)
    path = tmp_path / "r.npz"
    save_routing(path, tokens, (main, None))
    got_tokens, (got_main, got_mtp) = load_routing(path, model.config)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_array_equal(got_main, main)
    assert got_mtp is None
    with pytest.raises(ValueError, match="batch \\* \\(seq - 1\\)"):
        save_routing(tmp_path / "x.npz", tokens, (main[:, :7], None))
    save_routing(path, tokens, (main + 99, None))
    with pytest.raises(ValueError, match="expert ids outside"):
        load_routing(path, model.config)
    save_routing(path, tokens, (np.concatenate([main, main]), None))
    with pytest.raises(ValueError, match="2 MoE layers, the model has 1"):
        load_routing(path, model.config)
    (tmp_path / "junk.npz").write_text("not numpy")
    with pytest.raises(ValueError, match="not a routing file"):
        load_routing(tmp_path / "junk.npz")
