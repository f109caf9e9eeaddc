"""Presets: counts against a formula derived here, the 671B config against DeepSeek's published
numbers and config.json, the other families' (Qwen3-MoE, Mixtral, OLMoE, Kimi K2) against
theirs, and the preset registries."""

import pytest

from dropless.models import PRESETS as ALL_PRESETS
from dropless.models import get_preset as get_any_preset
from dropless.models.deepseek_v3 import PRESETS, DeepSeekV3Config, count_params, get_preset


def analytic_counts(c: DeepSeekV3Config) -> dict[str, float]:
    """Parameter counts written out from the architecture, term by term."""
    d, h = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = d * h * qk
    else:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * qk  # a-proj, norm, b-proj
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    attn = q + kv + h * c.v_head_dim * d + 2 * d  # + o_proj + the block's two norms
    dense_layer = attn + 3 * d * c.intermediate_size
    routed = c.n_routed_experts * 3 * d * c.moe_intermediate_size
    bias = c.n_routed_experts if c.topk_method == "noaux_tc" else 0
    router = c.n_routed_experts * d + bias
    shared = 3 * d * c.moe_intermediate_size * c.n_shared_experts
    moe_layer = attn + routed + router + shared
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    emb = c.vocab_size * d
    head = 0 if c.tie_word_embeddings else emb
    total = emb + head + d + c.first_k_dense_replace * dense_layer + n_moe * moe_layer
    unused = routed * (1 - c.num_experts_per_tok / c.n_routed_experts)
    mtp_block, mtp_unused = (moe_layer, unused) if n_moe else (dense_layer, 0)
    mtp_module = 3 * d + 2 * d * d + mtp_block  # enorm, hnorm, shared_head.norm, eh_proj
    depth = c.num_nextn_predict_layers
    return {
        "total": total,
        "active": total - n_moe * unused,
        "mtp": depth * mtp_module,
        "mtp_active": depth * (mtp_module - mtp_unused),
        "bias": (n_moe + (depth if n_moe else 0)) * bias,
    }


@pytest.mark.parametrize("name", list(PRESETS))
def test_counts_match_formula(name):
    c = get_preset(name)
    got = count_params(c)
    want = analytic_counts(c)
    assert got.total == want["total"]
    assert got.active == pytest.approx(want["active"], abs=1)
    assert got.mtp == want["mtp"]
    assert got.mtp_active == pytest.approx(want["mtp_active"], abs=1)
    assert got.expert_bias == want["bias"]
    assert got.embedding == c.vocab_size * c.hidden_size


@pytest.mark.parametrize("name", ["tiny", "deepseek-v2-lite"])
def test_counts_match_formula_variants(name):
    # Tied embeddings, no MTP, all-dense: the formula and the model agree there too.
    for changes in (
        {"tie_word_embeddings": True},
        {"num_nextn_predict_layers": 0},
        {"first_k_dense_replace": 4, "num_hidden_layers": 4},
        {"num_nextn_predict_layers": 2, "topk_method": "group_limited_greedy"},
    ):
        c = get_preset(name, **changes)
        got, want = count_params(c), analytic_counts(c)
        assert (got.total, got.mtp) == (want["total"], want["mtp"]), changes


def test_671b_matches_published_numbers():
    p = count_params(get_preset("deepseek-v3-671b"))
    # DeepSeek-V3 technical report: 671B total, 37B activated per token.
    assert p.total == pytest.approx(671e9, rel=0.002)
    assert p.active == pytest.approx(37e9, rel=0.03)
    # Hugging Face model card: 685B = 671B main + 14B MTP (MTP with its own embedding and head).
    assert p.total + p.mtp_with_embeddings == pytest.approx(685e9, rel=0.002)
    assert p.mtp_with_embeddings == pytest.approx(14e9, rel=0.05)


def test_v2_lite_matches_published_numbers():
    p = count_params(get_preset("deepseek-v2-lite"))
    # DeepSeek-V2 paper: V2-Lite has 15.7B total, 2.4B activated (without the input embedding).
    assert p.total == pytest.approx(15.7e9, rel=0.005)
    assert p.active - p.embedding == pytest.approx(2.4e9, rel=0.03)
    assert p.mtp == p.mtp_with_embeddings == 0  # no MTP modules, so none of their copies


def test_sizes_of_the_smaller_presets():
    def total(name):
        return count_params(get_preset(name)).total_with_mtp

    assert 0.7e6 < total("tiny") < 1.5e6
    assert 80e6 < total("small") < 130e6
    assert 1.7e9 < total("proxy-2b") < 2.3e9


def test_671b_equals_the_published_config_json():
    # The keys of DeepSeek-V3's config.json (Hugging Face deepseek-ai/DeepSeek-V3).
    published = {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "ep_size": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    assert DeepSeekV3Config.from_hf_config(published) == get_preset("deepseek-v3-671b")


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny, small, proxy-2b"):
        get_preset("huge")


def test_overrides_are_validated():
    assert get_preset("tiny", compute_dtype="bfloat16").compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match="n_group"):
        get_preset("tiny", n_group=5)


# --- the other families ---------------------------------------------------------------------

GQA_PRESETS = [n for n in ALL_PRESETS if ALL_PRESETS[n]().attention_type == "gqa"]


def gqa_analytic_counts(c: DeepSeekV3Config) -> tuple[int, float]:
    """(total, active) of a grouped-query-attention model, term by term."""
    d, h, kv, hd = c.hidden_size, c.num_attention_heads, c.kv_heads, c.gqa_head_dim
    norms = {"none": 0, "head": 2 * hd, "full": h * hd + kv * hd}[c.qk_norm]
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d + norms + 2 * d
    if c.attention_bias:  # gpt-oss: q, k, v and o biases
        attn += h * hd + 2 * kv * hd + d
    if c.attention_sinks:
        attn += h
    routed = c.n_routed_experts * 3 * d * c.moe_intermediate_size
    if c.experts_bias:  # gate, up and down biases
        routed += c.n_routed_experts * (2 * c.moe_intermediate_size + d)
    moe_layer = attn + routed + c.n_routed_experts * d + c.router_bias * c.n_routed_experts
    dense_layer = attn + 3 * d * c.intermediate_size
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    emb = c.vocab_size * d
    head = 0 if c.tie_word_embeddings else emb
    total = emb + head + d + c.first_k_dense_replace * dense_layer + n_moe * moe_layer
    unused = routed * (1 - c.num_experts_per_tok / c.n_routed_experts)
    return total, total - n_moe * unused


@pytest.mark.parametrize("name", GQA_PRESETS)
def test_gqa_counts_match_formula(name):
    c = get_any_preset(name)
    got, (total, active) = count_params(c), gqa_analytic_counts(c)
    assert got.total == total
    assert got.active == pytest.approx(active, abs=1)
    assert got.mtp == got.expert_bias == 0


@pytest.mark.parametrize(
    ("name", "total", "digits", "active"),
    [
        # model cards: Qwen3-30B-A3B "30.5B in total and 3.3B activated"; Mixtral-8x7B 46.7B
        # and 12.9B (Mistral AI's announcement); OLMoE-1B-7B 6.9B and 1.3B (the OLMoE paper);
        # Kimi K2 "1T total, 32B activated" (Kimi-K2-Instruct's model card)
        ("qwen3-30b-a3b", 30.5e9, 3, 3.3e9),
        ("mixtral-8x7b", 46.7e9, 3, 12.9e9),
        ("olmoe-1b-7b", 6.9e9, 2, 1.3e9),
        ("kimi-k2", 1e12, 1, 32e9),
    ],
)
def test_family_presets_match_published_numbers(name, total, digits, active):
    p = count_params(get_any_preset(name))
    assert f"{p.total:.{digits}g}" == f"{total:.{digits}g}"  # to the digits published
    assert p.active == pytest.approx(active, rel=0.03)


def test_family_tiny_presets_are_tiny_and_registered():
    for name in ("qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny"):
        assert 0.7e6 < count_params(get_any_preset(name)).total < 1.5e6
    assert set(PRESETS) < set(ALL_PRESETS)
    with pytest.raises(ValueError, match="known presets: .*olmoe-1b-7b"):
        get_any_preset("olmoe-2b")
