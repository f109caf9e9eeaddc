#!/usr/bin/env bash
# Seventeenth H200 run, call B (no TE): the row-gather kernels alone and in the batch-24 step,
# now with the combine's weight-gradient dot products fused into its backward gather.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
git log -1 --oneline > $OUT/b0_commit.log
cd experiments
timeout 480 python bench_row_gather.py --step --batch 24 > $OUT/b1_row_gather_b24.log 2>&1
grep -E "Error|ran out" $OUT/b1_row_gather_b24.log | cut -c 1-300; grep -E "^\{|^==" $OUT/b1_row_gather_b24.log | cut -c 1-400
