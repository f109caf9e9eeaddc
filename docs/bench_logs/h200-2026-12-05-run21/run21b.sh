#!/usr/bin/env bash
# Twenty-first run, call B (an H200: batch 24 needs 94 GiB): step_h200.py, the batch-24 step
# with float32 logits, bfloat16 logits, bfloat16 logits + fused SwiGLU, and any tile candidate
# named in $1 (comma-separated, after those), two rounds in one process. Logs to $OUT.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
export PYTHONPATH=$PWD:$PWD/experiments:$PWD/docs/bench_logs/h200-2026-12-05-run21
cd experiments
timeout ${2:-560} python ../docs/bench_logs/h200-2026-12-05-run21/step_h200.py 24 2 "${1:-f32,bf16,fused}" \
  > $OUT/b1_step_b24.log 2>&1
grep -E "Error|RESOURCE" $OUT/b1_step_b24.log | cut -c 1-300; grep -E "^==" $OUT/b1_step_b24.log
