"""The loss terms and the train step: the expert bias moves only by the sign rule, outside the
gradient and the weight decay.

Every step here uses the tiny preset at batch 8 x 32 tokens, so one compiled train step serves
the module (tests/conftest.py drops compiled programs between modules).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import PIDBiasUpdate, ProportionalBiasUpdate, SignBiasUpdate, update_expert_bias
from dropless.data._datasets import SyntheticCorpus
from dropless.models.deepseek_v3 import DeepSeekV3, ModelFeatures, ModelOutput, get_preset
from dropless.train import TrainConfig
from dropless.train.step import init_state, loss_terms, total_loss, train_step
from dropless.train.step._loss import batch_loads
from dropless.train.step._step import hparams

BATCH, SEQ = 8, 32


def tokens(step: int = 0) -> jax.Array:
    batch = SyntheticCorpus(512).batch(step, seed=0, batch_size=BATCH, seq_len=SEQ)
    return jnp.asarray(batch.tokens)


def biased_model(key: int = 0) -> DeepSeekV3:
    """The tiny model with non-zero expert biases (so weight decay would show on them)."""
    model = DeepSeekV3(get_preset("tiny"), key=jax.random.key(key))

    def where(m):
        return [m.moe_layers.mlp.router.expert_bias, m.mtp.layers.block.mlp.router.expert_bias]

    values = [jnp.linspace(-0.5, 0.5, b.size).reshape(b.shape) for b in where(model)]
    return eqx.tree_at(where, model, values)


def biases(model: DeepSeekV3) -> list[np.ndarray]:
    return [
        np.asarray(model.moe_layers.mlp.router.expert_bias),
        np.asarray(model.mtp.layers.block.mlp.router.expert_bias),
    ]


@eqx.filter_jit
@eqx.filter_value_and_grad(has_aux=True)
def loss_value_and_grad(model, batch):
    """The training loss (default weights) with its terms and the model's output as aux."""
    terms, out = loss_terms(model, batch)
    return total_loss(terms, hparams(TrainConfig())), (terms, out)


@pytest.mark.slow
def test_loss_is_the_weighted_sum_of_its_terms():
    model = DeepSeekV3(get_preset("tiny"), key=jax.random.key(0))
    # the terms as the loss's gradient sees them: one compiled program with the tests below
    (_, (terms, out)), _ = loss_value_and_grad(model, tokens())
    assert out.logits.shape == (BATCH, SEQ, 512)
    assert out.mtp_logits.shape == (1, BATCH, SEQ, 512)
    # at initialisation both cross-entropies are near uniform (log 512 = 6.24)
    assert 5.0 < float(terms["ce"]) < 8.0 and 5.0 < float(terms["mtp"]) < 8.0
    config = TrainConfig(mtp_loss_weight=0.5, balance_loss_coef=0.1, z_loss_coef=0.01)
    expected = (
        terms["ce"]
        + 0.5 * terms["mtp"]
        + 0.1 * terms["balance_loss"]
        + 1e-4 * terms["seq_balance_loss"]
        + 0.01 * terms["z_loss"]
    )
    np.testing.assert_allclose(total_loss(terms, hparams(config)), expected, rtol=1e-6)


@pytest.mark.slow
def test_expert_bias_gets_no_gradient_and_no_weight_decay():
    model = biased_model()
    before = biases(model)
    w_before = np.asarray(model.moe_layers.mlp.router.w_router)
    config = TrainConfig(bias_update_rate=0.0, weight_decay=0.5, warmup_steps=0, lr=1e-2)
    state, metrics = train_step(init_state(model, config), tokens())
    for b0, b1 in zip(before, biases(state.model), strict=True):
        np.testing.assert_array_equal(b0, b1)
    assert not np.array_equal(w_before, state.model.moe_layers.mlp.router.w_router)
    assert float(metrics["grad_norm"]) > 0 and int(state.step) == 1


@pytest.mark.slow
def test_bfloat16_parameters_stay_bfloat16():
    # AdamW's updates are float32 (float32 moments): added as they are, every bf16 parameter
    # would come back float32 after the first step. A dense and an MoE layer, no MTP block:
    # every kind of parameter, and a shorter compile.
    config = get_preset(
        "tiny",
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
    )
    model = DeepSeekV3(config, key=jax.random.key(0))
    state = init_state(model, TrainConfig(warmup_steps=0, lr=1e-2))

    def dtypes(tree):
        return [a.dtype for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]

    assert jnp.bfloat16 in dtypes(model)
    new, _ = train_step(state, tokens())
    assert dtypes(new.model) == dtypes(model)
    assert not np.array_equal(new.model.embed_tokens, model.embed_tokens)  # it trained


def test_expert_bias_follows_the_sign_rule():
    model = biased_model()
    before = biases(model)
    config = TrainConfig(bias_update_rate=0.01)
    state, metrics = train_step(init_state(model, config), tokens())
    load = np.asarray(metrics["tokens_per_expert"])  # rows: 3 MoE layers, then the MTP block
    assert load.shape == (4, 16)
    assert load.sum() == 4 * BATCH * SEQ * 2  # every token reaches k = 2 experts: no drops
    expected = [
        update_expert_bias(jnp.asarray(before[0]), jnp.asarray(load[:3]), 0.01),
        update_expert_bias(jnp.asarray(before[1]), jnp.asarray(load[3:]), 0.01),
    ]
    for got, want in zip(biases(state.model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    moved = np.abs(biases(state.model)[0] - before[0])
    assert moved.max() == pytest.approx(0.01, rel=1e-4)
    np.testing.assert_array_equal(np.asarray(state.expert_load), load)


@pytest.mark.slow
def test_loss_in_chunks_equals_the_loss_on_whole_logits():
    """`loss_chunk`: the model's features and the chunked head + loss give the same loss terms
    (main and MTP) and the same gradient of every parameter as the logits made at once; the
    features are what the logits come from."""
    plain = DeepSeekV3(get_preset("tiny"), key=jax.random.key(0))
    chunked = DeepSeekV3(get_preset("tiny", loss_chunk=24), key=jax.random.key(0))  # same weights
    batch = tokens()
    (want, (want_terms, logits)), want_grads = loss_value_and_grad(plain, batch)
    (got, (got_terms, features)), got_grads = loss_value_and_grad(chunked, batch)
    assert set(got_terms) == set(want_terms)
    for name in want_terms:
        np.testing.assert_allclose(got_terms[name], want_terms[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    pairs = zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True)
    for g, w in pairs:
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    # the model's outputs on the inputs batch[:, :-1]: its features, and the logits at once
    assert isinstance(features, ModelFeatures) and isinstance(logits, ModelOutput)
    np.testing.assert_allclose(plain.head(features.hidden), logits.logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_logits_train_within_their_rounding():
    """`logits_dtype="bfloat16"` in the loss of a bf16-compute model: the loss terms within the
    logits' rounding of the float32 logits' terms (2^-9 of the largest logit, twice), and every
    parameter's gradient as close to the float32-compute model's as the float32 logits' is
    (within 10%): the narrower logits add nothing to the error that bf16 compute makes."""
    exact = get_preset("tiny")
    models = {
        name: DeepSeekV3(config, key=jax.random.key(0))
        for name, config in {
            "float32": exact,
            "bf16": exact.replace(compute_dtype="bfloat16"),
            "bf16 logits": exact.replace(compute_dtype="bfloat16", logits_dtype="bfloat16"),
        }.items()
    }
    batch = tokens()
    runs = {name: loss_value_and_grad(model, batch) for name, model in models.items()}
    (_, (want_terms, want_out)), _ = runs["bf16"]
    (_, (got_terms, got_out)), _ = runs["bf16 logits"]
    assert got_out.logits.dtype == jnp.bfloat16
    bound = 2 * 2**-9 * float(jnp.abs(want_out.logits).max())
    for name in ("ce", "mtp"):
        np.testing.assert_allclose(got_terms[name], want_terms[name], rtol=0, atol=bound)
    exact_grads, wide_grads, narrow_grads = (jax.tree.leaves(run[1]) for run in runs.values())
    for ref, wide, narrow in zip(exact_grads, wide_grads, narrow_grads, strict=True):
        ref = np.asarray(ref, np.float32)
        wide_error = np.linalg.norm(np.asarray(wide, np.float32) - ref)
        narrow_error = np.linalg.norm(np.asarray(narrow, np.float32) - ref)
        assert narrow_error <= 1.1 * wide_error + 1e-7 * np.linalg.norm(ref)


def small_model(**changes) -> DeepSeekV3:
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0, **changes)
    return DeepSeekV3(config, key=jax.random.key(0))


@pytest.mark.slow
def test_global_balance_loss_in_micro_batches_is_the_whole_batchs():
    """The global-batch balance loss of a step in 2 micro-batches is the batch-wise loss of the
    whole batch in one pass, and so is the step it takes; the per-micro-batch loss is not."""
    config = TrainConfig(
        global_balance_loss_coef=0.1, seq_balance_loss_coef=0.0, bias_update_rate=0.0
    )
    batch = tokens()
    one, m1 = train_step(init_state(small_model(), config), batch)
    two, m2 = train_step(init_state(small_model(), config), batch, 2)
    np.testing.assert_allclose(m2["global_balance_loss"], m1["global_balance_loss"], rtol=1e-5)
    np.testing.assert_allclose(m1["global_balance_loss"], m1["balance_loss"], rtol=1e-6)
    assert abs(float(m2["balance_loss"]) - float(m1["balance_loss"])) > 1e-4
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    w1 = one.model.moe_layers.mlp.router.w_router
    w2 = two.model.moe_layers.mlp.router.w_router
    np.testing.assert_allclose(w2, w1, rtol=1e-4, atol=1e-6)
    # at 0 the pass that gathers the loads is skipped and the term reads 0
    off = TrainConfig(seq_balance_loss_coef=0.0, bias_update_rate=0.0)
    _, m0 = train_step(init_state(small_model(), off), batch, 2)
    assert float(m0["global_balance_loss"]) == 0.0


@pytest.mark.slow
def test_the_models_bias_rule_moves_the_bias():
    model = small_model(bias_update="proportional")
    assert model.moe_layers.mlp.router.bias_update == ProportionalBiasUpdate()
    before = jnp.array(model.moe_layers.mlp.router.expert_bias)  # the step donates the model
    state, metrics = train_step(init_state(model, TrainConfig(bias_update_rate=0.01)), tokens())
    load = metrics["tokens_per_expert"]
    want = ProportionalBiasUpdate()(before, load, 0.01)
    np.testing.assert_allclose(state.model.moe_layers.mlp.router.expert_bias, want, atol=1e-7)
    assert float(jnp.abs(want).max()) > 0


@pytest.mark.slow
def test_the_pid_rules_memory_lives_in_the_train_state():
    """Three steps under the PID rule: the bias and the rule's memory (`TrainState.bias_state`)
    follow the PID recurrence, in float64 here, on the steps' loads."""
    model = small_model(bias_update="pid", bias_pid_ki=0.5, bias_pid_kd=0.25)
    assert model.moe_layers.mlp.router.bias_update == PIDBiasUpdate(kp=1.0, ki=0.5, kd=0.25)
    bias = np.asarray(model.moe_layers.mlp.router.expert_bias, np.float64)
    state = init_state(model, TrainConfig(bias_update_rate=0.01))
    integral, last = np.zeros_like(bias), np.zeros_like(bias)
    for step in range(3):
        state, metrics = train_step(state, tokens(step))
        load = np.asarray(metrics["tokens_per_expert"], np.float64)
        target = load.mean(-1, keepdims=True)
        e = (target - load) / target
        integral += e
        bias += 0.01 * (e + 0.5 * integral + 0.25 * (e - last))
        last = e
        np.testing.assert_allclose(state.model.moe_layers.mlp.router.expert_bias, bias, atol=1e-6)
    main, mtp = state.bias_state
    assert mtp is None  # no MTP block
    np.testing.assert_allclose(main.integral, integral, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(main.error, last, rtol=1e-5, atol=1e-6)
    assert np.abs(integral).max() > 0.1  # the loads were uneven: the memory is not empty
    # the rule's gains are static: the whole batch's loads (a forward under jax.eval_shape,
    # its layers scanned) see no gain as a traced array
    shapes = eqx.filter_eval_shape(small_model, bias_update="pid")
    loads = jax.eval_shape(functools.partial(batch_loads, micro_batches=2), shapes, tokens())
    assert loads.shape == (1, 16)


@pytest.mark.slow
def test_zero_computation_experts_train_and_their_biases_follow_their_target():
    changes = dict(n_group=1, topk_group=1, n_zero_experts=2, zero_expert_active=1.0)
    model = small_model(**changes)
    moe = small_model(**changes).moe_layers.mlp  # the step donates `model`
    stats = eqx.filter_jit(lambda m, t: m(t[:, :-1]))(model, tokens()).moe_stats
    state, metrics = train_step(init_state(model, TrainConfig(bias_update_rate=0.01)), tokens())
    assert metrics["tokens_per_expert"].shape == (1, 16)  # one MoE layer
    assert 0 < float(metrics["active_experts"]) <= 2
    bias = state.model.moe_layers.mlp.router.expert_bias
    assert bias.shape == (1, 18)
    # the sign rule towards `MoE.bias_target`: 1 computing expert per token, 1 zero one
    loads = jnp.concatenate([stats.tokens_per_expert, stats.zero_tokens], -1)
    want = SignBiasUpdate()(moe.router.expert_bias, loads, 0.01, moe.bias_target(loads))
    np.testing.assert_allclose(bias, want, atol=1e-7)


@pytest.mark.slow
def test_bf16_weights_keep_float32_master_weights():
    """`weight_dtype="bfloat16"`: the model holds its trainable arrays in bf16 (the expert bias
    stays float32), the state the float32 master weights, which take the optimiser's update;
    the new weights are the master weights rounded. At lr 1e-4 Adam's first step moves a
    weight by about 1e-4, below half a bf16 ulp for |w| >= 2**-5: bf16 weights alone would
    lose those moves, the master weights keep them."""
    config = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
    model = DeepSeekV3(config, key=jax.random.key(0))
    train_config = TrainConfig(warmup_steps=0, lr=1e-4, weight_decay=0.0, weight_dtype="bfloat16")
    state = init_state(model, train_config)
    assert state.model.embed_tokens.dtype == jnp.bfloat16
    assert state.model.moe_layers.mlp.router.expert_bias.dtype == jnp.float32
    np.testing.assert_array_equal(state.master.embed_tokens, model.embed_tokens)
    assert init_state(model, TrainConfig()).master is None
    before = np.asarray(state.master.embed_tokens)
    weights_before = np.asarray(state.model.embed_tokens.astype(jnp.float32))

    new, _ = train_step(state, tokens())
    master = np.asarray(new.master.embed_tokens)
    assert master.dtype == np.float32
    np.testing.assert_array_equal(
        new.model.embed_tokens, new.master.embed_tokens.astype(jnp.bfloat16)
    )
    moved = np.abs(master - before)
    assert np.isclose(moved.max(), 1e-4, rtol=1e-2)  # Adam's first step: lr x sign(grad)
    lost = (moved > 0.5e-4) & (
        np.asarray(new.model.embed_tokens.astype(jnp.float32)) == weights_before
    )
    assert lost.sum() > 0  # moves a bf16 weight alone rounds away
