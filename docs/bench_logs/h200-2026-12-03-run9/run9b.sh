#!/usr/bin/env bash
# Ninth H200 run, call B (no TE): the segmented weight gradient rewritten to walk chunks (no
# per-step schedule loads): GPU tests, the tile search against per-expert pipelines, and
# bench_moe's grouped GEMM with segments at 256 rows per expert (bench_segmented.py).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python -m pytest -m gpu tests/backends/test_gpu_backends.py \
  -k "segmented or mosaic_kernels" -n 4 -q -p no:cacheprovider > $OUT/b1_gpu_tests.log 2>&1
tail -3 $OUT/b1_gpu_tests.log
grep -E "^(FAILED|ERROR)" $OUT/b1_gpu_tests.log | head -20
cd experiments
timeout 240 python tune_mosaic.py --ops wgrad --candidates "k64 s3 b16" --budget 200 \
  --cases 7168x2048@256x256,2048x7168@256x256,7168x2048@64x512,1024x512@64x1536,7168x2048@8x2048,512x1024@64x1536 \
  --out /tmp/tune > $OUT/b2_tune_wgrad.log 2>&1
cp /tmp/tune/tune_mosaic.csv $OUT/b2_tune_wgrad.csv
grep -v "^ *$" $OUT/b2_tune_wgrad.log | tail -8
PYTHONPATH=$PYTHONPATH:$PWD timeout 150 python ../docs/bench_logs/h200-2026-12-03-run9/bench_segmented.py 64 \
  --skip-layer --strategies pallas --out /tmp/bench > $OUT/b3_bench_gmm_seg64.log 2>&1
cp /tmp/bench/grouped_matmul.csv $OUT/b3_grouped_matmul_seg64.csv
grep -A1 "256 " $OUT/b3_bench_gmm_seg64.log | grep pallas
tail -3 $OUT/b3_bench_gmm_seg64.log
