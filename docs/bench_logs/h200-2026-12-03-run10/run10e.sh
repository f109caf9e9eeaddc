#!/usr/bin/env bash
# Tenth H200 run, call E (after four calls that carried TE's core parts): install TE and the
# test wheels; TE smoke test; GPU tests of our kernels on group-aligned tiles (and the merged
# weight-gradient frame of 42223ea); the schedule A/B (group-aligned tiles against fixed blocks).
export PYTHONUNBUFFERED=1
bash .te/recv.sh && source .te/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/e0_machine.log
timeout 90 python3 .te/te-smoke.py >> $OUT/e0_machine.log 2>&1
tail -6 $OUT/e0_machine.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 190 python -m pytest -m gpu tests/backends/test_gpu_backends.py \
  -k "segmented or mosaic_kernels or chained or (equals_oracle and pallas) or auto" -n 4 -q -p no:cacheprovider > $OUT/e1_gpu_tests.log 2>&1
tail -2 $OUT/e1_gpu_tests.log
grep -E "^(FAILED|ERROR)" $OUT/e1_gpu_tests.log | head -20
cd experiments
cp ../docs/bench_logs/h200-2026-12-03-run10/bench_schedule.py .
timeout 200 python bench_schedule.py --ops fwd,dgrad --candidates "128x2x128 s3 b4" --budget 170 \
  --cases 7168x2048@256x256,2048x7168@256x256,7168x2048@64x512,2048x7168@64x512,1024x512@64x1536,7168x2048@8x2048 \
  --out /tmp/tune > $OUT/e2_schedule_ab.log 2>&1
cp /tmp/tune/tune_mosaic.csv $OUT/e2_schedule_ab.csv
grep -v "^ *$" $OUT/e2_schedule_ab.log | tail -14
