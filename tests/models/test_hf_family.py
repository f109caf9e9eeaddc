"""Qwen3-MoE, Mixtral and OLMoE checkpoints against transformers: logits, loss and every
parameter's gradient on tiny random configs, two per family, checkpoints in both expert
layouts; exact export round trips that transformers reads back to the same logits; config
translation both ways."""

import dataclasses
import json
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import next_token_loss, read_safetensors, rel_err

from dropless.models.deepseek_v3 import DeepSeekV3Config, to_hf
from dropless.models.deepseek_v3._config import FAMILIES
from dropless.models.deepseek_v3.hf import from_pretrained, save_pretrained

RTOL = 1e-4  # float32, max |ours - reference| / max |reference|
BATCH, SEQ = 2, 24

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


@dataclasses.dataclass(frozen=True)
class Case:
    cls: str  # the transformers config class's name, less "Config"
    config: dict
    fused: bool  # transformers writes the fused expert layout


CASES = {
    "qwen3-headdim-norm-dense0": Case(
        "Qwen3Moe",
        dict(
            head_dim=12,
            num_experts=8,
            moe_intermediate_size=16,
            intermediate_size=40,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            num_hidden_layers=3,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        fused=True,
    ),
    "qwen3-window-tied-nonorm": Case(
        "Qwen3Moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=7,
            tie_word_embeddings=True,
            num_key_value_heads=1,
        ),
        fused=False,
    ),
    "mixtral-window": Case(
        "Mixtral",
        dict(num_local_experts=4, intermediate_size=24, sliding_window=9, rms_norm_eps=1e-5),
        fused=False,
    ),
    "mixtral-mha-8experts": Case(
        "Mixtral",
        dict(
            num_local_experts=8,
            num_experts_per_tok=3,
            intermediate_size=16,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        fused=True,
    ),
    "olmoe-gqa-nonorm": Case(
        "Olmoe",
        dict(num_experts=8, intermediate_size=16, norm_topk_prob=False),
        fused=False,
    ),
    "olmoe-mha-norm": Case(
        "Olmoe",
        dict(num_experts=6, intermediate_size=24, norm_topk_prob=True, num_key_value_heads=4),
        fused=True,
    ),
}


def per_expert(name: str, grad: np.ndarray, model_type: str) -> dict[str, np.ndarray]:
    """A fused expert tensor's gradient as the per-expert tensors `to_hf` names."""
    layer = name.rsplit(".experts.", 1)[0]
    if model_type == "mixtral":
        layer = layer.replace(".mlp", ".block_sparse_moe")
        gate, up, down = "w1", "w3", "w2"
    else:
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    out = {}
    for e, g in enumerate(grad):
        if name.endswith("gate_up_proj"):
            half = g.shape[0] // 2
            out[f"{layer}.experts.{e}.{gate}.weight"] = g[:half]
            out[f"{layer}.experts.{e}.{up}.weight"] = g[half:]
        else:
            out[f"{layer}.experts.{e}.{down}.weight"] = g
    return out


class Reference:
    """A random transformers model saved to `path`, with its logits, loss and gradients."""

    def __init__(self, case: Case, path, seed: int):
        torch = pytest.importorskip("torch", exc_type=ImportError)
        transformers = pytest.importorskip("transformers", minversion="5.0", exc_type=ImportError)
        torch.manual_seed(seed)
        hf_config = getattr(transformers, f"{case.cls}Config")(**{**BASE, **case.config})
        hf_config._attn_implementation = "eager"
        model = getattr(transformers, f"{case.cls}ForCausalLM")(hf_config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        model.save_pretrained(path, save_original_format=not case.fused)
        self.tokens = torch.randint(0, hf_config.vocab_size, (BATCH, SEQ))
        out = model(self.tokens, labels=self.tokens)
        out.loss.backward()
        self.torch, self.model, self.path, self.case = torch, model, path, case
        self.logits = out.logits.detach().numpy()
        self.loss = out.loss.item()
        model_type = hf_config.model_type
        self.grads: dict[str, np.ndarray] = {}
        for name, p in model.named_parameters():
            g = p.grad.numpy()
            if ".experts." in name:
                self.grads.update(per_expert(name, g, model_type))
            elif model_type == "mixtral" and name.endswith("mlp.gate.weight"):
                self.grads[name.replace(".mlp.", ".block_sparse_moe.")] = g
            else:
                self.grads[name] = g


@pytest.fixture(scope="module", params=list(CASES))
def parity(request, tmp_path_factory):
    """(reference, dropless model) for one case."""
    case = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = Reference(case, path, seed=list(CASES).index(request.param))
    model, _ = from_pretrained(path, dtype="float32", compute_dtype="float32", progress=False)
    return ref, model


def test_logits_loss_and_gradients_match_transformers(parity):
    assert_matches_reference(*parity)


def assert_matches_reference(ref, model):
    """Logits, loss and every parameter's gradient of `model` equal transformers' (`ref`)."""
    tokens = jnp.asarray(ref.tokens.numpy())
    logits = eqx.filter_jit(lambda m, t: m(t).logits)(model, tokens)
    assert rel_err(logits, ref.logits) <= RTOL
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(next_token_loss))(model, tokens)
    assert abs(float(loss) - ref.loss) <= 1e-5 * ref.loss
    ours = to_hf(grads)
    assert sorted(ours) == sorted(ref.grads)
    largest = max(float(np.max(np.abs(g))) for g in ref.grads.values())
    for name, g in ref.grads.items():
        assert ours[name].shape == g.shape, name
        # each gradient against its own scale (an expert no token reached: zero in both)
        scale = max(float(np.max(np.abs(g))), 1e-3 * largest)
        assert float(np.max(np.abs(ours[name] - g))) <= RTOL * scale, name


def test_export_round_trip_is_exact(parity, tmp_path):
    """transformers' files -> from_pretrained -> save_pretrained: the same tensors bit for
    bit, the same config, and transformers reads the export to the same logits."""
    ref, model = parity
    save_pretrained(model, model.config, tmp_path, fused_experts=ref.case.fused)
    source, exported = read_safetensors(ref.path), read_safetensors(tmp_path)
    assert sorted(exported) == sorted(source)
    for name, a in source.items():
        np.testing.assert_array_equal(exported[name], a, err_msg=name)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == ref.model.config.model_type
    again = type(ref.model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with ref.torch.no_grad():
        logits = again(ref.tokens).logits.numpy()
    np.testing.assert_array_equal(logits, ref.logits)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_config_round_trip(model_type):
    hf = {"model_type": model_type, "vocab_size": 100, "num_key_value_heads": 2, "head_dim": 16}
    config = DeepSeekV3Config.from_hf_config(hf)
    assert config.model_type == model_type and config.attention_type == "gqa"
    assert DeepSeekV3Config.from_hf_config(config.to_hf_dict()) == config
    family = FAMILIES[model_type]
    with pytest.raises(ValueError, match="n_shared_experts"):
        family.to_hf(config.replace(n_shared_experts=1))


def test_family_rules():
    with pytest.raises(ValueError, match="must come first"):
        DeepSeekV3Config.from_hf_config(
            {"model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [1]}
        )
    sparse2 = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "decoder_sparse_step": 2}
    with pytest.raises(ValueError, match=r"dense layers \[0, 2\]"):
        DeepSeekV3Config.from_hf_config(sparse2)
    window = {"model_type": "qwen3_moe", "sliding_window": 64}
    assert DeepSeekV3Config.from_hf_config(window).sliding_window is None  # not used
    window["use_sliding_window"] = True
    assert DeepSeekV3Config.from_hf_config(window).sliding_window == 64
    with pytest.raises(ValueError, match="clip_qkv"):
        DeepSeekV3Config.from_hf_config({"model_type": "olmoe", "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="router_jitter_noise"):
        DeepSeekV3Config.from_hf_config({"model_type": "mixtral", "router_jitter_noise": 0.1})
