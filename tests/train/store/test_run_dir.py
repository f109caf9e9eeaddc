"""`load_run` and `evaluate_run`: a trained run back from its directory, and its evaluation.

One tiny byte-level run (the tiny model cut to a dense and an MoE layer, 4 steps, batch 4 x 32
tokens, checkpoints at steps 2 and 4) serves the module; the tests that read it are slow
(compiling on a CPU)."""

import dataclasses
import gc
import json
import math
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from dropless.data import ByteTokenizer, prepare
from dropless.models.deepseek_v3 import DeepSeekV3, get_preset
from dropless.train import CheckpointError, TrainConfig, evaluate_run, load_run, train
from dropless.train.loop import _setup as setup
from dropless.train.loop import open_data
from dropless.train.loop._run_eval import append_metrics, prepared_eval_split
from dropless.train.step import init_state
from dropless.train.store import Checkpointer
from dropless.train.store._data_identity import DataMismatch

# A dense and an MoE layer, no MTP block: what a run directory holds is the same for any model,
# and the compiles are shorter.
MODEL = get_preset("tiny", num_hidden_layers=2, num_nextn_predict_layers=0)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven")


def write_corpus(folder, n_docs: int = 60) -> None:
    """ASCII documents of pseudo-random words, one per line of a .jsonl."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, 40)) + "."}) for _ in range(n_docs)]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")


def train_tiny_run(root):
    """(prepared data dir, run dir, TrainResults) of a 4-step byte-level run."""
    write_corpus(root)
    data = root / "data"
    meta = prepare([root / "docs.jsonl"], data, eval_fraction=0.2, progress=False)
    config = TrainConfig(
        steps=4, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=2,
        checkpoint_every=2, plots=False, data=str(data / "train.bin"),
        eval_data=str(data / "eval.bin"), data_dtype=meta["dtype"],
    )  # fmt: skip
    results = train(MODEL, config, backend="jnp", out_dir=str(root / "run"))
    return data, root / "run", results


slow = pytest.mark.slow
orbax_failed_restore = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("tiny"))


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@slow
def test_load_run_restores_the_final_model(tiny):
    data, run_dir, results = tiny
    run = load_run(run_dir)
    assert run.step == 4 and run.steps == [2, 4] and run.backend == "jnp"
    assert run.model_config == MODEL
    assert run.train_config.steps == 4 and run.train_config.mesh is None
    trained = arrays(results.model)
    assert len(arrays(run.model)) == len(trained)
    for got, want in zip(arrays(run.model), trained, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert isinstance(run.tokenizer, ByteTokenizer)
    assert run.tokenizer_source == str((data / "tokenizer.json").resolve())


@slow
def test_load_run_at_an_earlier_step(tiny):
    _, run_dir, results = tiny
    run = load_run(run_dir, step=2)
    assert run.step == 2
    differs = [
        not np.array_equal(a, b)
        for a, b in zip(arrays(run.model), arrays(results.model), strict=True)
    ]
    assert any(differs)  # two more steps changed the parameters


@slow
def test_load_run_errors(tiny, tmp_path):
    _, run_dir, _ = tiny
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 3 .*available steps: 2, 4"):
        load_run(run_dir, step=3)
    with pytest.raises(ValueError, match="not a run directory: no config.yaml"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="not a run directory: it does not exist"):
        load_run(tmp_path / "missing")
    shutil.copy(run_dir / "config.yaml", tmp_path / "config.yaml")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_run(tmp_path)


@slow
def test_a_synthetic_run_has_no_tokenizer(tiny, tmp_path):
    _, run_dir, _ = tiny
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["train"]["data"] = "synthetic"
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    run = load_run(copy)
    assert run.tokenizer is None and run.tokenizer_source is None


@slow
def test_eval_equals_the_trainers_last_evaluation(tiny):
    _, run_dir, results = tiny
    last = results.eval_records[-1]
    assert last["step"] == 4
    out = evaluate_run(load_run(run_dir))
    assert out["ce"] == pytest.approx(last["ce"], rel=1e-6)
    assert out["loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert out["perplexity"] == pytest.approx(math.exp(last["ce"]), rel=1e-6)
    assert out["tokens"] == 2 * 4 * 32 and out["batches"] == 2


@slow
def test_bits_per_byte_on_a_prepared_directory(tiny):
    data, run_dir, _ = tiny
    run = load_run(run_dir)
    out = evaluate_run(run, data=data, batches=3, batch_size=2)
    # the bytes of exactly the targets scored: the eval split's windows, decoded
    config = dataclasses.replace(run.train_config, eval_batches=3, batch_size=2)
    dataset = prepared_eval_split(data)
    tokenizer = ByteTokenizer()
    n_bytes = n_tokens = 0
    for i in range(3):
        targets = setup.batch(dataset, i, config, "eval").tokens[:, 1:]
        n_tokens += targets.size
        for row in targets:
            n_bytes += len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8"))
    assert out["tokens"] == n_tokens == 3 * 2 * 32 and out["bytes"] == n_bytes
    assert n_bytes < n_tokens  # the eos after every document is a token, not text
    expected = out["ce"] / math.log(2) * n_tokens / n_bytes
    assert out["bits_per_byte"] == pytest.approx(expected, rel=1e-9)


@slow
def test_eval_of_the_whole_split_scores_every_token_once(tiny):
    data, run_dir, _ = tiny
    run = load_run(run_dir)
    split = prepared_eval_split(data)
    windows = (len(split.tokens) - 1) // 32
    assert windows % 3  # a smaller last batch
    out = evaluate_run(run, data=data, batches="all", batch_size=3)
    assert out["tokens"] == windows * 32 and out["batches"] == -(-windows // 3)
    # the oracle: the model's cross-entropy over every consecutive window, in one forward
    tokens = np.asarray(split.tokens[: windows * 32 + 1], np.int32)
    rows = np.stack([tokens[i * 32 : i * 32 + 33] for i in range(windows)])
    logits = eqx.filter_jit(lambda m, t: m(t).logits)(run.model, rows[:, :-1])
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    ce = -np.take_along_axis(np.asarray(logp), rows[:, 1:, None], -1).mean()
    assert out["ce"] == pytest.approx(ce, rel=1e-5)
    assert out["bytes"] == int(np.count_nonzero(rows[:, 1:] < 256))


def test_append_metrics_keeps_every_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"split": "train", "step": 1}\n')
    append_metrics(path, {"step": 1, "ce": 2.0})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"split": "train", "step": 1}, {"split": "eval_cli", "step": 1, "ce": 2.0}]


# --- a run that is read while it trains, or after its files changed (issue 53) ------------------


def saved_run(root, steps=(2, 4)):
    """(data dir, run dir) of a run written without training: config.yaml as `train` writes it,
    and checkpoints of the freshly initialised state at `steps` (step counters set)."""
    write_corpus(root)
    data = root / "data"
    prepare([root / "docs.jsonl"], data, eval_fraction=0.2, progress=False)
    config = TrainConfig(steps=4, batch_size=4, seq_len=32, data=str(data), plots=False)
    source = open_data(config, MODEL.vocab_size)
    run = root / "run"
    run.mkdir()
    record = setup.config_dict(MODEL, config, "jnp", source.record)
    (run / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    state = init_state(DeepSeekV3(MODEL, key=jax.random.key(0)), config)
    checkpointer = Checkpointer(str(run / "checkpoints"))
    for step in steps:
        state = dataclasses.replace(state, step=jnp.asarray(step, state.step.dtype))
        checkpointer.save(step, state, {"config": json.loads(json.dumps(record)), "step": step})
    checkpointer.close()
    return data, run


def test_a_checkpoint_removed_while_read_is_retried_with_the_newest(tmp_path, monkeypatch):
    """Row 1: a live run saves step 6 and drops step 4 (its retention) while `load_run` reads
    step 4: the reader says so and reads step 6, never blaming the checkpoint."""
    _, run = saved_run(tmp_path)
    real = Checkpointer.restore
    calls = []

    def racing(self, like, step=None):
        calls.append(step)
        if len(calls) == 1:  # the trainer's save of 6 lands, its retention removes 4
            shutil.copytree(run / "checkpoints" / "4", run / "checkpoints" / "6")
            shutil.rmtree(run / "checkpoints" / "4")
        return real(self, like, step)

    monkeypatch.setattr(Checkpointer, "restore", racing)
    with pytest.warns(UserWarning, match="checkpoint 4 was removed while reading"):
        loaded = load_run(run)
    assert calls == [4, 6] and loaded.steps == [2, 6]
    assert loaded.step == 4  # the copy's own counter: step 6 holds step 4's state here


@orbax_failed_restore
@pytest.mark.slow
def test_eval_and_generate_fall_back_past_a_corrupt_checkpoint(tmp_path):
    """Row 14: the newest checkpoint's optimiser moment is corrupt; `load_run` (what eval and
    generate read) passes over it with a warning, as train --resume does; an asked-for step
    stays an error."""
    _, run = saved_run(tmp_path)
    moment = max(
        (p for p in (run / "checkpoints" / "4" / "state").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(moment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    moment.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checkpoint .*4 is corrupt.*trying an older"):
        loaded = load_run(run)
    assert loaded.step == 2
    with pytest.raises(CheckpointError, match="4"):
        load_run(run, step=4)
    gc.collect()


def test_a_run_refuses_a_tokenizer_it_was_not_trained_with(tmp_path):
    """Rows 5 and 6: the data folder prepared again with another tokenizer: generate and eval
    (through `load_run`) refuse it instead of decoding with it."""
    data, run = saved_run(tmp_path)
    assert isinstance(load_run(run).tokenizer, ByteTokenizer)
    other = tmp_path / "other"
    prepare([tmp_path / "docs.jsonl"], other, tokenizer="bpe", vocab_size=300, progress=False)
    shutil.rmtree(data)
    shutil.copytree(other, data)
    with pytest.raises(DataMismatch, match="not the tokenizer the run was trained with"):
        load_run(run)
