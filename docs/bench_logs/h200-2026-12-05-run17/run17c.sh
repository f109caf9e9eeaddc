#!/usr/bin/env bash
# Seventeenth H200 run, call C (no TE): the batch-24 step with the combine's weights gradient
# by token (before) and by row of the sorted buffer (now), in one process.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
here=$PWD/docs/bench_logs/h200-2026-12-05-run17
export PYTHONPATH=$PWD:$PWD/experiments:$here:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments
timeout 250 python $here/step_combine.py > $OUT/c2_step_combine_b24.log 2>&1
grep -E "Error|ran out" $OUT/c2_step_combine_b24.log | cut -c 1-300; grep -E "^==" $OUT/c2_step_combine_b24.log
