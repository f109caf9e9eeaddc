"""The train loop on a device mesh (`train(..., mesh=...)`, `dropless train --mesh`): the same
losses as the single-device run, also in micro-batches, a resume from sharded checkpoints, clear
errors, a CLI smoke run.

8 emulated CPU devices (tests/conftest.py). A two-layer tiny model (one dense layer, one MoE
layer, one MTP block) at batch 16 x 32 tokens keeps the compiles short; the runs share them,
and one single-device run is the reference of every comparison.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest
import yaml

from dropless import cli
from dropless.models.deepseek_v3 import get_preset
from dropless.train import read_jsonl, train

MODEL = get_preset("tiny", num_hidden_layers=2)
MESH = "data=2,expert=4"
RTOL = 1e-5

pytestmark = pytest.mark.mesh8


@pytest.fixture(scope="module")
def config(train_config):
    return functools.partial(train_config, batch_size=16)  # the micro-batch test splits it


@pytest.fixture(scope="module")
def single(tmp_path_factory, config):
    """The single-device run that the mesh runs are compared with."""
    return train(MODEL, config(), out_dir=str(tmp_path_factory.mktemp("single")))


@pytest.mark.slow
def test_mesh_run_equals_single_device_run_and_resumes(single, tmp_path, config):
    # Two steps on the mesh (checkpointed at the end), then resumed to three: the restore goes
    # into the shardings of the freshly placed state. With warmup 1 the learning rates of
    # steps 1-2 do not depend on `steps`, so the three losses are those of one 3-step run.
    out = str(tmp_path / "mesh")
    first = train(MODEL, config(steps=2), out_dir=out, mesh=MESH)
    resumed = train(MODEL, config(resume=True), out_dir=out, mesh=MESH)
    records = first.records + resumed.records
    assert [r["step"] for r in records] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in records], single.losses, rtol=RTOL)
    for name in ("ce", "mtp", "seq_balance_loss", "max_vio"):
        np.testing.assert_allclose(
            [r[name] for r in records], [r[name] for r in single.records], rtol=RTOL, atol=1e-6
        )
    np.testing.assert_allclose(resumed.final_eval["loss"], single.final_eval["loss"], rtol=RTOL)
    # the expert-bias update saw the global tokens per expert: same loads, same biases
    np.testing.assert_array_equal(resumed.expert_load, single.expert_load)
    np.testing.assert_allclose(
        resumed.model.moe_layers.mlp.router.expert_bias,
        single.model.moe_layers.mlp.router.expert_bias,
        atol=1e-7,
    )
    # the state stayed on the mesh: routed experts split over the expert axis
    experts = eqx.filter(resumed.model.moe_layers.mlp.experts, eqx.is_array)
    assert all("expert" in str(a.sharding.spec) for a in jax.tree.leaves(experts))
    assert len(resumed.model.moe_layers.mlp.router.expert_bias.sharding.device_set) == 8


@pytest.mark.slow
def test_mesh_run_in_micro_batches_equals_single_device_run(single, tmp_path, config):
    """Batch 16 in two micro-batches of 8 (strided slices of the sharded batch): the losses and
    loads of one pass over the batch on one device."""
    micro = train(MODEL, config(micro_batches=2), out_dir=str(tmp_path), mesh=MESH)
    np.testing.assert_allclose(micro.losses, single.losses, rtol=RTOL)
    np.testing.assert_array_equal(micro.expert_load, single.expert_load)
    for name in ("loss", "max_vio"):  # the final evaluation, in slices too
        np.testing.assert_allclose(micro.final_eval[name], single.final_eval[name], rtol=RTOL)


@pytest.mark.slow
def test_mesh_run_with_the_loss_in_chunks_equals_single_device_run(single, tmp_path, config):
    """`loss_chunk` on a mesh (each shard's positions walked in chunks of 12, which divides no
    power of two, so every shard's last chunk is padded): the losses and loads of the one-pass
    loss on one device."""
    chunked = train(MODEL.replace(loss_chunk=12), config(), out_dir=str(tmp_path), mesh=MESH)
    np.testing.assert_allclose(chunked.losses, single.losses, rtol=RTOL)
    np.testing.assert_array_equal(chunked.expert_load, single.expert_load)


@pytest.mark.parametrize(
    "model_changes, changes, mesh, message",
    [
        ({}, {"batch_size": 6}, MESH, "batch_size"),
        (
            {},
            {"batch_size": 8, "micro_batches": 8},
            MESH,
            r"batch_size \(8\) / micro_batches \(8\) must be",
        ),
        ({}, {}, "data=2,expert=2", "device count"),
        ({}, {}, "data=2,expert=3,fsdp=1", "device count"),
        ({"n_routed_experts": 6, "n_group": 1, "topk_group": 1}, {}, MESH, "n_routed_experts"),
        ({}, {}, "data=2,tensor=4", "unknown axis"),
    ],
)
def test_bad_meshes_are_clear_errors(tmp_path, model_changes, changes, mesh, message, config):
    model = MODEL.replace(**model_changes)
    with pytest.raises(ValueError, match=message):
        train(model, config(**changes), out_dir=str(tmp_path), mesh=mesh)


@pytest.mark.slow
def test_cli_mesh_smoke_run(tmp_path, capsys):
    out = tmp_path / "run"
    # the model and batch of the runs above, on their data: their compiled steps serve it
    args = [
        "train", "--mesh", MESH, "--steps", "2", "--batch-size", "16", "--seq-len", "32",
        "--warmup-steps", "1", "--eval-batches", "1", "--model.num-hidden-layers", "2",
        "--data", "synthetic", "--no-plots", "--no-progress", "--no-compile-cache",
        "--out-dir", str(out),
    ]  # fmt: skip
    assert cli.main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    # what runs: the backend's stages, with the 'ep' dispatcher on the expert axis
    assert "backend auto (jnp) with the 'ep' dispatcher, mesh data=2,expert=4" in first
    records = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records)
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["train"]["mesh"] == "data=2,expert=4"
    assert written["stages"] == {
        "dispatcher": "AllToAllDispatcher",
        "gmm": "ChunkedGroupedMatmul",
        "topk": "JnpTopK",
    }
