"""Hugging Face checkpoints: logit and routing parity with transformers (when torch and
transformers are importable), MTP parity with transformers' MtpModel, exact export round trips,
FP8 block dequantisation, the name table at DeepSeek-V3 671B shapes, and every kind of bad input."""

import dataclasses
import json
import math
import shutil
import tracemalloc

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err
from safetensors.numpy import save_file

from dropless.models.deepseek_v3 import (
    DeepSeekV3,
    dropless_names,
    get_preset,
    hf_names,
    to_hf,
    unstack,
)
from dropless.models.deepseek_v3.hf import (
    CheckpointError,
    config_from_pretrained,
    dequantize_fp8,
    from_pretrained,
    iter_checkpoint,
    save_pretrained,
)
from dropless.models.deepseek_v3.hf._names import LAYER, check_coverage, tensor_table

RTOL = 1e-4  # float32 logits, max |ours - reference| / max |reference|
BATCH, SEQ = 2, 40  # SEQ > the YaRN cases' original context (32)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    rms_norm_eps=1e-6,
)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # "v3" | "v2": which transformers class is the reference
    config: dict
    fused: bool  # transformers writes the fused expert layout (save_original_format=False)
    mtp: bool = False  # add an MTP layer to the files (checked against transformers' MtpModel)


CASES = {
    "v3-mha-nogroups-norm-tied": Case(
        "v3",
        dict(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=0,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        fused=True,
    ),
    "v3-qlora-groups4of2-nonorm-yarn-dense1": Case(
        "v3",
        dict(
            q_lora_rank=16,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            num_hidden_layers=3,
            rope_parameters=YARN,
        ),
        fused=False,
        mtp=True,
    ),
    "v3-qlora-groups2of1-norm-yarn-mscale-dense2": Case(
        "v3",
        dict(
            q_lora_rank=16,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            n_shared_experts=2,
            first_k_dense_replace=2,
            num_hidden_layers=3,
            rope_parameters={**YARN, "rope_theta": 500.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        ),
        fused=True,
    ),
    "v2-greedy-softmax-yarn": Case(
        "v2",
        dict(
            q_lora_rank=None,
            topk_method="greedy",
            n_group=None,
            topk_group=None,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
            num_hidden_layers=2,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        ),
        fused=False,
    ),
    "v2-group-limited-greedy": Case(
        "v2",
        dict(
            q_lora_rank=16,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            norm_topk_prob=False,
            routed_scaling_factor=2.0,
            first_k_dense_replace=0,
            num_hidden_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        fused=True,
    ),
}


def read_all(path) -> dict[str, np.ndarray]:
    return {name: np.array(a) for name, a in iter_checkpoint(path)}


def rewrite(path, tensors: dict[str, np.ndarray], **config_changes) -> None:
    """Replaces the checkpoint in `path` by one file holding `tensors`, and edits config.json."""
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config_changes:
        hf = json.loads((path / "config.json").read_text())
        hf.update(config_changes)
        (path / "config.json").write_text(json.dumps(hf))


# --- the transformers reference ------------------------------------------------------------------


def _randomise(model, torch) -> None:
    """Every parameter random (norms around 1, projections 1/sqrt(fan_in)), and the expert
    biases, which transformers initialises to zero, random as well."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))


def _add_mtp_tensors(path, config, rng) -> None:
    """Appends one random MTP layer, named as DeepSeek releases it, to a transformers checkpoint
    (transformers' DeepseekV3ForCausalLM writes none)."""
    skeleton = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    shapes = {
        jax.tree_util.keystr(p, simple=True, separator="."): tuple(leaf.shape)
        for p, leaf in jax.tree_util.tree_leaves_with_path(skeleton)
    }
    tensors = read_all(path)
    for name, t in tensor_table(shapes, config).items():
        m = LAYER.match(name)
        if m is None or int(m[1]) < config.num_hidden_layers:
            continue
        if name.endswith(".embed_tokens.weight"):
            tensors[name] = tensors["model.embed_tokens.weight"]
        elif name.endswith(".shared_head.head.weight"):
            tensors[name] = tensors["lm_head.weight"]
        elif "norm" in name:
            tensors[name] = (1 + 0.2 * rng.standard_normal(t.shape)).astype(np.float32)
        elif "e_score_correction_bias" in name:
            tensors[name] = (0.1 * rng.standard_normal(t.shape)).astype(np.float32)
        else:
            tensors[name] = (rng.standard_normal(t.shape) / math.sqrt(t.shape[-1])).astype(
                np.float32
            )
    rewrite(path, tensors)


class Reference:
    """A transformers model, its checkpoint directory, its logits and routing on `tokens`."""

    def __init__(self, case: Case, path, seed: int):
        torch = pytest.importorskip("torch", exc_type=ImportError)
        # 5.x: rope_parameters, save_original_format (the fused expert layout), MtpModel
        transformers = pytest.importorskip("transformers", minversion="5.0", exc_type=ImportError)
        torch.manual_seed(seed)
        if case.family == "v3":
            hf_config = transformers.DeepseekV3Config(**{**BASE, **case.config})
            cls = transformers.DeepseekV3ForCausalLM
        else:
            hf_config = transformers.DeepseekV2Config(**{**BASE, **case.config})
            cls = transformers.DeepseekV2ForCausalLM
        hf_config._attn_implementation = "eager"
        model = cls(hf_config).eval()
        _randomise(model, torch)
        model.save_pretrained(path, save_original_format=not case.fused)
        if case.mtp:
            _add_mtp_tensors(path, config_from_pretrained(path), np.random.default_rng(seed))
        self.torch, self.transformers, self.model, self.path, self.case = (
            torch,
            transformers,
            model,
            path,
            case,
        )
        self.tokens = torch.randint(0, hf_config.vocab_size, (BATCH, SEQ))
        gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        self.routing: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

        def hook(module, args, out):
            _, weights, ids = out
            h = args[0].reshape(-1, args[0].shape[-1])
            self.routing.append((h.numpy(), ids.numpy(), weights.detach().numpy()))

        handles = [g.register_forward_hook(hook) for g in gates]
        with torch.no_grad():
            out = model(self.tokens, output_hidden_states=True)
        for h in handles:
            h.remove()
        self.logits = out.logits.numpy()
        self.last_hidden = out.hidden_states[-1]  # after the final norm: what MTP reads

    def mtp_logits(self) -> np.ndarray:
        """transformers' MtpModel on the same checkpoint: depth 0's logits at positions
        0 .. SEQ - 2 (position i reads token i + 1 and the main hidden state at i)."""
        try:
            from transformers.modeling_layers import MtpModel
        except ImportError:
            pytest.skip("this transformers has no MtpModel")

        n = self.model.config.num_hidden_layers
        # transformers finds MTP weights by the main model's ignore patterns (layer 61 there).
        self.model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
        self.model.config.name_or_path = str(self.path)
        self.model.config.dtype = self.torch.float32
        mtp = MtpModel.from_pretrained(self.model).eval()
        mtp.set_attn_implementation("eager")
        with self.torch.no_grad():
            h = mtp.forward_layer(
                0,
                self.last_hidden[:, :-1],
                self.torch.arange(SEQ - 1)[None],
                None,
                input_ids=self.tokens[:, 1:],
            )
            return mtp._project_to_logits(h).numpy()


@pytest.fixture(scope="module", params=list(CASES))
def parity(request, tmp_path_factory):
    """(reference, dropless model, its output on the same tokens) for one case."""
    case = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = Reference(case, path, seed=list(CASES).index(request.param))
    model, config = from_pretrained(path, dtype="float32", compute_dtype="float32")
    assert config.num_nextn_predict_layers == int(case.mtp)
    out = eqx.filter_jit(lambda m, t: m(t))(model, jnp.asarray(ref.tokens.numpy()))
    return ref, model, out


def test_logits_match_transformers(parity):
    ref, _, out = parity
    err = rel_err(out.logits, ref.logits)
    print(f"{ref.path.name}: max relative logit error {err:.2e}")
    assert err <= RTOL


def test_routing_matches_transformers(parity):
    """Each MoE layer picks exactly the experts transformers picks: on transformers' own hidden
    states through our router, and in our own forward pass (tokens per expert)."""
    ref, model, out = parity
    assert len(ref.routing) == model.config.n_moe_layers > 0
    for layer, (h, hf_ids, hf_weights) in enumerate(ref.routing):
        router = unstack(model.moe_layers, layer).mlp.router
        routing = router(jnp.asarray(h))
        ours_ids, ours_w = np.asarray(routing.expert_ids), np.asarray(routing.weights)
        order_ours, order_hf = np.argsort(ours_ids, -1), np.argsort(hf_ids, -1)
        np.testing.assert_array_equal(
            np.take_along_axis(ours_ids, order_ours, -1), np.take_along_axis(hf_ids, order_hf, -1)
        )
        np.testing.assert_allclose(
            np.take_along_axis(ours_w, order_ours, -1),
            np.take_along_axis(hf_weights, order_hf, -1),
            rtol=1e-5,
            atol=1e-6,
        )
        counts = np.bincount(hf_ids.ravel(), minlength=model.config.n_routed_experts)
        np.testing.assert_array_equal(np.asarray(out.moe_stats.tokens_per_expert[layer]), counts)


def test_mtp_matches_transformers(parity):
    ref, _, out = parity
    if not ref.case.mtp:
        pytest.skip("no MTP layer in this case")
    err = rel_err(out.mtp_logits[0, :, : SEQ - 1], ref.mtp_logits())
    print(f"{ref.path.name}: max relative MTP logit error {err:.2e}")
    assert err <= RTOL


def test_export_round_trip_is_exact(parity, tmp_path):
    """transformers' files -> from_pretrained -> save_pretrained: the same tensors, bit for bit
    (in the layout the source used), and transformers reads the export to the same logits."""
    ref, model, _ = parity
    save_pretrained(model, model.config, tmp_path, fused_experts=ref.case.fused)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["model_type"] == f"deepseek_{ref.case.family}"
    source, exported = read_all(ref.path), read_all(tmp_path)
    assert sorted(exported) == sorted(source)
    for name, a in source.items():
        assert exported[name].dtype == a.dtype, name
        np.testing.assert_array_equal(exported[name], a, err_msg=name)
    again = type(ref.model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with ref.torch.no_grad():
        logits = again(ref.tokens).logits.numpy()
    np.testing.assert_array_equal(logits, ref.logits)


# --- export round trips without transformers -----------------------------------------------------


def small_config(**changes):
    return get_preset("tiny").replace(vocab_size=64, num_hidden_layers=3, **changes)


def random_model(config, seed=0):
    """A model with every parameter random and distinct (norms around 1, expert biases nonzero),
    filled from numpy into an `eval_shape` skeleton: nothing to compile."""
    rng = np.random.default_rng(seed)
    skeleton = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))

    def fill(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        x = rng.standard_normal(leaf.shape)
        if "norm" in name:
            x = 1.0 + 0.2 * x
        elif "expert_bias" in name:
            x = 0.1 * x
        else:
            x = x / math.sqrt(leaf.shape[-1])
        return jnp.asarray(x.astype(np.float32), leaf.dtype)

    return jax.tree_util.tree_map_with_path(
        fill, skeleton, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )


def assert_same_params(a, b):
    la = jax.tree_util.tree_leaves_with_path(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb, strict=True):
        name = jax.tree_util.keystr(path)
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random tiny float32 model with MTP, saved as one file."""
    config = small_config()
    model = random_model(config, 0)
    path = tmp_path_factory.mktemp("saved")
    save_pretrained(model, config, path)
    return model, config, path


@pytest.mark.parametrize("fused", [False, True])
def test_sharded_bfloat16_round_trip_with_mtp(tmp_path, fused):
    config = small_config(param_dtype="bfloat16")
    model = random_model(config, 1)
    save_pretrained(model, config, tmp_path / "a", max_shard_size="100KB", fused_experts=fused)
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "a" / "model.safetensors").exists()
    loaded, loaded_config = from_pretrained(tmp_path / "a", progress=False)
    assert loaded_config == config  # bfloat16 taken from config.json
    assert loaded.moe_layers.mlp.router.w_router.dtype == jnp.float32  # routers stay float32
    assert loaded.embed_tokens.dtype == jnp.bfloat16
    assert_same_params(loaded, model)
    save_pretrained(
        loaded, loaded_config, tmp_path / "b", max_shard_size="100KB", fused_experts=fused
    )
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert sorted(a) == sorted(b)
    for name in a:
        # the router is written as loaded (float32): the same values, widened
        same_dtype = a[name].dtype == b[name].dtype or name.endswith("mlp.gate.weight")
        assert same_dtype and np.array_equal(a[name].astype(np.float32), b[name].astype(np.float32))


def test_release_names_and_layout(saved):
    """MTP as layer num_hidden_layers with its own embedding and head copies, eh_proj [dim 2*dim]
    as stored by DeepSeek ([out in]), everything [out in]."""
    model, config, path = saved
    tensors = read_all(path)
    n, d = config.num_hidden_layers, config.hidden_size
    mtp = f"model.layers.{n}"
    np.testing.assert_array_equal(
        tensors[f"{mtp}.eh_proj.weight"], np.asarray(model.mtp.layers.eh_proj[0]).T
    )
    assert tensors[f"{mtp}.eh_proj.weight"].shape == (d, 2 * d)
    np.testing.assert_array_equal(
        tensors[f"{mtp}.embed_tokens.weight"], tensors["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(
        tensors[f"{mtp}.shared_head.head.weight"], tensors["lm_head.weight"]
    )
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert tensors[f"{mtp}.{name}.weight"].shape == (d,)
    assert f"{mtp}.mlp.experts.15.down_proj.weight" in tensors
    layer = config.first_k_dense_replace  # the first MoE layer
    np.testing.assert_array_equal(
        tensors[f"model.layers.{layer}.mlp.experts.3.gate_proj.weight"],
        np.asarray(model.moe_layers.mlp.experts.w_gate[0, 3]).T,
    )
    np.testing.assert_array_equal(
        tensors[f"model.layers.{layer}.mlp.gate.weight"],
        np.asarray(model.moe_layers.mlp.router.w_router[0]),
    )
    np.testing.assert_array_equal(
        tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"],
        np.asarray(model.moe_layers.mlp.router.expert_bias[0]),
    )
    hf = json.loads((path / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v3" and hf["num_nextn_predict_layers"] == 1


def leaf_at(tree, path: str) -> np.ndarray:
    """The value at a dropless path (`moe_layers.mlp.experts.w_gate[2][5]`) of a model."""
    leaf, *indices = path.replace("]", "").split("[")
    leaves = {
        jax.tree_util.keystr(p, simple=True, separator="."): x
        for p, x in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    }
    return np.asarray(leaves[leaf])[tuple(int(i) for i in indices)]


@pytest.mark.slow
def test_public_name_mapping(saved):
    """`hf_names` / `dropless_names`: every tensor the export writes has exactly one name in
    the mapping; the two round-trip; `to_hf` gives the files' tensors, each the mapped leaf (or
    its transpose: Hugging Face's [out in])."""
    model, config, path = saved
    tensors = read_all(path)
    forward, inverse = hf_names(model), dropless_names(config)
    assert forward == hf_names(config)
    assert sorted(inverse) == sorted(tensors)  # each written name once (dict keys: unique)
    assert len(set(forward.values())) == len(forward)
    assert all(inverse[name] == p for p, name in forward.items())
    copies = set(inverse) - set(forward.values())  # the MTP module's embedding and head copies
    n = config.num_hidden_layers
    assert copies == {
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.shared_head.head.weight",
    }
    assert forward["moe_layers.mlp.experts.w_gate[0][3]"] == (
        f"model.layers.{config.first_k_dense_replace}.mlp.experts.3.gate_proj.weight"
    )
    exported = to_hf(model)
    assert sorted(exported) == sorted(tensors)
    for name, p in inverse.items():
        np.testing.assert_array_equal(exported[name], tensors[name], name)
        leaf = leaf_at(model, p)
        assert np.array_equal(exported[name], leaf) or np.array_equal(exported[name], leaf.T), name
    # the same names and layouts for a tree shaped like the model: its gradients
    grads = eqx.filter_grad(lambda m: m(jnp.zeros((1, 4), jnp.int32)).logits.sum())(model)
    g = to_hf(grads)
    np.testing.assert_array_equal(
        g[forward["moe_layers.mlp.experts.w_down[0][1]"]],
        np.asarray(grads.moe_layers.mlp.experts.w_down[0, 1]).T,
    )


def test_mtp_option(saved, tmp_path):
    model, config, path = saved
    without, c = from_pretrained(path, mtp=False)
    assert without.mtp is None and c.num_nextn_predict_layers == 0
    # transformers' DeepseekV3ForCausalLM writes no MTP layer while its config says 1
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tensors = read_all(tmp_path)
    n = config.num_hidden_layers
    rewrite(tmp_path, {k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{n}.")})
    loaded, c = from_pretrained(tmp_path)
    assert loaded.mtp is None and c.num_nextn_predict_layers == 0
    with pytest.raises(CheckpointError, match=rf"missing tensors: model\.layers\.{n}\."):
        from_pretrained(tmp_path, mtp=True)
    # MTP layers in the files, but a config.json that says there are none
    shutil.copytree(path, tmp_path / "extra")
    hf = json.loads((tmp_path / "extra" / "config.json").read_text())
    (tmp_path / "extra" / "config.json").write_text(
        json.dumps({**hf, "num_nextn_predict_layers": 0})
    )
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers 0; pass mtp=False"):
        from_pretrained(tmp_path / "extra")
    assert from_pretrained(tmp_path / "extra", mtp=False)[0].mtp is None


def test_tied_head_round_trip(tmp_path):
    config = small_config(tie_word_embeddings=True, num_nextn_predict_layers=0)
    model = random_model(config, 2)
    save_pretrained(model, config, tmp_path)
    assert "lm_head.weight" not in read_all(tmp_path)
    loaded, _ = from_pretrained(tmp_path)
    assert loaded.lm_head is None
    assert_same_params(loaded, model)


def test_dtype_and_overrides(saved):
    model, _, path = saved
    loaded, config = from_pretrained(
        path, dtype=jnp.bfloat16, compute_dtype="bfloat16", remat="full", progress=True
    )
    assert (config.param_dtype, config.compute_dtype, config.remat) == ("bfloat16",) * 2 + ("full",)
    assert loaded.embed_tokens.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(loaded.embed_tokens), np.asarray(model.embed_tokens).astype(jnp.bfloat16)
    )
    router = loaded.moe_layers.mlp.router.w_router
    assert router.dtype == jnp.float32  # routers are never rounded
    np.testing.assert_array_equal(router, model.moe_layers.mlp.router.w_router)
    with pytest.raises(ValueError, match="dtype 'float16' must be one of"):
        from_pretrained(path, dtype="float16")
    with pytest.raises(ValueError, match=r"param_dtype: pass dtype= \(the loaded"):
        from_pretrained(path, param_dtype="float32")
    # an override that changes the shapes: the error says config.json was overridden
    with pytest.raises(CheckpointError, match=r"with the overrides n_routed_experts=8"):
        from_pretrained(path, n_routed_experts=8)


def test_max_shard_size_forms(saved, tmp_path):
    model, config, _ = saved
    save_pretrained(model, config, tmp_path, max_shard_size="1GiB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    save_pretrained(model, config, tmp_path, max_shard_size=200_000)  # replaces the single file
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert_same_params(from_pretrained(tmp_path)[0], model)
    with pytest.raises(ValueError, match="max_shard_size '5 parsecs'"):
        save_pretrained(model, config, tmp_path, max_shard_size="5 parsecs")


def test_loading_peaks_near_the_result(tmp_path):
    """Host memory (numpy allocations, as tracemalloc sees them) while loading a checkpoint whose
    experts dominate: per-expert tensors are written into the stacked arrays in place, never
    gathered and concatenated, and host copies are dropped leaf by leaf as they become jax
    arrays, so the peak is the result plus at most one leaf."""
    config = small_config(
        n_routed_experts=64, moe_intermediate_size=128, num_nextn_predict_layers=0
    )
    model = random_model(config, 3)
    save_pretrained(model, config, tmp_path)
    sizes = [x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    result, largest = sum(sizes), max(sizes)
    assert result > 10 * 2**20 and largest < result / 3
    tracemalloc.start()
    try:
        loaded, _ = from_pretrained(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < result + largest + 2**20, (peak, result, largest)
    assert_same_params(loaded, model)


def test_save_rejects_a_config_that_is_not_the_models(saved, tmp_path):
    model, config, _ = saved
    with pytest.raises(ValueError, match="config does not describe model"):
        save_pretrained(model, config.replace(hidden_size=32), tmp_path)


# --- FP8 -----------------------------------------------------------------------------------------


def quantise_fp8(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-style block quantisation: scale = amax / 448 per block, q = w / scale in e4m3."""
    *lead, m, n = w.shape
    bm, bn = block
    rows, cols = -(-m // bm), -(-n // bn)
    scale = np.empty((*lead, rows, cols), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[..., i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            s = np.maximum(np.abs(blk).max(axis=(-1, -2)), 1e-12) / 448.0
            scale[..., i, j] = s
            q[..., i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (
                blk / s[..., None, None]
            ).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantise_by_loop(q, scale, block=(128, 128)) -> np.ndarray:
    out = q.astype(np.float32)
    for idx in np.ndindex(*q.shape):
        out[idx] *= scale[(*idx[:-2], idx[-2] // block[0], idx[-1] // block[1])]
    return out


@pytest.mark.parametrize(
    "shape, block", [((300, 200), (128, 128)), ((128, 256), (128, 128)), ((3, 130, 67), (64, 32))]
)
def test_dequantize_fp8_against_float_reference(shape, block):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))).astype(np.float32)
    q, scale = quantise_fp8(w, block)
    out = dequantize_fp8(q, scale, block)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, dequantise_by_loop(q, scale, block))
    # within e4m3's rounding of each block-scaled value: 2^-4 relative, or its subnormal step
    s = dequantise_by_loop(np.ones(shape, ml_dtypes.float8_e4m3fn), scale, block)
    assert np.all(np.abs(out - w) <= np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10) * 1.0001)
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8(q, scale[..., :-1], block)


def test_fp8_checkpoint_is_dequantised(saved, tmp_path):
    """Every 2-D projection stored as float8 with a weight_scale_inv per 128x128 block (as
    DeepSeek releases V3; vocab 64 x dim 64 and 192 x 64 leave partial blocks) loads as the
    dequantised values."""
    _, config, path = saved
    tensors, expected = read_all(path), {}
    for name, a in list(tensors.items()):
        if a.ndim == 2 and "proj" in name and "embed" not in name:
            q, scale = quantise_fp8(a)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            expected[name] = dequantise_by_loop(q, scale)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    rewrite(tmp_path, tensors, quantization_config=quant, dtype="bfloat16")
    model, loaded_config = from_pretrained(tmp_path, dtype="float32")
    save_pretrained(model, loaded_config, tmp_path / "out")
    out = read_all(tmp_path / "out")
    assert not any(name.endswith("_scale_inv") for name in out)
    for name, want in expected.items():
        np.testing.assert_array_equal(out[name], want, err_msg=name)
    # without dtype, an FP8 checkpoint loads as bfloat16
    assert from_pretrained(tmp_path)[1].param_dtype == "bfloat16"


# --- the name table ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["deepseek-v3-671b", "deepseek-v2-lite", "tiny"])
def test_table_covers_every_parameter(preset):
    config = get_preset(preset)
    skeleton = eqx.filter_eval_shape(lambda: DeepSeekV3(config, key=jax.random.key(0)))
    shapes = {
        jax.tree_util.keystr(p, simple=True, separator="."): tuple(leaf.shape)
        for p, leaf in jax.tree_util.tree_leaves_with_path(skeleton)
    }
    table = tensor_table(shapes, config)
    check_coverage(table, shapes)
    if preset != "deepseek-v3-671b":  # (46k tensors: building the table twice takes a while)
        check_coverage(tensor_table(shapes, config, fused_layers=range(99)), shapes)
    else:  # shapes as in DeepSeek-V3's model.safetensors.index.json
        assert table["model.layers.0.self_attn.q_a_proj.weight"].shape == (1536, 7168)
        assert table["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 7168)
        assert table["model.layers.0.self_attn.kv_b_proj.weight"].shape == (32768, 512)
        assert table["model.layers.0.mlp.down_proj.weight"].shape == (7168, 18432)
        assert table["model.layers.3.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
        assert table["model.layers.3.mlp.gate.e_score_correction_bias"].shape == (256,)
        assert table["model.layers.60.mlp.shared_experts.gate_proj.weight"].shape == (2048, 7168)
        assert table["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
        assert table["model.layers.61.shared_head.head.weight"].shape == (129280, 7168)
        assert table["model.layers.61.mlp.experts.0.up_proj.weight"].shape == (2048, 7168)
        assert "model.layers.62.enorm.weight" not in table


# --- bad input -----------------------------------------------------------------------------------


def _damage(path, kind):
    """Damages the single-file checkpoint in `path`; returns (exception, message pattern)."""
    tensors = read_all(path)
    layer = "model.layers.1.self_attn.kv_b_proj.weight"
    if kind == "missing_config":
        (path / "config.json").unlink()
        return FileNotFoundError, r"config\.json"
    if kind == "missing_weights":
        (path / "model.safetensors").unlink()
        return FileNotFoundError, r"no model\.safetensors and no model\.safetensors\.index\.json"
    if kind == "missing_shard":
        (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"x": "model-00002-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return FileNotFoundError, r"model-00002-of-00002\.safetensors: no such file"
    if kind == "index_disagrees":
        (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
        index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
        index["weight_map"]["model.norm.weight"] = "model-00002-of-00001.safetensors"
        save_file(
            {"other": np.zeros(1, np.float32)}, str(path / "model-00002-of-00001.safetensors")
        )
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return CheckpointError, r"puts tensor 'model\.norm\.weight' in model-00002-of-00001"
    if kind == "missing_tensor":
        del tensors[layer]
        rewrite(path, tensors)
        return CheckpointError, rf"missing tensors: {layer}"
    if kind == "extra_tensor":
        tensors["model.layers.1.mlp.mystery.weight"] = np.zeros(3, np.float32)
        rewrite(path, tensors)
        return CheckpointError, r"unexpected tensors: model\.layers\.1\.mlp\.mystery\.weight"
    if kind == "wrong_shape":
        tensors[layer] = tensors[layer][:-1]
        rewrite(path, tensors)
        return (
            CheckpointError,
            rf"wrong shapes: {layer} is \[127, 32\], config.json implies \[128, 32\]",
        )
    if kind == "config_disagrees":
        hf = json.loads((path / "config.json").read_text())
        hf["moe_intermediate_size"] = 32
        (path / "config.json").write_text(json.dumps(hf))
        shared = r"model\.layers\.1\.mlp\.shared_experts\.gate_proj\.weight"
        return (
            CheckpointError,
            rf"wrong shapes: {shared} is \[64, 64\], config.json implies \[32, 64\]",
        )
    if kind == "unsupported_model_type":
        hf = json.loads((path / "config.json").read_text())
        hf["model_type"] = "deepseek_v32"
        (path / "config.json").write_text(json.dumps(hf))
        return CheckpointError, r"model_type 'deepseek_v32' is not supported; supported"
    if kind == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:-100])
        return CheckpointError, r"model\.safetensors: truncated safetensors file"
    if kind == "truncated_header":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:50])
        return CheckpointError, r"model\.safetensors: truncated safetensors file"
    if kind == "fp8_without_scale":
        tensors[layer] = tensors[layer].astype(ml_dtypes.float8_e4m3fn)
        rewrite(path, tensors)
        return CheckpointError, rf"{layer} is F8_E4M3 without {layer}_scale_inv"
    if kind == "integer_tensor":
        tensors[layer] = tensors[layer].astype(np.int32)
        rewrite(path, tensors)
        return CheckpointError, rf"{layer} has dtype I32, not a float type"
    if kind == "unsupported_quantization":
        rewrite(path, tensors, quantization_config={"quant_method": "gptq"})
        return CheckpointError, r"quant_method 'gptq' is not supported"
    raise AssertionError(kind)


BAD = [
    "missing_config",
    "missing_weights",
    "missing_shard",
    "index_disagrees",
    "missing_tensor",
    "extra_tensor",
    "wrong_shape",
    "config_disagrees",
    "unsupported_model_type",
    "truncated",
    "truncated_header",
    "fp8_without_scale",
    "integer_tensor",
    "unsupported_quantization",
]


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_is_a_clear_error(saved, tmp_path, kind):
    _, _, path = saved
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    error, message = _damage(tmp_path, kind)
    with pytest.raises(error, match=message):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["/abs/secret.txt", "../other/model.safetensors", "a/b", ".."])
def test_an_index_naming_a_file_outside_its_folder_is_refused(saved, tmp_path, name):
    """Issue 53 row 8: the outside file is never opened, and no error quotes a file's bytes."""
    _, _, path = saved
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"hunter2!" * 4)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    outside = str(secret) if name.startswith("/abs") else name
    weight_map = dict.fromkeys(read_all(path), "model-00001-of-00001.safetensors")
    weight_map["model.norm.weight"] = outside
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    import builtins

    builtins.open = spy
    try:
        with pytest.raises(CheckpointError, match="not a plain name"):
            from_pretrained(ckpt)
    finally:
        builtins.open = real_open
    assert not any("secret" in f or "other" in f for f in opened)


def test_a_file_that_is_no_safetensors_file_is_not_quoted(tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"hunter2!" + b"x" * 8)
    from dropless.models.deepseek_v3.hf._files import SafetensorsFile

    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(tmp_path / "secret.bin")
    leaked = str(int.from_bytes(b"hunter2!", "little"))
    assert leaked not in str(info.value) and "hunter2" not in str(info.value)
    (tmp_path / "secret.bin").write_bytes((4).to_bytes(8, "little") + b"\xffpw!")
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(tmp_path / "secret.bin")
    assert "0xff" not in str(info.value) and "pw" not in str(info.value)


@pytest.mark.parametrize(
    "changes",
    [{"n_routed_experts": 10**8}, {"n_routed_experts": 10**6}, {"num_hidden_layers": 200_000}],
)
def test_a_huge_config_is_refused_before_any_table_is_built(saved, tmp_path, changes):
    """Issue 53 row 10: in milliseconds, naming the fields."""
    import time

    _, _, path = saved
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **changes}))
    began = time.perf_counter()
    with pytest.raises(CheckpointError, match=f"{next(iter(changes))} .*call for at least"):
        from_pretrained(tmp_path)
    assert time.perf_counter() - began < 2.0


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        from_pretrained("/nonexistent/checkpoint")


def test_zero_size_tensors_of_absent_parts_are_accepted(tmp_path):
    """transformers saves a model with n_shared_experts=0 with zero-size shared_experts.*
    tensors (its Linear layers of width 0): they hold nothing and are accepted; a non-empty
    stray tensor is still refused."""
    config = small_config(n_shared_experts=0)
    model = random_model(config, 0)
    save_pretrained(model, config, tmp_path)
    tensors = read_all(tmp_path)
    hidden = config.hidden_size
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.shared_experts."
        tensors[prefix + "gate_proj.weight"] = np.zeros((0, hidden), np.float32)
        tensors[prefix + "up_proj.weight"] = np.zeros((0, hidden), np.float32)
        tensors[prefix + "down_proj.weight"] = np.zeros((hidden, 0), np.float32)
    rewrite(tmp_path, tensors)
    loaded, _ = from_pretrained(tmp_path)
    assert_same_params(model, loaded)
    tensors["model.layers.1.mlp.shared_experts.up_proj.weight"] = np.zeros((1, hidden), np.float32)
    rewrite(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="unexpected tensors: .*shared_experts.up_proj"):
        from_pretrained(tmp_path)
