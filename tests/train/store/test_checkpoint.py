"""Checkpointer: exact round trip, keep-last-N, and clear errors for missing/corrupt dirs."""

import errno
import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.step import init_state
from dropless.train.store import Checkpointer, CheckpointError, open_for_resume
from dropless.train.store._checkpoint import CorruptCheckpoint


def state(seed: int, moments_dtype: str = "float32"):
    model = DeepSeekV3(get_preset("tiny"), key=jax.random.key(seed))
    return init_state(model, TrainConfig(moments_dtype=moments_dtype))


@pytest.mark.slow
def test_round_trip_is_exact_and_keeps_the_last_few(tmp_path):
    saved = state(1)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, saved, {"step": step, "note": "hello"})
    checkpointer.wait()
    assert checkpointer.steps() == [2, 3]
    restored, meta = checkpointer.restore(state(2))  # different values, same structure
    checkpointer.close()
    assert meta == {"step": 3, "note": "hello"}
    a, b = jax.tree.leaves(saved), jax.tree.leaves(restored)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    assert jax.tree.structure(saved) == jax.tree.structure(restored)


def test_restored_arrays_are_placed_as_the_target_was(tmp_path):
    """An uncommitted target (a fresh single-device state) gets uncommitted arrays back, so jit
    sees the arguments it compiled the step for; a target committed to a device stays so."""
    saved = state(1)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, saved, {})
    checkpointer.wait()
    fresh = state(2)
    committed = jax.device_put(fresh, jax.devices()[0])
    assert not any(x.committed for x in jax.tree.leaves(fresh))
    loose, _ = checkpointer.restore(fresh)
    placed, _ = checkpointer.restore(committed)
    checkpointer.close()
    assert not any(x.committed for x in jax.tree.leaves(loose))
    assert all(x.committed for x in jax.tree.leaves(placed))
    for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(loose), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_model_without_moe_layers_round_trips(tmp_path):
    """Its expert load is a 0 x experts array, which orbax cannot write: nothing is saved for
    it, and the restore gives the target's, for a concrete and an abstract target alike."""

    def dense_state(seed):
        config = get_preset("tiny", num_hidden_layers=1, num_nextn_predict_layers=0)
        return init_state(DeepSeekV3(config, key=jax.random.key(seed)), TrainConfig())

    saved = dense_state(1)
    assert saved.expert_load.shape == (0, 16)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, saved, {"step": 1})
    checkpointer.wait()
    for like in (dense_state(2), eqx.filter_eval_shape(dense_state, 2)):
        restored, meta = checkpointer.restore(like)
        assert meta == {"step": 1}
        assert jax.tree.structure(saved) == jax.tree.structure(restored)
        for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
    checkpointer.close()


def test_resume_from_missing_or_empty_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_for_resume(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        open_for_resume(str(tmp_path / "empty"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        open_for_resume(str(tmp_path / "file"))


# orbax leaves its reading coroutines behind when a restore fails; they are collected (and
# complain) right away here, instead of during some later test.
orbax_failed_restore = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _corrupt(directory, step: int) -> None:
    # every array file of the checkpoint's state goes: what a half-copied directory looks like
    state_dir = directory / str(step) / "state"
    for path in state_dir.rglob("*"):
        if path.is_file() and path.name != "_CHECKPOINT_METADATA":
            path.write_bytes(b"garbage")


@orbax_failed_restore
def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    directory = tmp_path / "ckpt"
    checkpointer = Checkpointer(str(directory))
    checkpointer.save(5, state(0), {"step": 5})
    checkpointer.close()
    _corrupt(directory, 5)
    with pytest.raises(CheckpointError, match="cannot restore checkpoint .*5"):
        open_for_resume(str(directory)).restore(state(0))
    gc.collect()


@orbax_failed_restore
def test_restoring_into_another_model_shape_is_a_clear_error(tmp_path):
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, state(0), {"step": 1})
    checkpointer.wait()
    other = init_state(
        DeepSeekV3(get_preset("tiny", hidden_size=32), key=jax.random.key(0)), TrainConfig()
    )
    with pytest.raises(CheckpointError, match="different model"):
        checkpointer.restore(other)
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        checkpointer.restore(state(0), step=7)
    checkpointer.close()
    gc.collect()


def test_float32_moments_restore_as_bfloat16_into_a_bfloat16_state(tmp_path):
    """How a run resumed with `moments_dtype="bfloat16"` reads a float32 run's checkpoint: the
    fresh state it restores into has bf16 moments, and the saved ones arrive rounded to it."""
    saved = state(1)
    adam = saved.opt_state[1].inner_state[0]
    moved = adam._replace(mu=jax.tree.map(lambda m: m + 0.3, adam.mu))  # nonzero moments
    saved = eqx.tree_at(lambda s: s.opt_state[1].inner_state[0], saved, moved)
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, saved, {})
    checkpointer.wait()
    restored, _ = checkpointer.restore(state(2, "bfloat16"))
    checkpointer.close()
    got = jax.tree.leaves(restored.opt_state[1].inner_state[0].mu)
    want = jax.tree.leaves(saved.opt_state[1].inner_state[0].mu)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16 and w.dtype == jnp.float32
        np.testing.assert_array_equal(g, w.astype(jnp.bfloat16))


def _largest_array_file(directory, step: int):
    files = [p for p in (directory / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@orbax_failed_restore
def test_a_flipped_bit_or_a_truncated_file_is_caught_by_the_digest(tmp_path):
    directory = tmp_path / "ckpt"
    checkpointer = Checkpointer(str(directory))
    checkpointer.save(1, state(0), {"step": 1})
    checkpointer.save(2, state(0), {"step": 2})
    checkpointer.close()
    data = _largest_array_file(directory, 1)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="checkpoint .*1 is corrupt") as err:
        open_for_resume(str(directory)).restore(state(0), step=1)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400
    data = _largest_array_file(directory, 2)
    data.write_bytes(data.read_bytes()[:100])  # truncated
    with pytest.raises(CorruptCheckpoint, match="checkpoint .*2") as err:
        open_for_resume(str(directory)).restore(state(0), step=2)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400  # not a TensorStore spec
    (directory / "3").mkdir()  # an empty folder, as a kill leaves
    with pytest.raises(CorruptCheckpoint, match="checkpoint .*3 is empty"):
        open_for_resume(str(directory)).restore(state(0))
    gc.collect()


def test_a_full_disk_is_one_line_naming_the_directory_and_the_space(tmp_path, monkeypatch):
    """Issue 53 row 11: no raw OSError from deep inside orbax."""
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))

    def full(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("orbax: a background write failed") from err

    monkeypatch.setattr(checkpointer._manager, "save", full)
    monkeypatch.setattr(checkpointer._manager, "wait_until_finished", full)
    with pytest.raises(CheckpointError, match=r"no space left on the device of .*ckpt \(.* free, "
                       r"about .*MiB needed\)") as info:  # fmt: skip
        checkpointer.save(1, state(0), {"step": 1})
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="no space left"):
        checkpointer.wait()
    monkeypatch.undo()
    checkpointer.close()
