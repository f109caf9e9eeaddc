"""Resuming: the data a run continues on must be the run's (issue 53 rows 4 and 5), and model
settings changed on resume are noted (row 15). Checkpoints of a fresh state, nothing trained."""

import dataclasses
import json
import warnings

import jax
import pytest

from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import TrainConfig
from dropless.train.loop import config_dict
from dropless.train.step import init_state
from dropless.train.store import Checkpointer
from dropless.train.store._data_identity import DataMismatch
from dropless.train.store._resume import restore_intact

MODEL = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
BYTES = {"source": "prepared", "path": "/data/a", "meta_sha256": "m1", "dtype": "uint16",
         "tokenizer": "byte", "tokenizer_sha256": "t-byte", "vocab_size": 258}  # fmt: skip


@pytest.fixture(scope="module")
def fresh():
    return init_state(DeepSeekV3(MODEL, key=jax.random.key(0)), TrainConfig())


@pytest.fixture
def checkpointer(tmp_path, fresh):
    meta = {"config": json.loads(json.dumps(config_dict(MODEL, TrainConfig(), "jnp", BYTES)))}
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(2, fresh, {**meta, "step": 2})
    checkpointer.wait()
    yield checkpointer
    checkpointer.close()


def test_another_tokenizer_is_refused(checkpointer, fresh):
    """Row 4: a BPE run resumed on byte data (or the reverse), even with the flag."""
    bpe = {**BYTES, "tokenizer": "bpe", "tokenizer_sha256": "t-bpe", "vocab_size": 300}
    for allow in (False, True):
        config = TrainConfig(resume=True, allow_data_change=allow)
        with pytest.raises(DataMismatch, match="tokenizer differs.*t-byte.*t-bpe"):
            restore_intact(checkpointer, fresh, config, bpe)


def test_data_prepared_again_needs_the_flag(checkpointer, fresh):
    """Row 5: the folder prepared again in place (same tokenizer): refused, then allowed with
    --allow-data-change and a note; the same data moved elsewhere is the same data."""
    again = {**BYTES, "meta_sha256": "m2"}
    with pytest.raises(DataMismatch, match="meta_sha256: 'm1' -> 'm2'.*--allow-data-change"):
        restore_intact(checkpointer, fresh, TrainConfig(resume=True), again)
    with pytest.warns(UserWarning, match="other data with the same tokenizer"):
        restore_intact(checkpointer, fresh, TrainConfig(resume=True, allow_data_change=True), again)
    moved = {**BYTES, "path": "/elsewhere"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_intact(checkpointer, fresh, TrainConfig(resume=True), moved)


def test_a_changed_compute_dtype_is_noted(checkpointer, fresh):
    """Row 15: allowed (it touches no array), but said."""
    model = DeepSeekV3(MODEL.replace(compute_dtype="bfloat16"), key=jax.random.key(0))
    bf16 = dataclasses.replace(fresh, model=model)
    with pytest.warns(UserWarning, match="compute_dtype: 'float32' -> 'bfloat16'"):
        restore_intact(checkpointer, bf16, TrainConfig(resume=True), BYTES)
