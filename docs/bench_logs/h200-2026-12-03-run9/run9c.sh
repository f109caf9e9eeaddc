#!/usr/bin/env bash
# Ninth H200 run, call C (no TE): GPU tests of our kernels and the pallas strategy with the new
# default (segmented weight gradient where experts average <= 512 rows); the grouped GEMM and
# the MoE layer of bench_moe.py on it; a tile search of 64-row forward / input-gradient tiles.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python -m pytest -m gpu tests/backends/test_gpu_backends.py \
  -k "mosaic or pallas or segmented or auto" -n 4 -q -p no:cacheprovider > $OUT/c1_gpu_tests.log 2>&1
tail -2 $OUT/c1_gpu_tests.log
grep -E "^(FAILED|ERROR)" $OUT/c1_gpu_tests.log | head -20
cd experiments
timeout 150 python bench_moe.py --skip-layer --strategies pallas --out /tmp/bench > $OUT/c2_bench_gmm.log 2>&1
cp /tmp/bench/grouped_matmul.csv $OUT/c2_grouped_matmul.csv
grep pallas $OUT/c2_bench_gmm.log
timeout 120 python bench_moe.py --skip-gmm --layer-backends pallas,jnp --tokens 8192,16384 --out /tmp/layer > $OUT/c3_bench_layer.log 2>&1
grep -v "^ *$" $OUT/c3_bench_layer.log | tail -8
timeout 150 python tune_mosaic.py --ops fwd,dgrad --candidates "128x2x128 s3 b4|64x2x128" --budget 110 \
  --cases 7168x2048@256x256,7168x2048@64x512,2048x7168@256x256 --out /tmp/tune > $OUT/c4_tune_rows.log 2>&1
cp /tmp/tune/tune_mosaic.csv $OUT/c4_tune_rows.csv
grep -v "^ *$" $OUT/c4_tune_rows.log | tail -8
