"""DeepSeekV3Config: one test per validation rule, Hugging Face round trips, routing specs."""

import dataclasses
import json
import re

import pytest

from dropless.models import get_preset as get_any_preset
from dropless.models.deepseek_v3 import DeepSeekV3Config, get_preset
from dropless.models.deepseek_v3._config import DROPLESS_FIELDS, REMAT_POLICIES
from dropless.models.deepseek_v3._config_rules import validate
from dropless.models.deepseek_v3._layers import REMAT

POSITIVE = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "max_position_embeddings",
]


def tiny(**changes):
    return get_preset("tiny").replace(**changes)


@pytest.mark.parametrize("name", POSITIVE)
def test_sizes_must_be_positive(name):
    with pytest.raises(ValueError, match=rf"{name} \(0\) must be >= 1"):
        tiny(**{name: 0})


@pytest.mark.parametrize(
    "name", ["n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"]
)
def test_counts_must_be_non_negative(name):
    with pytest.raises(ValueError, match=rf"{name} \(-1\) must be >= 0"):
        tiny(**{name: -1})


def test_q_lora_rank_positive_or_none():
    with pytest.raises(ValueError, match=r"q_lora_rank \(0\) must be >= 1, or None"):
        tiny(q_lora_rank=0)
    assert tiny(q_lora_rank=None).q_lora_rank is None


def test_dense_layers_at_most_all_layers():
    with pytest.raises(
        ValueError, match=r"first_k_dense_replace \(5\) must be <= num_hidden_layers \(4\)"
    ):
        tiny(first_k_dense_replace=5)
    assert tiny(first_k_dense_replace=4).n_moe_layers == 0


def test_rope_dim_even():
    with pytest.raises(ValueError, match=r"qk_rope_head_dim \(7\) must be even"):
        tiny(qk_rope_head_dim=7)


def test_top_k_at_most_experts():
    with pytest.raises(
        ValueError, match=r"num_experts_per_tok \(17\) must be <= n_routed_experts \(16\)"
    ):
        tiny(num_experts_per_tok=17)


def test_experts_divisible_by_groups():
    with pytest.raises(
        ValueError, match=r"n_routed_experts \(16\) must be divisible by n_group \(3\)"
    ):
        tiny(n_group=3)


def test_topk_group_at_most_n_group():
    with pytest.raises(ValueError, match=r"topk_group \(3\) must be <= n_group \(2\)"):
        tiny(topk_group=3)


def test_top_k_reachable_in_selected_groups():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be <= topk_group \* "):
        tiny(n_group=4, topk_group=1, num_experts_per_tok=5)


def test_noaux_tc_needs_two_experts_per_group():
    with pytest.raises(ValueError, match=r"'noaux_tc' ranks groups by their two best"):
        tiny(n_group=16, topk_group=2)
    tiny(n_group=16, topk_group=2, topk_method="group_limited_greedy")  # max: fine


def test_greedy_ignores_groups():
    c = tiny(topk_method="greedy", n_group=3, topk_group=1)  # 16 % 3 != 0 does not matter
    assert c.routing_spec().n_group == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("topk_method", "bogus"),
        ("scoring_func", "tanh"),
        ("param_dtype", "float16"),
        ("compute_dtype", "fp8"),
        ("remat", "some"),
        ("attention_impl", "flash"),
        ("logits_dtype", "float16"),
    ],
)
def test_choices(field, value):
    with pytest.raises(ValueError, match=rf"{field} \('{value}'\) must be one of"):
        tiny(**{field: value})


@pytest.mark.parametrize(
    "field, value, rule",
    [("n_routed_experts", 16.0, "an int"), ("q_lora_rank", 8.0, "an int or None"),
     ("rms_norm_eps", "small", "a number"), ("unroll_layers", 1, "True or False"),
     ("loss_chunk", 2.5, "an int or None"), ("moe_weights_before_down", "yes", "True or False")],
)  # fmt: skip
def test_field_kinds(field, value, rule):
    # set past the constructor: the tests' runtime type checks would reject the value first,
    # where a user's YAML or `--set` value reaches the validation
    config = tiny()
    object.__setattr__(config, field, value)
    with pytest.raises(ValueError, match=re.escape(f"{field} ({value!r}) must be {rule}")):
        validate(config)


def test_routed_scaling_positive():
    with pytest.raises(ValueError, match=r"routed_scaling_factor \(0.0\) must be > 0"):
        tiny(routed_scaling_factor=0.0)


def test_rms_norm_eps_positive():
    with pytest.raises(ValueError, match=r"rms_norm_eps \(0.0\) must be > 0"):
        tiny(rms_norm_eps=0.0)


def test_rope_theta_above_one():
    with pytest.raises(ValueError, match=r"rope_theta \(1.0\) must be > 1"):
        tiny(rope_theta=1.0)


def test_hidden_act_silu():
    with pytest.raises(ValueError, match=r"hidden_act \('gelu'\) must be 'silu'"):
        tiny(hidden_act="gelu")


def test_attention_bias_needs_gqa():
    with pytest.raises(ValueError, match=r"attention_bias \(True\) needs attention_type 'gqa'"):
        tiny(attention_bias=True)


def test_rope_scaling_type():
    with pytest.raises(ValueError, match=r"rope_scaling type \('dynamic'\) must be one of"):
        tiny(rope_scaling={"type": "dynamic", "factor": 2.0})


def test_rope_scaling_factor():
    with pytest.raises(
        ValueError, match=r"rope_scaling\['factor'\] \(0.5\) must be given and >= 1"
    ):
        tiny(rope_scaling={"type": "yarn", "factor": 0.5})
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\] \(None\)"):
        tiny(rope_scaling={"rope_type": "linear"})


def test_rope_scaling_original_length():
    with pytest.raises(ValueError, match=r"original_max_position_embeddings'\] \(0\) must be >= 1"):
        tiny(rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 0})


def test_rope_scaling_must_be_a_mapping():
    # set past the constructor, as a YAML or `--set` value reaches it (the tests' runtime type
    # checks would object first)
    config = tiny()
    object.__setattr__(config, "rope_scaling", "yarn")
    with pytest.raises(ValueError, match=r"rope_scaling \('yarn'\) must be a mapping"):
        config.__post_init__()


@pytest.mark.parametrize(
    "key, value, rule",
    [("factor", "4", "a finite number"), ("factor", float("inf"), "a finite number"),
     ("mscale_all_dim", "x", "a finite number"), ("beta_fast", True, "a finite number"),
     ("original_max_position_embeddings", 4.5, "an int")],
)  # fmt: skip
def test_rope_scaling_numbers(key, value, rule):
    scaling = {"type": "yarn", "factor": 4, key: value}
    with pytest.raises(
        ValueError, match=re.escape(f"rope_scaling[{key!r}] ({value!r}) must be {rule}")
    ):
        tiny(rope_scaling=scaling)
    assert tiny(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096.0}
    )


@pytest.mark.parametrize("field", ["routed_scaling_factor", "rms_norm_eps"])
def test_infinite_floats_are_rejected(field):
    with pytest.raises(ValueError, match=rf"{field} \(inf\) must be > 0 and finite"):
        tiny(**{field: float("inf")})


def test_rope_scaling_betas():
    with pytest.raises(ValueError, match=r"beta_fast >= beta_slow > 0, got 1 and 32"):
        tiny(rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32})


def test_remat_choices_match_the_policy_table():
    assert set(REMAT_POLICIES) == set(REMAT)


def test_routing_spec_per_topk_method():
    v3 = tiny().routing_spec()
    assert (v3.scoring_func, v3.use_expert_bias, v3.group_score) == ("sigmoid", True, "top2_sum")
    assert (v3.n_group, v3.topk_group, v3.num_experts_per_tok) == (2, 1, 2)
    v2 = tiny(topk_method="group_limited_greedy", scoring_func="softmax").routing_spec()
    assert (v2.scoring_func, v2.use_expert_bias, v2.group_score) == ("softmax", False, "max")
    lite = get_preset("deepseek-v2-lite").routing_spec()
    assert (lite.n_group, lite.use_expert_bias, lite.norm_topk_prob) == (1, False, False)


def test_frozen_hashable_and_private_rope_scaling():
    scaling = {"type": "linear", "factor": 2.0}
    c = tiny(rope_scaling=scaling)
    scaling["factor"] = 100.0  # the caller's dict changing later must not change the config
    assert c.rope_scaling["factor"] == 2.0
    assert hash(c) == hash(tiny(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c == tiny(rope_scaling={"factor": 2.0, "type": "linear"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 3


@pytest.mark.parametrize("name", ["tiny", "deepseek-v2-lite", "deepseek-v3-671b"])
def test_hf_round_trip(name, tmp_path):
    c = get_preset(name, compute_dtype="bfloat16", remat="dots")
    hf = c.to_hf_dict()
    assert hf["model_type"] == "deepseek_v3"
    assert not set(DROPLESS_FIELDS) & set(hf)
    dropless = {f: getattr(c, f) for f in DROPLESS_FIELDS}
    assert DeepSeekV3Config.from_hf_config(hf, **dropless) == c
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert DeepSeekV3Config.from_json(path, **dropless) == c


def test_from_hf_ignores_unknown_keys_and_coerces_floats():
    hf = get_preset("tiny").to_hf_dict()
    hf.update({"torch_dtype": "bfloat16", "quantization_config": {"x": 1}, "rope_theta": 50000})
    c = DeepSeekV3Config.from_hf_config(hf)
    assert c.rope_theta == 50000.0 and isinstance(c.rope_theta, float)


def test_from_hf_unknown_override_is_an_error():
    hf = get_preset("tiny").to_hf_dict()
    with pytest.raises(ValueError, match="unknown field.s. compute_dtyp in the overrides"):
        DeepSeekV3Config.from_hf_config(hf, compute_dtyp="bfloat16")


def test_from_hf_missing_keys_take_hf_defaults():
    c = DeepSeekV3Config.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 4})
    assert c.hidden_size == 7168 and c.topk_method == "noaux_tc" and c.num_nextn_predict_layers == 1


def test_from_hf_deepseek_v2_defaults():
    # A V2-Lite config.json: no MTP key, null groups; V2's defaults apply, not V3's.
    hf = {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "q_lora_rank": None,
        "n_group": None,
        "topk_group": None,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
    }
    c = DeepSeekV3Config.from_hf_config(hf)
    assert (c.topk_method, c.scoring_func, c.norm_topk_prob) == ("greedy", "softmax", False)
    assert (c.n_group, c.topk_group, c.num_nextn_predict_layers, c.q_lora_rank) == (1, 1, 0, None)


def test_from_hf_rope_parameters():
    # transformers >= 5 writes rope_theta and the scaling into one `rope_parameters` dict.
    hf = get_preset("tiny").to_hf_dict()
    del hf["rope_scaling"], hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0}
    c = DeepSeekV3Config.from_hf_config(hf)
    assert c.rope_theta == 20000.0 and c.rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    assert DeepSeekV3Config.from_hf_config(hf).rope_scaling is None


@pytest.mark.parametrize("value", [0, -3])
def test_loss_chunk_positive_or_none(value):
    assert tiny(loss_chunk=64).loss_chunk == 64 and tiny().loss_chunk is None
    with pytest.raises(ValueError, match=rf"loss_chunk \({value}\) must be >= 1, or None"):
        tiny(loss_chunk=value)


def test_gqa_refuses_the_blockwise_attention():
    """Only MLA has a blockwise attention; a GQA config asking for it is refused, not run as
    the XLA one."""
    with pytest.raises(ValueError, match=r"attention_impl 'blockwise' is MLA's"):
        get_any_preset("qwen3-moe-tiny", attention_impl="blockwise")
    assert get_any_preset("qwen3-moe-tiny", attention_impl="cudnn").attention_impl == "cudnn"
