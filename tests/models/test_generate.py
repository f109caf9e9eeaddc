"""Decoding with the KV cache (MLA's latent one, GQA's keys and values): cached logits == the
full forward's at every position (several configs, the GQA families' included), greedy
generate == a naive argmax loop, sampling settings and reproducibility, one compilation per
length bucket, equal-length prompts."""

import importlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models import get_preset as get_any_preset
from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    decode_step,
    generate,
    get_preset,
    init_cache,
    prefill,
    sample,
)
from dropless.models.deepseek_v3._generate import length_bucket

# the module (the package re-exports its function `generate` under the same name)
gen = importlib.import_module("dropless.models.deepseek_v3._generate")

BATCH, SEQ, PREFIX = 2, 20, 7

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Between them: q LoRA or not, YaRN, MTP or not, MoE stacks or dense only, interleaved or
# half-split rope, tied head or not.
CONFIGS = {
    # q LoRA, one dense + three MoE layers, one MTP module
    "tiny": get_preset("tiny"),
    # direct q_proj, YaRN (softmax scale with mscale), half-split rope, tied head, no MTP
    "yarn-no-q-lora": get_preset("tiny").replace(
        q_lora_rank=None,
        rope_scaling=YARN,
        rope_interleave=False,
        tie_word_embeddings=True,
        num_nextn_predict_layers=0,
        num_hidden_layers=3,
    ),
    # dense layers only (no MoE stack)
    "dense": get_preset("tiny").replace(
        num_hidden_layers=2, first_k_dense_replace=2, num_nextn_predict_layers=0
    ),
    # grouped-query attention: per-head QK norm, a dense layer first (Qwen3-MoE)
    "qwen3-moe": get_any_preset("qwen3-moe-tiny", num_hidden_layers=3, first_k_dense_replace=1),
    # a sliding window shorter than the sequence (Mixtral)
    "mixtral-window": get_any_preset("mixtral-tiny", num_hidden_layers=2, sliding_window=6),
    # QK norm over whole projections, one key-value head per query head (OLMoE)
    "olmoe": get_any_preset("olmoe-tiny", num_hidden_layers=2),
    # attention sinks and biases, a window of 5 on layers 0 and 2 only, the clamped SwiGLU
    # with expert biases (gpt-oss)
    "gpt-oss": get_any_preset(
        "gpt-oss-tiny",
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        swiglu_limit=0.5,
    ),
}


def _build(config, seed=0):
    """A model with random weights drawn by numpy: compiling the model's own initialisation
    costs seconds per config on a CPU. Norm weights and expert biases are perturbed too, so
    that a norm or bias the cached path forgot would show."""
    rng = np.random.default_rng(seed)
    shapes = eqx.filter_eval_shape(lambda k: DeepSeekV3(config, key=k), jax.random.key(0))

    def draw(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        name = path[-1].name
        noise = rng.standard_normal(leaf.shape)
        if name == "weight":  # RMSNorm
            noise = 1 + 0.1 * noise
        elif name == "expert_bias":
            noise = 0.1 * noise
        elif name == "embed_tokens":
            noise = noise * (config.hidden_size**-0.5 if config.tie_word_embeddings else 1.0)
        else:  # a [in out] matrix, or a stack of them
            noise = noise / np.sqrt(leaf.shape[-2])
        return jnp.asarray(noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="module")
def models():
    return {name: _build(c) for name, c in CONFIGS.items()}


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, 512)


@eqx.filter_jit
def full_logits(model, tokens):
    return model(tokens).logits


@eqx.filter_jit
def cached_logits(model, tokens, prefix: int):
    """Prefill `tokens[:, :prefix]`, then decode the rest one position at a time: the logits of
    every position, and the final cache."""
    batch, seq = tokens.shape
    cache = init_cache(model, batch, length_bucket(seq))
    first, cache = prefill(model, cache, tokens[:, :prefix])

    def step(cache, position):
        logits, cache = decode_step(model, cache, tokens[:, position], position)
        return cache, logits

    cache, rest = jax.lax.scan(step, cache, jnp.arange(prefix, seq))
    return jnp.concatenate([first, rest.transpose(1, 0, 2)], axis=1), cache


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_full_forward(models, tokens, name):
    model, c = models[name], CONFIGS[name]
    want = full_logits(model, tokens)
    got, cache = cached_logits(model, tokens, PREFIX)
    # Every position: the prefix's from prefill, each later one from its own decode step.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # MLA caches the latent and the rope key per layer, not per-head keys and values; GQA its
    # key-value heads' keys and values.
    layers = [(cache.dense, c.n_dense_layers), (cache.moe, c.n_moe_layers)]
    for stack, n in layers:
        if n == 0:
            assert stack is None
            continue
        if c.attention_type == "gqa":
            shape = (n, BATCH, length_bucket(SEQ), c.kv_heads, c.gqa_head_dim)
            assert stack.k.shape == stack.v.shape == shape
            continue
        assert stack.latent.shape == (n, BATCH, length_bucket(SEQ), c.kv_lora_rank)
        assert stack.k_rope.shape == (n, BATCH, length_bucket(SEQ), c.qk_rope_head_dim)


def test_prefill_in_chunks(models, tokens):
    """A prompt prefilled in two chunks gives the one-chunk logits (the second chunk attends
    to the first's cached entries)."""
    model = models["tiny"]
    run = eqx.filter_jit(prefill)
    cache = init_cache(model, BATCH, length_bucket(SEQ))
    # Equal chunks, so that one compilation serves both.
    a, cache = run(model, cache, tokens[:, :10], jnp.int32(0))
    b, _ = run(model, cache, tokens[:, 10:], jnp.int32(10))
    want = full_logits(model, tokens)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), want, rtol=1e-5, atol=1e-5)


def naive_greedy(model, prompt, new):
    """The full forward over the whole buffer at every step (causal: later slots are unseen)."""
    buf = np.zeros((prompt.shape[0], prompt.shape[1] + new), np.int32)
    buf[:, : prompt.shape[1]] = prompt
    for p in range(prompt.shape[1] - 1, buf.shape[1] - 1):
        buf[:, p + 1] = np.argmax(np.asarray(full_logits(model, jnp.asarray(buf))[:, p]), -1)
    return buf


@pytest.mark.parametrize("name", ["tiny", "mixtral-window"])
def test_greedy_generate_equals_naive_loop(models, tokens, name):
    model = models[name]
    prompt = np.asarray(tokens[:, :5])
    got = generate(model, prompt, max_new_tokens=SEQ - 5)
    assert got.shape == (BATCH, SEQ) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, naive_greedy(model, prompt, SEQ - 5))


def test_sampling(models, tokens):
    model, prompt = models["tiny"], tokens[:, :5]

    def run(**kw):
        return np.asarray(generate(model, prompt, max_new_tokens=SEQ - 5, **kw))

    greedy = run()
    a = run(temperature=1.0, key=jax.random.key(7))
    np.testing.assert_array_equal(a, run(temperature=1.0, key=jax.random.key(7)))
    assert not np.array_equal(a, run(temperature=1.0, key=jax.random.key(8)))
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(a[:, :5], prompt)
    # Only the best token survives top_k=1, or a nucleus smaller than its probability.
    np.testing.assert_array_equal(run(temperature=1.0, top_k=1, key=jax.random.key(7)), greedy)
    np.testing.assert_array_equal(run(temperature=2.0, top_p=1e-6, key=jax.random.key(3)), greedy)
    with pytest.raises(ValueError, match="needs a key"):
        run(temperature=1.0)


def test_eos_stops_a_row(models, tokens):
    model, prompt = models["tiny"], tokens[:, :5]
    greedy = np.asarray(generate(model, prompt, max_new_tokens=SEQ - 5))
    eos = int(greedy[0, 8])  # row 0 writes it at position 8 (maybe earlier too)
    got = np.asarray(generate(model, prompt, max_new_tokens=SEQ - 5, eos_id=eos))
    for row in range(BATCH):
        hits = np.flatnonzero(greedy[row, 5:] == eos)
        stop = SEQ if hits.size == 0 else 5 + hits[0]
        np.testing.assert_array_equal(got[row, : stop + 1], greedy[row, : stop + 1])
        assert np.all(got[row, stop:] == eos)


def test_sample_filters():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    keys = jax.random.split(jax.random.key(0), 2000)

    @jax.jit
    def draws(top_k, top_p):
        def one(key):
            return sample(logits, key, temperature=1.0, top_k=top_k, top_p=top_p)[0]

        return jax.vmap(one)(keys)

    counts = np.bincount(np.asarray(draws(4, 1.0)), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.05, 0.5, 0.15, 0.3], atol=0.04)
    counts = np.bincount(np.asarray(draws(2, 1.0)), minlength=4) / 2000  # the best two
    assert counts[0] == counts[2] == 0
    np.testing.assert_allclose(counts[1], 0.5 / 0.8, atol=0.04)
    # Nucleus 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it.
    counts = np.bincount(np.asarray(draws(4, 0.7)), minlength=4) / 2000
    assert counts[0] == counts[2] == 0 and counts[1] > 0 and counts[3] > 0
    greedy = sample(logits, jax.random.key(0))
    assert int(greedy[0]) == 1


def test_one_compilation_per_length_bucket(models, tokens, monkeypatch):
    traces = []
    original = gen.init_cache
    # `init_cache` runs once per trace of generate's compiled loop (prefill and decode_step
    # take the cache as an argument).
    monkeypatch.setattr(gen, "init_cache", lambda *a, **k: traces.append(1) or original(*a, **k))
    model = models["tiny"]
    assert length_bucket(5) == length_bucket(9) == 16 and length_bucket(20) == 32
    generate(model, tokens[:, :5], max_new_tokens=15)  # prompt bucket 16, cache bucket 32
    traces.clear()
    # Other lengths and settings in the same buckets: no new trace.
    generate(model, tokens[:, :9], max_new_tokens=20)
    sampled = dict(temperature=0.7, top_k=5, top_p=0.9, key=jax.random.key(1), eos_id=3)
    generate(model, tokens[:, :6], max_new_tokens=13, **sampled)
    assert traces == []
    generate(model, tokens[:, :5], max_new_tokens=40)  # cache bucket 64: a new compilation
    assert traces == [1]


def test_prompts_of_unequal_length_are_refused(models):
    with pytest.raises(ValueError, match="equal lengths"):
        generate(models["tiny"], [[1, 2, 3], [4, 5]], max_new_tokens=2)


def test_bad_lengths_are_refused(models, tokens):
    model = models["tiny"]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, tokens, max_new_tokens=model.config.max_position_embeddings)
    np.testing.assert_array_equal(generate(model, tokens, max_new_tokens=0), tokens)
    with pytest.raises(ValueError, match="do not fit"):
        prefill(model, init_cache(model, BATCH, 16), tokens)


@eqx.filter_jit
def routed(model, tokens, replay=None):
    """Logits and every MoE layer's expert choice of a forward, replayed or not."""
    out = model(tokens, return_routing=True, replay=replay)
    return out.logits, out.moe_stats.expert_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "gpt-oss"])
def test_generate_records_the_routing_a_forward_replays(models, tokens, name):
    """Routing replay from sampling: `generate(return_routing=True)` records each token's
    expert choice as decoding made it (the tokens are those generated without recording); a
    forward over the samples with that replay gives the sampling-time logits (prefill and
    decode), routes as recorded even after the router moved, and trains the router."""
    model, prompt = models[name], np.asarray(tokens[:, :5])
    sampled = dict(max_new_tokens=SEQ - 5, temperature=1.0, key=jax.random.key(3))
    out, replay = generate(model, prompt, return_routing=True, **sampled)
    np.testing.assert_array_equal(out, generate(model, prompt, **sampled))
    c = model.config
    main, mtp = replay
    assert main.shape == (c.n_moe_layers, BATCH * (SEQ - 1), c.num_experts_per_tok)
    assert mtp is None
    inputs = jnp.asarray(out[:, :-1])
    logits, own = routed(model, inputs)
    np.testing.assert_array_equal(main, own)  # decoding chose what the full forward chooses
    replayed, _ = routed(model, inputs, replay)
    np.testing.assert_array_equal(replayed, logits)
    sampling_time, _ = cached_logits(model, jnp.asarray(out), 5)
    np.testing.assert_allclose(replayed, sampling_time[:, :-1], rtol=1e-5, atol=1e-5)

    # the router moves (a training step since sampling): the replay still routes as recorded
    where = lambda m: m.moe_layers.mlp.router.w_router  # noqa: E731
    noise = jax.random.normal(jax.random.key(5), where(model).shape)
    moved = eqx.tree_at(where, model, where(model) + 0.5 * noise)
    _, moved_own = routed(moved, inputs)
    _, moved_replayed = routed(moved, inputs, replay)
    assert not np.array_equal(moved_own, main)
    np.testing.assert_array_equal(moved_replayed, main)

    @eqx.filter_jit
    @eqx.filter_grad
    def router_grad(w):
        logits = eqx.tree_at(where, moved, w)(inputs, replay=replay).logits
        labels = jnp.asarray(out[:, 1:, None])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels, -1))

    g = router_grad(where(moved))
    assert np.all(np.isfinite(g)) and float(jnp.abs(g).max()) > 0


def test_recording_runs_past_every_rows_eos(models, tokens):
    model, prompt = models["tiny"], np.tile(tokens[:1, :5], (BATCH, 1))
    greedy = np.asarray(generate(model, prompt, max_new_tokens=SEQ - 5))
    eos = int(greedy[0, 6])  # every row writes it by position 6: the plain loop stops there
    out, (main, _) = generate(
        model, prompt, max_new_tokens=SEQ - 5, eos_id=eos, return_routing=True
    )
    np.testing.assert_array_equal(out, generate(model, prompt, max_new_tokens=SEQ - 5, eos_id=eos))
    _, own = routed(model, jnp.asarray(out[:, :-1]))
    np.testing.assert_array_equal(main, own)  # every position routed, eos ones included
    dense = models["dense"]
    assert generate(dense, prompt, max_new_tokens=3, return_routing=True)[1] is None
