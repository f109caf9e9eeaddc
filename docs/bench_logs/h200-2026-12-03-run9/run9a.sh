#!/usr/bin/env bash
# Ninth H200 run, call A (no TE): GPU tests of the segmented weight gradient and our other
# kernels; the tile search of the weight gradient (per-expert pipelines against segments);
# the grouped GEMM part of bench_moe.py (interleaved rounds) on the default pallas strategy.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/a0_machine.log
python -c "import jax; print(jax.__version__, jax.devices()[0].compute_capability)" >> $OUT/a0_machine.log 2>&1
cat $OUT/a0_machine.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python -m pytest -m gpu tests/backends/test_gpu_backends.py \
  -k "segmented or mosaic_kernels" -n 4 -q -p no:cacheprovider > $OUT/a1_gpu_tests.log 2>&1
tail -5 $OUT/a1_gpu_tests.log
cd experiments
timeout 240 python tune_mosaic.py --ops wgrad --candidates "k64 s3 b16" --budget 200 \
  --cases 7168x2048@256x256,2048x7168@256x256,7168x2048@64x512,1024x512@64x1536,512x1024@64x1536,7168x2048@8x2048 \
  --out /tmp/tune > $OUT/a2_tune_wgrad.log 2>&1
cp /tmp/tune/tune_mosaic.csv $OUT/a2_tune_wgrad.csv
grep -v "^ *$" $OUT/a2_tune_wgrad.log | tail -12
timeout 150 python bench_moe.py --skip-layer --strategies pallas --out /tmp/bench > $OUT/a3_bench_gmm.log 2>&1
cp /tmp/bench/*.csv $OUT/ 2>/dev/null
tail -20 $OUT/a3_bench_gmm.log
