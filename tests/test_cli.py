"""The `dropless` command: an end-to-end smoke run, option parsing, help, and clear errors.

The smoke run trains the tiny preset (two of its layers, no MTP module) at batch 8 x 32
tokens, the shapes of tests/train.
"""

import ast
import dataclasses
import inspect
import json
import math
import re
import shutil
import textwrap

import jax
import pytest
import tyro
import yaml

import dropless
import dropless.train
from dropless import GlobalBatchBalanceLoss, PIDBiasUpdate, SequenceBalanceLoss, cli
from dropless.cli._parsing import defaults
from dropless.data import ByteTokenizer, default_corpus_dir
from dropless.models import PRESETS as ALL_PRESETS
from dropless.models.deepseek_v3 import DeepSeekV3Config, get_preset
from dropless.train import TrainConfig
from dropless.train import _backend_names as backend_names
from dropless.train.step import learning_rate
from dropless.train.store import Checkpointer, load_run

SMALL_RUN = [
    "--steps", "6", "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "2",
    "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3",
    "--backend", "jnp", "--no-progress", "--no-compile-cache", "--data", "synthetic",
]  # fmt: skip
# Where the preset's architecture is not what a test checks: two layers and no MTP module,
# which compile in half the time.
SMALLER_FIELDS = dict(num_hidden_layers=2, num_nextn_predict_layers=0)
SMALLER = [
    arg
    for field, value in SMALLER_FIELDS.items()
    for arg in (f"--model.{field.replace('_', '-')}", str(value))
]


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_train_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", *SMALL_RUN, *SMALLER, "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("metrics.jsonl", "checkpoints", "loss.png", "expert_load.png"):
        assert str(out / name) in printed
    assert "backend jnp)" in printed  # the header
    # without a progress bar (--no-progress) the evaluations still print, a line each
    assert [line.split(":")[0] for line in printed.splitlines() if ": eval loss" in line] == [
        "step 3",
        "step 6",
    ]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in evals] == [3, 6]
    keys = "step loss ce mtp balance_loss seq_balance_loss z_loss max_vio tokens_per_s step_time lr"
    for record in train:
        assert set(keys.split()) <= set(record)
        assert record["loss"] > 0 and record["tokens_per_s"] > 0
    assert train[-1]["loss"] < train[0]["loss"]

    assert Checkpointer(str(out / "checkpoints")).steps() == [3, 6]
    assert any(p.stat().st_size > 1000 for p in (out / "checkpoints" / "6").rglob("*"))
    for plot in ("loss.png", "expert_load.png"):
        assert _is_png(out / plot) and (out / plot).stat().st_size > 10_000

    # the written config reproduces the run's settings, and a run from it is named after it
    command = cli.parse(["train", "--config", str(out / "config.yaml")])
    model, train_config = command.configs()
    assert model == get_preset("tiny", **SMALLER_FIELDS) and train_config.steps == 6
    assert command.backend == "jnp"
    assert cli.run_name(command, resume=False) == "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "jnp"
    # throughput: tokens/s in every record and the summary; MFU only with a known peak
    assert summary["tokens_per_s"] > 0 and "mfu" in summary
    assert all("mfu" in r for r in train)
    assert "tokens/s, MFU" in printed
    assert summary["data"]["source"] == "synthetic"
    assert "Sample" not in printed  # the synthetic corpus has no tokenizer


@pytest.mark.slow
def test_default_trains_on_stdlib_text_and_prints_a_sample(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = [
        "train", "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--warmup-steps", "1",
        "--eval-batches", "1", "--backend", "jnp", "--no-progress", "--no-compile-cache",
        "--no-plots", "--out-dir", str(out), *SMALLER,
    ]  # fmt: skip
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "on the Python stdlib corpus (byte" in printed
    assert "tokens/s, MFU" in printed
    sample = printed.split("--no-sample turns this off):\n", 1)[1]
    assert sample.startswith("[") and "]" in sample
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["model"]["vocab_size"] == 258  # the byte tokenizer's, not the preset's 512
    assert config["train"]["data"] == "stdlib"
    assert config["data"]["source"] == "stdlib" and len(config["data"]["meta_sha256"]) == 64
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == config["data"] and summary["tokens_per_s"] > 0
    # the run's config.yaml reads back (its data section is a record, not a setting), and
    # its vocabulary counts as given
    command = cli.parse(["train", "--config", str(out / "config.yaml")])
    assert command.configs()[0].vocab_size == 258
    assert cli.vocab_given(command, ["--config", str(out / "config.yaml")])

    # the README's next steps, from another working directory: the run knows its tokenizer
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = load_run(out)
    assert isinstance(run.tokenizer, ByteTokenizer)
    assert run.tokenizer_source == str(default_corpus_dir(progress=False) / "tokenizer.json")
    assert cli.main(["generate", str(out), "--prompt", "def main(", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def main(")
    assert cli.main(["eval", str(out), "--batches", "1"]) == 0
    table = capsys.readouterr().out
    result = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert re.search(rf"bits per byte +{result['bits_per_byte']:.4f}\n", table)
    # byte-level: one byte per target below 256 (special ids carry no text)
    assert 0 < result["bytes"] <= result["tokens"]
    nats = result["ce"] * result["tokens"]
    assert result["bits_per_byte"] == pytest.approx(nats / math.log(2) / result["bytes"])
    # the end of the run led with the same numbers, for the same eval batch
    summary_line = re.search(
        r"cross-entropy ([\d.]+), perplexity ([\d.]+), bits per byte ([\d.]+)", printed
    )
    assert float(summary_line[1]) == pytest.approx(result["ce"], abs=1e-4)
    assert float(summary_line[2]) == pytest.approx(result["perplexity"], abs=1e-2)
    assert float(summary_line[3]) == pytest.approx(result["bits_per_byte"], abs=1e-4)
    assert "docs/use-a-trained-model.md" in printed


def test_the_vocabulary_comes_from_the_data_unless_given(tmp_path, capsys):
    for args, given in [
        ([], False),
        (["--model.vocab-size", "300"], True),
        (["--model.vocab_size=300"], True),
        (["--set", "model.vocab_size=300"], True),
        (["--set", "train.lr=1e-3"], False),
    ]:
        assert cli.vocab_given(cli.parse(["train", *args]), args) is given, args
    assert not cli.parse(["train", "--no-sample"]).sample
    # a vocabulary smaller than the tokenizer's: one line naming both, nothing written
    out = tmp_path / "run"
    args = ["train", "--model.vocab-size", "200", "--no-progress", "--out-dir", str(out)]
    assert cli.main([*args, "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless: error: ") and "vocab_size = 200" in err and "(258)" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
    """A finished run of three steps, for the resume tests to continue (each a copy): a model
    narrower than the preset's, an lr and a seed other than the defaults."""
    out = tmp_path_factory.mktemp("resume") / "run"
    narrow = ["--model.n-routed-experts", "8", "--model.num-experts-per-tok", "2", *SMALLER]
    first = [*SMALL_RUN, "--steps", "3", "--lr", "1e-3", "--seed", "3", *narrow]
    assert cli.main(["train", *first, "--out-dir", str(out)]) == 0
    return out


@pytest.mark.slow
def test_resume_continues_the_run_with_its_own_config(three_step_run, tmp_path, capsys):
    out = tmp_path / "small-run"
    shutil.copytree(three_step_run, out)
    capsys.readouterr()
    # the README's form: no model or training options, only more steps
    resumed = ["train", "--out-dir", str(out), "--resume", "--steps", "4", "--no-progress"]
    command = cli.parse(resumed)
    model, train_config = command.configs()
    assert (model.n_routed_experts, model.num_experts_per_tok) == (8, 2)
    assert (train_config.steps, train_config.batch_size, train_config.resume) == (4, 8, True)
    assert command.backend == "jnp"
    assert cli.main([*resumed, "--no-compile-cache"]) == 0
    printed = capsys.readouterr()
    assert "resuming 'small-run'" in printed.out
    # more steps refit the cosine schedule, and a note says what that does to the next step
    before, after = (
        float(learning_rate(dataclasses.replace(train_config, steps=n), 3)) for n in (3, 4)
    )
    assert after > before
    assert (
        f"dropless: note: steps 3 -> 4: the learning-rate schedule now ends at step 4, so step 4 "
        f"trains at lr {after:.3g} (the run's schedule: {before:.3g})"
    ) in printed.err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 3] == [4, 4]  # the fourth step and its final evaluation
    # resuming through --set reads it too; without resuming the directory's config is not read
    set_resume = cli.parse(["train", "--out-dir", str(out), "--set", "train.resume=true"])
    assert set_resume.configs()[0].n_routed_experts == 8
    fresh = cli.parse(["train", "--out-dir", str(out), "--no-resume"]).configs()[0]
    assert fresh == get_preset("tiny")


def test_preset_yaml_flags_and_set_compose(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "preset": "tiny",
                "backend": "ragged",
                "model": {"hidden_size": 32, "n_routed_experts": 8},
                "train": {"steps": 5, "lr": 0.01},
            }
        )
    )
    command = cli.parse(
        [
            "train", "--config", str(config), "--steps", "9",
            "--model.n-routed-experts", "4",
            "--set", "model.num_experts_per_tok=1", "train.batch_size=3", "train.eps=1e-6",
            "train.micro_batches=3",
        ]
    )  # fmt: skip
    model, train = command.configs()
    assert command.backend == "ragged"
    assert (model.hidden_size, model.n_routed_experts, model.num_experts_per_tok) == (32, 4, 1)
    assert (train.steps, train.lr, train.batch_size, train.eps) == (9, 0.01, 3, 1e-6)
    assert train.micro_batches == 3
    assert model.vocab_size == get_preset("tiny").vocab_size  # the rest from the preset

    flags = cli.parse(["train", "--batch-size", "32", "--micro-batches", "4"]).configs()[1]
    assert (flags.batch_size, flags.micro_batches) == (32, 4)

    small = cli.parse(["train", "--preset", "small"]).configs()[0]
    assert small == get_preset("small")
    scaled = cli.parse(
        ["train", "--model.rope-scaling", "{type: yarn, factor: 4, beta_fast: 32, beta_slow: 1}"]
    ).configs()[0]
    assert scaled.rope_scaling == {"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--preset", "nope"], "unknown preset 'nope'; known presets: tiny, small"),
        (["train", "--set", "model.n_routed_experts"], "expected model.<field>=<value>"),
        (["train", "--set", "model.n_experts=3"], "unknown field(s) n_experts"),
        (["train", "--set", "train.steps=0"], "TrainConfig.steps must be >= 1"),
        (["train", "--set", "train.micro_batches=3"], "micro_batches (3) must divide batch_size"),
        (["train", "--set", "train.lr=fast"], "lr must be a number, got 'fast'"),
        (["train", "--set", "train.steps=1e3"], "steps must be an int, got '1e3'"),
        (["train", "--set", "model.hidden_size=None"], "hidden_size must be an int, got 'None'"),
        (["train", "--model.num-hidden-layers", "0"], "num_hidden_layers (0) must be >= 1"),
        (["train", "--config", "missing.yaml"], "config file not found"),
        (["train", "--resume"], "--resume needs --out-dir"),
        (["train", "--set", "train.lr=[1"], "--set 'train.lr=[1': not valid YAML ("),
        (["train", "--model.rope-scaling", "{type: yarn"], "--model.rope-scaling: not valid YAML"),
    ],
)
def test_bad_options_are_clear_errors(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "ep"], "backend 'ep' is expert-parallel and needs a device mesh"),
        (["--model.attention-impl", "cudnn"], "attention_impl = 'cudnn' needs an NVIDIA GPU"),
    ],
)
def test_settings_this_machine_cannot_run_fail_before_anything_is_written(
    args, message, tmp_path, capsys
):
    if "cudnn" in args and jax.devices()[0].platform == "gpu":
        pytest.skip("cuDNN attention runs here")
    out = tmp_path / "run"
    base = ["train", "--out-dir", str(out), "--no-progress", "--no-compile-cache"]
    assert cli.main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless: error: ") and message in err
    assert not out.exists()


def test_a_bad_flag_value_names_the_field_and_dropless_train(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--lr", "-1"])
    assert exit_.value.code == 2
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).replace("│", " ").split())
    assert "TrainConfig.lr must be > 0, got -1.0" in text
    assert "dropless train --help" in text and "tyro-dummy" not in text


def test_bad_yaml_config_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("train: [1, 2\n")  # not YAML at all
    assert cli.main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: not valid YAML (" in err and "line" in err and "Traceback" not in err
    config.write_text(yaml.safe_dump({"model": {"hidden": 3}, "optimizer": {}}))
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "unknown section(s) optimizer" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"model": {"hidden": 3}}))
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "unknown field(s) hidden" in capsys.readouterr().err


def test_yaml_section_not_a_mapping_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    for text, where in (("model: n_routed_experts\n", "model"), ("train: [1, 2]\n", "train")):
        config.write_text(text)
        assert cli.main(["train", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"{where}: must be a mapping of field: value" in err and "Traceback" not in err


def test_run_names(tmp_path):
    """The header's and default directory's name: preset, config file, or resumed run."""
    config = tmp_path / "sweep.yaml"
    config.write_text("preset: small\n")
    assert cli.run_name(cli.parse(["train"]), resume=False) == "tiny"
    assert cli.run_name(cli.parse(["train", "--config", str(config)]), resume=False) == "sweep"
    resumed = cli.parse(["train", "--out-dir", str(tmp_path / "a-run")])
    assert cli.run_name(resumed, resume=True) == "a-run"


def test_set_chooses_the_balancing_and_routing_values():
    """The balancing kit from `--set`: the bias rule, zero-computation experts, the
    global-batch balance loss; a bad choice is one line naming the field."""
    sets = [
        "model.bias_update=proportional",
        "model.n_group=1",
        "model.n_zero_experts=4",
        "model.zero_expert_active=1.5",
        "train.global_balance_loss_coef=0.01",
    ]
    model, train = cli.apply_overrides(get_preset("tiny"), TrainConfig(), sets)
    assert (model.bias_update, model.n_zero_experts, model.zero_expert_active) == (
        "proportional",
        4,
        1.5,
    )
    assert train.global_balance_loss_coef == 0.01
    assert train.balance_losses() == (SequenceBalanceLoss(1e-4), GlobalBatchBalanceLoss(0.01))
    with pytest.raises(ValueError, match="bias_update"):
        cli.apply_overrides(get_preset("tiny"), TrainConfig(), ["model.bias_update=pi"])
    pid = ["model.bias_update=pid", "model.bias_pid_ki=0.1", "model.bias_pid_kd=2"]
    model, _ = cli.apply_overrides(get_preset("tiny"), TrainConfig(), pid)
    assert model.bias_update_rule() == PIDBiasUpdate(kp=1.0, ki=0.1, kd=2.0)
    with pytest.raises(ValueError, match="bias_pid_kd"):
        cli.apply_overrides(get_preset("tiny"), TrainConfig(), ["model.bias_pid_kd=-1"])
    with pytest.raises(ValueError, match="n_group"):
        cli.apply_overrides(get_preset("tiny"), TrainConfig(), ["model.n_zero_experts=4"])
    with pytest.raises(ValueError, match="global_balance_loss_coef"):
        cli.apply_overrides(
            get_preset("tiny"), TrainConfig(), ["train.global_balance_loss_coef=-1"]
        )


def test_set_none_where_a_field_takes_none():
    model, _ = cli.apply_overrides(get_preset("tiny"), TrainConfig(), ["model.q_lora_rank=None"])
    assert model.q_lora_rank is None
    model, _ = cli.apply_overrides(get_preset("tiny"), TrainConfig(), ["model.q_lora_rank=null"])
    assert model.q_lora_rank is None


def test_unknown_backend_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--backend", "nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "'jnp'" in err and "'auto'" in err


def test_a_registered_backend_reaches_the_command_line(monkeypatch, capsys):
    factory = lambda: dropless.Backend(gmm=dropless.backends.RaggedDot())  # noqa: E731
    monkeypatch.setattr(backend_names, "BACKENDS", dict(backend_names.BACKENDS))
    dropless.train.register_backend("mine", factory)
    assert cli.parse(["train", "--backend", "mine"]).backend == "mine"
    with pytest.raises(SystemExit):
        cli.main(["train", "--help-all"])
    choices = capsys.readouterr().out.split("--backend {", 1)[1].split("}", 1)[0]
    assert "mine" in choices.replace(" ", "").replace("\n", "").split(",")
    monkeypatch.delitem(backend_names.BACKENDS, "mine")
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["train", "--backend", "mine"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("backend", ["te", "pallas"])
def test_a_backend_that_cannot_load_is_one_line_and_writes_nothing(backend, tmp_path, capsys):
    if backend in dropless.train.available_backends():
        pytest.skip(f"{backend} loads here")
    out = tmp_path / "run"
    args = ["train", "--backend", backend, "--out-dir", str(out), "--no-progress"]
    # --no-compile-cache: the command would otherwise point this test process's later
    # compilations at the user's persistent cache
    assert cli.main([*args, "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropless: error: ") and "Traceback" not in err
    assert ("pip install" in err) if backend == "te" else ("Hopper GPU" in err)
    assert not out.exists()


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (each option's help)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr):
            docs[field.target.id] = doc.value.value
    return docs


def _train_help(flag: str, capsys, monkeypatch) -> str:
    """What `dropless train FLAG` prints on an 80-column terminal (and exits 0)."""
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", flag])
    printed = capsys.readouterr()
    assert exit_.value.code == 0, printed.err
    return printed.out


COMMON_FLAGS = (
    "--preset", "--steps", "--batch-size", "--seq-len", "--lr", "--out-dir", "--resume",
    "--data", "--backend", "--mesh", "--config", "--set",
)  # fmt: skip


def test_help_fits_a_screen_and_names_the_common_options(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    top = capsys.readouterr().out
    assert "train" in top and "presets" in top

    text = _train_help("--help", capsys, monkeypatch)
    lines = text.splitlines()
    assert len(lines) <= 60, len(lines)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert "│" not in text and "--help-all" in text
    flags = [line.split()[0].rstrip(",") for line in lines if line.startswith("  --")]
    assert flags == list(COMMON_FLAGS)  # the common options, in this order, and only those
    assert "--model.hidden-size" not in text  # the rest: --help-all


def test_help_all_explains_every_option_in_whole_sentences(capsys, monkeypatch):
    text = _train_help("--help-all", capsys, monkeypatch)
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)
    flat = " ".join(text.split())
    for flag in (
        *COMMON_FLAGS, "--seed", "--checkpoint-every", "--eval-every", "--model.hidden-size",
        "--model.n-routed-experts", "--bias-update-rate", "--no-progress", "--no-compile-cache",
        "--model.no-norm-topk-prob",
    ):  # fmt: skip
        assert flag in flat, flag
    # every option comes with its whole explanation, never broken inside a word
    model_fields = {f.name for f in dataclasses.fields(DeepSeekV3Config)}
    assert set(cli.MODEL_HELP) == model_fields, "cli.MODEL_HELP must cover DeepSeekV3Config"
    train_docs = _field_docs(TrainConfig)
    assert set(train_docs) == {f.name for f in dataclasses.fields(TrainConfig)}
    command_docs = _field_docs(cli.TrainCommand)
    del command_docs["train"]  # the section of the flags without a prefix: no option of its own
    for doc in [*cli.MODEL_HELP.values(), *train_docs.values(), *command_docs.values()]:
        assert " ".join(doc.split()) in flat, doc
    # the same options as tyro parses: every flag of tyro's own help is listed
    with pytest.raises(SystemExit):
        tyro.cli(cli.TrainCommand, default=defaults([]), args=["--help"])
    tyro_flags = set(re.findall(r"--\w[\w.-]*", capsys.readouterr().out)) - {"--help"}
    assert tyro_flags and tyro_flags <= set(re.findall(r"--\w[\w.-]*", flat))


def test_help_shows_the_defaults_of_the_preset(capsys, monkeypatch):
    # the tiny preset's batch size
    assert "(default: 16)" in _train_help("--help", capsys, monkeypatch)


def test_presets_lists_sizes(capsys):
    """Every preset of every family with its sizes: DeepSeek-V3's published 671B total and 37B
    active, the other families' published sizes, and no MTP module where a preset has none."""
    assert cli.main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "preset", "family", "total", "active", "mtp", "layers", "experts", "top-k", "width", "ffn"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert set(rows) == set(ALL_PRESETS)
    # DeepSeek-V3: 61 layers (3 dense), 256 routed + 1 shared experts, top-8, width 7168
    assert rows["deepseek-v3-671b"] == [
        "deepseek_v3", "671.0B", "37.6B", "11.6B", "61", "(3", "dense)", "256+1", "8", "7168",
        "18432/2048",
    ]  # fmt: skip
    assert rows["deepseek-v2-lite"][3] == "-"  # num_nextn_predict_layers = 0
    assert rows["tiny"][1].endswith("M")
    assert rows["qwen3-30b-a3b"][:3] == ["qwen3_moe", "30.5B", "3.4B"]
    assert rows["mixtral-8x7b"][:3] == ["mixtral", "46.7B", "12.9B"]
    assert rows["olmoe-1b-7b"][:3] == ["olmoe", "6.9B", "1.3B"]
    # 3.6B published: its active count leaves out the 0.58B embedding table
    assert rows["gpt-oss-20b"][:3] == ["gpt_oss", "20.9B", "4.2B"]
    assert rows["kimi-k2"][:3] == ["kimi_k2", "1.03T", "32.9B"]


@pytest.mark.slow
def test_resume_without_config_yaml_uses_the_checkpoint_and_notes_changes(
    three_step_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(three_step_run, out)
    (out / "config.yaml").unlink()
    capsys.readouterr()
    resumed = ["train", "--out-dir", str(out), "--resume", "--steps", "4", "--no-progress"]
    model, train_config = cli.parse(resumed).configs()
    assert (train_config.lr, train_config.seed, train_config.warmup_steps) == (1e-3, 3, 2)
    assert (model.n_routed_experts, model.num_experts_per_tok) == (8, 2)
    assert cli.main([*resumed, "--no-compile-cache", "--lr", "2e-3"]) == 0
    err = capsys.readouterr().err
    assert "dropless: note: resuming with settings that differ from the checkpoint's: " in err
    assert "lr: 0.001 -> 0.002" in err and "seed" not in err and "Warning" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr", "inf"], "dropless: error: TrainConfig.lr must be finite, got inf ("),
        (["--grad-clip", "inf"], "dropless: error: TrainConfig.grad_clip must be finite"),
        (["--steps", "abc"], "dropless: error: --steps: invalid literal for int() with base 10"),
        (["--config", "."], "dropless: error: --config . is a folder, not a YAML file"),
    ],
)
def test_every_error_is_one_line(args, message, capsys):
    try:
        code = cli.main(["train", *args])
    except SystemExit as exit_:  # what tyro reports exits
        code = exit_.code
    assert code == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.startswith(message)
    assert printed.err.count("\n") == 1 and not set("│╭╰─") & set(printed.err)


def test_an_out_dir_that_is_a_file_and_a_short_run_warning_are_one_line_each(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out_dir in (tmp_path / "file", tmp_path / "file" / "under"):
        args = ["train", "--out-dir", str(out_dir), "--steps", "1", "--warmup-steps", "5"]
        assert cli.main([*args, "--no-compile-cache"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            "dropless: note: TrainConfig.warmup_steps (5) > steps (1): the learning rate never "
            "reaches lr (0.003)",
            f"dropless: error: out_dir {out_dir} is a file, or lies under one: give a directory",
        ]
