"""Kimi K2 checkpoints: a config.json with `model_type: "kimi_k2"` (Moonshot's, DeepSeek-V3's
architecture and keys) imports as DeepSeek-V3 with logit and routing parity against
transformers' DeepseekV3ForCausalLM, and exports bit for bit with its model type; the
published config is the `kimi-k2` preset."""

import json

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from test_hf import RTOL, _randomise, read_all

from dropless.models.deepseek_v3 import DeepSeekV3Config, get_preset
from dropless.models.deepseek_v3.hf import from_pretrained, save_pretrained

# Kimi-K2-Instruct's config.json, as released (its FP8 quantization_config aside)
KIMI_K2_INSTRUCT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

# The same keys at toy sizes: YaRN over an original context shorter than the test's sequence
# (max_position_embeddings / original = factor, as in the release), float32 weights.
TINY = {
    **KIMI_K2_INSTRUCT,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 12,
    "num_experts_per_tok": 3,
    "num_hidden_layers": 3,
    "vocab_size": 96,
    "max_position_embeddings": 128,
    "rope_scaling": {
        **KIMI_K2_INSTRUCT["rope_scaling"],
        "original_max_position_embeddings": 16,
        "factor": 8.0,
    },
    "torch_dtype": "float32",
}
BATCH, SEQ = 2, 40


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A random transformers DeepseekV3ForCausalLM of TINY's shape saved with TINY as its
    config.json; its tokens and logits."""
    torch = pytest.importorskip("torch", exc_type=ImportError)
    transformers = pytest.importorskip("transformers", minversion="5.0", exc_type=ImportError)
    torch.manual_seed(0)
    hf_config = transformers.DeepseekV3Config.from_dict(
        {k: v for k, v in TINY.items() if k != "model_type"}
    )
    hf_config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    _randomise(model, torch)
    path = tmp_path_factory.mktemp("kimi")
    model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(TINY))
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
    with torch.no_grad():
        logits = model(tokens).logits.numpy()
    return torch, transformers, path, tokens, logits


def test_import_matches_transformers(kimi):
    _, _, path, tokens, logits = kimi
    model, config = from_pretrained(path, dtype="float32", progress=False)
    assert config.model_type == "kimi_k2" and config.attention_type == "mla"
    assert config.rope_scaling["beta_fast"] == config.rope_scaling["beta_slow"] == 1.0
    assert config.n_routed_experts == 12 and config.first_k_dense_replace == 1
    out = eqx.filter_jit(lambda m, t: m(t))(model, jnp.asarray(tokens.numpy()))
    assert rel_err(out.logits, logits) <= RTOL


def test_export_round_trip_keeps_the_model_type(kimi, tmp_path):
    """Kimi K2's files -> from_pretrained -> save_pretrained: the same tensors bit for bit, a
    config.json of model type kimi_k2 that reads back to the same config, and transformers'
    DeepseekV3ForCausalLM reads the export (as deepseek_v3) to the same logits."""
    torch, transformers, path, tokens, logits = kimi
    model, config = from_pretrained(path, dtype="float32", progress=False)
    save_pretrained(model, config, tmp_path)
    source, exported = read_all(path), read_all(tmp_path)
    assert sorted(exported) == sorted(source)
    for name, a in source.items():
        np.testing.assert_array_equal(exported[name], a, err_msg=name)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "kimi_k2" and hf["architectures"] == ["DeepseekV3ForCausalLM"]
    assert DeepSeekV3Config.from_hf_config(hf, param_dtype="float32") == config
    # transformers converts the per-expert tensors by model type: it reads a kimi_k2
    # checkpoint through a deepseek_v3 config, as Moonshot's instructions say
    as_v3 = transformers.DeepseekV3Config.from_dict(
        {k: v for k, v in hf.items() if k != "model_type"}
    )
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, config=as_v3, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(again(tokens).logits.numpy(), logits)


def test_published_config_is_the_preset():
    config = DeepSeekV3Config.from_hf_config(KIMI_K2_INSTRUCT)
    assert config == get_preset("kimi-k2")
    hf = config.to_hf_dict()
    assert hf["model_type"] == "kimi_k2" and hf["architectures"] == ["DeepseekV3ForCausalLM"]
    assert DeepSeekV3Config.from_hf_config(hf) == config
    assert DeepSeekV3Config.from_hf_config({**hf, "model_type": "deepseek_v3"}) != config
