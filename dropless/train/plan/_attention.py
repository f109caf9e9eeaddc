"""Attention's share of the model FLOPs (`dropless.train.plan.flops_per_token`), layer by
layer: a query meets the keys its layer's window spans.

Per token and layer, the forward's QK^T and AV take 2 * keys * heads * (qk_head_dim +
v_head_dim) FLOPs, the backward twice that. `keys` is `seq` for a full layer and min(seq,
window) for a sliding-window one (`sliding_window`, per layer under gpt-oss's `layer_types`;
MTP modules take `sliding_window`). The causal mask is not discounted: each query counts every
key in its span, as PaLM's MFU counts `seq` for full attention.

These are model FLOPs, what the algorithm needs: the "xla" attention computes (and keeps for
the backward) a windowed layer's full `[seq seq]` scores, the window a mask over them, so its
memory is a full layer's, which the activation model reads off the program
(`dropless.train.plan._activations`).
"""

from dropless.models.deepseek_v3 import DeepSeekV3Config


def keys_per_query(config: DeepSeekV3Config, seq: int) -> tuple[int, ...]:
    """The keys a query of a `seq`-token sequence meets in each layer: the main layers', then
    the MTP modules'."""
    main = config.layer_windows() or (config.sliding_window,) * config.num_hidden_layers
    mtp = (config.sliding_window,) * config.num_nextn_predict_layers
    return tuple(seq if w is None else min(seq, w) for w in (*main, *mtp))


def attention_flops_per_token(config: DeepSeekV3Config, seq: int) -> int:
    """Forward and backward attention FLOPs per token over every layer (QK^T and AV)."""
    per_key = 2 * config.num_attention_heads * (config.qk_head_dim + config.value_head_dim)
    return 3 * per_key * sum(keys_per_query(config, seq))


def traced_without_cudnn(config: DeepSeekV3Config) -> DeepSeekV3Config:
    """`config` with an attention that traces without a GPU in place of cuDNN's (which asks
    the cuDNN library for its version while tracing): MLA's blockwise attention, which keeps
    what cuDNN's keeps for the backward (the output and a float32 statistic per row); GQA has
    no blockwise attention, so its XLA attention, which also keeps the `[b heads s s]`
    probabilities that cuDNN's does not (the plan then counts more than the GPU keeps)."""
    if config.attention_impl != "cudnn":
        return config
    return config.replace(attention_impl="blockwise" if config.attention_type == "mla" else "xla")
