#!/usr/bin/env bash
# Fourteenth H200 run, call A (no TE): routing's top-k and the combine, each before/after, by
# kernel time; then the library's split layers against the fully unrolled scan in one process
# (the split's lax.empty buffer and the bf16 combine cotangent had no GPU run yet).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
here=docs/bench_logs/h200-2026-12-04-run14
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python -c "import jax; print('jax', jax.__version__, jax.devices())"; git log -1 --format=%h; } > $OUT/a0_machine.log 2>&1
cd experiments
cp ../$here/bench_route_combine.py ../$here/bench_split.py .
timeout 120 python bench_route_combine.py > $OUT/a1_route_combine.log 2>&1
grep -E "^==|Error" $OUT/a1_route_combine.log
timeout 400 python bench_split.py > $OUT/a2_split.log 2>&1
grep -E "^==|Error" $OUT/a2_split.log
