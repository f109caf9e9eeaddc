"""gpt-oss against transformers' GptOssForCausalLM: logits, loss and every parameter's
gradient on two tiny random configs (YaRN and a clamp that never binds / default rope and a
clamp that binds often; sliding and full layers both ways round); exact export round trips that
transformers reads back to the same logits; config translation and rules; the presets' sizes;
every CPU backend equal to the default strategies."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backends, read_safetensors
from test_hf_family import assert_matches_reference  # the families' parity check

from dropless import with_backend
from dropless.models import get_preset
from dropless.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, count_params
from dropless.models.deepseek_v3.hf import from_pretrained, save_pretrained
from dropless.train import weight_decay_mask

RTOL = 1e-4  # float32, max |ours - reference| / max |reference|
BATCH, SEQ = 2, 24

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)

CASES = {
    # YaRN over a short original context (so that it changes the frequencies), a window of 5,
    # sliding layers first (transformers' default layer_types), the released clamp
    "yarn-window5-limit7": dict(
        num_hidden_layers=3,
        intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },
    ),
    # default rope, full attention first, multi-head, a clamp at 0.5 that binds on most units
    "full-first-mha-limit0.5": dict(
        num_hidden_layers=2,
        layer_types=["full_attention", "sliding_attention"],
        num_key_value_heads=4,
        intermediate_size=24,
        num_local_experts=6,
        num_experts_per_tok=3,
        sliding_window=3,
        swiglu_limit=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


class Reference:
    """A random transformers gpt-oss saved to `path`, with its logits, loss and gradients."""

    def __init__(self, config: dict, path, seed: int):
        torch = pytest.importorskip("torch", exc_type=ImportError)
        transformers = pytest.importorskip("transformers", minversion="5.0", exc_type=ImportError)
        torch.manual_seed(seed)
        hf_config = transformers.GptOssConfig(**{**BASE, **config})
        hf_config._attn_implementation = "eager"
        model = transformers.GptOssForCausalLM(hf_config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith("sinks"):
                    p.copy_(torch.randn_like(p))
                else:  # fan-in scaled (the experts store [in out]; biases by their width)
                    fan_in = p.shape[-2] if "experts" in name and p.ndim == 3 else p.shape[-1]
                    p.copy_(torch.randn_like(p) / math.sqrt(fan_in))
        model.save_pretrained(path)
        self.tokens = torch.randint(0, hf_config.vocab_size, (BATCH, SEQ))
        out = model(self.tokens, labels=self.tokens)
        out.loss.backward()
        self.torch, self.model, self.path = torch, model, path
        self.logits = out.logits.detach().numpy()
        self.loss = out.loss.item()
        self.grads = {name: p.grad.numpy() for name, p in model.named_parameters()}


@pytest.fixture(scope="module", params=list(CASES))
def parity(request, tmp_path_factory):
    """(reference, dropless model) for one case."""
    path = tmp_path_factory.mktemp(request.param)
    ref = Reference(CASES[request.param], path, seed=list(CASES).index(request.param))
    model, _ = from_pretrained(path, dtype="float32", compute_dtype="float32", progress=False)
    return ref, model


def test_logits_loss_and_gradients_match_transformers(parity):
    ref, model = parity
    c = model.config
    assert c.model_type == "gpt_oss" and c.attention_sinks and c.router_bias and c.experts_bias
    assert_matches_reference(ref, model)


def test_export_round_trip_is_exact(parity, tmp_path):
    """transformers' files -> from_pretrained -> save_pretrained: the same tensors bit for
    bit, the same config, and transformers reads the export to the same logits."""
    ref, model = parity
    save_pretrained(model, model.config, tmp_path)
    source, exported = read_safetensors(ref.path), read_safetensors(tmp_path)
    assert sorted(exported) == sorted(source)
    for name, a in source.items():
        np.testing.assert_array_equal(exported[name], a, err_msg=name)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "gpt_oss"
    assert hf["layer_types"] == list(ref.model.config.layer_types)
    again = type(ref.model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with ref.torch.no_grad():
        logits = again(ref.tokens).logits.numpy()
    np.testing.assert_array_equal(logits, ref.logits)


def test_config_round_trip_and_defaults():
    config = DeepSeekV3Config.from_hf_config({"model_type": "gpt_oss", "num_hidden_layers": 4})
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 150000.0
    assert config.swiglu_limit == 7.0 and config.attention_bias and config.sliding_window == 128
    assert config.layer_windows() == (128, 2**31 - 1) * 2
    assert DeepSeekV3Config.from_hf_config(config.to_hf_dict()) == config


def test_config_rules():
    # a new depth repeats the layer types' pattern; a wrong length of them is refused
    sliding, full = "sliding_attention", "full_attention"
    assert get_preset("gpt-oss-tiny", num_hidden_layers=3).layer_types == (sliding, full, sliding)
    irregular = get_preset("gpt-oss-tiny", layer_types=(full, full, sliding, full))
    assert irregular.replace(num_hidden_layers=5).layer_types == (full, full, sliding, full, full)
    with pytest.raises(ValueError, match=r"layer_types .* for each of the num_hidden_layers \(4\)"):
        get_preset("gpt-oss-tiny", layer_types=(full, sliding))
    with pytest.raises(ValueError, match="sliding_window must be set"):
        get_preset("gpt-oss-tiny", sliding_window=None)
    with pytest.raises(ValueError, match="attention_sinks need attention_impl 'xla'"):
        get_preset("gpt-oss-tiny", attention_impl="cudnn")
    with pytest.raises(ValueError, match="moe_weights_before_down"):
        get_preset("gpt-oss-tiny", moe_weights_before_down=True)
    with pytest.raises(ValueError, match="needs attention_type 'gqa'"):
        get_preset("tiny", attention_sinks=True)
    with pytest.raises(ValueError, match="attention_sinks"):  # a Mixtral checkpoint has none
        get_preset("mixtral-tiny", attention_sinks=True).to_hf_dict()


def test_presets_match_published_numbers():
    """gpt-oss-20b's model card: 20.91B parameters in total, 3.61B active; the active count
    there leaves out the embedding table (not the unembedding)."""
    p = count_params(get_preset("gpt-oss-20b"))
    assert f"{p.total / 1e9:.2f}" == "20.91"
    assert f"{(p.active - p.embedding) / 1e9:.2f}" == "3.61"
    assert 0.7e6 < count_params(get_preset("gpt-oss-tiny")).total < 1.5e6


def plain_loss(model, tokens):
    logp = jax.nn.log_softmax(model(tokens).logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def randomized(model, key):
    """`model` with every bias and sink random (they start at zero)."""

    drawn = []

    def leaf(path, a):
        name = jax.tree_util.keystr(path[-1:], simple=True, separator="")
        if name.endswith("_bias") or name == "sinks":
            drawn.append(name)
            k = jax.random.fold_in(key, len(drawn))
            return 0.5 * jax.random.normal(k, a.shape, a.dtype)
        return a

    return jax.tree_util.tree_map_with_path(leaf, model)


@pytest.mark.slow
@pytest.mark.parametrize("backend", backends())
def test_backends_equal_the_default(backend):
    """Every CPU backend's loss and gradients equal the default strategies' on gpt-oss (the
    experts' biases and clamp take the unfused path whatever the strategy)."""
    config = get_preset("gpt-oss-tiny", swiglu_limit=0.5)
    model = randomized(DeepSeekV3(config, key=jax.random.key(0)), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, config.vocab_size)
    run = eqx.filter_jit(eqx.filter_value_and_grad(plain_loss))
    loss, grads = run(model, tokens)
    got_loss, got = run(with_backend(model, backend), tokens)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_weight_decay_spares_biases_sinks_and_norms():
    """AdamW decays gpt-oss's matrices only: not its biases (router, experts, attention), its
    sinks or its norms."""
    model = DeepSeekV3(get_preset("gpt-oss-tiny", num_hidden_layers=2), key=jax.random.key(0))
    mask = weight_decay_mask(model)
    names = {
        jax.tree_util.keystr(p, simple=True, separator="."): m
        for p, m in jax.tree_util.tree_leaves_with_path(mask)
    }
    decayed = sorted(n.rsplit(".", 1)[-1] for n, m in names.items() if m)
    assert decayed == sorted(
        ["embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj"]
        + ["w_router", "w_gate", "w_up", "w_down"]
    )
