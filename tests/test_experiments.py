"""Smoke tests: each scripted experiment runs end to end for a few steps and writes its files;
the benchmark scripts run on toy shapes on the CPU."""

import json
import pathlib

import pytest
from helpers import load_script as load
from helpers import mosaic_threads_compiled_once

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# Shared by every training script, so the train/eval steps compile once for the whole file.
SMALL = ["--steps", "3", "--batch-size", "4", "--seq-len", "16"]


def check_outputs(out: pathlib.Path, name: str, min_rows: int) -> list[dict]:
    for suffix in ("json", "csv", "png"):
        path = out / f"{name}.{suffix}"
        assert path.exists() and path.stat().st_size > 100, path
    rows = json.loads((out / f"{name}.json").read_text())["rows"]
    assert len(rows) >= min_rows
    return rows


CASES = {
    "compare_backends": (
        ["--tokens", "64", "--repeats", "1", "--batch-size", "2", "--seq-len", "8"]
        + ["--backends", "jnp"],
        2,
    ),
    "load_balance": ([*SMALL, "--only", "none", "bias"], 2),
    "balancing": ([*SMALL, "--data", "synthetic", "--only", "global_aux", "bias+zero"], 2),
    "expert_granularity": ([*SMALL, "--sweep", "8/2"], 1),
    "dropless_vs_capacity": ([*SMALL, "--factors", "1.0", "--repeats", "1"], 6),
    "expert_specialisation": ([*SMALL, "--eval-batches", "1"], 3),
    "families": ([*SMALL, "--data", "synthetic", "--only", "tiny", "olmoe-tiny"], 2),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_experiment_runs(name, tmp_path):
    argv, min_rows = CASES[name]
    returned = load(name).main([*argv, "--out", str(tmp_path)])
    rows = check_outputs(tmp_path, name, min_rows)
    assert rows == json.loads(json.dumps(returned))


@pytest.mark.slow
def test_experiment_runs_on_real_text(tmp_path):
    """`--data stdlib`: every training script opens its data through _common.py's
    train_config and fit_to_data, so one script's run on real text stands for all."""
    name = "load_balance"
    argv = [*SMALL, "--data", "stdlib", "--only", "none", "--out", str(tmp_path)]
    load(name).main(argv)
    check_outputs(tmp_path, name, 1)
    meta = json.loads((tmp_path / f"{name}.json").read_text())["meta"]
    assert meta["data"] == "stdlib"
    config = (next(tmp_path.glob("*/config.yaml"))).read_text()
    assert "vocab_size: 258" in config and "source: stdlib" in config


def test_capacity_layer_without_drops_equals_dropless():
    import equinox as eqx
    import jax
    import numpy as np

    import dropless

    module = load("dropless_vs_capacity")
    spec = dropless.RoutingSpec(n_routed_experts=8, num_experts_per_tok=2)
    moe = dropless.MoE(16, 8, spec, n_shared_experts=1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    # compiled (a program each, the capacity static) rather than op by op: quicker
    capacity_moe = eqx.filter_jit(module.capacity_moe)
    y, copies, tokens = capacity_moe(moe, x, 32)
    np.testing.assert_allclose(y, eqx.filter_jit(moe)(x)[0], rtol=1e-4, atol=1e-5)
    assert int(copies) == int(tokens) == 0
    _, copies, _ = capacity_moe(moe, x, 1)  # 8 slots for 64 copies
    assert int(copies) == 64 - 8


def test_language_preference_counts_only_the_languages_seen():
    import numpy as np

    module = load("expert_specialisation")
    share = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.25, 0.25, 0.5], [0.0, 0.0, 0.0]])
    seen = np.array([True, False, True, False])  # languages 1 and 3 had no sequences
    spec, top = module.language_preference(share, seen)
    # over languages 0 and 2: expert maxima 0.5, 0.5, 0.5 over means 0.375, 0.375, 0.25
    assert spec == np.mean([0.5 / 0.375, 0.5 / 0.375, 0.5 / 0.25])
    assert top == 0.5
    # an expert that no seen language uses is left out, not counted as 0
    spec, _ = module.language_preference(np.array([[1.0, 0.0, 0.0]]), np.array([True]))
    assert spec == 1.0  # experts 1 and 2 unused: not two zeros in the mean
    assert np.isnan(module.language_preference(share, np.zeros(4, bool))[0])


def test_smoothed_curves_sit_at_the_last_step_they_average():
    import numpy as np

    steps, values = load("_common").smoothed([1.0, 2.0, 3.0, 4.0, 5.0], 2)  # steps 1..5
    np.testing.assert_array_equal(steps, [2, 3, 4, 5])
    np.testing.assert_array_equal(values, [1.5, 2.5, 3.5, 4.5])


def test_experiment_arguments_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        load("load_balance").main(["--only", "nonee", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "invalid choice: 'nonee'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"8/4: experts / top-k must be the first setting's 8/2"):
        load("expert_granularity").main([*SMALL, "--sweep", "8/2", "8/4", "--out", str(tmp_path)])


@pytest.mark.slow
def test_profile_attributes_time_to_named_scopes_and_directions(tmp_path):
    import jax
    import jax.numpy as jnp

    profile = load("_profile")

    def loss(w, x):
        with jax.named_scope("attention"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("head"):
            return jnp.sum(h @ w.T)

    step = jax.jit(jax.grad(loss))
    w, x = jnp.ones((256, 256)) / 256, jnp.ones((512, 256))
    jax.block_until_ready(step(w, x))
    hlo = step.lower(w, x).compile().as_text()
    scopes, kernels = profile.profile(
        lambda: jax.block_until_ready(step(w, x)), hlo, trace_copy=tmp_path / "t.json.gz"
    )
    timed = {r["scope"] for r in scopes if r["ms/step"] > 0}
    assert {"attention", "head (bwd)"} <= timed, scopes
    assert abs(sum(r["share"] for r in scopes) - 1) < 1e-6
    assert kernels and (tmp_path / "t.json.gz").stat().st_size > 0
    # top=None lists every kernel; grouped by op they add back up to each scope's time
    _, every = profile.profile(lambda: jax.block_until_ready(step(w, x)), hlo, top=None)
    by_op = profile.ops_by_scope(every, hlo, top=10_000)
    for scope, rows in by_op.items():
        want = sum(r["ms/step"] for r in every if r["scope"] == scope)
        assert abs(sum(r["ms/step"] for r in rows) - want) < 1e-9, scope
    assert {"attention", "head (bwd)"} <= set(by_op)
    assert all(r["op"] != "?" for r in by_op["attention"])  # named scopes come from op names


def test_ops_by_scope_merges_one_kernel_over_layers():
    """The same fusion in two layers (instructions fusion.1 and fusion.2, kernels loop_mul_1
    and loop_mul_2) is one row; another op in the same scope stays apart."""
    profile = load("_profile")
    hlo = "\n".join(
        f'  %{name} = f32[8] fusion(), metadata={{op_name="jit(step)/layer{i}/attention/{op}"}}'
        for i, (name, op) in enumerate([("fusion.1", "mul"), ("fusion.2", "mul"), ("f.3", "add")])
    )
    rows = [
        {"kernel": "loop_mul_1", "hlo op": "fusion.1", "scope": "attention", "ms/step": 1.0},
        {"kernel": "loop_mul_2", "hlo op": "fusion.2", "scope": "attention", "ms/step": 2.0},
        {"kernel": "loop_add", "hlo op": "f.3", "scope": "attention", "ms/step": 0.5},
    ]
    got = profile.ops_by_scope(rows, hlo)["attention"]
    assert [(r["kernel"], r["op"], r["instructions"], r["ms/step"]) for r in got] == [
        ("loop_mul", "mul", 2, 3.0),
        ("loop_add", "add", 1, 0.5),
    ]
    assert profile._layer_free("fusion.12.clone_3") == "fusion"


def test_tile_search_rejects_inexact_tilings(tmp_path, monkeypatch, capsys):
    """tune_pallas's search, with the GPU kernels replaced by the reference (and one tiling made
    wrong): the wrong tiling is never chosen, and the tiles file holds the exact best."""
    import dataclasses
    import sys
    import time

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("tune_pallas", None)
    import tune_pallas

    from dropless.backends import _pallas as pallas

    wrong = pallas.BlockConfig(64, 128, 64, 2, 1)

    def run_op(op, a, b, group_sizes, cfg):
        out = pallas.reference_op(op, a, b, group_sizes)
        return out * 1.5 if cfg == wrong else out

    def kernel_ms(fn, *args):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        return time.perf_counter() - start

    monkeypatch.setattr(pallas, "run_op", run_op)
    monkeypatch.setattr(pallas, "load_kernels", lambda: None)
    monkeypatch.setattr(tune_pallas, "kernel_ms", kernel_ms)
    monkeypatch.setattr(
        tune_pallas, "candidates", lambda op, k, n, limit: [wrong, pallas.BlockConfig()]
    )
    tiles = tmp_path / "tiles.json"
    argv = ["--shapes", "256x128", "--experts", "4", "--rows", "64", "--ops", "fwd,wgrad"]
    tune_pallas.main([*argv, "--out", str(tmp_path), "--tiles-out", str(tiles)])
    entries = json.loads(tiles.read_text())
    assert [e["op"] for e in entries] == ["fwd", "wgrad"]
    fields = [f.name for f in dataclasses.fields(pallas.BlockConfig)]
    chosen = {pallas.BlockConfig(**{f: e[f] for f in fields}) for e in entries}
    assert chosen == {pallas.BlockConfig()}
    assert capsys.readouterr().out.count("inexact on uneven groups, rejected") == 2


@pytest.mark.slow
def test_mosaic_tile_search_rejects_inexact_settings(tmp_path, monkeypatch, capsys):
    """tune_mosaic's search, with our kernels replaced by the reference (and one setting made
    wrong): the wrong setting is reported, never timed, and never chosen."""
    import sys
    import time

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("tune_mosaic", None)
    import tune_mosaic

    from dropless.backends import _pallas as pallas
    from dropless.backends import mosaic

    wrong = mosaic.KernelConfig(band=2)

    def grouped_matmul(a, b, group_sizes, *, transpose_rhs=False, config=None):
        out = pallas.reference_op("dgrad" if transpose_rhs else "fwd", a, b, group_sizes)
        return (out * 1.5 if config == wrong else out).astype(a.dtype)

    def grouped_weight_grad(a, b, group_sizes, *, config=None):
        return pallas.reference_op("wgrad", a, b, group_sizes).astype(a.dtype)

    def kernel_time(fn, *args):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        return time.perf_counter() - start

    monkeypatch.setattr(mosaic, "grouped_matmul", grouped_matmul)
    monkeypatch.setattr(mosaic, "grouped_weight_grad", grouped_weight_grad)
    monkeypatch.setattr(tune_mosaic, "kernel_time", kernel_time)
    rows = {"default": mosaic.KernelConfig(), "wrong": wrong}
    monkeypatch.setattr(tune_mosaic, "ROW_CANDIDATES", rows)
    monkeypatch.setattr(tune_mosaic, "WGRAD_CANDIDATES", {"default": mosaic.WeightGradConfig()})
    monkeypatch.setattr(
        tune_mosaic, "DEFAULTS", dict.fromkeys(("fwd", "dgrad", "wgrad"), "default")
    )
    argv = ["--cases", "256x256@4x64", "--ops", "fwd,wgrad", "--repeats", "1"]
    tune_mosaic.main([*argv, "--out", str(tmp_path)])
    assert "INEXACT fwd wrong" in capsys.readouterr().out
    timed = json.loads((tmp_path / "tune_mosaic.json").read_text())["rows"]
    assert {(r["op"], r["candidate"]) for r in timed} == {("fwd", "default"), ("wgrad", "default")}
    assert len(timed) == 4  # two ops, balanced and Dirichlet
    best = json.loads((tmp_path / "tune_mosaic_best.json").read_text())["rows"]
    assert [(r["op"], r["best"]) for r in best] == [("fwd", "default"), ("wgrad", "default")]


@pytest.mark.parametrize(
    "name",
    [
        "128x2x128 k32 s4 b4",
        "chain 128x2x128 k32 s4 b4",
        "chain 128x2x128 k32 s4 b8",
        "chain 64x2x128 s4 b4",
    ],
)
def test_short_contraction_tile_candidates_lower_for_cuda(name, lowered, monkeypatch):
    """tune_mosaic's candidates for the proxy's short contractions (added untimed) go through
    Mosaic GPU's lowering, forward and input gradient, at the proxy's [512 -> 1024]: a setting
    Mosaic cannot lay out fails here, not in a GPU call."""
    import sys

    import jax
    import jax.numpy as jnp

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("tune_mosaic", None)
    import tune_mosaic

    config = tune_mosaic.ROW_CANDIDATES[name]
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    w = jax.ShapeDtypeStruct((64, 512, 1024), jnp.bfloat16)
    for op, width in (("fwd", 512), ("dgrad", 1024)):
        assert tune_mosaic.applies(op, config, 512, 1024)
        x = jax.ShapeDtypeStruct((4096, width), jnp.bfloat16)
        text = lowered(tune_mosaic.kernel(op, config), x, w, sizes, platform="cuda")
        assert text.count("custom_call @mosaic_gpu") == 1


def test_grouped_gemm_figure_is_redrawn_from_a_results_file(tmp_path, monkeypatch):
    """--replot draws a committed table (the H200's, benchmarks/results/) without running
    anything; a CSV of another script is named as such."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_moe = load("bench_moe")
    path = RESULTS / "grouped_gemm_h200.json"
    rows = bench_moe.read_rows(path)
    assert len(rows) == 24 and all(isinstance(r["fwd+bwd / dense"], float) for r in rows)
    bench_moe.main(["--replot", str(path), "--out", str(tmp_path)])
    assert (tmp_path / "grouped_gemm_h200.png").stat().st_size > 10_000
    other = tmp_path / "other.csv"
    other.write_text("backend,step s\npallas,0.1\n")
    with pytest.raises(ValueError, match="not a grouped_matmul table of bench_moe.py"):
        bench_moe.read_rows(other)


def test_cpu_grouped_matmul_benchmark_on_toy_shapes(tmp_path, monkeypatch):
    """bench_grouped_matmul.py (the CPU table of docs/benchmarks.md) at toy shapes, glibc left
    as it is (this process has run JAX, so `keep_freed_memory` could not act), and its record
    of that."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    argv = ["--rows", "512", "--in-width", "32", "--out-width", "64", "--experts", "8"]
    argv += ["--strategies", "jnp-chunked,jnp-capacity", "--repeats", "2", "--glibc-default"]
    returned = load("bench_grouped_matmul").main([*argv, "--out", str(tmp_path)])
    assert (tmp_path / "grouped_matmul.csv").exists()
    assert (tmp_path / "bench_grouped_matmul.png").stat().st_size > 100
    results = json.loads((tmp_path / "grouped_matmul.json").read_text())
    rows, meta = results["rows"], results["meta"]
    assert len(rows) == 4 and rows == json.loads(json.dumps(returned))
    assert meta["keep_freed_memory"] is False and "--glibc-default" in meta["command"]
    for row in rows:  # each strategy timed against dense, and equal to the first one
        assert row["fwd / dense"] > 0 and row["fwd+bwd / dense"] > 0
        assert row["rel. diff"] < 1e-5


@pytest.mark.slow
def test_grouped_gemm_benchmark_times_in_rounds(tmp_path, monkeypatch):
    """bench_moe.py's grouped-GEMM table on toy shapes (its CPU smoke run), in two rounds."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its helpers, _timing and _profile
    argv = ["--tiny", "--quick", "--skip-layer", "--strategies", "jnp-capacity", "--rounds", "2"]
    load("bench_moe").main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "grouped_matmul.json").read_text())["rows"]
    assert len(rows) == 4  # two layouts x balanced / Dirichlet, one width order (--quick)
    for row in rows:
        assert row["strategy"] == "jnp-capacity"
        assert row["fwd+bwd / dense"] > 0 and row["fwd+bwd spread"] >= 0


def test_mfu_history_figure_and_its_table(tmp_path):
    """The train-step MFU history: the committed table draws; within a series (batch,
    micro-batches) MFU x step time is one number, the model FLOPs per step over the peak (the
    1.5% allows for the logs' rounding, 3 significant figures or MFU to 0.1%, and the 0.15%
    that proxy-2b's wider rope key adds); a table without a column is refused by name."""
    import statistics

    plot_mfu_history = load("plot_mfu_history")
    table = RESULTS / "train_step_h200_history.json"
    plot_mfu_history.main([str(table), "--out", str(tmp_path)])
    assert (tmp_path / "mfu_history.png").stat().st_size > 10_000

    products = {}
    for row in plot_mfu_history.read_rows(table):
        assert row["log"].startswith("docs/bench_logs/")  # in git history (see its meta)
        key = (row["batch"], row["micro_batches"])
        products.setdefault(key, []).append(row["mfu"] * row["step_s"])
    assert set(products) == {(8, 1), (16, 1), (24, 1), (32, 1), (32, 2), (32, 4)}
    for series, values in products.items():
        middle = statistics.median(values)
        assert all(abs(v / middle - 1) < 0.015 for v in values), (series, values)

    no_mfu = tmp_path / "no_mfu.csv"
    no_mfu.write_text("run,date,change,batch,micro_batches,step_s,log\n7,d,c,8,1,0.177,x.log\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['mfu'\]"):
        plot_mfu_history.main([str(no_mfu), "--out", str(tmp_path)])


def test_results_name_their_command_and_commit():
    """Every file of benchmarks/results/ holds rows and says what made them: the benchmark,
    the machine, and a command and a commit (in its meta, or in each row)."""
    files = sorted(RESULTS.glob("*.json"))
    assert len(files) >= 8
    for path in files:
        results = json.loads(path.read_text())
        meta, rows = results["meta"], results["rows"]
        assert rows and meta["benchmark"] and meta["machine"], path
        for key in ("command", "commit"):
            assert key in meta or all(key in r for r in rows), (path, key)


def test_step_comparison_runs_each_variant_inside_its_context(monkeypatch):
    """bench_train.compare: each variant's step is timed inside its own context (here a
    `patched` attribute), with JAX's caches cleared before it, and the attribute is restored
    afterwards, also when a variant fails. `bench` itself is replaced: no model is compiled."""
    import types

    import jax

    from dropless.models.deepseek_v3 import get_preset

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_train = load("bench_train")
    owner = types.SimpleNamespace(choice="library")
    seen, cleared = [], []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(len(seen)))

    def fake_bench(config, *args, **kwargs):  # a 0.5 s step, a loss of 2; notes the variant
        seen.append((owner.choice, kwargs, config.loss_chunk))
        return 0.5, 2.0

    monkeypatch.setattr(bench_train, "bench", fake_bench)
    monkeypatch.setattr(bench_train, "flops_per_token", lambda config, seq: 1e9)
    variants = {
        "library": bench_train.contextlib.nullcontext,
        "before": lambda: bench_train.patched(owner, "choice", "before"),
        "bf16 moments": {"moments_dtype": "bfloat16"},  # keyword arguments for bench
        "chunked loss": {"set": ["loss_chunk=16"]},  # the model config changed as --set does
    }
    rows = bench_train.compare(
        get_preset("tiny"), "jnp", variants, batch=2, seq=8, steps=3, peak=1e12
    )
    assert seen == [
        ("library", {}, None),
        ("before", {}, None),
        ("library", {"moments_dtype": "bfloat16"}, None),
        ("library", {}, 16),
    ]
    assert cleared == [0, 1, 2, 3]
    assert owner.choice == "library"  # restored
    assert [r["variant"] for r in rows] == ["library", "before", "bf16 moments", "chunked loss"]
    assert rows[0]["tokens/s"] == 32 and rows[0]["MFU"] == pytest.approx(32 * 1e9 / 1e12)
    with pytest.raises(RuntimeError), bench_train.patched(owner, "choice", "x"):
        raise RuntimeError
    assert owner.choice == "library"


@pytest.mark.parametrize("fraction_set", [False, True])
def test_train_bench_names_the_memory_fraction_when_out_of_memory(
    monkeypatch, tmp_path, capsys, fraction_set
):
    """An out-of-memory step is reported in the table; on a GPU, unless JAX's memory fraction
    was set, the run also says how to give JAX more of it. `bench` is replaced (nothing
    compiles), and so is the backend's name."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_train = load("bench_train")
    monkeypatch.setattr(bench_train.jax, "default_backend", lambda: "gpu")
    for name in bench_train.MEMORY_FRACTION:
        monkeypatch.delenv(name, raising=False)
    if fraction_set:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 82.52GiB")

    monkeypatch.setattr(bench_train, "bench", out_of_memory)
    argv = ["bench_train.py", "--preset", "tiny", "--backends", "jnp", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    bench_train.main()
    printed = capsys.readouterr().out
    assert "error: RESOURCE_EXHAUSTED" in printed
    assert ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in printed) is not fraction_set


def test_train_bench_profiles_with_command_buffers_off(monkeypatch, tmp_path):
    """--profile turns XLA's GPU command buffers off (they hide the scopes), replacing a
    command-buffer flag already set and keeping the other flags. `bench` is replaced."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_train = load("bench_train")
    flags = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer=FUSION"
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.setattr(bench_train, "bench", lambda *args, **kwargs: (1.0, 2.0))
    argv = ["bench_train.py", "--preset", "tiny", "--backends", "jnp", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", argv)
    bench_train.main()
    assert bench_train.os.environ["XLA_FLAGS"] == flags  # untouched without --profile
    monkeypatch.setattr("sys.argv", [*argv, "--profile"])
    bench_train.main()
    assert bench_train.os.environ["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer="
    )


def test_attention_bench_runs_each_width_pair(tmp_path, monkeypatch):
    """bench_attention on the CPU (JAX's own attention, tiny sizes): a row per width pair,
    positive rates against the dense matmul of the same run, and its result files."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load("bench_attention")
    argv = ["--impl", "xla", "--batch", "1", "--seq", "64", "--heads", "2", "--repeats", "1"]
    rows = bench.main([*argv, "--widths", "96/64,64/64", "--out", str(tmp_path)])
    assert [r["qk/v"] for r in rows] == ["96/64", "64/64"]
    assert all(r["fwd / dense"] > 0 and r["fwd+bwd / dense"] > 0 for r in rows)
    saved = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert [r["qk/v"] for r in saved] == ["96/64", "64/64"]


def test_bench_train_set_reads_values_as_the_cli_does(monkeypatch):
    """bench_train.py --set FIELD=VALUE: values as `dropless train --set model.FIELD=VALUE`
    reads them (1e4 a number although YAML reads a string, None for an optional field), and an
    unknown field or a malformed item is an error naming it."""
    from dropless.models.deepseek_v3 import get_preset

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_train = load("bench_train")
    items = ["num_attention_heads=8", "q_lora_rank=None", "rope_theta=1e4"]
    config = bench_train.with_overrides(get_preset("tiny"), items)
    assert (config.num_attention_heads, config.q_lora_rank, config.rope_theta) == (8, None, 1e4)
    with pytest.raises(ValueError, match=r"unknown field\(s\) num_attention_head \(did you mean"):
        bench_train.with_overrides(get_preset("tiny"), ["num_attention_head=8"])
    with pytest.raises(ValueError, match=r"--set 'model.heads': expected"):
        bench_train.with_overrides(get_preset("tiny"), ["heads"])


def test_cross_entropy_bench_times_each_forward(tmp_path, monkeypatch):
    """bench_cross_entropy on the CPU (tiny sizes): every forward timed for each dtype, each
    giving the one pass's losses (to float32 rounding), its result files, and ratios over
    whichever variant is asked for."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load("bench_cross_entropy")
    argv = ["--positions", "16", "--vocab", "64", "--out", str(tmp_path)]
    rows = bench.main(argv)
    assert [(r["dtype"], r["variant"]) for r in rows] == [
        (dtype, variant) for dtype in ("bfloat16", "float32") for variant in bench.VARIANTS
    ]
    assert all(r["fwd ms"] > 0 and r["fwd+bwd ms"] > 0 and r["max |diff|"] < 1e-5 for r in rows)
    saved = json.loads((tmp_path / "cross_entropy.json").read_text())["rows"]
    assert len(saved) == len(rows)
    # Ratios over any variant, not only the first timed.
    rows = bench.main([*argv, "--dtypes", "float32"], base="two passes")
    assert [r["fwd / two passes"] for r in rows if r["variant"] == "two passes"] == [1.0]


@pytest.mark.slow
def test_swiglu_epilogue_bench_in_the_interpreter(tmp_path, monkeypatch):
    """bench_swiglu_epilogue on the CPU through Mosaic GPU's interpreter (one tiny case): both
    paths timed, their hidden outputs within bf16 rounding, and its result files."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")
    bench = load("bench_swiglu_epilogue")
    from dropless.backends.mosaic import _launch

    monkeypatch.setattr(_launch, "INTERPRET", None)  # main sets it; restored after the test
    mosaic_threads_compiled_once(monkeypatch)
    rows = bench.main(["--interpret", "--cases", "128x64@3x40", "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == ["128x64@3x40"]
    assert rows[0]["separate ms"] > 0 and rows[0]["fused ms"] > 0 and rows[0]["rel diff"] < 1e-2
    assert (tmp_path / "swiglu_epilogue.json").exists()


@pytest.mark.slow
def test_weights_before_down_bench_keeps_less(tmp_path, monkeypatch):
    """bench_weights_before_down on the CPU (a small float32 layer): both settings compiled and
    timed, and with the weights before the down projection JAX keeps less for the backward
    (no expert outputs: [rows dim] less, rows = tokens * k), with the ratio."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load("bench_weights_before_down")
    argv = ["--tokens", "1024", "--dim", "128", "--hidden", "64", "--experts", "8", "--k", "4"]
    rows = bench.main([*argv, "--backend", "jnp", "--dtype", "float32", "--repeats", "1"]
                      + ["--out", str(tmp_path)])  # fmt: skip
    assert [r["weights"] for r in rows] == ["on the outputs", "before the down projection"]
    assert all(r["fwd+bwd ms"] > 0 for r in rows)
    saved = (rows[0]["kept MiB"] - rows[1]["kept MiB"]) * 2**20
    assert saved >= 1024 * 4 * 128 * 4  # at least the float32 expert outputs
    assert rows[1]["kept MiB / default"] < 1.0
    assert (tmp_path / "weights_before_down.json").exists()
