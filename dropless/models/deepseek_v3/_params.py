"""Parameter counts from a config, through `jax.eval_shape` (nothing is allocated)."""

import dataclasses
import math

import equinox as eqx
import jax

from dropless._experts import GroupedExperts
from dropless._routing import TopKRouter
from dropless.models.deepseek_v3._config import DeepSeekV3Config
from dropless.models.deepseek_v3._model import DeepSeekV3


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a DeepSeek-V3 model.

    - `total`: the main model (embedding, layers, final norm, head): DeepSeek-V3's "671B".
    - `active`: per token: `total` with routed experts counted at k / n_routed_experts
      (embedding and head included): DeepSeek-V3's "37B".
    - `mtp`, `mtp_active`: the MTP modules' own parameters (embedding and head are shared).
    - `embedding`, `head`: the input table and the output head (0 when tied), part of `total`.
    - `expert_bias`: the routers' selection biases (in `total`; updated outside the gradient).
    """

    total: int
    active: int
    mtp: int
    mtp_active: int
    embedding: int
    head: int
    expert_bias: int

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp

    @property
    def mtp_with_embeddings(self) -> int:
        """MTP as DeepSeek's checkpoint stores it, with its own copy of embedding and head
        (DeepSeek-V3 reports 671B main + 14B MTP = 685B on that basis); 0 without MTP."""
        if not self.mtp:
            return 0
        return self.mtp + self.embedding + (self.head or self.embedding)


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape"))


def _routed(tree) -> int:
    nodes = jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, GroupedExperts))
    return sum(_size(n) for n in nodes if isinstance(n, GroupedExperts))


def _bias(tree) -> int:
    nodes = jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, TopKRouter))
    return sum(_size(n.expert_bias) for n in nodes if isinstance(n, TopKRouter))


def count_params(config: DeepSeekV3Config) -> ParamCount:
    """Total and active parameters of the model `config` describes, without allocating it."""
    model = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    main = eqx.tree_at(lambda m: m.mtp, model, None, is_leaf=lambda x: x is None)
    inactive = 1.0 - config.num_experts_per_tok / config.n_routed_experts
    total, mtp = _size(main), _size(model.mtp)
    return ParamCount(
        total=total,
        active=round(total - _routed(main) * inactive),
        mtp=mtp,
        mtp_active=round(mtp - _routed(model.mtp) * inactive),
        embedding=_size(model.embed_tokens),
        head=_size(model.lm_head),
        expert_bias=_bias(model),
    )
