"""bf16 weights beside float32 master weights (`TrainConfig.weight_dtype="bfloat16"`, DeepSeek-V3's
setting) against float32 weights: the default run (the tiny preset on the stdlib corpus, 500
steps), once each, same seed and batches; the final eval losses and their ratio.

    python experiments/bf16_weights.py [--steps 500] [--out DIR]

Everything else is `dropless train`'s default (float32 compute, the tokenizer's 258 symbols).
The runs write into a temporary folder; the table goes to `--out` (benchmarks/results by
default) as bf16_weights_cpu.
"""

import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import machine, parser, print_table, write_results  # noqa: E402

from dropless.models.deepseek_v3 import get_preset  # noqa: E402
from dropless.train import TrainConfig, train  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main():
    args_parser = parser("bf16_weights", __doc__, steps=500)
    args_parser.set_defaults(out=str(ROOT / "benchmarks" / "results"))
    args = args_parser.parse_args()
    out, runs = pathlib.Path(args.out), tempfile.mkdtemp(prefix="bf16_weights_")
    rows = []
    for weight_dtype in ("float32", "bfloat16"):
        config = TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            seed=args.seed,
            weight_dtype=weight_dtype,
            plots=False,
        )
        began = time.perf_counter()
        results = train(
            get_preset(args.size, vocab_size=258),
            config,
            backend="auto",
            out_dir=f"{runs}/{weight_dtype}",
        )
        last = results.eval_records[-1]
        rows.append(
            {
                "weight_dtype": weight_dtype,
                "steps": args.steps,
                "final eval loss": last["loss"],
                "final eval ce": last["ce"],
                "s": time.perf_counter() - began,
            }
        )
        print(rows[-1], flush=True)
    ratio = rows[1]["final eval loss"] / rows[0]["final eval loss"]
    print_table(rows, "final eval loss: bf16 weights (float32 master) vs float32 weights")
    print(f"bf16 / float32 final eval loss = {ratio:.4f} ({100 * (ratio - 1):+.2f}%)")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    meta = {
        "benchmark": "experiments/bf16_weights.py (bf16 weights vs float32, default run)",
        "machine": machine(),
        "commit": commit,
        "command": f"python experiments/bf16_weights.py --steps {args.steps}",
        "ratio": ratio,
    }
    write_results(out, "bf16_weights_cpu", rows, meta)


if __name__ == "__main__":
    main()
