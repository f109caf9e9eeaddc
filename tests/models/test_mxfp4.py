"""gpt-oss's MXFP4 experts: `dequantize_mxfp4` equals transformers' `convert_moe_packed_tensors`
bit for bit; a tiny random gpt-oss whose experts this test quantises with its own encoder,
written as the official files name them, imports to exactly transformers' dequantised weights
(float32 and bfloat16) and to its logits, and exports plain weights; malformed blocks are
refused."""

import json
import math

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dropless.models.deepseek_v3 import to_hf
from dropless.models.deepseek_v3.hf import (
    CheckpointError,
    dequantize_mxfp4,
    from_pretrained,
    save_pretrained,
)

RTOL = 1e-4  # float32 logits, max |ours - reference| / max |reference|
PACKED = ("gate_up_proj", "down_proj")
# gpt-oss-20b's config.json says so
QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4 E2M1, codes 0-7


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 of `w` [..., cols] along its last axis (a block's scale the least power of two
    that brings its largest |x| to 6 or below, values rounded to the nearest E2M1 magnitude):
    blocks [..., cols / 32, 16] and scales [..., cols / 32], uint8."""
    x = np.asarray(w, np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6)), -127)
    scaled = np.abs(x) / 2.0**exponent
    magnitude = np.abs(scaled[..., None] - MAGNITUDES).argmin(-1)  # ties: the smaller
    codes = (magnitude | np.where(x < 0, 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: the arrays follow `w`'s layout, which safetensors' writer does not
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(
        exponent[..., 0] + 127, np.uint8
    )


def transformers_dequantize(blocks, scales, dtype):
    torch = pytest.importorskip("torch", exc_type=ImportError)
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4", exc_type=ImportError)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype
    )
    return out.float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_equals_transformers(dtype, unchecked):
    """Every code in both nibbles, scales from 2^-127 to 2^125 (6 * 2^127 is past float32);
    [experts rows groups 16]."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(0, 253, (3, 5, 4), dtype=np.uint8)
    scales[0, 0, :2] = (0, 252)
    ours = dequantize_mxfp4(blocks, scales, getattr(ml_dtypes, dtype, np.float32))
    assert ours.shape == (3, 5, 128) and ours.dtype.name == dtype
    ref = transformers_dequantize(blocks, scales, dtype)  # [experts cols rows]
    np.testing.assert_array_equal(np.swapaxes(ours.astype(np.float32), -1, -2), ref)
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        unchecked(dequantize_mxfp4)(blocks, scales[..., :3])


def test_encoder_is_mxfp4():
    """The test's encoder: every value within half a grid step of the weight (at most 1 in
    units of the block's scale: the top step is 4 to 6), a block's largest value above 3 in
    those units (no smaller scale would fit it); signs and zeros kept."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 64)) * np.exp(rng.standard_normal((4, 1)))
    w[0, :32] = 0.0
    blocks, scales = encode_mxfp4(w)
    back = dequantize_mxfp4(blocks, scales).astype(np.float64)
    step = 2.0 ** (scales.astype(np.float64) - 127)  # the grid's unit per block
    err = np.abs(back - w).reshape(4, 2, 32) / step[..., None]
    assert err.max() <= 1.0 and np.all(back[0, :32] == 0)
    largest = (np.abs(w).reshape(4, 2, 32).max(-1) / step)[np.abs(w).reshape(4, 2, 32).max(-1) > 0]
    assert np.all((largest > 3) & (largest <= 6))
    assert np.all(np.sign(back) * np.sign(w) >= 0)


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """A random transformers gpt-oss saved with its experts in MXFP4 (this test's encoder),
    named as gpt-oss's release names them; the packed tensors; transformers' logits loading
    them (dequantising on CPU)."""
    torch = pytest.importorskip("torch", exc_type=ImportError)
    transformers = pytest.importorskip("transformers", minversion="5.0", exc_type=ImportError)
    torch.manual_seed(0)
    hf_config = transformers.GptOssConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = transformers.GptOssForCausalLM(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                fan_in = p.shape[-2] if "experts" in name and p.ndim == 3 else p.shape[-1]
                p.copy_(torch.randn_like(p) / math.sqrt(fan_in))
    path = tmp_path_factory.mktemp("mxfp4")
    model.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    packed = {}
    for name in list(tensors):
        if name.rsplit(".", 1)[-1] in PACKED:  # [experts in out], quantised along `in`
            blocks, scales = encode_mxfp4(np.swapaxes(tensors.pop(name), -1, -2))
            packed[name] = tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    assert len(packed) == 2 * hf_config.num_hidden_layers
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "quantization_config": QUANTIZATION}))
    reference = transformers.GptOssForCausalLM.from_pretrained(
        path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    tokens = torch.randint(0, hf_config.vocab_size, (2, 24))
    with torch.no_grad():
        logits = reference(tokens).logits.numpy()
    return path, packed, tokens.numpy(), logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_equals_transformers_dequantisation(quantised, dtype):
    path, packed, _, _ = quantised
    model, config = from_pretrained(path, dtype=dtype, progress=False)
    assert config.model_type == "gpt_oss" and config.param_dtype == dtype
    ours = to_hf(model)
    for name, (blocks, scales) in packed.items():
        assert ours[name].dtype.name == dtype, name
        ref = transformers_dequantize(blocks, scales, dtype)
        np.testing.assert_array_equal(ours[name].astype(np.float32), ref, err_msg=name)


def test_logits_match_transformers(quantised):
    path, _, tokens, logits = quantised
    model, _ = from_pretrained(path, dtype="float32", progress=False)
    out = eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(tokens))
    ours, ref = np.asarray(out, np.float64), logits.astype(np.float64)
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= RTOL


def test_export_writes_plain_weights(quantised, tmp_path):
    path, packed, _, _ = quantised
    model, config = from_pretrained(path, dtype="bfloat16", progress=False)
    save_pretrained(model, config, tmp_path)
    exported = load_file(str(tmp_path / "model.safetensors"))
    hf = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in hf and hf["dtype"] == "bfloat16"
    for name, (blocks, scales) in packed.items():
        assert f"{name}_blocks" not in exported and exported[name].dtype == ml_dtypes.bfloat16
        ref = transformers_dequantize(blocks, scales, "bfloat16")
        np.testing.assert_array_equal(exported[name].astype(np.float32), ref, err_msg=name)


def test_malformed_blocks_are_refused(quantised, tmp_path):
    path, packed, _, _ = quantised
    tensors = load_file(str(path / "model.safetensors"))
    name = next(iter(packed))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    bad = {**tensors, f"{name}_blocks": tensors[f"{name}_blocks"][..., :8]}
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}_blocks is U8 .* needs U8"):
        from_pretrained(tmp_path, progress=False)
    del tensors[f"{name}_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}_blocks without {name}_scales"):
        from_pretrained(tmp_path, progress=False)
    hf = json.loads((path / "config.json").read_text())
    del hf["quantization_config"]  # without it, packed tensors are no parameters
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(load_file(str(path / "model.safetensors")), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors: .*unexpected tensors"):
        from_pretrained(tmp_path, progress=False)
