"""`dropless prepare`, `train`, `eval`, `generate` in a row, as the quick start runs them, and
the subcommands' help and errors.

One byte-level run (prepared from a small .jsonl, 2 steps of batch 4 x 32 tokens) serves the
module; the tests that read it are slow (compiling the tiny model on a CPU)."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from dropless import cli
from dropless.data import ByteTokenizer
from dropless.models.deepseek_v3 import from_pretrained, load_routing, save_pretrained
from dropless.train import load_run

slow = pytest.mark.slow
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven")
TRAIN = [
    "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--warmup-steps", "1",
    "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "1", "--backend", "jnp",
    "--no-progress", "--no-compile-cache", "--no-plots",
    # a smaller model than the tiny preset's, quicker to compile: two layers, no MTP module
    "--model.num-hidden-layers", "2", "--model.num-nextn-predict-layers", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("use")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, 40)) + "."}) for _ in range(60)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    data, run = root / "data", root / "run"
    prepare = [str(root / "docs.jsonl"), "--out", str(data), "--eval-fraction", "0.2"]
    assert cli.main(["prepare", *prepare, "--no-progress"]) == 0
    files = ["--data", str(data / "train.bin"), "--eval-data", str(data / "eval.bin")]
    assert cli.main(["train", *TRAIN, *files, "--out-dir", str(run)]) == 0
    return run


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"dropless {command}: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert listed == ["train", "presets", "prepare", "plan", "eval", "generate", "verify"]
    for command in ("prepare", "plan", "eval", "generate", "verify"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: dropless {command}") and len(text.splitlines()) <= 40


def test_unknown_commands_and_missing_arguments_are_one_line(capsys):
    assert cli.main(["evaluate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless: error: unknown command 'evaluate'") and err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_:
        cli.main(["eval"])
    assert exit_.value.code == 2
    assert "RUN_DIR" in one_line_error(capsys, "eval")
    with pytest.raises(SystemExit):
        cli.main(["plan", "--preset", "tiny"])
    assert "--batch-size" in one_line_error(capsys, "plan")


def test_unknown_options_and_fields_name_the_nearest(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--step", "10"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless: error: unknown option --step; did you mean --steps")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["eval", "runs/x", "--batchs", "3"])
    assert "unknown option --batchs; did you mean --batches" in one_line_error(capsys, "eval")
    assert cli.main(["train", "--set", "model.n_routed_expert=3"]) == 2
    err = capsys.readouterr().err
    assert "n_routed_expert (did you mean n_routed_experts?)" in err and err.count("\n") == 1


def test_an_empty_prompt_is_one_line(tmp_path, capsys):
    assert cli.main(["generate", "--hf", str(tmp_path), "--prompt-ids", ""]) == 2
    assert "--prompt-ids is empty" in one_line_error(capsys, "generate")


def test_not_a_run_is_one_line(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert "not a run directory" in one_line_error(capsys, "eval")
    assert cli.main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "not a run directory" in one_line_error(capsys, "generate")
    assert cli.main(["generate", "--prompt", "x"]) == 2
    assert "RUN_DIR or --hf" in one_line_error(capsys, "generate")


@slow
def test_eval_prints_a_table_and_appends_to_the_metrics(run_dir, capsys):
    before = (run_dir / "metrics.jsonl").read_text()
    assert cli.main(["eval", str(run_dir)]) == 0
    out = capsys.readouterr().out
    # the numbers that compare across frameworks lead; the total loss (ours) follows
    names = [line.split("  ")[0] for line in out.splitlines()[:4]]
    assert names == ["cross-entropy", "perplexity", "bits per byte", "total loss"]
    assert "step  " in out
    after = (run_dir / "metrics.jsonl").read_text()
    assert after.startswith(before) and after.count("\n") == before.count("\n") + 1
    record = json.loads(after.splitlines()[-1])
    last_eval = [json.loads(line) for line in before.splitlines()][-1]
    assert record["split"] == "eval_cli" and record["step"] == 2 and last_eval["split"] == "eval"
    assert record["ce"] == pytest.approx(last_eval["ce"], rel=1e-6)
    assert record["bits_per_byte"] > 0 and f"{record['bits_per_byte']:.4f}" in out

    assert cli.main(["eval", str(run_dir), "--step", "7"]) == 2
    assert "available steps: 1, 2" in one_line_error(capsys, "eval")


@slow
def test_generate_prints_text_reproducibly_per_seed(run_dir, capsys):
    # 9 + 7 tokens: the compiled lengths (16) of the other tests' generations, compiled once
    args = ["generate", str(run_dir), "--prompt", "the quick", "--max-new-tokens", "7"]
    assert cli.main([*args, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("the quick") and len(first) > len("the quick\n")
    assert cli.main([*args, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert cli.main([*args, "--num-samples", "2", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().out.count("--- sample ") == 2


def last_record(run_dir) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@slow
def test_routing_recorded_by_generate_and_eval_replays(run_dir, tmp_path, capsys):
    """`generate --record-routing` and `eval --record-routing` write the routing that `eval
    --replay-routing` scores with; with the same model, the replayed cross-entropy is the
    model's own (the whole recorded choice is the one it makes)."""
    sampled = tmp_path / "sampled.npz"
    args = ["generate", str(run_dir), "--prompt", "the quick", "--max-new-tokens", "7"]
    assert cli.main([*args, "--num-samples", "2", "--record-routing", str(sampled)]) == 0
    assert f"routing of 2 sample(s) recorded in {sampled}" in capsys.readouterr().err
    tokens, (main, mtp) = load_routing(sampled)
    assert tokens.shape == (2, 16) and main.shape == (1, 2 * 15, 2) and mtp is None
    assert cli.main(["eval", str(run_dir), "--replay-routing", str(sampled)]) == 0
    assert "own routing" in capsys.readouterr().out
    record = last_record(run_dir)
    assert record["split"] == "eval_replay" and record["routing_agreement"] == 1.0
    assert record["ce"] == pytest.approx(record["ce_own_routing"], rel=1e-5)

    windows = tmp_path / "eval.npz"
    assert cli.main(["eval", str(run_dir), "--record-routing", str(windows)]) == 0
    assert f"recorded in {windows}" in capsys.readouterr().out
    scored = last_record(run_dir)
    assert cli.main(["eval", str(run_dir), "--replay-routing", str(windows)]) == 0
    replayed = last_record(run_dir)
    assert (replayed["tokens"], replayed["routing_agreement"]) == (scored["tokens"], 1.0)
    assert replayed["ce"] == pytest.approx(scored["ce"], rel=1e-5)

    assert cli.main(["eval", str(run_dir), "--replay-routing", str(windows), "--batches", "1"]) == 2
    assert "--replay-routing" in one_line_error(capsys, "eval")
    assert cli.main(["eval", str(run_dir), "--replay-routing", str(tmp_path / "none.npz")]) == 2
    assert "not a routing file" in one_line_error(capsys, "eval")


@slow
def test_generate_without_a_tokenizer_takes_ids(run_dir, tmp_path, capsys):
    synthetic = tmp_path / "synthetic"
    shutil.copytree(run_dir, synthetic)
    config = yaml.safe_load((synthetic / "config.yaml").read_text())
    config["train"]["data"] = "synthetic"
    (synthetic / "config.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["generate", str(synthetic), "--prompt", "the"]) == 2
    assert "--prompt-ids" in one_line_error(capsys, "generate")
    args = ["generate", str(synthetic), "--prompt-ids", "1,2,3", "--max-new-tokens", "5"]
    assert cli.main([*args, "--temperature", "0"]) == 0
    ids = [int(i) for i in capsys.readouterr().out.strip().split(",")]
    assert ids[:3] == [1, 2, 3] and len(ids) == 8


@slow
def test_generate_from_a_hugging_face_checkpoint(run_dir, tmp_path, capsys):
    run = load_run(run_dir)
    save_pretrained(run.model, run.model_config, tmp_path)
    ByteTokenizer().save(tmp_path)
    args = ["generate", "--hf", str(tmp_path), "--prompt", "the", "--max-new-tokens", "8"]
    assert cli.main([*args, "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the")
    assert cli.main([*args, "--step", "1"]) == 2
    assert "--step" in one_line_error(capsys, "generate")


@slow
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny", "gpt-oss-tiny"])
def test_other_families_train_eval_generate_and_export(run_dir, preset, tmp_path, capsys):
    """The same commands for the grouped-query-attention families: train a preset, evaluate
    the run, generate from it and from its Hugging Face export (its family's config.json)."""
    data = run_dir.parent / "data"
    files = ["--data", str(data / "train.bin"), "--eval-data", str(data / "eval.bin")]
    run = tmp_path / "run"
    assert cli.main(["train", "--preset", preset, *TRAIN, *files, "--out-dir", str(run)]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(run)]) == 0
    assert "cross-entropy" in capsys.readouterr().out
    args = ["--prompt", "the", "--max-new-tokens", "6", "--temperature", "0"]
    assert cli.main(["generate", str(run), *args]) == 0
    assert capsys.readouterr().out.startswith("the")
    loaded = load_run(run)
    assert loaded.model_config.model_type == preset.removesuffix("-tiny").replace("-", "_")
    save_pretrained(loaded.model, loaded.model_config, tmp_path / "hf")
    ByteTokenizer().save(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == loaded.model_config.model_type
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % loaded.model_config.vocab_size
    exported, _ = from_pretrained(tmp_path / "hf", dtype="float32")
    np.testing.assert_array_equal(exported(tokens).logits, loaded.model(tokens).logits)
    assert cli.main(["generate", "--hf", str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out.startswith("the")
