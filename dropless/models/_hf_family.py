"""How a Hugging Face MoE family's `config.json` maps onto `DeepSeekV3Config`: `HFFamily`.

Qwen3-MoE, Mixtral, OLMoE and gpt-oss are the same decoder as DeepSeek-V3 with grouped-query
attention in place of MLA, softmax top-k routing and no shared experts; each family package
holds one `HFFamily` (its field names, defaults and what it fixes), and
`DeepSeekV3Config.from_hf_config` and `to_hf_dict` go through it for that family's
`model_type` (`deepseek_v3._config.FAMILIES`).
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """One family's config mapping.

    - `renames`: {Hugging Face name: DeepSeekV3Config field} where the names differ.
    - `defaults`: the Hugging Face config class's defaults (its names), for keys a file omits.
    - `fixed`: DeepSeekV3Config values the family implies (attention kind, routing, no MTP).
    - `exported`: the Hugging Face names `to_hf_dict` writes (besides the model type).
    - `read`, `write`: the family's own rules, on the renamed dict (returning a new one) and on
      the written dict (in place, with the config).
    """

    model_type: str
    architecture: str
    renames: Mapping[str, str]
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any]
    exported: tuple[str, ...]
    read: Callable[[dict[str, Any]], dict[str, Any]] = dict
    write: Callable[[dict[str, Any], Any], None] = lambda out, config: None

    def from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """DeepSeekV3Config values (unknown keys kept: the caller drops them) of `hf`."""

        def renamed(d):  # several Hugging Face names (aliases) may map to one field
            return {self.renames.get(k, k): v for k, v in d.items()}

        out = self.read({**renamed(self.defaults), **renamed(hf)})
        out.update(self.fixed, model_type=self.model_type)
        return out

    def to_hf(self, config: Any) -> dict[str, Any]:
        """The Hugging Face config dict of `config`."""
        out = {name: getattr(config, self.renames.get(name, name)) for name in self.exported}
        for name, value in self.fixed.items():
            if getattr(config, name) != value:
                raise ValueError(
                    f"a {self.model_type} checkpoint has {name} = {value!r}; this config has "
                    f"{getattr(config, name)!r}"
                )
        out["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
        out["num_key_value_heads"], out["head_dim"] = config.kv_heads, config.gqa_head_dim
        out["model_type"] = self.model_type
        out["architectures"] = [self.architecture]
        self.write(out, config)
        return out


# The settings Qwen3-MoE, Mixtral and OLMoE share: GQA, softmax top-k without groups, scaling
# or MTP, and none of gpt-oss's additions.
GQA_MOE = {
    "attention_type": "gqa",
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_shared_experts": 0,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 0,
    "rope_interleave": False,
    "q_lora_rank": None,
    "attention_bias": False,
    "layer_types": None,
    "attention_sinks": False,
    "router_bias": False,
    "experts_bias": False,
    "swiglu_limit": None,
}
COMMON = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts_per_tok",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "hidden_act",
)
