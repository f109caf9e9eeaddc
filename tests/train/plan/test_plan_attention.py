"""The plan of sliding-window and sink configs (`dropless.train.plan._attention`): attention
FLOPs of windowed layers by their window, their "xla" activations a full layer's (the window
masks full scores), and gpt-oss-20b's parameters, sinks included, counted by hand."""

from dropless.models import get_preset
from dropless.models.deepseek_v3 import count_params
from dropless.train.plan import flops_per_token, plan, traced_without_cudnn
from dropless.train.plan._attention import keys_per_query

BATCH, SEQ = 2, 512
FULL, SLIDING = "full_attention", "sliding_attention"


def test_windowed_layers_count_attention_by_their_window():
    """gpt-oss-tiny: layers 0 and 2 see 64 keys, 1 and 3 all 512; against the same model with
    four full layers, two layers' attention for 512 - 64 keys fewer, and nothing else."""
    windowed = get_preset("gpt-oss-tiny")
    full = windowed.replace(layer_types=(FULL,) * 4)
    assert windowed.layer_types == (SLIDING, FULL) * 2 and windowed.sliding_window == 64
    assert keys_per_query(windowed, SEQ) == (64, 512, 64, 512)
    per_key = 3 * 2 * 4 * (16 + 16)  # fwd + bwd, QK^T and AV, 4 heads of 16
    saved = per_key * 2 * (SEQ - 64)
    assert flops_per_token(full, SEQ) - flops_per_token(windowed, SEQ) == saved
    a, b = plan(windowed, "", BATCH, SEQ), plan(full, "", BATCH, SEQ)
    assert b.flops_per_step - a.flops_per_step == saved * BATCH * SEQ
    # a window as long as the sequence changes nothing; Mixtral's window is every layer's
    assert flops_per_token(windowed, 64) == flops_per_token(full, 64)
    mixtral = get_preset("mixtral-tiny", sliding_window=100)
    assert keys_per_query(mixtral, SEQ) == (100,) * 4
    assert keys_per_query(mixtral.replace(sliding_window=None), SEQ) == (SEQ,) * 4


def test_xla_keeps_a_windowed_layers_full_scores():
    """The "xla" attention (gpt-oss's: its sinks and layer types need it) masks a windowed
    layer's [seq seq] scores: the plan traces the same residuals as for a full layer. XLA's own
    buffer assignment agrees: gpt-oss-tiny, window 16, batch 16 x 64, remat "full": temp
    22,183,800 bytes windowed, 22,167,408 full."""
    for remat in ("none", "dots"):
        windowed = get_preset("gpt-oss-tiny", remat=remat)
        full = windowed.replace(layer_types=(FULL,) * 4)
        a, b = plan(windowed, "", BATCH, SEQ), plan(full, "", BATCH, SEQ)
        assert (a.activations, a.recompute) == (b.activations, b.recompute)


def test_gpt_oss_20b_parameters_by_hand():
    """The plan's count of gpt-oss-20b, by hand from its config.json: 20,914,757,184, of which
    24 x 64 sinks."""
    config = get_preset("gpt-oss-20b")
    vocab, dim, heads, kv, hd, experts, ffn = 201088, 2880, 64, 8, 64, 32, 2880
    attention = (dim + 1) * heads * hd + 2 * (dim + 1) * kv * hd + (heads * hd + 1) * dim
    sinks = heads
    router = (dim + 1) * experts
    moe = experts * ((dim + 1) * 2 * ffn + (ffn + 1) * dim)
    layer = attention + sinks + 2 * dim + router + moe  # two norms
    total = 2 * vocab * dim + 24 * layer + dim  # embedding, head, final norm
    assert total == 20_914_757_184
    assert plan(config, "expert=8", 8, 128).param_count == total == count_params(config).total
    without = config.replace(attention_sinks=False)
    assert plan(without, "expert=8", 8, 128).param_count == total - 24 * sinks


def test_cudnn_is_traced_as_what_keeps_the_same_or_more():
    """Without a GPU the plan traces MLA's cuDNN attention as the blockwise one and GQA's as
    the XLA one; other settings pass through."""
    mla = get_preset("tiny", attention_impl="cudnn")
    gqa = get_preset("qwen3-moe-tiny", attention_impl="cudnn")
    assert traced_without_cudnn(mla).attention_impl == "blockwise"
    assert traced_without_cudnn(gqa).attention_impl == "xla"
    assert traced_without_cudnn(get_preset("tiny")) == get_preset("tiny")
