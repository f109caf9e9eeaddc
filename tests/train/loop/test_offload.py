"""Optimizer-state host offload (`TrainConfig.offload_optimizer`): the moments live in pinned
host memory between steps and the runs equal the in-device ones, on one device and on a mesh.
The CPU backend labels the memory but holds both kinds in the same RAM; the `gpu` test measures
the device memory saved."""

import jax
import numpy as np
import pytest

from dropless.models.deepseek_v3 import get_preset
from dropless.train import train
from dropless.train.loop import _offload as offload

# One dense and one MoE layer, no MTP block: which layers there are matters not to where the
# moments live, and the compiles take about 40% less time.
MODEL = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)


@pytest.fixture(scope="module")
def config(train_config):
    return train_config


def _assert_same_run(got, want):
    assert got.losses == want.losses
    assert offload.moment_memory_kinds(got.state) == {offload.HOST}
    assert offload.moment_memory_kinds(want.state) == {"device"}
    pairs = zip(
        jax.tree.leaves(got.state.opt_state), jax.tree.leaves(want.state.opt_state), strict=True
    )
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_offloaded_run_equals_in_device_run(tmp_path, config):
    want = train(MODEL, config(), out_dir=str(tmp_path / "device"))
    got = train(MODEL, config(offload_optimizer=True), out_dir=str(tmp_path / "host"))
    _assert_same_run(got, want)
    # a resumed run puts the restored moments on the host again
    resumed = train(
        MODEL, config(steps=4, offload_optimizer=True, resume=True), out_dir=str(tmp_path / "host")
    )
    assert offload.moment_memory_kinds(resumed.state) == {offload.HOST}


@pytest.mark.slow
@pytest.mark.mesh8
def test_offloaded_mesh_run_equals_in_device_run(tmp_path, config):
    mesh = "data=2,expert=4"
    want = train(MODEL, config(mesh=mesh), out_dir=str(tmp_path / "device"))
    got = train(MODEL, config(mesh=mesh, offload_optimizer=True), out_dir=str(tmp_path / "host"))
    _assert_same_run(got, want)
    moments = [x for x in jax.tree.leaves(got.state.opt_state) if offload.is_moment(x)]
    assert any("expert" in str(x.sharding.spec) for x in moments)  # still sharded


@pytest.mark.gpu
def test_offload_frees_device_memory(tmp_path, config):
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a GPU")
    model = get_preset("small")
    device = train(model, config(), out_dir=str(tmp_path / "device"))
    host = train(model, config(offload_optimizer=True), out_dir=str(tmp_path / "host"))
    saved = offload.state_bytes(device.state.opt_state, "device") - offload.state_bytes(
        host.state.opt_state, "device"
    )
    assert saved == offload.state_bytes(host.state.opt_state, offload.HOST) > 0
    np.testing.assert_allclose(host.losses, device.losses, rtol=1e-6)
